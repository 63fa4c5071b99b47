#!/usr/bin/env bash
# Run pytest in .venv; an empty selection (exit 5) counts as a failure here,
# because a suite that collects nothing has tested nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest "$@"
rc=$?
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests for: $*" >&2
fi
exit $rc
