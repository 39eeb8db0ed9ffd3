"""`make manifests-check`: the Kubernetes overlays, rendered and checked offline.

Each overlay under deploy/kubernetes/overlays is rendered by `kubectl kustomize` (what
`kubectl apply -k` would send), and every object it renders is checked:

- against the schemas of Kubernetes (kubernetes-validate's, which it ships: no network),
  strict, so an unknown or misspelt field is an error, for each version in
  `KUBERNETES_VERSIONS` (the oldest supported, and the newest the package knows);
- a kind Kubernetes does not define (a CRD's) against its schema in
  deploy/kubernetes/schemas (`CRD_SCHEMAS`); a kind with no schema at all is an error;
- then what a schema cannot see (`reference_errors`): the ConfigMaps and Secrets a pod
  names exist (or are the Secrets the operator makes, `OPERATOR_SECRETS`), its volume
  mounts and named probe ports exist, every selector (Service, NetworkPolicy,
  PodDisruptionBudget, ServiceMonitor) selects some pod or Service, an HPA's target
  exists, every image is pinned to a tag, and the edge's grace period covers its
  preStop and its drain (`drain_errors`).

Knows nothing of the edge's code: it reads manifests and a config.toml's one key.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate.utils as kv
import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = KUBERNETES / "overlays"
KUBERNETES_VERSIONS = ("1.30.0", kv.latest_version())
CRD_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): KUBERNETES
    / "schemas"
    / "servicemonitor-monitoring-v1.json",
}
# The Secrets the operator makes with kubectl (docs/kubernetes.md): never rendered.
OPERATOR_SECRETS = frozenset({"iop-edge-keys", "iop-node-token", "iop-redis-auth", "hf-token"})
# The edge exits at most this long after SIGTERM past drain_timeout_s (the supervisor's
# bound; one process stops itself 5 s sooner): docs/operations.md, Drain.
EXIT_AFTER_DRAIN_S = 20
DEFAULT_DRAIN_S = 30
EDGE_LABEL = ("app.kubernetes.io/name", "iop-edge")
WORKLOADS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet"})
KUSTOMIZE_TIMEOUT_S = 120

Obj = dict[str, Any]


class CheckError(Exception):
    """The check could not run (kubectl missing, an overlay that does not render)."""


def overlays() -> list[Path]:
    """Every overlay: a folder of deploy/kubernetes/overlays with a kustomization.yaml."""
    return sorted(p.parent for p in OVERLAYS.glob("*/kustomization.yaml"))


def render(overlay: Path) -> list[Obj]:
    """The objects `kubectl kustomize overlay` renders."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise CheckError(
            "kubectl is missing: the overlays are rendered with `kubectl kustomize` "
            "(install kubectl 1.27 or later, which embeds kustomize)"
        )
    done = subprocess.run(
        [kubectl, "kustomize", str(overlay)],
        capture_output=True, text=True, timeout=KUSTOMIZE_TIMEOUT_S, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise CheckError(f"{_name(overlay)}: kubectl kustomize failed: {done.stderr.strip()}")
    return [o for o in yaml.safe_load_all(done.stdout) if o]


def schema_errors(obj: Obj) -> list[str]:
    """What the object's schema refuses, for each Kubernetes version checked."""
    key = (obj.get("apiVersion", ""), obj.get("kind", ""))
    if key in CRD_SCHEMAS:
        schema = json.loads(CRD_SCHEMAS[key].read_text())
        validator = jsonschema.Draft202012Validator(schema)
        return [
            f"{_what(obj)}: {'.'.join(map(str, e.path)) or '(top)'}: {e.message}"
            for e in validator.iter_errors(obj)
        ]
    errors = []
    for version in KUBERNETES_VERSIONS:
        try:
            kv.validate(obj, version, strict=True)
        except kv.ValidationError as exc:
            where = ".".join(map(str, exc.path)) or "(top)"
            errors.append(f"{_what(obj)}: Kubernetes {exc.version}: {where}: {exc.message}")
        except kv.SchemaNotFoundError:
            errors.append(
                f"{_what(obj)}: no schema for {key[0]} {key[1]} in Kubernetes {version} "
                f"(a CRD's kind needs its schema in deploy/kubernetes/schemas)"
            )
    return errors


def _what(obj: Obj) -> str:
    return f"{obj.get('kind', '?')}/{obj.get('metadata', {}).get('name', '?')}"


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _templates(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, its pod template) for every workload rendered."""
    for obj in objects:
        if obj.get("kind") in WORKLOADS:
            yield obj, obj["spec"]["template"]


def _containers(pod: Obj) -> list[Obj]:
    spec = pod.get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _pod_labels(objects: list[Obj]) -> list[dict[str, str]]:
    return [pod.get("metadata", {}).get("labels", {}) for _, pod in _templates(objects)]


def _named(objects: list[Obj], kind: str) -> set[str]:
    return {o["metadata"]["name"] for o in objects if o.get("kind") == kind}


def _refs(pod: Obj) -> Iterator[tuple[str, str]]:
    """("ConfigMap" | "Secret", name) for every ConfigMap and Secret the pod names, but
    the optional ones."""
    for volume in pod["spec"].get("volumes", []):
        if "configMap" in volume:
            yield "ConfigMap", volume["configMap"]["name"]
        if "secret" in volume:
            yield "Secret", volume["secret"]["secretName"]
    for container in _containers(pod):
        for env in container.get("env", []):
            source = env.get("valueFrom", {})
            for key, kind in (("configMapKeyRef", "ConfigMap"), ("secretKeyRef", "Secret")):
                if key in source and not source[key].get("optional", False):
                    yield kind, source[key]["name"]
        for env_from in container.get("envFrom", []):
            for key, kind in (("configMapRef", "ConfigMap"), ("secretRef", "Secret")):
                if key in env_from and not env_from[key].get("optional", False):
                    yield kind, env_from[key]["name"]


def pod_errors(objects: list[Obj]) -> list[str]:
    """Names a pod uses that nothing defines: ConfigMaps, Secrets, volumes, ports."""
    errors = []
    known = {"ConfigMap": _named(objects, "ConfigMap"), "Secret": _named(objects, "Secret")}
    known["Secret"] |= OPERATOR_SECRETS
    for workload, pod in _templates(objects):
        what = _what(workload)
        for kind, name in _refs(pod):
            if name not in known[kind]:
                errors.append(f"{what}: {kind} {name} is neither rendered nor made by hand")
        volumes = {v["name"] for v in pod["spec"].get("volumes", [])}
        volumes |= {c["metadata"]["name"] for c in workload["spec"].get("volumeClaimTemplates", [])}
        selector = workload["spec"].get("selector", {}).get("matchLabels", {})
        if not _matches(selector, pod.get("metadata", {}).get("labels", {})):
            errors.append(f"{what}: its selector does not match its pod template's labels")
        for container in _containers(pod):
            ports = {p["name"] for p in container.get("ports", []) if "name" in p}
            for mount in container.get("volumeMounts", []):
                if mount["name"] not in volumes:
                    errors.append(f"{what}: {container['name']} mounts no volume {mount['name']}")
            for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
                for action in ("httpGet", "tcpSocket", "grpc"):
                    port = container.get(probe, {}).get(action, {}).get("port")
                    if isinstance(port, str) and port not in ports:
                        errors.append(f"{what}: {container['name']} {probe}: no port {port}")
            image = container.get("image", "")
            tag = image.rpartition("/")[2].partition("@")[0].rpartition(":")[2]
            if ":" not in image.rpartition("/")[2] or tag == "latest":
                errors.append(f"{what}: {container['name']}: image {image!r} is not pinned")
    return errors


def selector_errors(objects: list[Obj]) -> list[str]:
    """Selectors that select nothing, and targets that do not exist."""
    errors = []
    pods = _pod_labels(objects)
    services = [o for o in objects if o.get("kind") == "Service"]
    for obj in objects:
        kind, spec = obj.get("kind"), obj.get("spec", {})
        selector: dict[str, str] | None = None
        if kind == "Service":
            selector = spec.get("selector", {})
        elif kind == "NetworkPolicy":
            selector = spec.get("podSelector", {}).get("matchLabels", {})
        elif kind == "PodDisruptionBudget":
            selector = spec.get("selector", {}).get("matchLabels", {})
        if selector and not any(_matches(selector, labels) for labels in pods):
            errors.append(f"{_what(obj)}: its selector matches no pod")
        if kind == "HorizontalPodAutoscaler":
            target = spec["scaleTargetRef"]
            if target["name"] not in _named(objects, target["kind"]):
                errors.append(f"{_what(obj)}: no {target['kind']} {target['name']}")
        if kind == "ServiceMonitor":
            wanted = spec.get("selector", {}).get("matchLabels", {})
            chosen = [s for s in services if _matches(wanted, s["metadata"].get("labels", {}))]
            ports = {p.get("name") for s in chosen for p in s["spec"].get("ports", [])}
            if not chosen:
                errors.append(f"{_what(obj)}: its selector matches no Service")
            for endpoint in spec.get("endpoints", []):
                if "port" in endpoint and endpoint["port"] not in ports:
                    errors.append(f"{_what(obj)}: no Service port named {endpoint['port']}")
    return errors


def drain_errors(objects: list[Obj]) -> list[str]:
    """The edge's pods must outlast their drain: the grace period covers preStop, then
    [server] drain_timeout_s of the config.toml they mount, then the edge's exit."""
    errors = []
    configs = {
        o["metadata"]["name"]: o["data"]["config.toml"]
        for o in objects
        if o.get("kind") == "ConfigMap" and "config.toml" in o.get("data", {})
    }
    for workload, pod in _templates(objects):
        if pod.get("metadata", {}).get("labels", {}).get(EDGE_LABEL[0]) != EDGE_LABEL[1]:
            continue
        names = [v["configMap"]["name"] for v in pod["spec"]["volumes"] if "configMap" in v]
        texts = [configs[n] for n in names if n in configs]
        if len(texts) != 1:
            errors.append(f"{_what(workload)}: mounts {len(texts)} config.toml, not one")
            continue
        drain = tomllib.loads(texts[0]).get("server", {}).get("drain_timeout_s", DEFAULT_DRAIN_S)
        grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        for container in pod["spec"]["containers"]:
            hook = container.get("lifecycle", {}).get("preStop", {})
            pre_stop = hook.get("sleep", {}).get("seconds", 0)
            needed = pre_stop + drain + EXIT_AFTER_DRAIN_S
            if grace < needed:
                errors.append(
                    f"{_what(workload)}: terminationGracePeriodSeconds {grace} < preStop "
                    f"{pre_stop} + drain_timeout_s {drain} + {EXIT_AFTER_DRAIN_S} = {needed}"
                )
    return errors


def reference_errors(objects: list[Obj]) -> list[str]:
    """What the schemas cannot see: names, selectors, images, the drain."""
    return pod_errors(objects) + selector_errors(objects) + drain_errors(objects)


def check(objects: list[Obj]) -> list[str]:
    """Every error of a rendered overlay's objects: the schemas' first (the references
    are read from objects of the shapes the schemas allow, so only then)."""
    errors = [e for obj in objects for e in schema_errors(obj)]
    return errors or reference_errors(objects)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.kubecheck", description=__doc__)
    parser.add_argument("overlays", nargs="*", type=Path, help="default: every overlay")
    args = parser.parse_args(argv)
    failed = False
    for overlay in args.overlays or overlays():
        try:
            objects = render(overlay)
        except CheckError as exc:
            print(f"manifests-check: {exc}", file=sys.stderr)
            return 1
        errors = check(objects)
        for error in errors:
            print(f"{_name(overlay)}: {error}", file=sys.stderr)
        failed = failed or bool(errors)
        versions = " and ".join(v.rpartition(".")[0] for v in KUBERNETES_VERSIONS)
        verdict = f"{len(errors)} error(s)" if errors else "valid"
        print(f"{_name(overlay)}: {len(objects)} objects, Kubernetes {versions}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
