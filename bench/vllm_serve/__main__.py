"""``python -m bench.vllm_serve``: runs the benchmark (see :mod:`bench.vllm_serve`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bench.results_format import run_and_report
from bench.vllm_serve.result import HEADLINE, NAME, run
from tests.integration.vllm.serve_process import DELIVERIES


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm_serve",
                                     description="vLLM's own drain against vllm serve with "
                                                 "quiesce, and the middleware's overhead")
    parser.add_argument("--delivery", action="append", choices=DELIVERIES,
                        help="only these aggregated deliveries (repeatable; default: all)")
    args = parser.parse_args(argv)
    run_and_report(NAME, lambda: run(tuple(args.delivery or DELIVERIES)), HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
