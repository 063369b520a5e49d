"""``python -m bench.vllm``: run the vLLM benchmark (see :mod:`bench.vllm`) and report it."""

from __future__ import annotations

import sys

from bench.results_format import run_and_report
from bench.vllm.result import HEADLINE, NAME
from bench.vllm.run import run


def main() -> int:
    run_and_report(NAME, run, HEADLINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
