"""Options of ``quiesce serve``, kept apart from the worker so that the CLI (and the
Kubernetes preStop hook it also serves) starts without importing the HTTP stack."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import urllib.parse
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from quiesce.adapters.dynamo.backend import DISCOVERY_BACKENDS, REQUEST_PLANES
from quiesce.adapters.nvml import parse_devices
from quiesce.adapters.sim import SimConfig
from quiesce.drain import DrainConfig
from quiesce.errors import ConfigError
from quiesce.probe import Role
from quiesce.shutdown import ShutdownPolicy

if TYPE_CHECKING:
    from quiesce.adapters.dynamo.backend import DynamoBackendConfig
    from quiesce.adapters.etcd import EtcdConfig

ENGINES = ("sim", "vllm", "sglang", "trtllm")
MODEL_ENGINES = ("vllm", "sglang", "trtllm")
"""Engines that load a model (``--model`` required)."""
DTYPES = ("auto", "bfloat16", "float16", "float32")
WILDCARD_HOSTS = ("0.0.0.0", "0", "::", "::0", "")
"""Addresses a server binds to but no router can connect to."""
DYNAMO_SHUTDOWNS = ("quiesce", "dynamo")
"""``--dynamo-shutdown``: quiesce's drain, or Dynamo 1.6.1's own graceful-shutdown helper."""
DYNAMO_CONFLICTS = {
    "engine": "--dynamo serves the sim engine only (Dynamo's own vLLM worker: "
              "quiesce dynamo vllm)",
    "etcd": "--dynamo registers in Dynamo's discovery (--dynamo-discovery-backend), "
            "not quiesce's etcd directory",
    "advertise_url": "--dynamo serves no HTTP API to advertise (Dynamo's request plane)",
    "role": "--dynamo serves an aggregated worker only",
}
DYNAMO_ONLY = ("dynamo_endpoint", "dynamo_discovery_backend", "dynamo_request_plane")
"""Options that mean something only with ``--dynamo``."""
ETCD_OPTIONS = {"worker": "name", "prefix": "etcd_prefix", "ttl_s": "etcd_ttl",
                "host": "etcd", "port": "etcd", "address": "advertise_url"}
"""EtcdConfig's fields → the ``quiesce serve`` options they come from."""


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    engine: str = "sim"
    model: str | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    gpu_memory_utilization: float | None = None
    served_model_name: str | None = None
    kv_transfer_config: Mapping[str, Any] | None = None
    cache_transceiver_config: Mapping[str, Any] | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    admin_host: str = "127.0.0.1"
    admin_port: int = 8001
    role: Role = Role.AGGREGATED
    budget_s: float = 30.0
    cleanup_reserve_s: float = 5.0
    router_grace_s: float = 2.0
    admin_token_file: str | None = None
    decode_step_s: float = 0.02
    name: str = "worker"
    publish_deletion_cost: bool = False
    require_gpu_quiet: tuple[int, ...] = ()
    etcd: tuple[str, int] | None = None
    """Register in etcd at ``(host, port)``; None: no discovery outside the process."""
    etcd_prefix: str = "/quiesce/instances"
    etcd_ttl_s: int = 10
    advertise_url: str | None = None
    """Where routers reach the serving API; default ``http://HOST:PORT`` as bound."""
    router_quiet_s: float = 0.0
    dynamo: bool = False
    """Serve as a Dynamo backend (model card and endpoint) instead of the HTTP API."""
    dynamo_endpoint: str = "dynamo.backend.generate"
    dynamo_discovery_backend: str = "etcd"
    dynamo_request_plane: str = "tcp"
    dynamo_shutdown: str = "quiesce"
    """What SIGTERM runs with ``dynamo``: quiesce's drain, or Dynamo's own helper."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError("engine", f"unknown engine {self.engine!r}; one of {ENGINES}")
        if self.engine in MODEL_ENGINES and not self.model:
            raise ConfigError("model", f"--engine {self.engine} needs --model PATH")
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"unknown dtype {self.dtype!r}; one of {DTYPES}")
        if self.max_model_len is not None and (isinstance(self.max_model_len, bool)
                                               or self.max_model_len < 1):
            raise ConfigError("max_model_len", f"must be >= 1, got {self.max_model_len!r}")
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ConfigError("served_model_name", "must not be empty")
        if self.kv_transfer_config is not None:
            if not isinstance(self.kv_transfer_config, Mapping):
                raise ConfigError("kv_transfer_config", "must be a JSON object")
            if self.engine != "vllm":
                raise ConfigError("kv_transfer_config", "needs --engine vllm (TensorRT-LLM: "
                                  "--cache-transceiver-config)")
        if self.cache_transceiver_config is not None:
            if not isinstance(self.cache_transceiver_config, Mapping):
                raise ConfigError("cache_transceiver_config", "must be a JSON object")
            if self.engine != "trtllm":
                raise ConfigError("cache_transceiver_config", "needs --engine trtllm")
        share = self.gpu_memory_utilization
        if share is not None and not 0 < share <= 1:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {share!r}")
        # validate the time model, the budget and discovery before anything starts
        SimConfig(decode_step_s=self.decode_step_s)
        self.shutdown_policy()
        self.drain_config()
        self._check_discovery()
        self._check_dynamo()

    def _check_discovery(self) -> None:
        if self.advertise_url is not None:
            check_url("advertise_url", self.advertise_url)
        if self.etcd is None:
            return
        if self.advertise_url is None and self.host in WILDCARD_HOSTS:
            raise ConfigError("advertise_url", f"needed with --etcd when --host is "
                                               f"{self.host!r}: routers cannot reach a "
                                               f"wildcard address (e.g. "
                                               f"--advertise-url http://$POD_IP:{self.port})")
        self.etcd_config(self.port)

    def _check_dynamo(self) -> None:
        """``--dynamo``: what it needs and what it cannot be combined with."""
        if self.dynamo_shutdown not in DYNAMO_SHUTDOWNS:
            raise ConfigError("dynamo_shutdown", f"one of {DYNAMO_SHUTDOWNS}, got "
                                                 f"{self.dynamo_shutdown!r}")
        if not self.dynamo:
            if self.dynamo_shutdown != "quiesce":
                raise ConfigError("dynamo_shutdown", "needs --dynamo")
            return
        conflicts = {"engine": self.engine != "sim", "etcd": self.etcd is not None,
                     "advertise_url": self.advertise_url is not None,
                     "role": self.role is not Role.AGGREGATED}
        for field, conflict in conflicts.items():
            if conflict:
                raise ConfigError(field, DYNAMO_CONFLICTS[field])
        if not self.model:
            raise ConfigError("model", "--dynamo needs --model DIR: the model card Dynamo's "
                                       "frontend tokenizes with (config.json, tokenizer.json)")
        self.dynamo_config()

    def dynamo_config(self) -> DynamoBackendConfig:
        """The :class:`~quiesce.adapters.dynamo.backend.DynamoBackendConfig` of
        ``--dynamo``; ConfigError naming the option on a bad value."""
        from quiesce.adapters.dynamo.backend import DynamoBackendConfig  # noqa: PLC0415

        assert self.model is not None
        return DynamoBackendConfig(
            model_path=self.model, served_model_name=self.served_model_name or self.model,
            endpoint=self.dynamo_endpoint, discovery_backend=self.dynamo_discovery_backend,
            request_plane=self.dynamo_request_plane)

    def drain_config(self) -> DrainConfig:
        return DrainConfig(router_grace_s=self.router_grace_s,
                           router_quiet_s=self.router_quiet_s)

    def shutdown_policy(self) -> ShutdownPolicy:
        return ShutdownPolicy(total_s=self.budget_s, cleanup_reserve_s=self.cleanup_reserve_s)

    def etcd_config(self, api_port: int) -> EtcdConfig:
        """The :class:`~quiesce.adapters.etcd.EtcdConfig` of this worker, its address
        from ``api_port`` unless ``advertise_url`` is set; ConfigError naming the option
        (``name``, ``etcd_prefix``, ``etcd_ttl``...) on a bad value."""
        from quiesce.adapters.etcd import EtcdConfig  # noqa: PLC0415 (aetcd: lazily)

        assert self.etcd is not None
        etcd_host, etcd_port = self.etcd
        listen = f"[{self.host}]" if ":" in self.host else self.host  # IPv6
        address = self.advertise_url or f"http://{listen}:{api_port}"
        try:
            return EtcdConfig(worker=self.name, address=address, role=self.role.value,
                              host=etcd_host, port=etcd_port, prefix=self.etcd_prefix,
                              ttl_s=self.etcd_ttl_s)
        except ConfigError as exc:  # name the option the operator typed
            option = ETCD_OPTIONS.get(exc.field, exc.field)
            raise ConfigError(option, str(exc).split(": ", 1)[-1]) from None


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerOptions()
    parser.add_argument("--engine", choices=ENGINES, default="sim",
                        help="engine behind the worker: sim (simulated), vllm (needs "
                             "quiesce[vllm] and --model), sglang (needs quiesce[sglang] and "
                             "--model) or trtllm (TensorRT-LLM's PyTorch "
                             "backend in the worker's process; needs tensorrt_llm, e.g. its "
                             "release container, and --model)")
    parser.add_argument("--model", default=None, help="vllm, sglang, trtllm: model directory")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name of the OpenAI API (/v1/models and the answers' "
                             "`model`; default: the --model directory's name, 'quiesce' "
                             "for sim)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="vllm: maximum context length (default: the model's own)")
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype,
                        help="vllm: weights and activations dtype (%(default)s: the model's "
                             "on a GPU; float32 on a CPU, where vLLM's bfloat16 hit SIGILL "
                             "in its AMX kernel)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=None,
                        help="vllm: share of the GPU's memory the engine may use "
                             "(vLLM's default when not given). On a CPU, when neither this "
                             "nor $VLLM_CPU_KVCACHE_SPACE (GiB) is set, the KV cache gets "
                             "min(4 GiB, a quarter of the available memory)")
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help="vllm: KV connector configuration, a JSON object for vLLM's "
                             "KVTransferConfig, as `vllm serve --kv-transfer-config` takes "
                             "it (e.g. '{\"kv_connector\": \"NixlConnector\", "
                             "\"kv_role\": \"kv_both\"}')")
    parser.add_argument("--cache-transceiver-config", default=None, metavar="JSON",
                        help="trtllm: KV cache transceiver configuration, a JSON object for "
                             "TensorRT-LLM's CacheTransceiverConfig (default for the prefill "
                             "and decode roles: '{\"backend\": \"DEFAULT\"}')")
    parser.add_argument("--host", default=defaults.host, help="serving API address")
    parser.add_argument("--port", type=int, default=defaults.port, help="serving API port")
    parser.add_argument("--admin-host", default=defaults.admin_host, help="admin API address")
    parser.add_argument("--admin-port", type=int, default=defaults.admin_port,
                        help="admin API port")
    parser.add_argument("--admin-token-file", default=None,
                        help="file with the admin bearer token (else $QUIESCE_ADMIN_TOKEN)")
    parser.add_argument("--role", default=defaults.role.value,
                        choices=[r.value for r in Role], help="worker role")
    parser.add_argument("--budget", type=float, default=defaults.budget_s,
                        help="shutdown budget from SIGTERM to exit, s (%(default)s)")
    parser.add_argument("--reserve", type=float, default=None,
                        help="part of the budget kept for abort and cleanup, s "
                             "(default: a fifth of the budget, at most 5)")
    parser.add_argument("--router-grace", type=float, default=defaults.router_grace_s,
                        help="keep admitting this long after unregistering, s (%(default)s)")
    parser.add_argument("--decode-step", type=float, default=defaults.decode_step_s,
                        help="sim engine: seconds per decode step (%(default)s)")
    parser.add_argument("--require-gpu-quiet", default=None, metavar="DEVICES",
                        help="before `drained`, also require these GPUs (NVML indices as "
                             "nvidia-smi shows them, e.g. 0,1) to be quiet: SM utilisation "
                             "and PCIe/NVLink traffic under thresholds, sampled when the "
                             "engine says it is idle. Never makes a worker drained on its "
                             "own; unreadable NVML is unknown. Needs quiesce[nvml]")
    parser.add_argument("--publish-deletion-cost", action="store_true",
                        help="keep this pod's controller.kubernetes.io/pod-deletion-cost "
                             "annotation at the worker's drain cost, so a scale-down removes "
                             "the cheapest worker to drain (in a Kubernetes pod; needs the "
                             "RBAC of deploy/kubernetes/worker.yaml; API errors are logged "
                             "and shown in status, never fatal)")
    discovery = parser.add_argument_group(
        "discovery", "where routers find the worker; without --etcd it registers nowhere "
                     "outside the process (a router must be told its address)")
    discovery.add_argument("--etcd", default=None, metavar="HOST:PORT",
                           help="register in etcd under PREFIX/NAME with a lease kept alive; "
                                "unregistering (the drain's first step) deletes the key. "
                                "Needs quiesce[etcd]")
    discovery.add_argument("--name", default=None,
                           help="this worker's name in discovery (default: $POD_NAME, else "
                                "HOSTNAME-PID)")
    discovery.add_argument("--advertise-url", default=None, metavar="URL",
                           help="the serving API's URL as routers should use it (default: "
                                "http://HOST:PORT as bound)")
    discovery.add_argument("--etcd-prefix", default=defaults.etcd_prefix,
                           help="key prefix (%(default)s)")
    discovery.add_argument("--etcd-ttl", type=int, default=defaults.etcd_ttl_s,
                           help="lease TTL, whole seconds: how long a dead worker stays listed "
                                "(%(default)s)")
    add_dynamo_backend_arguments(parser)


def add_dynamo_backend_arguments(parser: argparse.ArgumentParser) -> None:
    """``quiesce serve --dynamo`` and its options (defaults resolved by
    :func:`options_from_args`, from Dynamo's own environment variables)."""
    parser.add_argument("--router-quiet", type=float, default=None,
                        help="after the router grace, keep admitting until no request came "
                             f"for this long, s (default: {DYNAMO_QUIET_S:g} with --dynamo, "
                             "else 0: off)")
    group = parser.add_argument_group(
        "Dynamo backend", "serve the engine behind NVIDIA Dynamo's frontend (ai-dynamo 1.6.1) "
                          "instead of the OpenAI HTTP API (--host/--port unused)")
    group.add_argument("--dynamo", action="store_true",
                       help="register as a Dynamo backend: Dynamo's model card from --model "
                            "DIR (config.json and tokenizer.json: the frontend tokenizes) and "
                            "a token endpoint through Dynamo's runtime; sim engine only. "
                            "Needs quiesce[dynamo]")
    group.add_argument("--dynamo-endpoint", default=None, metavar="NAMESPACE.COMPONENT.ENDPOINT",
                       help="the endpoint served (default: $DYN_NAMESPACE.backend.generate, "
                            "i.e. dynamo.backend.generate, as Dynamo's workers)")
    group.add_argument("--dynamo-discovery-backend", default=None, choices=DISCOVERY_BACKENDS,
                       help="Dynamo's discovery (default: $DYN_DISCOVERY_BACKEND, else etcd; "
                            "file: $DYN_FILE_KV)")
    group.add_argument("--dynamo-request-plane", default=None, choices=REQUEST_PLANES,
                       help="Dynamo's request plane (default: $DYN_REQUEST_PLANE, else tcp)")
    group.add_argument("--dynamo-shutdown", default="quiesce", choices=DYNAMO_SHUTDOWNS,
                       help="on SIGTERM: quiesce (%(default)s: unregister the model card and "
                            "the instance, router grace and quiet, close admission, wait until "
                            "nothing is admitted and the engine is idle) or dynamo (Dynamo "
                            "1.6.1's own helper as its workers ship it: unregister the "
                            "instance, sleep $DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS or 5 s, "
                            "abort what is left)")


def parse_json_object(field: str, text: str | None) -> dict[str, Any] | None:
    """``text`` as a JSON object, None for None; anything else is a ConfigError on ``field``."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(field, f"not valid JSON ({exc}): {text!r}") from exc
    if not isinstance(value, dict):
        raise ConfigError(field, f"must be a JSON object, got {type(value).__name__}")
    return value


def parse_endpoint(field: str, text: str | None) -> tuple[str, int] | None:
    """``HOST:PORT`` (``[IPv6]:PORT``) as ``(host, port)``, None for None; else a
    ConfigError on ``field``."""
    if text is None:
        return None
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # an IPv6 address needs its brackets
    if (not sep or not host or "/" in host or not (port.isascii() and port.isdecimal())
            or not 0 < int(port) < 65536):
        raise ConfigError(field, f"must be HOST:PORT with a port in 1..65535, got {text!r}")
    return host, int(port)


def check_url(field: str, url: str) -> None:
    """ConfigError on ``field`` unless ``url`` is an http(s) URL with a host (and a valid
    port, if it has one)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise ConfigError(field, f"must be an http(s) URL with a host, got {url!r}")


def default_name() -> str:
    """``$POD_NAME`` (set it from the downward API), else ``HOSTNAME-PID``."""
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def dynamo_fields(args: argparse.Namespace,
                  environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The ``--dynamo`` fields of :class:`WorkerOptions`, unset ones from Dynamo's
    environment; ConfigError for a Dynamo-only option given without ``--dynamo``."""
    if not args.dynamo:
        for field in DYNAMO_ONLY:
            if getattr(args, field) is not None:
                raise ConfigError(field, "needs --dynamo")
    namespace = environ.get("DYN_NAMESPACE") or "dynamo"
    return {"dynamo": args.dynamo,
            "dynamo_endpoint": args.dynamo_endpoint or f"{namespace}.backend.generate",
            "dynamo_discovery_backend": (args.dynamo_discovery_backend
                                         or environ.get("DYN_DISCOVERY_BACKEND") or "etcd"),
            "dynamo_request_plane": (args.dynamo_request_plane
                                     or environ.get("DYN_REQUEST_PLANE") or "tcp"),
            "dynamo_shutdown": args.dynamo_shutdown,
            "router_quiet_s": (args.router_quiet if args.router_quiet is not None
                               else DYNAMO_QUIET_S if args.dynamo else 0.0)}


def options_from_args(args: argparse.Namespace) -> WorkerOptions:
    """:class:`WorkerOptions` from parsed arguments; raises ConfigError naming the field."""
    return WorkerOptions(
        engine=args.engine, model=args.model, max_model_len=args.max_model_len, dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        served_model_name=args.served_model_name,
        kv_transfer_config=parse_json_object("kv_transfer_config", args.kv_transfer_config),
        cache_transceiver_config=parse_json_object("cache_transceiver_config",
                                                   args.cache_transceiver_config),
        host=args.host, port=args.port, admin_host=args.admin_host,
        admin_port=args.admin_port, role=Role.parse(args.role), budget_s=args.budget,
        cleanup_reserve_s=(args.reserve if args.reserve is not None
                           else min(5.0, max(args.budget, 0) / 5)),
        router_grace_s=args.router_grace,
        admin_token_file=args.admin_token_file, decode_step_s=args.decode_step,
        publish_deletion_cost=args.publish_deletion_cost,
        require_gpu_quiet=(() if args.require_gpu_quiet is None
                           else parse_devices(args.require_gpu_quiet)),
        name=args.name if args.name is not None else default_name(),
        etcd=parse_endpoint("etcd", args.etcd), etcd_prefix=args.etcd_prefix,
        etcd_ttl_s=args.etcd_ttl, advertise_url=args.advertise_url, **dynamo_fields(args))


# -- quiesce dynamo COMPONENT [options] -- ARGS --------------------------------------

DYNAMO_COMPONENTS = ("vllm", "sglang", "trtllm")
"""Dynamo worker components ``quiesce dynamo`` runs (``python -m dynamo.<name>``; the same
names as :data:`quiesce.adapters.dynamo.components.COMPONENTS`)."""
DYNAMO_GRACE_ENV = "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS"
DYNAMO_GRACE_S = 1.0
DYNAMO_QUIET_S = 2.0
"""The router grace of ``quiesce dynamo``: at least ``DYNAMO_GRACE_S`` after the
unregister (the model card and the endpoint instances), then until no request came for
``DYNAMO_QUIET_S`` (:func:`quiesce.drain.wait_router_quiet`; the quiet period Dynamo's own
later drain uses). With only the instances unregistered, Dynamo 1.6.1's frontend still
picked the worker 5 s later (bench/dynamo logs): it routes by the model card."""


def add_dynamo_arguments(parser: argparse.ArgumentParser) -> None:
    """``quiesce dynamo COMPONENT [options] -- ARGS``: ARGS go to Dynamo unchanged (the
    CLI splits them off at ``--`` before parsing, into ``args.args``)."""
    parser.add_argument("component", choices=DYNAMO_COMPONENTS,
                        help="the Dynamo worker component to run (python -m dynamo.COMPONENT)")
    parser.add_argument("--admin-host", default="127.0.0.1", help="admin API address")
    parser.add_argument("--admin-port", type=int, default=8001, help="admin API port")
    parser.add_argument("--admin-token-file", default=None,
                        help="file with the admin bearer token (else $QUIESCE_ADMIN_TOKEN)")
    parser.add_argument("--budget", type=float, default=30.0,
                        help="shutdown budget from SIGTERM to exit, s (%(default)s)")
    parser.add_argument("--reserve", type=float, default=None,
                        help="part of the budget kept for abort and Dynamo's teardown, s "
                             "(default: a fifth of the budget, at most 5)")
    parser.add_argument("--router-grace", type=float, default=None,
                        help="keep admitting at least this long after unregistering, s "
                             f"(default: ${DYNAMO_GRACE_ENV} if set, else "
                             f"{DYNAMO_GRACE_S:g}; unlike Dynamo's helper, nothing is "
                             "aborted afterwards)")
    parser.add_argument("--router-quiet", type=float, default=DYNAMO_QUIET_S,
                        help="then keep admitting until no request came for this long, s "
                             "(%(default)s; 0: off): a frontend that still sends keeps "
                             "the gate open")
    parser.add_argument("--accept-untested-engine", default=None, metavar="VERSION",
                        help="sglang only: trust the installed SGLang although quiesce's "
                             "adapter was not tested on it (VERSION must name exactly the "
                             "installed release, which you checked; a tested release or "
                             "one known not to fit, such as 0.5.21, is refused). Shown as "
                             "a warning in the log, the ready line and the status")


def dynamo_policy(args: argparse.Namespace,
                  environ: Mapping[str, str] = os.environ) -> tuple[ShutdownPolicy, DrainConfig]:
    """The shutdown budget and drain settings of ``quiesce dynamo``; ConfigError naming
    the field for bad values (a bad ``$DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS`` too)."""
    reserve = args.reserve if args.reserve is not None else min(5.0, max(args.budget, 0) / 5)
    grace = args.router_grace
    if grace is None:
        text = environ.get(DYNAMO_GRACE_ENV, "")
        try:
            grace = float(text) if text else DYNAMO_GRACE_S
        except ValueError:
            raise ConfigError(DYNAMO_GRACE_ENV, f"not a number of seconds: {text!r}") from None
    quiet = getattr(args, "router_quiet", DYNAMO_QUIET_S)
    return (ShutdownPolicy(total_s=args.budget, cleanup_reserve_s=reserve),
            DrainConfig(router_grace_s=grace, router_quiet_s=quiet))
