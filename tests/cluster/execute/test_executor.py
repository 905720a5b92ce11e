"""A cluster plan run as a training step: numerics against the unpipelined
step, the schedule run against the one priced, and bad plans refused."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_trains_as_jitted, jitted_training

import automap
from automap import cluster
from automap._src.models import gpt, zoo

GPT = gpt.GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=4)  # tied embeddings
BATCH = 16
BUDGET = automap.Budget(episodes=8)
# eps well above rounding noise: attention's key bias has an exactly zero
# gradient, which Adam would turn into steps of either sign.
TX = optax.adam(1e-2, eps=1e-3)


def gpt_loss():
  return zoo.gpt_loss(GPT, BATCH)


class _DecoderBlock(nn.Module):
  @nn.compact
  def __call__(self, x, memory):
    attn = nn.MultiHeadDotProductAttention(num_heads=2)
    return x + attn(nn.RMSNorm()(x), memory)


class _EncoderBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(nn.tanh(x))


class _EncoderDecoder(nn.Module):
  """A T5-style model: every decoder block attends to the encoder's output."""

  width: int = 32

  @nn.compact
  def __call__(self, src, tgt):
    embed = nn.Embed(64, self.width, name="embed")
    enc = embed(src)
    for i in range(2):
      enc = _EncoderBlock(name=f"enc_{i}")(enc)
    dec = embed(tgt)
    for i in range(2):
      dec = _DecoderBlock(name=f"dec_{i}")(dec, enc)
    return nn.Dense(64, name="head")(dec)


def encoder_decoder_loss():
  model = _EncoderDecoder()
  src = jax.random.randint(jax.random.key(1), (BATCH, 6), 0, 64)
  tgt = jax.random.randint(jax.random.key(2), (BATCH, 6), 0, 64)
  params = model.init(jax.random.key(0), src, tgt)

  def loss(params, src, tgt):
    logits = model.apply(params, src, tgt)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  return loss, params, (src, tgt)


def hf_gpt2_loss():
  """HuggingFace's Flax GPT-2 as its users call it: blocks under
  transformer/h/<i>, the head tied to the token embedding."""
  transformers = pytest.importorskip("transformers")
  config = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=2, n_positions=8)
  model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
  tokens = jax.random.randint(jax.random.key(1), (BATCH, 9), 0, 64)

  def loss(params, inputs, labels):
    logits = model(inputs, params=params, train=False).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return loss, model.params, (tokens[:, :-1], tokens[:, 1:])


def hf_bart_loss():
  """HuggingFace's Flax BART: encoder and decoder stacks under
  model/encoder/layers and model/decoder/layers."""
  transformers = pytest.importorskip("transformers")
  config = transformers.BartConfig(
      vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
      decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
      max_position_embeddings=16)
  model = transformers.FlaxBartForConditionalGeneration(config, seed=0)
  src = jax.random.randint(jax.random.key(1), (BATCH, 8), 0, 64)
  tgt = jax.random.randint(jax.random.key(2), (BATCH, 9), 0, 64)

  def loss(params, src, tgt):
    logits = model(src, decoder_input_ids=tgt[:, :-1], params=params, train=False).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt[:, 1:]).mean()

  return loss, model.params, (src, tgt)


def run_plan(model, steps=3, run=None, **config):
  loss, params, batch = model()
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(**config),
                               global_batch=BATCH, hardware="cpu", budget=BUDGET)
  step = plan.train_step(loss, TX, params, *batch, schedule=run)
  assert_trains_as_jitted(step, loss, TX, params, batch, steps)
  return plan, step


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_tied_gpt_over_stages_tensor_and_data_matches_the_jitted_step():
  plan, step = run_plan(gpt_loss, tensor=2, pipeline=2, data=2, microbatch=2, zero=1)
  # The tied embedding lives on both stages; its gradient is summed on the first.
  (embedding,) = [i for i, s in step.owner.items() if i in step.stage_params[1] and s == 0]
  assert step.param_avals[embedding].shape == (GPT.vocab, GPT.hidden)
  # What ran is the order priced, slot for slot.
  assert step.executed == step.timetable.in_order()
  assert step.timetable.schedule == "1f1b" and plan.schedule() == ("1f1b", 2, 4, 1)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_huggingface_gpt2_runs_as_planned_without_rewriting_the_model():
  with jax.numpy_rank_promotion("allow"):  # library code broadcasts freely
    plan, step = run_plan(hf_gpt2_loss, tensor=2, pipeline=2, data=2, microbatch=2, zero=1)
  layers = [name for s in plan.placement.stages for name in s.layers]
  # Named as the model nests them; the repeated block split between stages.
  assert [n for n in layers if n.startswith("transformer/h/")] == [
      f"transformer/h/{i}" for i in range(4)]
  assert plan.placement.stages[0].layers[:2] == ("transformer/wte", "transformer/wpe")
  assert plan.placement.stages[1].layers[-1] == "lm_head"
  assert step.executed == step.timetable.in_order()


