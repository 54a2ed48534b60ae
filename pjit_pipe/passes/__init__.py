"""IR -> IR passes: each takes a valid schedule and returns a valid one.

Passes compose with `chain(...)` (like `optax.chain`); bind a pass's options
first (`functools.partial(defer_w, costs=costs)`, `postpone_w(defer)`).
"""

from pjit_pipe.passes.chain import Pass, chain, renamed
from pjit_pipe.passes.comm import insert_comm
from pjit_pipe.passes.defer_w import defer_w
from pjit_pipe.passes.fuse_backward import fuse_stage, fuse_where_free
from pjit_pipe.passes.list_scheduler import ORDERS, Placement, list_schedule
from pjit_pipe.passes.postpone_w import postpone_w
from pjit_pipe.passes.reroute import FailedWorkers, assign, canonically, default_limit, reroute
from pjit_pipe.passes.shares import KEEPS, TRIMS, balanced_counts, share_placement
from pjit_pipe.passes.split_backward import split_backward
from pjit_pipe.passes.stagger import stagger

__all__ = [
    "KEEPS",
    "ORDERS",
    "TRIMS",
    "FailedWorkers",
    "Pass",
    "Placement",
    "assign",
    "balanced_counts",
    "canonically",
    "chain",
    "default_limit",
    "defer_w",
    "fuse_stage",
    "fuse_where_free",
    "insert_comm",
    "list_schedule",
    "postpone_w",
    "renamed",
    "reroute",
    "share_placement",
    "split_backward",
    "stagger",
]
