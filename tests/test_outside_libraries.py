"""Train steps written with other libraries' own model code run first try.

Steps of `outside_steps.py` at its TINY size: a HuggingFace Flax
GPT-2 with its tied head, equinox (the whole model as the argument,
activation functions static) and keras 3 (`stateless_call` on lists, named
by `names=`). Each is partitioned and run, checked against the
unpartitioned step, and the experts' predicted collective bytes and peaks
are checked against what XLA compiles for them.
The whole set, at benchmark size, is `benchmarks/outside.py`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import mesh, saved_dot_outputs

import automap
from automap._src.cluster.profile import layers as layers_lib
from automap._src.plan import planner

os.environ.setdefault("KERAS_BACKEND", "jax")  # before keras is first imported
pytest.importorskip("equinox")
pytest.importorskip("haiku")
pytest.importorskip("keras")
pytest.importorskip("transformers")

import outside_steps  # noqa: E402

from automap import referee  # noqa: E402
from automap.referee import collectives, compiled_memory  # noqa: E402

M = mesh((4, 2))
# The three calling conventions apart from flax's own: HF's model objects
# (with a tied head), equinox's whole-model argument with static leaves, and
# keras' lists named by `names=`. Haiku, linen and nnx steps are in the benchmark.
# Equinox's convention runs on its MLP by default; HF's GPT-2 (whose tracing
# the dots-policy test below checks) and T5, equinox's transformer and keras' whole
# step (whose names test_library_names.py checks) with `pytest -m slow`.
BUILDERS = [pytest.param(outside_steps.hf_gpt2, marks=pytest.mark.slow),
            pytest.param(outside_steps.hf_t5, marks=pytest.mark.slow), outside_steps.eqx_mlp,
            pytest.param(outside_steps.eqx_transformer, marks=pytest.mark.slow),
            pytest.param(outside_steps.keras_transformer, marks=pytest.mark.slow)]


@pytest.mark.heavy
@pytest.mark.parametrize("build", BUILDERS, ids=lambda b: b.__name__)
def test_outside_train_step_runs_first_try_and_prices_the_experts_as_compiled(build):
  with jax.numpy_rank_promotion("allow"):  # library code broadcasts freely
    step = build(outside_steps.TINY)
    plan = automap.search(step.fn, *step.args, mesh=M, hardware="cpu", names=step.names,
                          budget=automap.Budget(episodes=10, seconds=60))
    report = automap.verify(plan, step.fn, *step.args, mesh=M, names=step.names)
    # AdamW moves a weight by about the learning rate (1e-3) a step, even one
    # whose exact gradient is zero (a key bias): a wrong layout errs by the
    # weights' own size, rounding by far less than the step.
    assert report.max_abs_error < 2e-3, report.worst_leaf
    # The experts, written by hand on the arguments (the rest propagated as
    # XLA propagates it): predicted bytes are the compiled ones, and peaks
    # within the memory model's bound (temporaries live in the buffers of
    # results made after they die, as XLA's buffer assignment places them).
    experts, traced = referee.expert_specs(step, M, automap.HARDWARE["cpu"])
    for name, (specs, _, predicted) in experts.items():
      compiled = referee.compile_layout(traced, M, specs, step.args)
      found = sum(c.nbytes for c in collectives(compiled.as_text(), M))
      assert predicted.total_comm_bytes == pytest.approx(found, rel=0.05), name
      assert predicted.total_comm_bytes > 0
      peak = compiled_memory(compiled)[0]
      assert predicted.peak_memory == pytest.approx(peak, rel=0.15), name


@pytest.mark.heavy
def test_dots_policy_keeps_what_jax_saves_of_huggingface_gpt2():
  """HuggingFace's Flax GPT-2 (two blocks, named transformer/h/<i>): the
  bytes the "dots" recompute mode keeps are the dot_general outputs JAX
  saves as residuals of the same loss under the dots-with-no-batch-dims
  policy. Each block keeps q/k/v fused, the attention projection and the
  MLP's first matmul; its last matmul's output joins the residual stream,
  which the next layer keeps as its input; the head keeps the tied logits."""
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  tokens = jnp.zeros((2, 32), jnp.int32)
  with jax.numpy_rank_promotion("allow"):  # library code broadcasts freely
    model = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                           n_positions=32), seed=0)

    def loss(p, x, y):
      logits = model(x, params=p, train=False).logits
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    saved = saved_dot_outputs(loss, model.params, tokens, tokens)
    profile = layers_lib.measure(loss, model.params, (tokens, tokens), widths=[1],
                                 hardware=automap.HARDWARE["cpu"],
                                 search=planner.searcher(None))
  assert len(saved) == 9
  dots = {layer.name: layer.widths[1].dots for layer in profile.at(2).layers}
  f32 = 4
  per_block = 2 * 32 * (3 * 64 + 64 + 256) * f32
  assert [dots[f"transformer/h/{i}"] for i in range(2)] == [per_block] * 2
  assert dots["lm_head"] == 2 * 32 * 128 * f32
  mlp_out = 2 * 32 * 64 * f32
  assert sum(dots.values()) + 2 * mlp_out == sum(saved)


def test_equinox_runtime_checks_and_markers_are_priced_as_what_they_compute():
  """equinox's runtime checks (`unvmap_any`, `unvmap_max`: a reduction of
  every element) and its value markers (`nonbatchable`) have rules: no
  UnknownPrimitiveWarning (an error here), bytes as XLA compiles them."""
  import equinox.internal as eqxi
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def f(w, x):
    h = eqxi.nonbatchable(jnp.tanh(x @ w))
    out = jnp.sum(h @ w.T) * eqxi.unvmap_max(h)
    return jnp.where(eqxi.unvmap_any(h > 0.5), out, 0.0)

  w, x = jnp.ones((64, 128)) / 64, jnp.ones((32, 64))
  specs = (P(None, "model"), P("data", None))
  cost = automap.evaluate(f, w, x, mesh=M, in_shardings=specs, hardware="cpu")
  shardings = tuple(NamedSharding(M, s) for s in specs)
  compiled = jax.jit(f, in_shardings=shardings).lower(w, x).compile()
  assert cost.total_comm_bytes == sum(c.nbytes for c in collectives(compiled.as_text(), M))
  plan = automap.partition(f, mesh=M, hardware="cpu", layout=specs)
  assert float(plan(w, x)) == pytest.approx(float(f(w, x)), rel=1e-5)
