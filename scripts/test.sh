#!/usr/bin/env bash
# `make test`: the suite without the Qwen pair's tests, in two runs.
# 1. The tests that start no engine, on two pytest-xdist workers: they are single-threaded Python (small
#    tensors, thousands of seeded decodes), so two run at once on a 2-core machine in about 60 % of the time.
#    Two, not one per core of a bigger machine: each worker holds 1.5-3 GB (torch).
# 2. The engine tests in one process: they share engines through one pool (tests/engine_pool.py), and each
#    engine uses both cores.
# Both always run; the exit status is the first run's failure, else the second's.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/pytest.sh tests -m "not engine and not qwen" -n 2 --durations=10 "$@"
unit=$?
bash scripts/pytest.sh tests -m "engine and not qwen" --durations=15 "$@"
engine=$?
if [[ $unit -ne 0 ]]; then
    echo "the tests without an engine failed (exit $unit); the engine tests exited $engine" >&2
    exit $unit
fi
exit $engine
