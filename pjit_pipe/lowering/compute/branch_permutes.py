"""A compiled program is refused when XLA put a collective-permute inside a
branch that only some devices take.

Inside a stage's op the program is manual over the worker axes and XLA
partitions the compute over 'tensor' (docs/tensor_parallel.md). When a value
is split in a way the next op cannot use in place (a rotary embedding halving
a head that the tensor split already halved, say), XLA reshards it with a
collective-permute. Its source/target pairs span every tensor group of the
program, and on CPU its rendezvous waits for every device those pairs name;
inside a switch on the pipeline position only one stage's devices arrive, so
the step would wait forever. The program's own ppermutes (messages, ZeRO's
copies) are named `ppermute` and run on every device; any other
collective-permute inside a branch is XLA's reshard. It is found in the
compiled HLO, before the program runs, and refused by naming the op that
caused it.
"""

from __future__ import annotations

import re
from typing import Any

from pjit_pipe.errors import SplitError
from pjit_pipe.lowering.host_heap import keep_on_heap

_PERMUTE = re.compile(r"collective-permute(?:-start)?\(.*?op_name=\"([^\"]*)\"")


def stage_local_permutes(hlo_text: str) -> list[str]:
    """The op names of the collective-permutes XLA inserted inside a branch of
    the pipeline's shard_map (module docstring), in the order of the text."""
    names = []
    for line in hlo_text.splitlines():
        found = _PERMUTE.search(line)
        if found is None:
            continue
        name = found.group(1)
        in_branch = "shard_map" in name and "branch_" in name
        if in_branch and not name.endswith("ppermute"):
            names.append(name)
    return names


class BranchSafeJit:
    """A jitted function whose first compile is checked by `stage_local_permutes`
    (and, on CPU, whose temporaries are then kept on the heap: host_heap.py).

    The first call lowers and compiles for its arguments (JAX keeps that
    executable, so the call after it does not compile again) and raises
    SplitError when a stage's branch holds an XLA collective-permute; later
    calls go straight to the jitted function.
    """

    def __init__(self, jitted: Any):
        self.jitted = jitted
        self.checked = False

    def __call__(self, *args: Any) -> Any:
        """The jitted function on `args`, checked on the first call.

        Raises:
            SplitError: when XLA resharded a value inside a stage's branch.
        """
        if not self.checked:
            self.check(self.jitted.lower(*args).compile())
        return self.jitted(*args)

    def lower(self, *args: Any) -> Any:
        """The jitted function's `lower` (ahead-of-time compiles are checked by `check`)."""
        return self.jitted.lower(*args)

    def check(self, compiled: Any) -> Any:
        """`compiled`, once its HLO holds no collective-permute inside a stage's branch.

        Raises:
            SplitError: naming the op that XLA resharded and the fix.
        """
        names = stage_local_permutes(compiled.as_text())
        if names:
            op = names[0].rsplit("/", 2)[-2:]
            raise SplitError(
                f"tensor split: XLA reshards a value inside one stage's op ('{'/'.join(op)}'), "
                "which would deadlock the devices of the other stages; split each weight "
                "over 'tensor' so every device holds whole units of what the op works "
                "on (whole attention heads: n_heads and n_kv_heads multiples of tensor), "
                "or use a smaller tensor"
            )
        self.checked = True
        keep_on_heap(compiled)
        return compiled
