"""The Kubernetes deployment (deploy/kubernetes) and its image (Containerfile), offline.

Each overlay is rendered by `kubectl kustomize` and checked by `tools.kubecheck` (the
Kubernetes schemas, strict; the ServiceMonitor's; names, selectors, the drain); the
check itself is shown to refuse what a cluster would. Then what the deployment promises:
every door to a node is locked (a token on the node and in the edge's config, vLLM on
loopback, only edge pods let through), the edge accepts the config.toml each overlay
ships, the init container puts any Redis password into it intact, and the image is
linted and starts the edge. Without kubectl the tests that render skip and say so,
except under CI=true, where they fail.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import redis

from edge.config import NodeConfig
from edge.config.parse import load_config_file
from tools import kubecheck

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = ROOT / "Containerfile"
PLACEHOLDER = "${REDIS_PASSWORD}"
# The files the Secrets put in the edge pod, as its config.toml names them.
SECRET_FILES = {
    "/etc/iop-edge/keys/api-keys": b"sk-test-1\n",
    "/etc/iop-edge/keys/team-a": b"sk-test-team-a\n",
    "/etc/iop-edge/node-token/token": b"0123456789abcdef\n",
}

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    """Every overlay's objects, by the overlay's folder name."""
    if shutil.which("kubectl") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("kubectl is missing: the overlays cannot be rendered")
        pytest.skip("kubectl is missing: the overlays cannot be rendered (kubectl kustomize)")
    return {overlay.name: kubecheck.render(overlay) for overlay in kubecheck.overlays()}


def _one(objects: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def _edge_config(objects: list[Obj]) -> str:
    names = [o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"]
    (name,) = [n for n in names if n.startswith("iop-edge-config-")]
    return str(_one(objects, "ConfigMap", name)["data"]["config.toml"])


def _pods(objects: list[Obj]) -> list[Obj]:
    return [o["spec"]["template"] for o in objects if o["kind"] in kubecheck.WORKLOADS]


def _app(pod: Obj) -> str | None:
    return pod["metadata"]["labels"].get("app.kubernetes.io/name")


def test_every_overlay_renders_and_every_object_is_valid(rendered: dict[str, list[Obj]]) -> None:
    """Both overlays render; every object passes the schemas of Kubernetes 1.30 and the
    newest version checked (strict), and every name, selector and target resolves."""
    assert set(rendered) == {"dev", "production"}
    for name, objects in rendered.items():
        assert kubecheck.check(objects) == [], name
        kinds = {o["kind"] for o in objects}
        assert {"Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"} <= kinds, name
        assert {"NetworkPolicy", "StatefulSet", "Service", "ConfigMap"} <= kinds, name
    assert "ServiceMonitor" in {o["kind"] for o in rendered["production"]}
    assert kubecheck.KUBERNETES_VERSIONS[0] == "1.30.0"


def _break_field(objects: list[Obj]) -> None:
    edge = _one(objects, "Deployment", "iop-edge")["spec"]["template"]["spec"]["containers"][0]
    edge["readinesProbe"] = edge.pop("readinessProbe")


def _break_type(objects: list[Obj]) -> None:
    pod = _one(objects, "Deployment", "iop-edge")["spec"]["template"]["spec"]
    pod["terminationGracePeriodSeconds"] = "150"


def _break_monitor(objects: list[Obj]) -> None:
    _one(objects, "ServiceMonitor", "iop-edge")["spec"]["endpoints"][0]["intervall"] = "15s"


def _break_secret(objects: list[Obj]) -> None:
    pod = _one(objects, "Deployment", "iop-edge")["spec"]["template"]["spec"]
    next(v for v in pod["volumes"] if "secret" in v)["secret"]["secretName"] = "iop-edge-key"


def _break_drain(objects: list[Obj]) -> None:
    _one(objects, "Deployment", "iop-edge")["spec"]["template"]["spec"][
        "terminationGracePeriodSeconds"
    ] = 60


def _break_selector(objects: list[Obj]) -> None:
    _one(objects, "Service", "iop-node")["spec"]["selector"] = {"app.kubernetes.io/name": "node"}


def _break_image(objects: list[Obj]) -> None:
    pod = _one(objects, "StatefulSet", "iop-redis")["spec"]["template"]["spec"]
    pod["containers"][0]["image"] = "docker.io/library/redis"


def _break_kind(objects: list[Obj]) -> None:
    objects.append({"apiVersion": "example.com/v1", "kind": "Gadget", "metadata": {"name": "x"}})


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        (_break_field, "'readinesProbe' was unexpected"),
        (_break_type, "'150' is not of type 'integer'"),
        (_break_monitor, "'intervall' was unexpected"),
        (_break_secret, "Secret iop-edge-key is neither rendered nor made by hand"),
        (_break_drain, "terminationGracePeriodSeconds 60 < preStop 10 + drain_timeout_s 120"),
        (_break_selector, "Service/iop-node: its selector matches no pod"),
        (_break_image, "image 'docker.io/library/redis' is not pinned"),
        (_break_kind, "no schema for example.com/v1 Gadget"),
    ],
)
def test_the_check_refuses_what_a_cluster_would(
    rendered: dict[str, list[Obj]], breakage: Any, expected: str
) -> None:
    """A misspelt field, a wrong type, a Secret or selector that names nothing, an
    unpinned image, a kind with no schema, a grace period shorter than the drain: each
    one is reported, naming the object."""
    objects = copy.deepcopy(rendered["production"])
    breakage(objects)
    errors = kubecheck.check(objects)
    assert any(expected in e for e in errors), errors


def test_no_one_reaches_a_node_except_the_edge_with_its_token(
    rendered: dict[str, list[Obj]],
) -> None:
    """Every node process takes only RPCs with the token (--token-file), the edge sends
    it to every node entry, vLLM listens on the pod's loopback, the node pods publish
    their gRPC port alone, and the network lets only edge pods reach that port (and
    Redis)."""
    for name, objects in rendered.items():
        nodes = [p for p in _pods(objects) if _app(p) == "iop-node"]
        assert nodes, name
        for pod in nodes:
            for container in pod["spec"]["containers"]:
                command = [*container.get("command", []), *container.get("args", [])]
                if command and command[0] in ("iop-node", "iop-sim-node"):
                    assert "--token-file" in command
                    assert "--insecure" not in command
                    assert [p["name"] for p in container["ports"]] == ["grpc"]
                else:
                    assert command[command.index("--host") + 1] == "127.0.0.1", name
                    assert "ports" not in container
        config = tomllib.loads(_edge_config(objects).replace(PLACEHOLDER, "x"))
        assert all(entry.get("token_file") for entry in config["nodes"]), name
        for policy_name, port in (("iop-node", "grpc"), ("iop-redis", "redis")):
            spec = _one(objects, "NetworkPolicy", policy_name)["spec"]
            assert spec["policyTypes"] == ["Ingress"]
            assert spec["ingress"] == [
                {
                    "from": [
                        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "iop-edge"}}}
                    ],
                    "ports": [{"port": port, "protocol": "TCP"}],
                }
            ], name


def _loaded(text: str, tmp_path: Path) -> Any:
    path = tmp_path / "config.toml"
    data = text.replace(PLACEHOLDER, "secret").encode()
    return load_config_file(path, data, SECRET_FILES).config


def test_the_edge_accepts_each_overlays_config_with_an_address(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """Each overlay's config.toml, with the Secrets' files in place, is one the edge
    accepts: its nodes entry given as an address here (discover is the DNS discovery's
    key, checked below), the rest as shipped: Redis for limits and responses, the keys,
    the drain, one worker."""
    for name, objects in rendered.items():
        text = _edge_config(objects)
        text = re.sub(r'(?m)^discover = ".*"$', 'address = "127.0.0.1:50061"', text)
        text = re.sub(r"(?m)^discover_interval_s = .*$", "", text)
        config = _loaded(text, tmp_path)
        assert config.server.api_keys == ("sk-test-1",), name
        assert config.server.drain_timeout_s == 120
        assert config.server.workers == 1
        assert config.limits.redis_url == "redis://:secret@iop-redis:6379/0"
        assert config.responses.store == "redis"
        assert config.nodes[0].token_file == "/etc/iop-edge/node-token/token"


@pytest.mark.skipif(
    "discover" not in {f.name for f in dataclasses.fields(NodeConfig)},
    reason="[[nodes]] discover (DNS discovery) is not a key of this tree's configuration",
)
def test_the_edge_accepts_each_overlays_config_as_shipped(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """Each overlay's config.toml as shipped, nodes found in DNS, is one the edge accepts."""
    for name, objects in rendered.items():
        config = _loaded(_edge_config(objects), tmp_path)
        assert config.nodes, name


