"""FreeRide: useful side work inside the pipeline bubbles of training jobs."""

from freeride.protocol import PROTOCOL_VERSION
from freeride.sidetask import IterativeTask, StepGate, TaskContext, TaskStopped

__all__ = ["PROTOCOL_VERSION", "IterativeTask", "StepGate", "TaskContext", "TaskStopped", "__version__"]

__version__ = "0.1.0"
