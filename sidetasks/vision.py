"""Image-classification side tasks: training and batch inference of ResNet18/50 and VGG19.

Data never comes from the network. By default it is a synthetic labelled set
(noisy, shifted copies of one smooth random pattern per class; see
:class:`~freeride.sidetasks._data.SyntheticImages`) that a network can learn
within a few hundred steps. With ``data_dir`` it is a folder holding one
sub-folder of images per class; ``.ppm``/``.pgm``/``.pnm`` and ``.npy`` files
are always read, PNG and JPEG only when Pillow is installed. Every tenth file
of a class is held out for evaluation.

Training tasks are :class:`freeride.partition.PartitionedTraining` tasks: one
SGD step (momentum, weight decay) per batch, which the partitioner cuts at
setup into task steps sized for the device's bubbles (``target_ms``), with the
same arithmetic and exact checkpoints at every step. Inference tasks classify one batch of the held-out split per
step and report throughput and top-1 accuracy; their model comes from
``checkpoint`` (a saved training-task state or a bare model ``state_dict``) or,
without one, from ``fit_steps`` training steps taken as their first steps.
"""

from __future__ import annotations

from freeride.sidetasks._vision_inference import VisionInference
from freeride.sidetasks._vision_options import VisionOptions
from freeride.sidetasks._vision_training import VisionTraining

__all__ = [
    "ResNet18Inference",
    "ResNet18Training",
    "ResNet50Inference",
    "ResNet50Training",
    "VGG19Inference",
    "VGG19Training",
]


class _VGG19(VisionOptions):
    """VGG-19's settings, shared by its training and inference tasks."""

    arch = "vgg19"
    default_lr = 0.002  # without batch norm, 0.01 makes the loss spike at batch size 8
    min_image_size = 32


class ResNet18Training(VisionTraining):
    __doc__ = "ResNet-18 training.\n\n" + (VisionTraining.__doc__ or "")
    arch = "resnet18"


class ResNet50Training(VisionTraining):
    __doc__ = "ResNet-50 training.\n\n" + (VisionTraining.__doc__ or "")
    arch = "resnet50"


class VGG19Training(_VGG19, VisionTraining):
    __doc__ = "VGG-19 training. Without batch norm it learns slowly at first.\n\n" + (VisionTraining.__doc__ or "")


class ResNet18Inference(VisionInference):
    __doc__ = "ResNet-18 batch inference.\n\n" + (VisionInference.__doc__ or "")
    arch = "resnet18"


class ResNet50Inference(VisionInference):
    __doc__ = "ResNet-50 batch inference.\n\n" + (VisionInference.__doc__ or "")
    arch = "resnet50"


class VGG19Inference(_VGG19, VisionInference):
    __doc__ = "VGG-19 batch inference.\n\n" + (VisionInference.__doc__ or "")
