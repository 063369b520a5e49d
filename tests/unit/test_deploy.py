"""The Kubernetes recipes keep their timing promise: the worker always exits before SIGKILL.

Reads the manifests in deploy/kubernetes/ (the reference worker, Dynamo's vLLM worker
under ``quiesce dynamo vllm``, and ``vllm serve`` with quiesce's middleware) and checks
the rule stated at the top of each against the real parsers: quiesce's CLI, and for
``vllm serve`` quiesce's ``$QUIESCE_VLLM_ARGS`` (so a renamed flag breaks this test, not
a cluster).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from quiesce.ops.cli import build_parser
from quiesce.ops.operator_commands import DEFAULT_URL
from quiesce.serve.server_options import (
    SGLANG_ARGS_ENV,
    VLLM_ARGS_ENV,
    ServerOptions,
    parse_server_options,
)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFEST = DEPLOY / "worker.yaml"
DYNAMO_MANIFEST = DEPLOY / "dynamo-vllm-worker.yaml"
VLLM_SERVE_MANIFEST = DEPLOY / "vllm-serve.yaml"
SGLANG_SERVE_MANIFEST = DEPLOY / "sglang-serve.yaml"
MANIFESTS = [MANIFEST, DYNAMO_MANIFEST]
"""The manifests whose worker is a ``quiesce`` command line."""


def test_every_manifest_is_checked_here() -> None:
    assert sorted(DEPLOY.glob("*.yaml")) == sorted([*MANIFESTS, VLLM_SERVE_MANIFEST,
                                                    SGLANG_SERVE_MANIFEST])


def deployment(manifest: Path = MANIFEST) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    (found,) = [d for d in docs if d["kind"] == "Deployment"]
    assert isinstance(found, dict)
    return found


def parse(command: list[str]) -> argparse.Namespace:
    """The worker's or the hook's command line as ``quiesce`` parses it (for ``quiesce
    dynamo``, the arguments after ``--`` go to Dynamo, as in ``quiesce.ops.cli.main``)."""
    words = command[1:]
    passthrough: list[str] = []
    if words[:1] == ["dynamo"] and "--" in words:
        cut = words.index("--")
        words, passthrough = words[:cut], words[cut + 1:]
    args = build_parser().parse_args(words)
    args.passthrough = passthrough
    return args


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_worker_exits_before_sigkill_in_every_case(manifest: Path) -> None:
    pod = deployment(manifest)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    grace = float(pod["terminationGracePeriodSeconds"])
    serve = parse(container["command"])
    prestop = parse(container["lifecycle"]["preStop"]["exec"]["command"])
    env = {e["name"]: e for e in container.get("env", [])}
    # the hook's grace period: its --grace-period, else $QUIESCE_GRACE_PERIOD_S
    told = (prestop.grace_period if prestop.grace_period is not None
            else float(env["QUIESCE_GRACE_PERIOD_S"]["value"]))
    assert told == grace
    prestop_budget = grace - prestop.margin
    # SIGTERM arrives at the latest when prestop gives up; the worker's own budget must end
    # before the kubelet's SIGKILL at the grace period.
    assert prestop_budget > 0
    assert prestop_budget + serve.budget < grace


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda p: p.name)
def test_admin_api_is_protected_and_probes_point_at_it(manifest: Path) -> None:
    (container,) = deployment(manifest)["spec"]["template"]["spec"]["containers"]
    serve = parse(container["command"])
    env = {e["name"]: e for e in container["env"]}
    assert serve.admin_host == "0.0.0.0"
    assert "secretKeyRef" in env["QUIESCE_ADMIN_TOKEN"]["valueFrom"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert ports[container[probe]["httpGet"]["port"]] == serve.admin_port
    prestop = parse(container["lifecycle"]["preStop"]["exec"]["command"])
    url = prestop.url or env.get("QUIESCE_ADMIN_URL", {}).get("value") or DEFAULT_URL
    assert urlsplit(url).port == serve.admin_port  # the hook drains this worker


def test_dynamo_worker_runs_dynamo_vllm_on_one_gpu_and_waits_for_its_model() -> None:
    (container,) = deployment(DYNAMO_MANIFEST)["spec"]["template"]["spec"]["containers"]
    serve = parse(container["command"])
    assert serve.command == "dynamo" and serve.component == "vllm"
    assert "--model" in serve.passthrough  # Dynamo's own arguments, after --
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # the admin API listens only once the model is registered: liveness must wait for it
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/health/live"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_the_pod_may_patch_its_own_deletion_cost() -> None:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert build_parser().parse_args(container["command"][1:]).publish_deletion_cost
    account = pod["serviceAccountName"]
    assert by_kind["ServiceAccount"]["metadata"]["name"] == account
    binding = by_kind["RoleBinding"]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    assert binding["roleRef"]["name"] == by_kind["Role"]["metadata"]["name"]
    (rule,) = by_kind["Role"]["rules"]
    assert rule["resources"] == ["pods"] and rule["verbs"] == ["patch"]  # nothing more
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"


def check_server_pod(manifest: Path, env_name: str) -> tuple[list[str], ServerOptions]:
    """The checks every engine-server manifest passes: exits before SIGKILL, the admin API
    beyond loopback with a token and drained by the preStop hook, quiesce's readiness and
    the engine's own liveness, the deletion cost with no more rights than patching pods.
    Returns the container's command and quiesce's options as its plugin reads them."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    pod = deployment(manifest)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command: list[str] = container["command"]
    env = {e["name"]: e for e in container["env"]}
    options = parse_server_options(env_name, env[env_name]["value"])  # what the plugin reads
    grace = float(pod["terminationGracePeriodSeconds"])
    prestop = parse(container["lifecycle"]["preStop"]["exec"]["command"])
    assert prestop.grace_period == grace
    assert grace - prestop.margin > 0
    assert grace - prestop.margin + options.budget_s < grace
    # the admin API: beyond loopback with a token; the hook drains this server
    assert options.admin_host == "0.0.0.0"
    assert "secretKeyRef" in env["QUIESCE_ADMIN_TOKEN"]["valueFrom"]
    assert urlsplit(prestop.url).port == options.admin_port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["admin"] == options.admin_port
    assert ports["http"] == int(command[command.index("--port") + 1])
    # readiness is quiesce's on the engine's port; liveness stays the engine's own
    assert container["readinessProbe"]["httpGet"] == {"path": "/quiesce/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    # the deletion cost: the pod may patch pods and nothing more
    assert options.publish_deletion_cost
    assert pod["serviceAccountName"] == by_kind["ServiceAccount"]["metadata"]["name"]
    (rule,) = by_kind["Role"]["rules"]
    assert rule["resources"] == ["pods"] and rule["verbs"] == ["patch"]
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    return command, options


def test_vllm_serve_exits_before_sigkill_and_only_the_middleware_is_added() -> None:
    from quiesce.serve.vllm_plugin import MIDDLEWARE, names_middleware

    command, _ = check_server_pod(VLLM_SERVE_MANIFEST, VLLM_ARGS_ENV)
    assert command[:2] == ["vllm", "serve"] and names_middleware(command)
    assert [w for w in command if "quiesce" in w] == [MIDDLEWARE]  # vLLM's command otherwise


def test_sglang_serve_exits_before_sigkill_and_its_command_is_sglangs_own() -> None:
    from quiesce.serve.sglang_plugin import layout_problem

    command, _ = check_server_pod(SGLANG_SERVE_MANIFEST, SGLANG_ARGS_ENV)
    assert command[:3] == ["python3", "-m", "sglang.launch_server"]
    assert layout_problem(command[3:]) is None  # a layout quiesce serves
    assert not [w for w in command if "quiesce" in w]  # SGLang's command, unchanged
