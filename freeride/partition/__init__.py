"""Training and inference of any ``nn.Module`` as side tasks, cut automatically into bubble-sized steps.

A whole training step of a real model rarely fits in a pipeline bubble. The
tasks here trace the model with ``torch.fx``, time every piece on the device
the task landed on, open slow modules into their children and split large
``Linear`` and ``Conv2d`` layers by output, then group the pieces into steps
under a target duration (sized from the device's bubbles, see
:func:`piece_target_s`): the forward pass, the backward pass (autograd
through the activations each piece kept) and the optimizer update in runs of
parameters. The arithmetic is that of one plain step; every step boundary is
an exact checkpoint. See :class:`PartitionedTraining`.

A model whose forward ``torch.fx`` cannot trace (every Hugging Face model,
``nn.LSTM``, ``nn.Transformer``), or whose slowest part fx cannot trace into,
is exported by ``torch.export`` instead: a piece per ATen operation, for
batches of the first batch's shapes (see :mod:`freeride.partition.exported`).
Where neither can take it, setup says why each failed. A batch input that is a
tuple is the model's arguments (``model(*x)``). Outputs and the values between
pieces keep their containers' types: a ``ModelOutput``, a named tuple, a
dataclass (see :mod:`freeride.partition.values`). A piece that stays over the
target is logged with its module and measured time.

The recipe around the step is the plain loop's too (see
:mod:`freeride.partition.recipe`): a learning-rate scheduler returned by
``build()`` steps once per batch after its last update chunk, the option
``clip_grad_norm`` clips the batch's whole gradient before the first chunk,
and ``autocast_dtype`` runs the forward pieces under ``torch.autocast``;
``eval_every`` with held-out data evaluates the model in bubble-sized steps
too (see :mod:`freeride.partition.evaluation`).
"""

from freeride.partition._common import DEFAULT_TARGET_MS, capture_rng, piece_target_s, restore_rng
from freeride.partition.inference import InferenceParts, PartitionedInference
from freeride.partition.training import PartitionedTraining, TrainingParts

__all__ = [
    "DEFAULT_TARGET_MS",
    "InferenceParts",
    "PartitionedInference",
    "PartitionedTraining",
    "TrainingParts",
    "capture_rng",
    "piece_target_s",
    "restore_rng",
]
