"""The cluster queue on a real two-node Ray cluster, on one machine (``ray.cluster_utils.Cluster``).

Each Ray node has its own FreeRide node beside it: a ``freeride serve`` with
its own runtime and state dirs, a simulated 2-stage pipeline (``freeride
sim``) whose stages are its devices, and a ``freeride cluster join`` agent.
Six shards of the sweep sample go into one queue; both nodes take some. Node
b is then killed mid-run (its agent, manager, workers and stages by SIGKILL,
and its Ray node removed); its jobs' leases expire and node a resumes them
from their checkpoints on the shared directory. Every shard must end with the
exact sum, written once, and every job be finished exactly once.

The agents are Ray drivers: on a host with several raylets Ray attaches every
driver to the head, so a node's loss is seen here as it is on a real cluster,
through its agent's leases no longer being renewed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import freeride_cmd, poll, serving

from freeride.cluster import messages as m
from freeride.sidetasks.sweep import expected_sum

ray = pytest.importorskip("ray", reason="the cluster queue needs Ray: pip install 'freeride-runtime[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning")]

SHARDS = 6
SIZE = 3_000_000  # numbers per shard: 600 steps of 5000
CHUNK = 5_000
_RAY_NODE = {"num_cpus": 0, "object_store_memory": 80 << 20}


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


@contextlib.contextmanager
def _process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                _kill_group(proc)


@contextlib.contextmanager
def _node(name: str, base: Path, address: str, *join: str) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One FreeRide node: manager, simulated pipeline and agent (``join``: more of its options), reaped at the end."""
    runtime = base / name
    runtime.mkdir(mode=0o700)
    with contextlib.ExitStack() as stack:
        # --max-loss: a checkpoint within a second even where none fits a bubble (a first one slowed by a
        # cold disk sets the estimate the next must fit; the shards last 5-7 s in all)
        manager = stack.enter_context(
            serving(runtime, "--checkpoint-every", "0.3s", "--max-loss", "1s", "--settle", "0s")
        )
        sim = stack.enter_context(
            _process(
                freeride_cmd(
                    "sim", "--runtime-dir", str(runtime), "--stages", "2", "--microbatches", "2",
                    "--forward", "10ms", "--backward", "20ms", "--steps", "4000",
                ),
                base / f"{name}-sim.log",
            )
        )  # fmt: skip
        agent = stack.enter_context(
            _process(
                freeride_cmd(
                    "cluster", "join", "--address", address, "--node", name, "--runtime-dir", str(runtime),
                    "--lease", "3s", "--poll", "0.5s", *join,
                ),
                base / f"{name}-agent.log",
            )
        )  # fmt: skip
        yield [agent, manager, sim]


def _show_logs(base: Path) -> None:
    """The agents' and stages' output, for a failing run (pytest shows what the test printed)."""
    for log in sorted(base.glob("*.log")):
        print(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))


def _status(queue: object) -> m.QueueStatus:
    from freeride.cluster.queue import ClusterQueue

    assert isinstance(queue, ClusterQueue)
    reply = queue.request(m.QueueStatusRequest())
    assert isinstance(reply, m.QueueStatus), reply
    return reply


