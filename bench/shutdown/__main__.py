"""Exit after drained: from the moment the real vLLM worker is drained to its process being gone.

``python -m bench.shutdown``: runs the benchmark (see :mod:`bench.shutdown`) and reports it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.results_format import run_and_report
from bench.shutdown.one_run import DELIVERIES
from bench.shutdown.result import HEADLINE, NAME, RUNS, TIME_BUDGET_S, run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.shutdown",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=RUNS, help="runs per delivery at most")
    parser.add_argument("--budget", type=float, default=TIME_BUDGET_S,
                        help="seconds after which no run starts")
    parser.add_argument("--delivery", action="append", choices=DELIVERIES,
                        help="only these deliveries (repeatable; default: all)")
    args = parser.parse_args(argv)
    deliveries = tuple(args.delivery or DELIVERIES)
    run_and_report(NAME, lambda: run(args.runs, args.budget, deliveries), HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
