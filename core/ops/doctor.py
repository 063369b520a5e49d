"""``quiesce doctor ENGINE``: check an engine's sources for drift, without a GPU.

``quiesce doctor trtllm [--source DIR] [--json]`` checks, without a GPU and without
importing it, that an installed TensorRT-LLM (or a source tree) still defines the names
the adapter reads (:mod:`quiesce.adapters.trtllm.doctor`). This module adds the
subcommand to the ``quiesce`` parser (:func:`add_doctor_command`) and runs the check.

Exit codes: 0 every required name is there (in a known layout), 1 drift (the probe would
report UNKNOWN for good), 2 bad arguments, 6 no TensorRT-LLM sources found, or they cannot
be read, 7 an incomplete install (a file the package lists is missing: reinstall, this is
not drift).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

EXIT_NO_SOURCE = 6
"""``quiesce doctor``: nothing to check (no sources found, or unreadable)."""


def add_doctor_command(commands: Any) -> None:
    """Add ``doctor`` and its engines to ``quiesce``'s subparsers."""
    doctor = commands.add_parser(
        "doctor", help="check an engine's sources for drift (no GPU, no import)",
        description="Check that an engine's installed sources still define what quiesce's "
                    "adapter reads, by parsing them (the engine is never imported).")
    engines = doctor.add_subparsers(dest="engine", required=True, metavar="ENGINE")
    trtllm = engines.add_parser(
        "trtllm", help="TensorRT-LLM: PyExecutor, transfer tracker, queues, stats, Ray",
        description="Parse TensorRT-LLM's sources with ast and report each name the adapter "
                    "relies on as found, alternative (an older known layout) or missing. "
                    "Exit 0 when every required name is there, 1 on drift (the probe would "
                    "report UNKNOWN for good), 6 when no sources are found or readable, 7 "
                    "when the install is incomplete (a file it lists is missing).")
    trtllm.add_argument("--source", default=None, metavar="DIR",
                        help="a TensorRT-LLM checkout, an unpacked wheel, or the tensorrt_llm "
                             "package directory (default: the installed package)")
    trtllm.add_argument("--json", action="store_true", help="print one JSON object")
    trtllm.set_defaults(handler=_doctor_trtllm)


def _doctor_trtllm(args: argparse.Namespace) -> int:
    from pathlib import Path  # noqa: PLC0415 (kept off the CLI's start-up path)

    from quiesce.adapters.trtllm import doctor  # noqa: PLC0415

    try:
        report = (doctor.check(doctor.package_dir(Path(args.source)))
                  if args.source is not None else doctor.check_installed())
    except doctor.DoctorError as exc:
        print(f"quiesce doctor trtllm: {exc}", file=sys.stderr)
        return EXIT_NO_SOURCE
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return report.exit_code  # 0 ok, 1 drift, 7 incomplete install
