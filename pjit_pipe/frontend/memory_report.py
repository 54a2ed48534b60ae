"""`Pipelined.memory_report`: what each device would hold to train a pipeline,
priced from shapes before anything is allocated (lowering/memory_prediction.py).

It has its own module because it is a question about a pipeline, not a step of
building its program: it traces the stages from shapes alone, for a replica
count, tensor size or ZeRO level that may differ from the pipeline's own.
`MemoryReports` is a base of `CompiledPrograms` (compiled_programs.py), whose
cut, tick table and program it uses.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from pjit_pipe.compiler import build_schedule, build_table
from pjit_pipe.errors import BatchError, OptionError
from pjit_pipe.frontend.cutter.tensor_split import stage_splits, unbox
from pjit_pipe.frontend.inputs import leading_dim
from pjit_pipe.frontend.mesh import tensor_size
from pjit_pipe.frontend.options import check_grad_sum
from pjit_pipe.ir.memory import split_stages
from pjit_pipe.lowering import MemoryReport, any_split, predict_memory, traced_stages

if TYPE_CHECKING:
    from pjit_pipe.frontend.pipelined import LossFn


class MemoryReports:
    """The memory-report half of `CompiledPrograms`: predict, and optionally compile."""

    def memory_report(
        self,
        params: Any,
        batch: tuple[Any, Any],
        loss_fn: LossFn | None = None,
        *,
        data: int | None = None,
        tensor: int | None = None,
        zero: int | None = None,
        grad_sum: str | None = None,
        compiled: bool = False,
    ) -> MemoryReport:
        """What each device would hold to train this pipeline, before anything is
        allocated (lowering/memory_prediction.py): from shapes alone, so
        `jax.eval_shape(module.init, ...)` of a model too large for the machine will do.

        Args:
            params: the module's parameters, or their ShapeDtypeStructs (boxed or not).
            batch: (x, y) of one global batch, arrays or ShapeDtypeStructs.
            loss_fn: as in `train_step`; None prices the last stage without a loss's
                own residuals (an LM's softmax keeps its logits: pass the loss).
            data: D, the replicas to predict for (None: this pipeline's mesh's), so
                a deployment larger than this machine can be priced.
            tensor: T, the devices each stage's annotated weights split over (None:
                this pipeline's mesh's).
            zero: 0, 1 or 3 (None: this pipeline's `zero`).
            grad_sum: with zero, "accumulator", "slices" or "slices-compute" (None:
                this pipeline's).
            compiled: also compile the train step on this pipeline's mesh and add
                XLA's memory analysis of it (`MemoryReport.compiled`).

        Returns:
            The MemoryReport: per pipeline position, each part's bytes.

        Raises:
            OptionError: no optimizer, zero outside 0, 1, 3, or compiled with another
                zero, data or tensor than the pipeline's.
            BatchError: the batch does not split into data*microbatches.
        """
        if self.optimizer is None:
            raise OptionError(
                "memory_report: this pipeline has no optimizer; give it one with "
                "pm.with_options(optimizer=optax.adam(1e-3))"
            )
        mesh_data, mesh_tensor = self.replicas, tensor_size(self.mesh)
        want_data = mesh_data if data is None else data
        want_tensor = mesh_tensor if tensor is None else tensor
        own_level, own_sum = self.options.zero, self.options.grad_sum
        level = own_level if zero is None else zero
        how = own_sum if grad_sum is None else grad_sum
        check_grad_sum(how)
        if compiled and (
            (level, how) != (own_level, own_sum)
            or (want_data, want_tensor) != (mesh_data, mesh_tensor)
        ):
            raise OptionError(
                f"memory_report(compiled=True): compiles on this pipeline's mesh with "
                f"its zero, so give no data/tensor other than ({mesh_data}, {mesh_tensor}), "
                f"no zero other than {own_level} and no grad_sum other than {own_sum!r}"
            )
        plain, boxed = unbox(params)
        plain = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), plain)
        x, y = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.result_type(a)), tuple(batch)
        )
        loss_fn = _output_mean if loss_fn is None else loss_fn
        n = want_data * self.microbatches
        batch_size = leading_dim("x", x)
        if batch_size % n:
            raise BatchError(
                f"batch: global batch {batch_size} is not divisible by data*microbatches = "
                f"{want_data}*{self.microbatches} = {n}; use a multiple of {n}"
            )
        cut = self._keyed_cut(plain, x, None)
        names = getattr(self.model, "sharding_names", lambda: None)()
        splits = stage_splits(cut, plain, boxed, want_tensor, names)
        if want_data == mesh_data and not self.failed.failed and not self.measure:
            table = self.tick_table()
        else:
            spec = dataclasses.replace(self.spec, replicas=want_data, failed=())
            table = build_table(
                build_schedule(spec, self.costs),
                self.costs,
                1,
                self.options.mem_limit,
                self.options.pack_polish,
                sync=self.options.resolved_tick_sync(),
            )
        split = set() if self.remat is True else set(split_stages(table.schedule))
        mb = lambda a: jax.ShapeDtypeStruct((a.shape[0] // n, *a.shape[1:]), a.dtype)  # noqa: E731
        _, stages = traced_stages(
            cut.stage_fns(),
            loss_fn,
            False,
            cut.split(plain),
            jax.tree.map(mb, x),
            jax.tree.map(mb, y),
            split,
            None,
            tensor_split=any_split(splits),
        )
        nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves((x, y)))
        report = predict_memory(
            table,
            stages,
            self.optimizer,
            zero=level,
            tensor=want_tensor,
            splits=splits,
            remat=self.remat is True,
            input_bytes=nbytes,
            grad_sum=how,
        )
        if compiled:
            report = report.with_compiled(self._compiled_memory(plain, boxed, x, y, loss_fn))
        return report

    def _compiled_memory(self, plain: Any, boxed: Any, x: Any, y: Any, loss_fn: LossFn) -> Any:
        """XLA's memory analysis of the train step compiled for these shapes."""
        _, program = self.program(plain, x, y, loss_fn, boxed=boxed)
        sharding = NamedSharding(self.device_mesh, PartitionSpec())
        placed = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), (x, y)
        )
        skip = self.options.skip_nonfinite is not False and not program.steps_in_loop
        program.compile_device_train_step(*placed, donate=True, skip_nonfinite=skip)
        return program.device_memory_analysis(donate=True, skip_nonfinite=skip)


def _output_mean(out: Any, y: Any) -> jax.Array:
    """The loss `memory_report` prices without one: the outputs' mean, which keeps
    no residual of its own."""
    del y
    return jnp.mean(jnp.stack([jnp.mean(a.astype(jnp.float32)) for a in jax.tree.leaves(out)]))