@pytest.mark.slow
def test_huggingface_bart_runs_as_planned_without_rewriting_the_model():
  with jax.numpy_rank_promotion("allow"):
    plan, step = run_plan(hf_bart_loss, pipeline=2, data=2, microbatch=2, zero=3)
  layers = {name for s in plan.placement.stages for name in s.layers}
  assert {f"model/{part}/layers/{i}" for part in ("encoder", "decoder")
          for i in range(2)} <= layers


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
@pytest.mark.parametrize("config", [
    dict(tensor=1, pipeline=4, data=2, microbatch=2),
    dict(tensor=1, pipeline=2, data=2, microbatch=2, schedule="interleaved", virtual_stages=2),
    dict(tensor=2, pipeline=2, data=2, microbatch=2, zero=2),
    dict(tensor=2, pipeline=2, data=2, microbatch=2, zero=3),
    dict(tensor=2, pipeline=2, data=2, microbatch=2, recompute="full"),
    dict(tensor=2, pipeline=2, data=2, microbatch=2, recompute="dots"),
    dict(tensor=2, pipeline=2, data=2, microbatch=2, recompute="selective"),
], ids=["4x2", "interleaved", "zero2", "zero3", "full", "dots", "selective"])
def test_gpt_plans_match_the_jitted_step(config):
  plan, step = run_plan(gpt_loss, **config)
  assert [s.recompute_mode for s in plan.placement.stages] == [config.get(
      "recompute", "none")] * config["pipeline"]
  assert step.executed == step.timetable.in_order()


@pytest.mark.slow
def test_encoder_decoder_with_gpipe_matches_the_jitted_step():
  plan, step = run_plan(encoder_decoder_loss, pipeline=2, data=2, microbatch=2, zero=3,
                        schedule="gpipe")
  # GPipe is priced holding every microbatch, and run as priced.
  assert plan.schedule() == ("gpipe", 2, 4, 1)
  assert [s.in_flight for s in plan.placement.stages] == [4, 4]
  # The encoder's output crosses to the decoder layer on the other stage.
  layers = [s.layers for s in plan.placement.stages]
  assert layers == [("embed", "enc_0", "enc_1", "embed#2", "dec_0"), ("dec_1", "head")]
  (chunk, last) = step.cut.chunks
  assert len(last.receives) == 2  # the encoder's output and dec_0's
  assert step.timetable.render().splitlines()[0].startswith("stage 0: F0  F1  F2  F3")


@pytest.mark.parametrize("schedule,stages,microbatches,virtual", [
    ("1f1b", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 2, 1), ("interleaved", 2, 4, 2),
    ("interleaved", 4, 8, 2), ("interleaved", 2, 2, 2), ("interleaved", 4, 4, 3),
    ("gpipe", 4, 8, 1)])
def test_the_timetable_is_the_schedule_the_cluster_model_prices(schedule, stages,
                                                               microbatches, virtual):
  table = cluster.timetable(schedule, stages, microbatches, virtual)
  # Equal stages, a slot per chunk's forward or backward: the priced time
  # (M + (S - 1) / v) * (time per microbatch) is 2 M v + 2 (S - 1) slots.
  assert table.slots == 2 * microbatches * virtual + 2 * (stages - 1)
  for s in range(stages):
    assert table.in_flight(s) == cluster.get_schedule(schedule).in_flight(
        s, stages, microbatches, virtual)
  # Every dependency is met: a forward after the previous chunk's, a backward
  # after its own forward and the next chunk's backward.
  slot = {(w.phase, w.chunk, w.microbatch): w.slot for w in table.in_order()}
  for (phase, c, m), t in slot.items():
    if phase == "forward" and c:
      assert slot[("forward", c - 1, m)] < t
    if phase == "backward":
      assert slot[("forward", c, m)] < t
      if c < stages * virtual - 1:
        assert slot[("backward", c + 1, m)] < t


