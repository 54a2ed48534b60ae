"""The training loop of `pjit-pipe train`: an example model trained on a pipeline
schedule through injected failures, and the printing of its steps and costs.

The subcommand itself (its options, and the choice between one process and
`--processes N`) is `train_command`; the loop lives here so that both it and
each process of a multi-process run (`train_processes`) use it. JAX is
imported only inside `train`, after XLA_FLAGS asks for enough host (CPU)
devices for the mesh; the flag does not affect GPU or TPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from typing import Any

from pjit_pipe.cli.compile_cache import configure_compilation_cache
from pjit_pipe.cli.device_choice import ensure_host_devices, run_devices
from pjit_pipe.cli.train_args import check_failure_plan, check_slow_plan


@dataclass
class Task:
    """An example model with its data stream and loss."""

    model: Any
    loss_fn: Any
    next_batch: Any  # () -> (x, y)
    tokens_per_example: int
    rng: Any  # the data stream's numpy Generator: its state is the stream position
    corpus: Any = None

    def position(self) -> dict:
        """Where the data stream stands (JSON), for a checkpoint."""
        return self.rng.bit_generator.state

    def seek(self, position: dict) -> None:
        """Continue the data stream from a saved `position`."""
        self.rng.bit_generator.state = position


def make_task(name: str, batch: int, seed: int, tensor: int = 1) -> Task:
    import numpy as np

    from pjit_pipe.models import GPT, GPTConfig, ResidualMLP, lm_loss, mse_loss
    from pjit_pipe.models.char_corpus import CharCorpus

    rng = np.random.default_rng(seed)
    if name == "gpt-tiny":
        corpus = CharCorpus.load()
        config = GPTConfig.tiny(vocab=corpus.vocab)
        if tensor > 1:  # Megatron's column/row splits of the blocks over 'tensor'
            config = dataclasses.replace(config, megatron=True)
        return Task(
            GPT(config),
            lm_loss,
            lambda: corpus.batch(rng, batch, config.seq_len),
            config.seq_len,
            rng,
            corpus,
        )
    teacher = rng.normal(size=(16, 8)).astype(np.float32) / 4.0

    def regression():
        x = rng.normal(size=(batch, 16)).astype(np.float32)
        return x, np.sin(x @ teacher)

    return Task(ResidualMLP(), mse_loss, regression, 1, rng)


def make_optimizer(lr: float, clip: float | None = None) -> Any:
    """The CLI's optimizer: Adam at `lr`, after a global-norm clip to `clip` if given."""
    import optax

    adam = optax.adam(lr)
    return adam if clip is None else optax.chain(optax.clip_by_global_norm(clip), adam)


@dataclass
class StepRecord:
    """What one committed step did."""

    step: int
    loss: float
    seconds: float
    tokens: int
    failed: list[str]  # workers down during the committed attempt, as R:S
    events: list[str]  # failures, program switches and skipped updates on the way
    skipped: int = 0  # steps skipped so far because their loss or gradient was not finite


