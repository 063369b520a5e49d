"""quiesce's settings inside an engine's own server: one environment variable, checked
before the engine starts.

``QUIESCE_VLLM_ARGS`` (``vllm serve``) or ``QUIESCE_SGLANG_ARGS`` (SGLang's
``launch_server``) holds quiesce's options as a command line (shell-quoted), for example
``--admin-port 8001 --budget 60 --router-grace 5``; every option has a default.
:func:`parse_server_options` is called by quiesce's plugin in the server's main process
before the engine starts: a bad setting raises :class:`~quiesce.errors.ConfigError` naming
it, and the server refuses to start. Standard library and the library's mechanisms only
(the plugins load this before anything else).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
from collections.abc import Mapping, Sequence

from quiesce.drain import DrainConfig
from quiesce.errors import ConfigError
from quiesce.probe import Role
from quiesce.shutdown import ShutdownPolicy

VLLM_ARGS_ENV = "QUIESCE_VLLM_ARGS"
SGLANG_ARGS_ENV = "QUIESCE_SGLANG_ARGS"
ROLES = ("auto", *(role.value for role in Role))
_OPTION_OF = {"total_s": "--budget", "cleanup_reserve_s": "--reserve",
              "router_grace_s": "--router-grace", "router_quiet_s": "--router-quiet"}


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    """What quiesce adds to an engine's server; invalid values raise ConfigError naming
    them."""

    admin_host: str = "127.0.0.1"
    admin_port: int = 8001
    admin_token_file: str | None = None
    budget_s: float = 30.0
    reserve_s: float | None = None
    """Kept back for abort and the engine's shutdown; None: a fifth of the budget, at
    most 5 s."""
    router_grace_s: float = 2.0
    router_quiet_s: float = 0.0
    role: str = "auto"
    """``auto``: the role the engine's own settings give (vLLM's ``--kv-transfer-config``,
    SGLang's ``--disaggregation-mode``)."""
    publish_deletion_cost: bool = False
    name: str = "vllm-serve"

    def __post_init__(self) -> None:
        if not 0 <= self.admin_port <= 65535:
            raise ConfigError("--admin-port", f"must be in 0..65535, got {self.admin_port}")
        if self.role not in ROLES:
            raise ConfigError("--role", f"unknown role {self.role!r}; one of {ROLES}")
        if not self.name.strip():
            raise ConfigError("--name", "must not be empty")
        for check in (self.shutdown_policy, self.drain_config):
            try:
                check()
            except ConfigError as exc:  # named as the option is spelled
                option = _OPTION_OF.get(exc.field, exc.field)
                raise ConfigError(option, str(exc)[len(exc.field) + 2:]) from None

    def shutdown_policy(self) -> ShutdownPolicy:
        reserve = self.reserve_s if self.reserve_s is not None else \
            min(5.0, max(self.budget_s, 0.0) / 5)
        return ShutdownPolicy(total_s=self.budget_s, cleanup_reserve_s=reserve)

    def drain_config(self) -> DrainConfig:
        return DrainConfig(router_grace_s=self.router_grace_s, router_quiet_s=self.router_quiet_s)

    def resolved_role(self, engine_role: Role) -> Role:
        """The worker's role: ``--role``, or the one the engine's settings give."""
        return engine_role if self.role == "auto" else Role.parse(self.role)


class _Parser(argparse.ArgumentParser):
    def __init__(self, env: str) -> None:
        super().__init__(prog=f"${env}", add_help=False, allow_abbrev=False)
        self.env = env

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(self.env, message)


def _parser(env: str, name: str) -> argparse.ArgumentParser:
    d = ServerOptions()
    parser = _Parser(env)
    parser.add_argument("--admin-host", default=d.admin_host)
    parser.add_argument("--admin-port", type=int, default=d.admin_port)
    parser.add_argument("--admin-token-file", default=None)
    parser.add_argument("--budget", type=float, default=d.budget_s)
    parser.add_argument("--reserve", type=float, default=None)
    parser.add_argument("--router-grace", type=float, default=d.router_grace_s)
    parser.add_argument("--router-quiet", type=float, default=d.router_quiet_s)
    parser.add_argument("--role", default=d.role)
    parser.add_argument("--publish-deletion-cost", action="store_true")
    parser.add_argument("--name", default=name)
    return parser


def parse_server_options(env: str = VLLM_ARGS_ENV, text: str | None = None,
                         environ: Mapping[str, str] | None = None, *,
                         name: str = "vllm-serve") -> ServerOptions:
    """The options in ``text`` (default: the variable ``env``; ``name``: the worker's
    default name); ConfigError naming the bad one (an unknown option, a value that is not
    a number, a budget out of range)."""
    if text is None:
        text = (environ if environ is not None else os.environ).get(env, "")
    try:
        argv: Sequence[str] = shlex.split(text)
    except ValueError as exc:
        raise ConfigError(env, f"cannot split {text!r}: {exc}") from None
    args = _parser(env, name).parse_args(argv)
    return ServerOptions(
        admin_host=args.admin_host, admin_port=args.admin_port,
        admin_token_file=args.admin_token_file, budget_s=args.budget, reserve_s=args.reserve,
        router_grace_s=args.router_grace, router_quiet_s=args.router_quiet, role=args.role,
        publish_deletion_cost=args.publish_deletion_cost, name=args.name)

