"""The Flax frontend: pipeline a linen or NNX module, cut it into stages, build the mesh."""

from pjit_pipe.frontend.cut import StageCut, cut_module
from pjit_pipe.frontend.mesh import make_mesh
from pjit_pipe.frontend.pipeline import Pipelined, PipelinedClass, TrainState, TrainStep, pipeline
from pjit_pipe.frontend.trace import boundary

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
]
