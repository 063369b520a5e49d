"""``python -m bench [NAME ...]``: run the benchmarks (all by default).

Each writes ``bench/results/<name>.json`` (format: :mod:`bench.results_format`) and
prints a short summary.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from bench import admission, discovery, drain_lag, truth_matrix, victim
from bench.replay import result as replay
from bench.results_format import Result, run_and_report

BENCHMARKS: dict[str, tuple[Callable[[], Result], Sequence[str]]] = {
    drain_lag.NAME: (drain_lag.run, drain_lag.HEADLINE),
    admission.NAME: (admission.run, admission.HEADLINE),
    victim.NAME: (victim.run, victim.HEADLINE),
    discovery.NAME: (discovery.run, discovery.HEADLINE),
    replay.NAME: (replay.run, replay.HEADLINE),
    truth_matrix.NAME: (truth_matrix.run, truth_matrix.HEADLINE),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"benchmarks to run (default: all): {', '.join(BENCHMARKS)}")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(BENCHMARKS))
        return 0
    unknown = [name for name in args.names if name not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmark(s) {', '.join(unknown)}; "
                     f"choose from {', '.join(BENCHMARKS)}")
    for name in args.names or list(BENCHMARKS):
        benchmark, headline = BENCHMARKS[name]
        run_and_report(name, benchmark, headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
