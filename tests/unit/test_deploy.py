"""The Kubernetes recipe keeps its timing promise: the worker always exits before SIGKILL.

Reads deploy/kubernetes/worker.yaml and checks the rule stated at its top against the
real CLI parsers (so a renamed flag breaks this test, not a cluster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from quiesce.cli import build_parser

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "worker.yaml"


def deployment() -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (found,) = [d for d in docs if d["kind"] == "Deployment"]
    assert isinstance(found, dict)
    return found


def test_worker_exits_before_sigkill_in_every_case() -> None:
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    grace = float(pod["terminationGracePeriodSeconds"])
    serve = build_parser().parse_args(container["command"][1:])
    prestop = build_parser().parse_args(container["lifecycle"]["preStop"]["exec"]["command"][1:])
    env = {e["name"]: e for e in container["env"]}
    assert float(env["QUIESCE_GRACE_PERIOD_S"]["value"]) == grace
    prestop_budget = grace - prestop.margin
    # SIGTERM arrives at the latest when prestop gives up; the worker's own budget must end
    # before the kubelet's SIGKILL at the grace period.
    assert prestop_budget > 0
    assert prestop_budget + serve.budget < grace


def test_admin_api_is_protected_and_probes_point_at_it() -> None:
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    serve = build_parser().parse_args(container["command"][1:])
    env = {e["name"]: e for e in container["env"]}
    assert serve.admin_host == "0.0.0.0"
    assert "secretKeyRef" in env["QUIESCE_ADMIN_TOKEN"]["valueFrom"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health/live"


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
