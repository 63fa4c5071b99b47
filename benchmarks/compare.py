"""Compare runs side by side (e.g. before/after a change); refuses different prompt sets.

    .venv/bin/python -m benchmarks.compare A/summary.json B/summary.json [--metric wall_s]

Speedups are only reported within one run (against its own baseline); this
puts one metric of several runs next to each other, after checking that they
used the same prompts (prompt-set hash) and settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness import PromptSetMismatchError
from benchmarks.report import comparison_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.compare", description=__doc__.split("\n")[0])
    p.add_argument("summaries", nargs="+", type=Path, help="summary.json files written by benchmarks.run")
    p.add_argument("--metric", default="output_tokens_per_s", help="a key of a method's summary")
    args = p.parse_args(argv)
    results = [json.loads(path.read_text()) for path in args.summaries]
    try:
        print(comparison_table(results, args.metric))
    except PromptSetMismatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
