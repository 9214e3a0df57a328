"""Fixtures for tests with real processes and sockets.

Every fixture that starts a process also reaps it. Runtime directories are
short (ipc:// socket paths must stay under ~100 bytes).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from freeride.config import ServeConfig
from freeride.manager import Manager
from freeride.transport import Endpoints

HERE = Path(__file__).resolve().parent


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="fr-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True)
def _tasks_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker processes import the test tasks in _tasks.py."""
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    monkeypatch.syspath_prepend(str(HERE))


async def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``predicate`` on the event loop until it holds (the state lives in this process)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not predicate():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}") from None


@pytest.fixture
async def manager(runtime_dir: Path) -> AsyncIterator[Manager]:
    config = ServeConfig(
        endpoints=Endpoints.ipc(runtime_dir), state_dir=runtime_dir / "state", checkpoint_every_s=0.2, stop_timeout_s=5
    )
    stop = asyncio.Event()
    async with Manager(config) as mgr:
        runner = asyncio.create_task(mgr.run(stop), name="test-manager")
        await asyncio.sleep(0)
        try:
            yield mgr
        finally:
            stop.set()
            await runner
