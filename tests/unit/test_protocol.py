"""Wire contract: every message round-trips; garbage, unknown tags and bad types are rejected."""

from __future__ import annotations

import msgspec
import pytest

from freeride import protocol as p

HELLO = p.Hello(
    protocol_version=p.PROTOCOL_VERSION,
    rank=3,
    stage=1,
    num_stages=4,
    device="cuda:1",
    framework="deepspeed",
    pid=1234,
    cpu_affinity=[2, 3],
    device_memory=80 << 30,
    t_ns=5,
)
SPEC = p.IterativeSpec(target="m:C", options={"lr": 0.1, "n": 3, "name": "x", "flag": True})

SAMPLES: list[tuple[object, msgspec.Struct]] = [
    (p.BackendEvent, HELLO),
    (p.BackendEvent, p.BubbleStarted(rank=1, stage=1, device="cpu:1", step=7, index=2, t_ns=10, expected_ns=20)),
    (p.BackendEvent, p.BubbleEnded(rank=1, stage=1, device="cpu:1", step=7, index=2, t_ns=30, duration_ns=20)),
    (p.BackendEvent, p.StepFinished(rank=1, stage=1, step=7, t_ns=40, duration_ns=100, bubble_ns=20)),
    (p.BackendEvent, p.Heartbeat(rank=1, t_ns=50)),
    (p.BackendEvent, p.Goodbye(rank=1, t_ns=60, dropped=4)),
    (
        p.ManagerToWorker,
        p.Assign(
            task_id=1,
            spec=SPEC,
            device="cpu:0",
            checkpoint_path="/c",
            margin_ns=1,
            checkpoint_every_ns=2,
            cpu_affinity=[0],
        ),
    ),
    (p.ManagerToWorker, p.Grant(grant_id=1, bubble_t_ns=2, deadline_ns=3)),
    (p.ManagerToWorker, p.Revoke(grant_id=1)),
    (p.ManagerToWorker, p.Stop(reason="bye")),
    (p.WorkerToManager, p.WorkerReady(protocol_version=1, task_id=1, pid=2, set_up=True, step_estimate_ns=3)),
    (
        p.WorkerToManager,
        p.GrantDone(
            task_id=1,
            grant_id=2,
            steps=3,
            busy_ns=4,
            first_step_delay_ns=5,
            overrun_ns=0,
            reason="no_fit",
            step_estimate_ns=6,
        ),
    ),
    (p.WorkerToManager, p.Progress(task_id=1, steps=2, metrics={"loss": 0.5})),
    (p.WorkerToManager, p.Checkpointed(task_id=1, steps=2, path="/c")),
    (p.WorkerToManager, p.TaskFinished(task_id=1, steps=2)),
    (p.WorkerToManager, p.TaskFailed(task_id=1, error="boom", traceback="tb")),
    (p.ControlRequest, p.Submit(spec=SPEC)),
    (p.ControlRequest, p.Cancel(task_id=4)),
    (p.ControlRequest, p.StatusRequest()),
    (p.ControlReply, p.Submitted(task_id=4, device="")),
    (p.ControlReply, p.Cancelled(task_id=4)),
    (p.ControlReply, p.Rejected(reason="no")),
]


@pytest.mark.parametrize(("union", "msg"), SAMPLES, ids=lambda x: type(x).__name__)
def test_round_trip(union: object, msg: msgspec.Struct) -> None:
    decoder = msgspec.msgpack.Decoder(union)
    assert decoder.decode(msgspec.msgpack.encode(msg)) == msg


def test_messages_are_frozen() -> None:
    with pytest.raises(AttributeError):
        HELLO.rank = 4  # type: ignore[misc]


def test_tags_are_unique_across_unions() -> None:
    tags = [type(m).__struct_config__.tag for _, m in SAMPLES]
    assert len(tags) == len(set(tags))


def test_unknown_tag_is_rejected() -> None:
    frame = msgspec.msgpack.encode({"type": "bubble_exploded", "rank": 1})
    with pytest.raises(msgspec.ValidationError, match="bubble_exploded"):
        msgspec.msgpack.Decoder(p.BackendEvent).decode(frame)


def test_wrong_field_type_is_rejected() -> None:
    frame = msgspec.msgpack.encode({"type": "heartbeat", "rank": "one", "t_ns": 1})
    with pytest.raises(msgspec.ValidationError, match="rank"):
        msgspec.msgpack.Decoder(p.BackendEvent).decode(frame)


def test_garbage_is_rejected() -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.msgpack.Decoder(p.BackendEvent).decode(b"\xc1\xff\x00garbage")


def test_a_message_of_another_socket_is_rejected() -> None:
    frame = msgspec.msgpack.encode(p.Grant(grant_id=1, bubble_t_ns=2, deadline_ns=3))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(p.BackendEvent).decode(frame)


def test_unknown_fields_are_ignored_for_append_only_evolution() -> None:
    frame = msgspec.msgpack.encode({"type": "heartbeat", "rank": 1, "t_ns": 2, "added_later": [1, 2]})
    assert msgspec.msgpack.Decoder(p.BackendEvent).decode(frame) == p.Heartbeat(rank=1, t_ns=2)


def test_options_reject_non_scalars() -> None:
    frame = msgspec.msgpack.encode({"type": "iterative_spec", "target": "m:C", "options": {"x": [1, 2]}})
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.Decoder(p.TaskSpec).decode(frame)