def test_the_init_container_puts_any_password_into_the_redis_url(
    rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """The init container's own script, run on the dev ConfigMap: the password comes
    out of the URL as it went into the Secret, however many of a URL's reserved
    characters it holds, and the file is readable by its owner only."""
    objects = rendered["dev"]
    pod = _one(objects, "Deployment", "iop-edge")["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    script = init["command"][2]
    template, run = tmp_path / "template", tmp_path / "run"
    template.mkdir()
    run.mkdir()
    (template / "config.toml").write_text(_edge_config(objects))
    script = script.replace("/etc/iop-edge/template", str(template))
    script = script.replace("/run/iop-edge", str(run))
    password = "p@ss:w/rd?#%&+ =x"
    env = {**os.environ, "REDIS_PASSWORD": password}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    out = run / "config.toml"
    assert stat.S_IMODE(out.stat().st_mode) == 0o400
    url = tomllib.loads(out.read_text())["limits"]["redis_url"]
    client = redis.Redis.from_url(url)
    try:
        assert client.connection_pool.connection_kwargs["password"] == password
    finally:
        client.close()
    assert PLACEHOLDER not in out.read_text()


def test_the_containerfile_is_linted_clean_and_runs_the_projects_commands() -> None:
    """hadolint finds nothing; the base image is pinned to a version; the processes run
    as a user other than root; the entry point and the commands the manifests run are
    the project's scripts."""
    hadolint = Path(sys.executable).parent / "hadolint"
    done = subprocess.run(
        [str(hadolint), str(CONTAINERFILE)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = CONTAINERFILE.read_text()
    base = re.search(r"(?m)^ARG PYTHON_IMAGE=(\S+)$", text)
    assert base is not None
    assert re.search(r":3\.11\.\d+-slim", base.group(1))
    assert re.search(r"(?m)^USER 10001:10001$", text)
    entry = re.search(r'(?m)^ENTRYPOINT \["([^"]+)"\]$', text)
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry is not None
    assert entry.group(1) == "iop-edge"
    assert {"iop-edge", "iop-node", "iop-sim-node"} <= set(scripts)