def test_gpipe_holds_every_microbatch_and_1f1b_fewer():
  gpipe, one = cluster.timetable("gpipe", 4, 8), cluster.timetable("1f1b", 4, 8)
  assert [gpipe.in_flight(s) for s in range(4)] == [8] * 4
  assert [one.in_flight(s) for s in range(4)] == [4, 3, 2, 1]
  assert gpipe.slots == one.slots


def _dense_stack(params, x, y):
  for i, (w, b) in enumerate(params):
    with jax.named_scope(f"dense_{i}"):
      x = jnp.tanh(x @ w + b[None])
  return jnp.mean((x - y) ** 2)


def _hand_plan(stages_layers) -> cluster.ClusterPlan:
  """A plan stated by hand: the stages given, two data-parallel replicas,
  microbatches of 2 samples, nothing priced."""
  stages = tuple(cluster.Stage(tuple(layers), 1, False, s, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                               0.0) for s, layers in enumerate(stages_layers))
  S = len(stages)
  placement = cluster.Placement(2, BATCH // 4, 0, stages, 2 * S, 0.0)
  return cluster.ClusterPlan(placement, 2, BATCH, 2 * S, "cpu", {})


def test_a_cut_inside_one_equation_is_refused_with_both_layers():
  params = [(jnp.full((8, 8), 0.1), jnp.zeros(8)) for _ in range(3)]
  x = jnp.ones((BATCH, 8))

  def loss(params, x, y):  # dense_1 and dense_2 inside one checkpoint
    with jax.named_scope("dense_0"):
      h = jnp.tanh(x @ params[0][0] + params[0][1][None])

    def tail(p, h):
      for i, (w, b) in enumerate(p, start=1):
        with jax.named_scope(f"dense_{i}"):
          h = jnp.tanh(h @ w + b[None])
      return h

    return jnp.mean((jax.checkpoint(tail)(params[1:], h) - y) ** 2)

  plan = _hand_plan([("dense_0", "dense_1"), ("dense_2",)])
  with pytest.raises(cluster.PlacementError, match=r"inside one `remat2`.*dense_1.*dense_2"):
    plan.train_step(loss, TX, params, x, x)


def test_bad_plans_devices_optimizers_and_batches_are_refused():
  params = [(jnp.full((8, 8), 0.1), jnp.zeros(8)) for _ in range(2)]
  x = jnp.ones((BATCH, 8))
  plan = _hand_plan([("dense_0",), ("dense_1",)])
  step = plan.train_step(_dense_stack, TX, params, x, x)
  state, value = step(step.init(params), x, x)
  assert np.isfinite(float(value))
  with pytest.raises(cluster.PlacementError, match="devices: the plan uses 4 devices"):
    plan.train_step(_dense_stack, TX, params, x, x, devices=jax.devices()[:2])
  with pytest.raises(cluster.PlacementError, match="clip_by_global_norm"):
    plan.train_step(_dense_stack, optax.chain(optax.clip_by_global_norm(1.0), TX), params, x, x)
  with pytest.raises(cluster.PlacementError, match="leading batch dim"):
    plan.train_step(_dense_stack, TX, params, x[:8], x[:8])
  with pytest.raises(cluster.PlacementError, match="structure, shapes and dtypes"):
    step(state, x[:8], x[:8])
  other = [(jnp.zeros((8, 8)), jnp.zeros(8)) for _ in range(3)]
  with pytest.raises(cluster.PlacementError, match=r"no stage holds.*dense_2"):
    plan.train_step(_dense_stack, TX, other, x, x)
  swapped = _hand_plan([("dense_1",), ("dense_0",)])
  with pytest.raises(cluster.PlacementError, match="may only read what earlier stages"):
    swapped.train_step(_dense_stack, TX, params, x, x)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
@pytest.mark.parametrize("config", [
    dict(pipeline=2, data=2, microbatch=2, zero=0),
    dict(pipeline=2, data=2, microbatch=2, zero=1),
    dict(pipeline=2, data=2, microbatch=2, zero=2),
    dict(pipeline=2, data=2, microbatch=2, zero=3),
    dict(pipeline=2, data=2, microbatch=2, schedule="interleaved", virtual_stages=2),
    dict(tensor=2, pipeline=2, data=2, microbatch=2, recompute="full"),
], ids=["zero0", "zero1", "zero2", "zero3", "interleaved", "t2-full"])
def test_each_stage_moves_the_bytes_its_plan_priced(config):
  loss, params, batch = gpt_loss()
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(**config),
                               global_batch=BATCH, hardware="cpu", budget=BUDGET)
  step = plan.train_step(loss, TX, params, *batch)
  state = step.init(params)
  checks, _ = step.check(state, *batch)
  assert len(checks) == 2
  for check in checks:
    ratios = check.ratios()
    # The data-parallel sync and ZeRO's collectives as compiled, and the
    # activations and cotangents each stage receives, as the plan counts them
    # (the last stage's copy of the tied embedding is refreshed from the
    # first stage after the update, not gathered: 5.0% of its bytes there).
    assert abs(ratios["data"] - 1) <= 0.06, check
    assert abs(ratios["received"] - 1) <= 0.05, check
    assert check.received[0] > 0 and check.data[0] > 0
    # The tensor group's collectives under the width's searched plan (its
    # layouts of parameters and of the batch).
    assert abs(ratios["tensor"] - 1) <= 0.05, check
    assert (check.tensor[0] > 0) == (config.get("tensor", 1) > 1)
    # Memory: what the schedule holds between programs, as the plan counts
    # it; with the programs' largest temporary (XLA:CPU's backward working
    # set, beyond the plan's count) it is over.
    assert 0.85 <= ratios["held"] <= 1.15, check
    assert 0.9 <= ratios["memory"] <= 1.5, check


