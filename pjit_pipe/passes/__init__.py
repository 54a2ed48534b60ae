"""IR -> IR passes: each takes a valid schedule and returns a valid one."""

from pjit_pipe.passes.split_backward import split_backward
from pjit_pipe.passes.stagger import stagger

__all__ = ["split_backward", "stagger"]
