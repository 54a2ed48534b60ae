"""IR -> one jitted shard_map program per schedule (see program.py for the entry point)."""

from pjit_pipe.lowering.program import PipelineStep, lower

__all__ = ["PipelineStep", "lower"]