def train(
    args: argparse.Namespace,
    on_step: Any,
    on_compiled: Any = None,
    on_event: Any = None,
    devices: Any = None,
    on_trainer_event: Any = None,
    stop: Any = None,
) -> tuple[Any, Any, Task]:
    """Build the pipeline and run args.steps steps through the injected failures;
    on_step(StepRecord) after each (tokens: input positions in the global batch).
    A checkpoint holds the data stream's position and the workers down, and a
    resume restores both; one already at or past args.steps runs nothing.
    Failure variants compile in the background while training runs (the ones
    the plan needs first), calling on_compiled(variant) after each; a step
    that needs one not ready yet waits for it. on_event(line) is called with
    each runtime event as it happens (failure, wait, switch, skipped step);
    the StepRecord lists them too, and on_trainer_event(TrainerEvent) gets
    the event itself. `devices`: the mesh's devices (a process of a
    multi-process run passes the job's training devices), else this
    machine's (`run_devices`). On a job of several processes failures are
    real, not injected: the trainer's default detector, LiveDevices. With
    args.checkpoint_dir, resume from its latest checkpoint (if any) and save
    every args.checkpoint_every steps and at the end. async-1f1b without failures
    carries its microbatches from step to step (`train_carrying`). `stop`: a
    `PlannedStop` of a job of several processes; at the step it agrees on, the
    run saves a checkpoint there and returns early (the launcher restarts the
    job from it)."""
    data, stages, tensor = args.mesh
    fail, rejoin = getattr(args, "fail", {}), getattr(args, "rejoin", {})
    ensure_host_devices(data * stages * tensor)
    import jax

    import pjit_pipe as pp
    from pjit_pipe.runtime import (
        Checkpoints,
        InjectedFailures,
        InjectedSlowdowns,
        ProcessCheckpoints,
        ResilientTrainer,
    )

    # Before the first compile: JAX opens its cache folder once per process.
    configure_compilation_cache(getattr(args, "cache_dir", None), getattr(args, "no_cache", False))
    directory = getattr(args, "checkpoint_dir", None)
    # A job of several processes: each saves its own stages, with no collective.
    kind = ProcessCheckpoints if jax.process_count() > 1 else Checkpoints
    checkpoints = kind(directory, args.checkpoint_every) if directory else None

    batch = args.batch or 2 * data * args.microbatches
    task = make_task(args.model, batch, args.seed, tensor)
    pm = pp.pipeline(
        task.model,
        stages=stages,
        microbatches=args.microbatches,
        schedule=args.schedule,
        chunks=args.chunks,
        mesh=pp.make_mesh(
            data=data,
            stage=stages,
            tensor=tensor,
            devices=devices if devices is not None else run_devices(data * stages * tensor),
        ),
        optimizer=make_optimizer(args.lr, getattr(args, "clip", None)),
        async_weights=getattr(args, "async_weights", None),
        zero=getattr(args, "zero", False),
        grad_sum=getattr(args, "grad_sum", "accumulator"),
        **({"costs": "measure"} if getattr(args, "show_costs", False) else {}),
    )
    precompile = getattr(args, "precompile", None)
    if precompile is None:
        precompile = 1 if fail else 0
    x, y = task.next_batch()  # the batch of step 0, or an example to resume with
    key = jax.random.key(args.seed)
    down: list[tuple[int, int]] = []  # workers down when the run starts (a resumed run's)
    if checkpoints is not None and checkpoints.latest_step() is not None:
        step_fn = pm.train_step(task.loss_fn, donate=False)
        start_from, saved = checkpoints.restore(step_fn, (x, y), jax.eval_shape(pm.init, key, x))
        position, down = resume_point(saved)
        if jax.process_count() > 1:
            down = []  # a new job: every process is live again
        if start_from.step >= args.steps:
            print(
                f"checkpoint {directory} is already at step {start_from.step}, at or past "
                f"--steps {args.steps}: nothing to run; raise --steps to train further",
                file=sys.stderr,
            )
            checkpoints.close()
            return pm, start_from, task
        task.seek(position)
        x, y = task.next_batch()
        # The plan's events before the resumed step already happened.
        fail = {k: v for k, v in fail.items() if k >= start_from.step}
        rejoin = {k: v for k, v in rejoin.items() if k >= start_from.step}
    else:
        # One compiled init instead of one small compile per initializer (seconds).
        start_from = jax.jit(pm.init)(key, x)
    start = start_from.step if isinstance(start_from, pp.TrainState) else 0
    check_failure_plan(fail, rejoin, data, stages, args.steps, down, start)
    events: list[str] = []  # the events of the step in progress, for its StepRecord
    slow = getattr(args, "slow", {})
    check_slow_plan(slow, data, stages, args.steps)

    def record_event(event: Any) -> None:
        events.append(event.describe())
        if on_event is not None:
            on_event(event.describe())
        if on_trainer_event is not None:
            on_trainer_event(event)

    trainer = ResilientTrainer(
        pm,
        task.loss_fn,
        InjectedFailures(fail, rejoin, down) if jax.process_count() == 1 else None,
        max_failures=precompile,
        on_event=record_event,
        speeds=InjectedSlowdowns(slow) if slow else None,
    )
    if getattr(args, "show_costs", False):
        params = start_from.params if isinstance(start_from, pp.TrainState) else start_from
        pm.measure_schedule(params, x, y, task.loss_fn)
        show_costs(pm, args.json)
    if args.schedule == "async-1f1b" and not fail and not rejoin and not down:
        state = train_carrying(args, pm, task, start_from, (x, y), checkpoints, on_step, batch)
        return pm, state, task
    state = trainer.init(
        start_from,
        (x, y),
        precompile=precompile > 0 or bool(slow),  # a --slow plan's programs, ahead
        on_compiled=on_compiled,
    )
    try:
        for step in range(state.step, args.steps):
            if stop is not None and stop.should_stop(step):
                checkpoints.save(state, saved, force=True)
                break
            start = time.perf_counter()
            state, loss = trainer.step(state, (x, y))
            down = sorted(trainer.down)
            record = StepRecord(
                step,
                host_scalar(loss),
                time.perf_counter() - start,
                batch * task.tokens_per_example,
                [f"{w.replica}:{w.stage}" for w in down],
                events[:],
                state.skipped,
            )
            events.clear()
            on_step(record)
            saved = {"position": task.position(), "failed": [list(w) for w in down]}
            x, y = task.next_batch()  # the position saved is before this batch
            if checkpoints is not None:
                checkpoints.save(state, saved, force=state.step == args.steps)
    finally:
        trainer.close()
        if checkpoints is not None:
            checkpoints.close()  # waits for the last save
    return pm, state, task


def host_scalar(value: Any) -> float:
    """A scalar array as a float, read from this process's own copy (on a job of
    several processes the array also lives on devices of other processes)."""
    import numpy as np

    if getattr(value, "is_fully_addressable", True):
        return float(value)
    return float(np.asarray(value.addressable_data(0)))


def resume_point(saved: dict) -> tuple[dict, list[tuple[int, int]]]:
    """(data stream position, workers down) from a checkpoint's data record."""
    failed = [(int(r), int(s)) for r, s in saved.get("failed", [])]
    return saved["position"], failed


