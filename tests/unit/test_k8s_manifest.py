"""The Kubernetes manifest of docs/launchers.md: its structure, as FreeRide needs it (no cluster here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from freeride.cli import common
from freeride.cli.main import build_parser
from freeride.cli.serve import serve_config
from freeride.serve.config import DEFAULT_METRICS_PORT
from freeride.transport import Endpoints
from freeride.transport.endpoints import RUNTIME_DIR_ENV

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "k8s" / "freeride-trainer.yaml"


def _docs() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def _pod() -> dict[str, Any]:
    (job,) = [d for d in _docs() if d["kind"] == "Job"]
    pod: dict[str, Any] = job["spec"]["template"]["spec"]
    return pod


def _containers() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _pod()
    (manager,) = [c for c in pod.get("initContainers", []) if c["name"] == "freeride-manager"]
    (trainer,) = [c for c in pod["containers"] if c["name"] == "trainer"]
    return manager, trainer


def _env(container: dict[str, Any]) -> dict[str, str]:
    """A container's environment as Kubernetes builds it: ConfigMaps of envFrom, then env over them."""
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in _docs() if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return env


def _runtime_dir(command: list[str], container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> str:
    """The runtime dir a freeride command line of a container uses, parsed by freeride's own parser."""
    assert command[0] == "freeride"
    argv = command[1:]
    if "--" in argv:
        argv = argv[: argv.index("--")]
    with monkeypatch.context() as m:
        m.delenv(RUNTIME_DIR_ENV, raising=False)
        for name, value in _env(container).items():
            m.setenv(name, value)
        return str(common.runtime_dir(build_parser().parse_args(argv)))


def test_the_manager_is_a_native_sidecar_serving_with_mps(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, _ = _containers()
    assert manager["restartPolicy"] == "Always"  # starts before the trainer, stops after it: the Job completes
    assert manager["command"][:2] == ["freeride", "serve"] and "--mps" in manager["command"]
    probe = manager["startupProbe"]["exec"]["command"]
    assert probe[:2] == ["freeride", "status"]  # the trainer waits until the manager answers
    assert _runtime_dir(probe, manager, monkeypatch) == _runtime_dir(manager["command"], manager, monkeypatch)


def test_trainer_and_manager_share_the_runtime_dir_through_one_volume(monkeypatch: pytest.MonkeyPatch) -> None:
    manager, trainer = _containers()
    assert trainer["command"][:2] == ["freeride", "launch"] and "--" in trainer["command"]
    runtime_dir = _runtime_dir(manager["command"], manager, monkeypatch)
    assert _runtime_dir(trainer["command"], trainer, monkeypatch) == runtime_dir
    # named once, in the environment both containers take from one ConfigMap
    assert _env(manager)[RUNTIME_DIR_ENV] == _env(trainer)[RUNTIME_DIR_ENV] == runtime_dir
    commands = [manager["command"], manager["startupProbe"]["exec"]["command"], trainer["command"]]
    assert not [c for c in commands if any(a.startswith("--runtime-dir") for a in c)]
    Endpoints.ipc(Path(runtime_dir))  # socket paths short enough
    volumes = {v["name"]: v for v in _pod()["volumes"]}

    def mount_of(container: dict[str, Any]) -> tuple[str, str]:
        for m in container["volumeMounts"]:
            if runtime_dir.startswith(m["mountPath"].rstrip("/") + "/"):
                return m["name"], m["mountPath"]
        raise AssertionError(f"{container['name']} mounts nothing holding {runtime_dir}")

    assert mount_of(manager) == mount_of(trainer)
    name, mount_path = mount_of(manager)
    assert "emptyDir" in volumes[name]
    # the emptyDir itself is world-writable, which serve refuses: the runtime dir is a directory below it
    assert runtime_dir != mount_path.rstrip("/")


def test_one_user_and_shared_memory_for_mps() -> None:
    pod = _pod()
    manager, trainer = _containers()
    assert "runAsUser" in pod["securityContext"]  # pod level: both containers run as the same uid
    assert all("runAsUser" not in c.get("securityContext", {}) for c in (manager, trainer))
    shm = {v["name"] for v in pod["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
    for container in (manager, trainer):
        assert any(m["mountPath"] == "/dev/shm" and m["name"] in shm for m in container["volumeMounts"])
    env = {e["name"]: e.get("value") for e in manager.get("env", [])}
    assert env.get("NVIDIA_VISIBLE_DEVICES") == "all"  # the side tasks see the trainer's GPUs
    assert "nvidia.com/gpu" in trainer["resources"]["limits"]


def test_prometheus_can_scrape_the_manager_and_only_prometheus() -> None:
    manager, _ = _containers()
    config = serve_config(build_parser().parse_args(manager["command"][1:]))
    assert config.metrics_port == DEFAULT_METRICS_PORT
    assert config.metrics_host == "0.0.0.0"  # the pod's IP, not loopback: Prometheus scrapes from outside the pod
    (port,) = [p for p in manager["ports"] if p["containerPort"] == config.metrics_port]
    assert port["name"] == "freeride-metrics"
    (job,) = [d for d in _docs() if d["kind"] == "Job"]
    annotations = job["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert annotations["prometheus.io/port"] == str(config.metrics_port)
    assert annotations["prometheus.io/path"] == "/metrics"
    # unauthenticated metrics: a NetworkPolicy on the same pods names the port
    (policy,) = [d for d in _docs() if d["kind"] == "NetworkPolicy"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert "Ingress" in policy["spec"]["policyTypes"]
    named = [p["port"] for rule in policy["spec"]["ingress"] for p in rule.get("ports", [])]
    assert named == ["freeride-metrics"]
