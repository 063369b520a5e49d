"""``python -m bench.replay``: the field report, replayed (see :mod:`bench.replay.result`);
writes ``bench/results/replay.json``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from bench.replay.result import HEADLINE, NAME, RUNS, run
from bench.results_format import run_and_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.replay",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", choices=[r[0] for r in RUNS], default=None,
                        help="which replays (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_and_report(NAME, lambda: run(names=args.runs), HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
