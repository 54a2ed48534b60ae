"""IR -> one jitted shard_map program per schedule (see program.py for the entry point)."""

from pjit_pipe.lowering.async_pipeline.async_carry import check_carry
from pjit_pipe.lowering.comms.topology import AXES, TENSOR, Topology
from pjit_pipe.lowering.compute.emulated_ticks import KIND_CODES
from pjit_pipe.lowering.compute.forward import lower_forward
from pjit_pipe.lowering.compute.loss import LossLayout, check_loss_fn
from pjit_pipe.lowering.compute.residual_policy import (
    DEFAULT_POLICY,
    POLICIES,
    saved_names,
)
from pjit_pipe.lowering.compute.rng import check_rngs, current_rngs, impls_of, microbatch_rngs
from pjit_pipe.lowering.compute.stage_cache import traced_stages
from pjit_pipe.lowering.compute.stages import StageVjp
from pjit_pipe.lowering.layout.device_state import DeviceLayout, device_bytes
from pjit_pipe.lowering.layout.flat_buffers import Buffers, FlatSpec, dtype_of
from pjit_pipe.lowering.layout.param_layout import ChunkLayout
from pjit_pipe.lowering.layout.tensor_layout import any_split
from pjit_pipe.lowering.memory_prediction import MemoryReport, predict_memory
from pjit_pipe.lowering.program import LoweringOptions, PipelineStep, lower
from pjit_pipe.lowering.shard_map_operands import shard_map_without_empty_operands

__all__ = [
    "AXES",
    "DEFAULT_POLICY",
    "KIND_CODES",
    "POLICIES",
    "TENSOR",
    "Buffers",
    "ChunkLayout",
    "DeviceLayout",
    "FlatSpec",
    "LossLayout",
    "LoweringOptions",
    "MemoryReport",
    "PipelineStep",
    "StageVjp",
    "Topology",
    "any_split",
    "check_carry",
    "check_loss_fn",
    "check_rngs",
    "current_rngs",
    "device_bytes",
    "dtype_of",
    "impls_of",
    "lower",
    "lower_forward",
    "microbatch_rngs",
    "predict_memory",
    "saved_names",
    "shard_map_without_empty_operands",
    "traced_stages",
]
