"""IR -> IR passes: each takes a valid schedule and returns a valid one."""

from pjit_pipe.passes.comm import insert_comm
from pjit_pipe.passes.defer_w import defer_w
from pjit_pipe.passes.reroute import reroute
from pjit_pipe.passes.split_backward import split_backward
from pjit_pipe.passes.stagger import stagger

__all__ = [
    "defer_w",
    "insert_comm",
    "reroute",
    "split_backward",
    "stagger",
]
