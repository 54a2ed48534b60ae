"""The public API: explicit exports, typed options, the error hierarchy, and the
rough edges a new user hits (none of these tests compiles a pipeline)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
import warnings
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pjit_pipe as pp
from pjit_pipe import errors
from pjit_pipe.cli import build_parser, main
from pjit_pipe.frontend.program_cache import ProgramCache, ProgramKey
from pjit_pipe.schedules import DEFAULT_CHUNKS, make_schedule

REPO = Path(__file__).resolve().parents[1]
MODEL = nn.Sequential([nn.Dense(6), nn.Dense(5), nn.Dense(4), nn.Dense(2)])
X = np.asarray(jax.random.normal(jax.random.key(0), (8, 3)))
Y = np.asarray(jax.random.normal(jax.random.key(1), (8, 2)))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@pytest.fixture(scope="module")
def params():
    return MODEL.init(jax.random.key(2), X)


def two_stages(**options):
    return pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(1, 2), **options)


# ---- exports ----


def test_every_export_resolves_and_the_package_import_loads_no_jax():
    for name in pp.__all__:
        assert getattr(pp, name) is not None, name
    for name in ("Costs", "ScheduleError", "Schedule", "make_schedule", "PipelineOptions"):
        assert name in pp.__all__
    assert pp.make_schedule is make_schedule
    code = "import sys, pjit_pipe; print('jax' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "False"


def test_errors_form_one_hierarchy_that_imports_nothing_from_pjit_pipe():
    classes = [getattr(pp, n) for n in errors.__all__]
    assert all(issubclass(c, pp.PjitPipeError) and issubclass(c, ValueError) for c in classes)
    assert all(c.__doc__ and len(c.__doc__) > 40 for c in classes)  # each says what to do
    from pjit_pipe.ir.schedule import ScheduleError

    assert ScheduleError is pp.ScheduleError and issubclass(pp.FailurePlanError, ScheduleError)
    tree = ast.parse((REPO / "pjit_pipe" / "errors.py").read_text())
    imported = [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]
    assert all(getattr(n, "module", None) == "__future__" for n in imported)


# ---- PipelineOptions ----


@pytest.mark.parametrize(
    "changes,error,words",
    [
        (dict(stages=0), pp.OptionError, "stages must be a positive integer"),
        (dict(microbatches=2.5), pp.OptionError, "microbatches must be a positive integer"),
        (dict(chunks=0), pp.OptionError, "chunks must be a positive integer or None"),
        (dict(schedule="zigzag"), pp.OptionError, "choose one of gpipe, 1f1b"),
        (dict(balance="even"), pp.OptionError, r"balance: expected one of flops, params, flops\+"),
        (dict(costs="guess"), pp.OptionError, "costs: expected a pjit_pipe.Costs"),
        (dict(mem_limit=0), pp.OptionError, "mem_limit: expected a positive number"),
        (dict(search_time=-1.0), pp.OptionError, "search_time: expected a positive number"),
        (dict(pack_polish="fast"), pp.OptionError, "pack_polish: expected a number of seconds"),
        (dict(remat="yes"), pp.OptionError, "remat: expected True, False or 'auto'"),
        (dict(optimizer=optax.adam), pp.OptionError, "optax GradientTransformation"),
        (dict(max_programs=0), pp.OptionError, "max_programs must be a positive integer"),
        (dict(stages=3), pp.MeshError, "'stage' axis has 2 devices, but stages=3"),
        (dict(failed=(0, 1)), pp.FailurePlanError, r"write \[\(0, 1\)\]"),
        (dict(failed=[(0, 0), (0, 1)]), pp.FailurePlanError, "keep at least one replica"),
        (dict(failed=[(1, 0)]), pp.FailurePlanError, "outside the 1x2 mesh"),
    ],
)
def test_bad_option_names_itself_and_what_it_takes(changes, error, words):
    options = {**dict(stages=2, microbatches=2, mesh=pp.make_mesh(1, 2)), **changes}
    with pytest.raises(error, match=words):
        pp.PipelineOptions(**options)
    with pytest.raises(error, match=words):
        pp.pipeline(MODEL, **options)


def test_with_options_is_replace_on_the_frozen_options():
    pm = two_stages(schedule="zb-h1")
    opt = optax.sgd(0.1)
    changed = pm.with_options(optimizer=opt, failed=[])
    assert changed.options == dataclasses.replace(pm.options, optimizer=opt)
    assert changed.optimizer is opt and changed.schedule.kind == pm.schedule.kind
    with pytest.raises(dataclasses.FrozenInstanceError):
        pm.options.stages = 3  # type: ignore[misc]


@pytest.mark.parametrize("kind", ["zb-v", "interleaved-1f1b", "1f1b"])
def test_each_kind_runs_with_its_own_chunks_by_default(kind):
    pm = pp.pipeline(MODEL, stages=2, microbatches=4, schedule=kind, mesh=pp.make_mesh(1, 2))
    assert pm.schedule.chunks == DEFAULT_CHUNKS[kind] == make_schedule(kind, 2, 4).chunks
    assert pm.chunks == DEFAULT_CHUNKS[kind]
    args = build_parser().parse_args(["train", "--schedule", kind])
    assert args.chunks is None  # `train` passes None: the same default


def test_with_failures_of_a_bare_pair_says_to_wrap_it():
    pm = pp.pipeline(MODEL, stages=2, microbatches=2, mesh=pp.make_mesh(2, 2))
    with pytest.raises(pp.FailurePlanError, match=r"\(replica, stage\) pairs.*\[\(0, 1\)\]"):
        pm.with_failures((0, 1))
    variant = pm.with_failures([(0, 1)])
    assert variant.options.failed == ((0, 1),) and variant.cuts is pm.cuts


# ---- the optimizer mask and the program cache ----


def test_a_mask_tree_for_adamw_reaches_the_clear_message(params):
    mask = jax.tree.map(lambda a: a.ndim > 1, params)
    pm = two_stages(optimizer=optax.adamw(1e-3, mask=mask))
    with pytest.raises(pp.OptimizerError, match=r"give optax\.masked / multi_transform a function"):
        pm.train_step(mse).init(params, (X, Y))
    with pytest.raises(pp.OptimizerError, match="a function of the parameters"):
        pm.value_and_grad(mse)(params, X, Y)


def test_program_cache_is_bounded_and_least_recently_used_goes_first():
    cache: ProgramCache[str] = ProgramCache(size=2)
    built: list[str] = []

    def build(name):
        return lambda: built.append(name) or name

    for name in ("a", "b", "a", "c"):  # "a" is used again, so "b" is the oldest at "c"
        assert cache.get(ProgramKey(mse, name), build(name)) == name
    assert built == ["a", "b", "c"] and len(cache) == 2
    assert ProgramKey(mse, "a") in cache and ProgramKey(mse, "b") not in cache


def test_a_new_loss_object_for_the_same_shapes_warns_once_per_recompile():
    cache: ProgramCache[int] = ProgramCache(size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.get(ProgramKey(mse, "shapes"), lambda: 1)
        cache.get(ProgramKey(mse, "shapes"), lambda: 2)  # a hit
        cache.get(ProgramKey(mse, "other shapes"), lambda: 3)  # a new shape: no warning
        cache.get(ProgramKey("forward", "shapes"), lambda: 4)
    with pytest.warns(UserWarning, match="define the loss once and reuse it"):
        cache.get(ProgramKey(lambda o, y: mse(o, y), "shapes"), lambda: 5)


def test_the_pipeline_warns_when_a_fresh_lambda_recompiles(params):
    pm = two_stages(max_programs=1)
    cut, first = pm.program(params, X, Y, mse)
    again_cut, cached = pm.program(params, X, Y, mse)
    assert again_cut is cut and cached is first
    with pytest.warns(UserWarning, match="define the loss once"):
        _, again = pm.program(params, X, Y, lambda o, y: mse(o, y))
    assert again is not first
    with pytest.warns(UserWarning, match="define the loss once"):  # max_programs=1 dropped it
        _, third = pm.program(params, X, Y, mse)
    assert third is not first


# ---- the CLI ----


def train_parser():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return sub.choices["train"]


def test_every_train_option_has_help_and_the_description_no_xla_internals():
    parser = train_parser()
    options = [a for a in parser._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 14
    assert [a.dest for a in options if not (a.help and len(a.help) > 10)] == []
    assert "XLA" not in parser.description and "jax" not in parser.description.lower()


BAD_PLANS = {
    "every replica of a stage": (["--fail", "1:0:1,2:1:1"], "every replica of stage 1"),
    "rejoin of a worker never down": (["--rejoin", "2:1:0"], "1:0 is not down before step 2"),
    "rejoin before its failure": (
        ["--fail", "3:1:0", "--rejoin", "2:1:0"],
        "1:0 is not down before step 2",
    ),
    "fail past the last step": (["--fail", "5:0:0"], "step 5 is past the last step"),
    "rejoin past the last step": (
        ["--fail", "1:0:0", "--rejoin", "9:0:0"],
        "step 9 is past the last step",
    ),
}


@pytest.mark.parametrize("extra,words", BAD_PLANS.values(), ids=BAD_PLANS.keys())
def test_train_refuses_a_failure_plan_before_compiling(capsys, extra, words):
    argv = ["train", "--model", "mlp", "--mesh", "2x2", "--steps", "5", *extra]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words in err


def test_a_plan_that_keeps_a_replica_of_each_stage_is_accepted():
    from pjit_pipe.cli.train_args import check_failure_plan

    # 1:0 fails, comes back, then 0:0 fails: stage 0 always has a live replica.
    check_failure_plan({1: [(1, 0)], 3: [(0, 0)]}, {3: [(1, 0)]}, 2, 2, steps=5)
