"""Our schedules against the frameworks' own: DeepSpeed's TrainSchedule and what megatron-core runs."""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict, deque
from typing import Any
from unittest import mock

import pytest

from freeride.backends.schedule import Action, interleaved, one_f_one_b

# --- against the frameworks ---------------------------------------------------------------------------


def test_1f1b_matches_deepspeed_train_schedule() -> None:
    ds_schedule = pytest.importorskip("deepspeed.runtime.pipe.schedule")
    for p, m in itertools.product(range(1, 5), range(1, 9)):
        ours = one_f_one_b(p, m)
        for s in range(p):
            train = ds_schedule.TrainSchedule(micro_batches=m, stages=p, stage_id=s)
            order: list[Action] = []
            counts = {"F": 0, "B": 0}
            for step_id, cmds in enumerate(train.steps()):
                for cmd in cmds:
                    if isinstance(cmd, ds_schedule.ForwardPass | ds_schedule.BackwardPass):
                        kind: Any = "F" if isinstance(cmd, ds_schedule.ForwardPass) else "B"
                        # DeepSpeed names a buffer, not a micro-batch: recover the id from the step.
                        microbatch, is_forward = train._step_to_micro_batch(step_id)
                        assert is_forward == (kind == "F")
                        assert microbatch == counts[kind]  # passes run in micro-batch order
                        assert cmd.buffer_id == microbatch % train.num_pipe_buffers()
                        counts[kind] += 1
                        order.append(Action(s, kind, microbatch))
            assert tuple(order) == ours.actions[s], (p, m, s)


def _megatron_helper_order(megatron: Any, p: int, m: int, v: int, s: int) -> list[Action]:
    """Rank s's order from megatron-core's own table, warm-up count and order helpers."""
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    table = megatron.get_schedule_table(m, v, p)
    communicator = mock.Mock(virtual_pipeline_model_parallel_size=v)
    communicator.pp_group.size.return_value = p
    communicator.pp_group.rank.return_value = s
    _, _, warm, _ = megatron.get_pp_rank_microbatches(m, v, p, p2p_communicator=communicator)
    forwards = iter(table)
    in_flight: dict[int, deque[int]] = defaultdict(deque)
    order: list[Action] = []
    for signed_chunk in convert_schedule_table_to_order(warm, v, table):
        chunk = abs(signed_chunk) - 1
        if signed_chunk > 0:
            microbatch, table_chunk = next(forwards)
            assert table_chunk == chunk
            in_flight[chunk].append(microbatch)
            order.append(Action(s, "F", microbatch, chunk))
        else:  # backward pops the oldest activation of the chunk, as the schedule's pop(0) does
            order.append(Action(s, "B", in_flight[chunk].popleft(), chunk))
    return order


def _megatron_executed_order(megatron: Any, p: int, m: int, v: int | None, s: int) -> list[Action]:
    """Run megatron-core's schedule function for rank s with recording stand-ins for compute and p2p."""
    import torch
    from megatron.core.enums import ModelType
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v,
        microbatch_group_size_per_vp_stage=p,
        batch_p2p_comm=False,
        pipeline_dtype=torch.float32,
    )
    # The schedules read these two TransformerConfig fields; a plain ModelParallelConfig lacks them.
    vars(config).update(hidden_size=1, fine_grained_activation_offloading=False)
    order: list[Action] = []

    class Chunk(torch.nn.Module):
        def __init__(self, chunk: int) -> None:
            super().__init__()
            self.chunk, self.config, self.model_type = chunk, config, ModelType.encoder_or_decoder

    def forward_step(*args: Any, current_microbatch: int, **kwargs: Any) -> tuple[Any, torch.Tensor]:
        chunk = args[2].chunk
        order.append(Action(s, "F", current_microbatch, chunk))
        return ((chunk, current_microbatch),), torch.zeros((), dtype=torch.int)

    def backward_step(input_tensor: Any, output_tensor: Any, *args: Any) -> None:
        (chunk, microbatch) = output_tensor[0]
        order.append(Action(s, "B", microbatch, chunk))

    communicator = mock.Mock(config=config, virtual_pipeline_model_parallel_size=v)
    communicator.pp_group.size.return_value = p
    communicator.pp_group.rank.return_value = s
    for name in ("recv_forward", "recv_backward", "send_forward_recv_backward", "send_backward_recv_forward"):
        getattr(communicator, name).return_value = None
    communicator.send_forward_recv_forward.return_value = None
    communicator.send_backward_recv_backward.return_value = None
    communicator.send_forward_backward_recv_forward_backward.return_value = (None, None)
    groups = mock.Mock()
    groups.cp.size.return_value = 1
    groups.tp.size.return_value = 1
    model = [Chunk(c) for c in range(v or 1)]
    function = (
        megatron.forward_backward_pipelining_without_interleaving
        if v is None
        else megatron.forward_backward_pipelining_with_interleaving
    )
    with (
        mock.patch.object(megatron, "forward_step", forward_step),
        mock.patch.object(megatron, "backward_step", backward_step),
        mock.patch.object(torch.distributed, "is_initialized", return_value=True),
        _cuda_factories_on_cpu(),
    ):
        function(
            forward_step_func=None,
            data_iterator=[None] * len(model),
            model=model,
            num_microbatches=m,
            seq_length=1,
            micro_batch_size=1,
            p2p_communicator=communicator,
            pg_collection=groups,
        )
    return order


def _cuda_factories_on_cpu() -> contextlib.AbstractContextManager[Any]:
    """The schedules allocate a token counter with device="cuda"; keep it on the CPU."""
    import torch

    class CudaToCpu(torch.overrides.TorchFunctionMode):
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: dict[str, Any] | None = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if kwargs.get("device") == "cuda":
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    return CudaToCpu()


MEGATRON_CASES = [(2, 4, 2), (4, 8, 2), (2, 2, 2), (3, 6, 3), (4, 4, 2)]


@pytest.mark.parametrize(("p", "m", "v"), MEGATRON_CASES)
def test_interleaved_matches_megatron_helpers(p: int, m: int, v: int) -> None:
    megatron = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ours = interleaved(p, m, v)
    for s in range(p):
        assert tuple(_megatron_helper_order(megatron, p, m, v, s)) == ours.actions[s], s


@pytest.mark.parametrize(("p", "m", "v"), MEGATRON_CASES)
def test_interleaved_matches_what_megatron_executes(p: int, m: int, v: int) -> None:
    megatron = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ours = interleaved(p, m, v)
    for s in range(p):
        assert tuple(_megatron_executed_order(megatron, p, m, v, s)) == ours.actions[s], s


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 4), (4, 8), (3, 2)])
def test_1f1b_matches_what_megatron_executes(p: int, m: int) -> None:
    megatron = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    ours = one_f_one_b(p, m)
    for s in range(p):
        assert tuple(_megatron_executed_order(megatron, p, m, None, s)) == ours.actions[s], s