def test_a_stage_holds_layers_apart_in_the_program_when_values_flow_forward():
  params = [(jnp.full((8, 8), 0.1 * (i + 1)), jnp.zeros(8)) for i in range(4)]
  x = jnp.linspace(-1, 1, BATCH * 8).reshape(BATCH, 8)

  def loss(params, x, y):  # "side" reads only the input: stage 0 runs it, after "second"
    def dense(i, h, extra=0.0):
      with jax.named_scope(f"dense_{i}"):
        return jnp.tanh((h + extra) @ params[i][0] + params[i][1][None])

    with jax.named_scope("side"):
      side = x * 2.0
    first = dense(0, x)
    second = dense(1, first)
    with jax.named_scope("late"):
      late = side @ params[2][0]
    with jax.named_scope("dense_3"):
      out = dense(3, second, late)
      return jnp.mean((out - y) ** 2)

  plan = _hand_plan([("side", "dense_0", "late"), ("dense_1", "dense_3")])
  step = plan.train_step(loss, TX, params, x, x)
  assert [c.layers for c in step.cut.chunks] == [("side", "dense_0", "late"),
                                                  ("dense_1", "dense_3")]
  state, value = step(step.init(params), x, x)
  want, _ = jitted_training(loss, TX, params, (x, x), 1)
  np.testing.assert_allclose(float(value), want[0], rtol=1e-6)


@pytest.mark.slow
def test_two_processes_of_four_devices_run_the_plan_as_one():
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  worker = str(pathlib.Path(__file__).with_name("multiprocess_step.py"))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  runs = [subprocess.Popen([sys.executable, worker, str(i), str(port)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
          for i in range(2)]
  for run in runs:
    out, err = run.communicate(timeout=600)
    assert run.returncode == 0, err[-3000:]
    (line,) = [x for x in out.splitlines() if x.startswith("ok ")]
    _, loss_error, param_error = line.split()
    assert float(loss_error) < 1e-5 and float(param_error) < 1e-4, line


def test_parameters_the_loss_never_reads_are_kept_and_stepped():
  params = {"layers": [(jnp.full((8, 8), 0.1), jnp.zeros(8)) for _ in range(2)],
            "unused": jnp.ones((3,))}
  x = jnp.linspace(-1, 1, BATCH * 8).reshape(BATCH, 8)
  loss = lambda p, x, y: _dense_stack(p["layers"], x, y)  # noqa: E731
  plan = _hand_plan([("dense_0",), ("dense_1",)])
  tx = optax.adamw(1e-2, weight_decay=0.5)  # moves a parameter whose gradient is zero
  step = plan.train_step(loss, tx, params, x, x)
  state, _ = step(step.init(params), x, x)
  got = step.params(state)

  @jax.jit
  def reference_step(p):
    grads = jax.grad(loss)(p, x, x)
    updates, _ = tx.update(grads, tx.init(p), p)
    return optax.apply_updates(p, updates)

  want = reference_step(params)
  np.testing.assert_allclose(np.asarray(got["unused"]), np.asarray(want["unused"]), rtol=1e-6)
  assert float(got["unused"][0]) < 1.0