def train_carrying(
    args: argparse.Namespace,
    pm: Any,
    task: Task,
    start_from: Any,
    batch: tuple[Any, Any],
    checkpoints: Any,
    on_step: Any,
    rows: int,
) -> Any:
    """`train` for async-1f1b without failures: steps carry their microbatches in
    flight (lowering/async_pipeline/async_carry.py), so the pipeline never drains between steps.
    A step's record comes when its batch has finished, after the next step's call
    (`seconds`: that call's time); the pipeline is flushed before each checkpoint
    and at the end. Returns the final state."""
    import pjit_pipe as pp

    step_fn = pm.train_step(task.loss_fn, carry=True)
    if isinstance(start_from, pp.TrainState):
        state, _ = step_fn.adopt(start_from, batch)
    else:
        state = step_fn.init(start_from, batch)

    def finished(step: int, loss: Any, start: float) -> None:
        seconds = time.perf_counter() - start
        on_step(StepRecord(step, float(loss), seconds, rows * task.tokens_per_example, [], []))

    try:
        for step in range(state.step, args.steps):
            start, filling = time.perf_counter(), state.in_flight is None
            state, loss = step_fn(state, batch)
            if not filling:  # the previous step's batch finished in this call
                finished(step - 1, loss, start)
            saved = {"position": task.position(), "failed": []}
            batch = task.next_batch()  # the position saved is before this batch
            last = state.step == args.steps
            if last or (checkpoints is not None and state.step % checkpoints.every == 0):
                start = time.perf_counter()
                state, loss = step_fn.flush(state)
                finished(step, loss, start)
                if checkpoints is not None:
                    checkpoints.save(state, saved, force=last)
    finally:
        if checkpoints is not None:
            checkpoints.close()
    return state


def show_costs(pm: Any, as_json: bool) -> None:
    """Print the measured per-stage costs (ms per microbatch), and what a step costs
    under them (ms): the event-driven schedule, the tick table the program runs, and
    the least any tick table of one iteration could cost."""
    from pjit_pipe.simulator import lockstep_lower_bound, packed_time, simulate

    table = pm.stage_times.as_dict(pm.stages, pm.schedule.layout)
    costs, schedule = pm.costs, pm.schedule  # measured: --show-costs sets costs="measure"
    step = {
        "event_ms": simulate(schedule, costs).makespan,
        "ticks_ms": packed_time(pm.tick_table(), costs),
        "bound_ms": lockstep_lower_bound(schedule, costs),
    }
    if as_json:
        print(json.dumps({"costs": table, "step": step}), flush=True)
        return
    print("measured costs (ms per microbatch):")
    for p in range(pm.stages):
        print(
            f"  stage {p}: F {table['f'][p]:.3f}  B {table['b'][p]:.3f}  W {table['w'][p]:.3f}"
            f"  (not split: F {table['f_fused'][p]:.3f}  BW {table['bw'][p]:.3f})"
        )
    if table["fbw"] is not None:
        p = pm.schedule.layout[-1]  # the loss stage's position
        apart = table["f_fused"][p] + table["bw"][p]
        print(
            f"  the loss stage's F and BW as one program: {table['fbw'][p]:.3f}"
            f" ({table['fbw'][p] / apart:.2f}x F + BW; run so where a tick holds both)"
        )
    print(
        f"  transfer C {table['c']:.3f}; fixed cost of a tick {table['tick']:.3f}; for "
        f"`pjit-pipe schedule`: --costs {table['costs_arg']} --tick-cost {table['tick']:.4g}"
        f" --fused-costs {table['fused_costs_arg']}"
    )
    print(
        f"  a step: {step['event_ms']:.3f} ms event-driven, {step['ticks_ms']:.3f} ms as the "
        f"compiled tick table; no tick table of the schedule below {step['bound_ms']:.3f}"
    )


def step_printer(args: argparse.Namespace) -> tuple[Any, Any]:
    """(on_step, close): print each StepRecord as `train` does, one JSON object per
    step with --json, else a progress bar (made at the first step, so errors come
    first) with the step's events above it; close() ends the bar."""
    from tqdm import tqdm

    bars: list[Any] = []

    def on_step(rec: StepRecord) -> None:
        tokens_per_s = rec.tokens / rec.seconds if rec.seconds > 0 else 0.0
        if args.json:
            record = {
                "step": rec.step,
                "loss": rec.loss,
                "seconds": rec.seconds,
                "tokens_per_s": tokens_per_s,
                "failed": rec.failed,
                "skipped": rec.skipped,
                "events": rec.events,
            }
            print(json.dumps(record), flush=True)
            return
        if not bars:
            bars.append(
                tqdm(total=args.steps, initial=rec.step, desc=f"train {args.model}", unit="step")
            )
        bar = bars[0]
        for line in rec.events:
            bar.write(line)
        bar.set_postfix(loss=f"{rec.loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")
        bar.update()

    def close() -> None:
        for bar in bars:
            bar.close()

    return on_step, close
