"""benchmarks/bench_models.py at its tiny size: the ratio table is printed, and
every program's loss after the timed steps equals plain optax's on the whole batch."""

import jax
import optax
import pytest

from benchmarks import bench_models
from pjit_pipe.models import lm_loss


def full_batch_losses(steps: int) -> list[float]:
    """The loss before each of `steps` adamw updates, from jax.value_and_grad of the
    whole batch (no microbatches, no scan): the mean over equal microbatches of
    their mean losses is the whole batch's mean loss."""
    case = bench_models.build_case("gpt2-124m", "f32", None, quick=True, width=None, layers=None)
    params, x, y = bench_models.initial(case, 2 * 2, jax.devices()[0])
    optimizer = optax.adamw(bench_models.LEARNING_RATE)
    opt_state = optimizer.init(params)
    grad_fn = jax.jit(jax.value_and_grad(lambda p: lm_loss(case.module.apply(p, x), y)))
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(loss))
    return losses


@pytest.mark.slow
def test_quick_gpt2_rows_and_losses_match_plain_optax(capsys):
    rounds = 1
    sizes = ["--microbatches", "2", "--mb-size", "2", "--dtype", "f32", "--rounds", str(rounds)]
    rows = bench_models.main(["--quick", "--model", "gpt2-124m", "--kinds", "1f1b,zb-v", *sizes])
    printed = capsys.readouterr().out
    for name in ("plain", "1f1b", "zb-v"):
        row = next(line for line in printed.splitlines() if line.split()[:1] == [name])
        assert "x [" in row  # the ratio column
    assert [r.name for r in rows] == ["plain", "1f1b", "zb-v"]
    # One first call, one warm-up call and `rounds` timed calls: rounds + 2 steps each.
    reference = full_batch_losses(rounds + 2)
    # One step more or fewer would fail the check below: a step moves the loss more.
    assert abs(reference[-1] - reference[-2]) > 1e-3 * abs(reference[-1])
    for row in rows:
        assert abs(row.loss - reference[-1]) <= 1e-5 * abs(reference[-1]), row.name


def test_full_gpt2_is_gpt2_small_and_flops_count_its_matmuls():
    """The full-size model has GPT-2 small's 124,439,808 parameters (Hugging Face's
    gpt2, tied head); the FLOP count leaves out only the position table."""
    case = bench_models.build_case("gpt2-124m", "f32", None, quick=False, width=None, layers=None)
    tokens = jax.ShapeDtypeStruct((1, case.seq), "int32")
    params = jax.eval_shape(case.module.init, jax.random.key(0), tokens)
    assert sum(a.size for a in jax.tree.leaves(params)) == 124_439_808
    n = bench_models.matmul_params(params, case.lookup_only)
    assert n == 124_439_808 - 1024 * 768
    # 6 N per token, and 12 L d S per token of attention: 2 sequences of 1024.
    per_token = 6 * n + 12 * 12 * 768 * 1024
    assert bench_models.model_flops(case, n, 2) == per_token * 2 * 1024
