"""The Flax frontend: pipeline a linen or NNX module, cut it into stages, build the mesh."""

from pjit_pipe.frontend.cutter.cut import StageCut, cut_module
from pjit_pipe.frontend.cutter.trace import boundary
from pjit_pipe.frontend.mesh import make_mesh, reorder_replicas, worker_devices
from pjit_pipe.frontend.pipeline import PipelinedClass, pipeline
from pjit_pipe.frontend.pipelined import Pipelined
from pjit_pipe.frontend.state import TrainState
from pjit_pipe.frontend.train_step import TrainStep

__all__ = [
    "Pipelined",
    "PipelinedClass",
    "StageCut",
    "TrainState",
    "TrainStep",
    "boundary",
    "cut_module",
    "make_mesh",
    "pipeline",
    "reorder_replicas",
    "worker_devices",
]