def test_a_queue_of_shards_survives_the_loss_of_a_node() -> None:
    from freeride.cluster.queue import ClusterQueue

    base = Path(tempfile.mkdtemp(prefix="frc-", dir="/tmp"))
    shared = base / "shared"
    (shared / "ckpt").mkdir(parents=True)
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={**_RAY_NODE, "include_dashboard": False})
    try:
        worker = cluster.add_node(**_RAY_NODE)
        address = cluster.address
        with (
            ClusterQueue(address, create=True, timeout_s=60) as queue,
            _node("a", base, address) as node_a,
            _node("b", base, address) as node_b,
        ):
            submit = subprocess.run(
                freeride_cmd(
                    "cluster", "submit", "sweep-shard", "--address", address, "--name", "sweep",
                    "--shards", str(SHARDS), "--opt", f"size={SIZE}", "--opt", f"chunk={CHUNK}",
                    "--opt", f"out={shared / 'out'}", "--checkpoint-dir", str(shared / "ckpt"),
                ),
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert submit.returncode == 0, submit.stderr
            assert f"{SHARDS} job(s) queued" in submit.stdout

            def on_b() -> dict[int, int]:
                """Node b's jobs and the step of their last checkpoint."""
                jobs = [j for j in _status(queue).jobs if j.state == "leased" and j.node == "b"]
                return {j.job_id: j.checkpointed_steps for j in jobs}

            poll(lambda: any(j.node == "a" for j in _status(queue).jobs if j.state == "leased"), 90, "node a to lease")
            # one checkpointed job on b is what the test needs (it must resume on a); waiting for all of
            # b's jobs at once could outlast them: on a loaded machine a job b leased after finishing
            # another had no checkpoint yet at every look, until b had no job left
            try:
                poll(lambda: max(on_b().values(), default=-1) > 0, 90, "a checkpoint of one of node b's jobs")
            except AssertionError as exc:
                jobs = [(j.job_id, j.state, j.node, j.checkpointed_steps) for j in _status(queue).jobs]
                raise AssertionError(f"{exc}; jobs (id, state, node, checkpointed): {jobs}") from None
            for proc in node_b:  # agent, manager (its workers die with it), stages
                _kill_group(proc)
            lost = on_b()  # what it held when it died (its leases run for 2.5 s more at least)
            assert lost, "node b finished its jobs before it could be killed: make the shards longer"
            cluster.remove_node(worker, allow_graceful=False)

            poll(lambda: all(j.state == "finished" for j in _status(queue).jobs), 150, "every job to finish")
            assert all(proc.poll() is None for proc in node_a), "node a must live on"
            status = _status(queue)
            report = subprocess.run(
                freeride_cmd("cluster", "report", "--address", address, "--json"),
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
    except BaseException:
        _show_logs(base)
        shutil.rmtree(base, ignore_errors=True)
        raise
    finally:
        with contextlib.suppress(Exception):
            cluster.shutdown()

    try:
        # every job finished exactly once, and each lost one on node a, resumed from its checkpoint
        for job in status.jobs:
            outcomes = [(h.node, h.outcome) for h in job.history]
            assert [o for _, o in outcomes].count("finished") == 1, outcomes
            if job.job_id in lost:
                assert outcomes[0] == ("b", "expired") and outcomes[-1] == ("a", "finished"), outcomes
        assert lost and status.expired >= len(lost)
        assert {h.node for j in status.jobs for h in j.history} == {"a", "b"}  # the queue spread over both
        # each shard's result: the exact sum, written once; the lost ones resumed mid-way
        names = {j.job_id: j.spec.name for j in status.jobs}
        resumed = 0
        for shard in range(SHARDS):
            log = (shared / "out" / f"shard-{shard}.log").read_text().splitlines()
            assert len(log) == 1, log
            result = json.loads(log[0])
            assert int(result["sum"]) == expected_sum(shard, SIZE)
            job_id = next(i for i, n in names.items() if n == f"sweep-{shard}")
            if lost.get(job_id, -1) > 0:  # it resumed from the checkpoint seen before the kill, or a later one
                assert result["resumed_from"] >= lost[job_id] * CHUNK, (result, lost)
                resumed += 1
        assert resumed, lost
        # the cluster report sums both nodes and counts the attempts
        assert report.returncode == 0, report.stderr
        summary = json.loads(report.stdout)
        assert set(summary["nodes"]) == {"a", "b"}
        assert summary["jobs"]["finished"] == SHARDS and summary["attempts"]["finished"] == SHARDS
        assert summary["attempts"]["expired"] == len(lost)
        assert summary["total"]["bubble_ns"] > 0 and summary["total"]["used_ns"] > 0
    except AssertionError:
        _show_logs(base)
        raise
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_cancel_forged_reports_and_programs_on_a_real_ray_cluster() -> None:
    """One node with two devices: three long shards (two leased, one queued), one program, one unsigned job.

    Another Ray driver's forged FinishJob (the node's name and the attempt, without the lease's token) is
    refused; the program is never leased (the agent does not allow programs); a cancel ends the queued
    job at once and the leased one through its node; the remaining job runs on. The node holds the
    cluster's secret: the job another driver queued without it fails there, unrun, once it is leased.
    """
    from freeride import protocol as p
    from freeride.cluster.queue import ClusterQueue
    from freeride.cluster.signing import create_secret

    base = Path(tempfile.mkdtemp(prefix="frc-", dir="/tmp"))
    keys = base / "keys"
    create_secret(keys)
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={**_RAY_NODE, "include_dashboard": False})
    try:
        address = cluster.address
        with (
            ClusterQueue(address, create=True, timeout_s=60) as queue,
            _node("a", base, address, "--keys-dir", str(keys)),
        ):
            submit = subprocess.run(
                freeride_cmd(
                    "cluster", "submit", "sweep-shard", "--address", address, "--name", "long", "--shards", "3",
                    "--opt", f"size={100 * SIZE}", "--opt", f"chunk={CHUNK}", "--keys-dir", str(keys),
                ),
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert submit.returncode == 0, submit.stderr
            program = p.ProgramSpec(argv=["id"], name="a-program")
            assert isinstance(queue.request(m.SubmitJobs(specs=[program])), m.Submitted)
            unsigned = p.IterativeSpec(
                target="freeride.sidetasks.sweep:SweepShard", name="unsigned",
                options={"size": SIZE, "chunk": CHUNK, "out": str(base / "unsigned")},
            )  # fmt: skip
            assert isinstance(queue.request(m.SubmitJobs(specs=[unsigned])), m.Submitted)
            bad = subprocess.run(
                freeride_cmd("cluster", "submit", "sweep-shard", "--address", address, "--name", "x", "--opt", "no=1"),
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert bad.returncode != 0 and "no" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr

            def jobs() -> dict[str, m.JobRecord]:
                return {j.spec.name: j for j in _status(queue).jobs}

            poll(lambda: sum(j.state == "leased" for j in jobs().values()) == 2, 90, "both devices to lease a job")
            leased = sorted(j.job_id for j in jobs().values() if j.state == "leased")
            [queued] = [j.job_id for j in jobs().values() if j.state == "queued" and j.spec.name.startswith("long")]
            forged = queue.request(m.FinishJob(node="a", job_id=leased[0], attempt=1, steps=1))
            assert isinstance(forged, m.Refused) and "holds no lease" in forged.reason, forged

            cancel = subprocess.run(
                freeride_cmd("cluster", "cancel", "--address", address, str(queued), str(leased[0])),
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert cancel.returncode == 0, cancel.stderr
            by_id = {j.job_id: j for j in _status(queue).jobs}
            assert by_id[queued].state == "cancelled"  # at once: it was never leased
            poll(lambda: {j.job_id: j.state for j in _status(queue).jobs}[leased[0]] == "cancelled", 60, "its node")
            final = {j.job_id: j for j in _status(queue).jobs}
            assert [h.outcome for h in final[leased[0]].history] == ["cancelled"]
            assert final[leased[1]].state == "leased"  # the other runs on
            assert jobs()["a-program"].state == "queued" and jobs()["a-program"].attempt == 0  # never leased
            text = subprocess.run(
                freeride_cmd("cluster", "status", "--address", address),
                capture_output=True, text=True, timeout=120, check=False,
            ).stdout  # fmt: skip
            assert "lease held, renewed by a" in text and "cancelled" in text, text
            # the slot the cancel freed goes to the unsigned job, which the node fails unrun
            poll(lambda: jobs()["unsigned"].state == "failed", 60, "the node to refuse the unsigned job")
            refused = jobs()["unsigned"]
            assert "runs only jobs signed with the cluster's secret, and this one is unsigned" in refused.error
            assert [h.outcome for h in refused.history] == ["failed"] and not (base / "unsigned").exists()
    except BaseException:
        _show_logs(base)
        raise
    finally:
        with contextlib.suppress(Exception):
            cluster.shutdown()
        shutil.rmtree(base, ignore_errors=True)
