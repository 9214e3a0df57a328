"""The Kubernetes manifest of docs/launchers.md: its structure, as FreeRide needs it (no cluster here)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from freeride.cli.main import build_parser
from freeride.transport import Endpoints

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "k8s" / "freeride-trainer.yaml"


def _pod() -> dict[str, Any]:
    docs = list(yaml.safe_load_all(MANIFEST.read_text()))
    (job,) = [d for d in docs if d["kind"] == "Job"]
    pod: dict[str, Any] = job["spec"]["template"]["spec"]
    return pod


def _containers() -> tuple[dict[str, Any], dict[str, Any]]:
    pod = _pod()
    (manager,) = [c for c in pod.get("initContainers", []) if c["name"] == "freeride-manager"]
    (trainer,) = [c for c in pod["containers"] if c["name"] == "trainer"]
    return manager, trainer


def _runtime_dir(command: list[str]) -> str:
    """The --runtime-dir of a freeride command line, parsed by freeride's own parser."""
    assert command[0] == "freeride"
    argv = command[1:]
    if "--" in argv:
        argv = argv[: argv.index("--")]
    runtime_dir: str = build_parser().parse_args(argv).runtime_dir
    return runtime_dir


def test_the_manager_is_a_native_sidecar_serving_with_mps() -> None:
    manager, _ = _containers()
    assert manager["restartPolicy"] == "Always"  # starts before the trainer, stops after it: the Job completes
    assert manager["command"][:2] == ["freeride", "serve"] and "--mps" in manager["command"]
    probe = manager["startupProbe"]["exec"]["command"]
    assert probe[:2] == ["freeride", "status"]  # the trainer waits until the manager answers
    assert _runtime_dir(probe) == _runtime_dir(manager["command"])


def test_trainer_and_manager_share_the_runtime_dir_through_one_volume() -> None:
    manager, trainer = _containers()
    assert trainer["command"][:2] == ["freeride", "launch"] and "--" in trainer["command"]
    runtime_dir = _runtime_dir(manager["command"])
    assert _runtime_dir(trainer["command"]) == runtime_dir
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
