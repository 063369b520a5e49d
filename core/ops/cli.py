"""The ``quiesce`` command line: the parser, the commands it dispatches to, ``main``.

This module builds the root parser and its subcommands, splits off what follows ``--``
for ``quiesce dynamo``, sets up logging and runs the chosen command's handler. It is the
console script (``quiesce.ops.cli:main``) and what ``python -m quiesce`` runs.

``quiesce demo`` replays the field report's scale-down under two policies. Exit
codes: 0 success, 1 the demo's quiesce policy lost a request, 2 bad arguments.

``quiesce serve`` runs the reference worker (:mod:`quiesce.serve.worker`; its exit codes
are the shutdown report's). ``quiesce dynamo vllm|sglang|trtllm [options] -- ARGS`` runs
NVIDIA Dynamo's own ``dynamo.<engine>`` worker with quiesce inside
(:mod:`quiesce.serve.dynamo_worker`; the same exit codes, plus 1 when Dynamo's worker ends
by itself).

``quiesce doctor`` checks an engine's sources for drift (:mod:`quiesce.ops.doctor`, with
its exit codes). The operator commands ``status``, ``drain``, ``resume`` and ``prestop``
talk to a running worker's admin API (:mod:`quiesce.ops.operator_commands`, with theirs).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from quiesce.errors import ConfigError
from quiesce.ops.demo import DemoConfig
from quiesce.ops.demo import main as demo_main
from quiesce.ops.doctor import add_doctor_command
from quiesce.ops.operator_commands import EXIT_CODES_EPILOG, add_operator_commands
from quiesce.serve.options import add_dynamo_arguments, add_serve_arguments


def _demo(args: argparse.Namespace) -> int:
    try:
        config = DemoConfig(
            workers=args.workers, seed=args.seed, time_scale=args.time_scale,
            never_pulled=args.never_pulled, scale_down_at_s=args.scale_down_at,
            discovery_lag_s=args.discovery_lag, router_grace_s=args.router_grace,
            shutdown_budget_s=args.budget)
    except ConfigError as exc:
        print(f"quiesce demo: invalid option {exc}", file=sys.stderr)
        return 2
    return demo_main(config, as_json=args.json, quiet=args.quiet)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="quiesce",
        description="Let an LLM inference worker leave service without losing a request.",
        epilog=EXIT_CODES_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    defaults = DemoConfig()
    demo = commands.add_parser(
        "demo", help="replay the field report's scale-down: fixed grace vs quiesce",
        description="Replay a two-phase load (8 req/s, then 0.2 req/s) against simulated "
                    "workers and scale one down mid-load under the fixed-grace policy and "
                    "under quiesce. All times are simulated seconds.")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--quiet", action="store_true", help="no progress on stderr")
    demo.add_argument("--seed", type=int, default=defaults.seed, help="workload seed (%(default)s)")
    demo.add_argument("--workers", type=int, default=defaults.workers,
                      help="number of workers (%(default)s)")
    demo.add_argument("--time-scale", type=float, default=defaults.time_scale,
                      help="wall seconds per simulated second (%(default)s)")
    demo.add_argument("--never-pulled", type=int, default=defaults.never_pulled,
                      help="disaggregated requests whose KV the decoder never pulls "
                           "(quiesce then ends at its budget, forced)")
    demo.add_argument("--scale-down-at", type=float, default=defaults.scale_down_at_s,
                      help="when the worker is scaled down, simulated s (%(default)s)")
    demo.add_argument("--discovery-lag", type=float, default=defaults.discovery_lag_s,
                      help="how late the dispatcher sees an unregistration, s (%(default)s)")
    demo.add_argument("--router-grace", type=float, default=defaults.router_grace_s,
                      help="quiesce's router grace after unregistering, s (%(default)s)")
    demo.add_argument("--budget", type=float, default=defaults.shutdown_budget_s,
                      help="quiesce's shutdown budget, s (%(default)s)")
    demo.set_defaults(handler=_demo)

    serve = commands.add_parser(
        "serve", help="run the reference worker (needs quiesce[server])",
        description="Serve an OpenAI-compatible /v1/completions in front of an engine, with "
                    "the admin API on its own port; SIGTERM drains on one budget.")
    add_serve_arguments(serve)
    serve.set_defaults(handler=_serve)

    dynamo = commands.add_parser(
        "dynamo", help="run NVIDIA Dynamo's own worker component, drained by quiesce",
        description="Run Dynamo's worker (python -m dynamo.COMPONENT ARGS, ai-dynamo 1.6.1) "
                    "with quiesce inside: admission, the engine's probe, signal ownership "
                    "and a budgeted drain on SIGTERM instead of Dynamo's fixed 5 s grace; "
                    "the admin API on --admin-port. Example: quiesce dynamo vllm "
                    "--admin-port 9100 -- --model Qwen/Qwen3-0.6B (everything after -- "
                    "goes to Dynamo unchanged)")
    add_dynamo_arguments(dynamo)
    dynamo.set_defaults(handler=_dynamo)

    add_doctor_command(commands)
    add_operator_commands(commands)
    return parser


def _serve(args: argparse.Namespace) -> int:
    try:
        from quiesce.serve.worker import serve_main  # noqa: PLC0415 (optional extra)
    except ImportError as exc:
        print(f"quiesce serve needs the server extra: pip install 'quiesce[server]' ({exc})",
              file=sys.stderr)
        return 2
    return serve_main(args)


def _dynamo(args: argparse.Namespace) -> int:
    try:
        from quiesce.serve.dynamo_worker import dynamo_main  # noqa: PLC0415 (optional extras)
    except ImportError as exc:
        print(f"quiesce dynamo needs the server extra: pip install 'quiesce[server]' ({exc})",
              file=sys.stderr)
        return 2
    return dynamo_main(args)


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    # ``quiesce dynamo COMPONENT [options] -- ARGS``: ARGS belong to Dynamo, unparsed
    passthrough: list[str] = []
    if "dynamo" in words and "--" in words and words.index("dynamo") < words.index("--"):
        cut = words.index("--")
        words, passthrough = words[:cut], words[cut + 1:]
    args = build_parser().parse_args(words)
    if args.command == "dynamo":
        args.args = passthrough
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
