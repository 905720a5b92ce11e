"""Models whose layers are one scan over stacked parameters, planned and run
as their layers: each stage runs its own layers' slices of the stack, and
the parameters come back stacked. Numerics against the unpartitioned jitted
step after three optimizer steps; each stage's compiled collectives and held
bytes against the plan's price."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trains_as_jitted, jitted_state, stated_run

import automap
from automap import cluster
from automap._src.models import llama, zoo

LLAMA = llama.LlamaConfig(vocab=64, embed=32, mlp=64, heads=4, kv_heads=2, head_dim=8,
                          layers=4, seq=16, batch=16)
BATCH = 16
BUDGET = automap.Budget(episodes=8)
TX = optax.adam(1e-2, eps=1e-3)  # eps above rounding noise, as test_executor.py
MEGATRON = dict(pipeline=2, tensor=2, data=2, microbatch=4)


def run_and_check(loss, params, batch, **config):
  plan, step, state = stated_run(loss, params, batch, TX, global_batch=BATCH, budget=BUDGET,
                                 **config)
  # The user's stacked pytree comes back, each leaf from its layers' stages.
  got = step.params(state)
  assert jax.tree.structure(got) == jax.tree.structure(params)
  assert jax.tree.map(lambda a: a.shape, got) == jax.tree.map(lambda a: a.shape, params)
  # So does the optimizer state, as optax would hold it unpartitioned.
  opt = step.opt_state(state)
  _, _, want = jitted_state(loss, TX, params, batch, 3)
  assert jax.tree.structure(opt) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(opt), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
  del got, opt  # the check counts the stages' live bytes
  checks, _ = step.check(state, *batch)
  for check in checks:
    ratios = check.ratios()
    for kind in ("tensor", "data", "received"):
      assert abs(ratios[kind] - 1) <= 0.05, check
    assert 0.85 <= ratios["held"] <= 1.15, check
  return plan, step


def stage_layers(plan) -> list[tuple[str, ...]]:
  return [tuple(s.layers) for s in plan.placement.stages]


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.heavy
def test_scanned_llama_runs_as_its_layers_at_pipeline2_tensor2_data2():
  loss, params, batch = zoo.llama_loss(LLAMA)
  plan, step = run_and_check(loss, params, batch, **MEGATRON)
  assert stage_layers(plan) == [("token_embedder", "layers_0", "layers_1"),
                                ("layers_2", "layers_3", "decoder_norm", "logits_dense")]
  # Each stage holds its own layers' slices of each stacked weight, no more,
  # each weight's slice as one stacked leaf that its scan reads whole.
  layout = step.layout
  paths = [jax.tree_util.keystr(k) for k, _ in
           jax.tree_util.tree_flatten_with_path(step.stacks.split(params))[0]]
  held = [{paths[i][-3:] for slot in step.stage_params[s]
           for i in layout.members.get(slot, (slot,)) if paths[i].startswith("['layers']")}
          for s in (0, 1)]
  assert held == [{"[0]", "[1]"}, {"[2]", "[3]"}]
  for s in (0, 1):
    layers = [i for i in step.stage_params[s] if paths[i].startswith("['layers']")]
    assert layers and all(len(layout.members[i]) == 2 for i in layers)
    assert all(layout.slot_avals[i].shape[0] == 2 for i in layers)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_a_stages_programs_take_as_many_arguments_at_any_depth():
  """A stage's scanned layers reach its programs as one stacked argument
  per weight: four times the layers, the same programs' arguments (what
  keeps a stage's compile from growing with its depth)."""
  def arguments(layers):
    loss, params, batch = zoo.llama_loss(dataclasses.replace(LLAMA, layers=layers))
    plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(
        pipeline=2, data=4, microbatch=2), global_batch=BATCH, hardware="cpu", budget=BUDGET)
    step = plan.train_step(loss, TX, params, *batch)
    assert [s.recompute_mode for s in plan.placement.stages] == ["none", "none"]
    return [len(slots) for slots in step.chunk_programs.slots], [
        len(held) for held in step.stage_params]

  assert arguments(4) == arguments(16)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
@pytest.mark.parametrize("tied, config", [
    (True, dict(MEGATRON, recompute="full")),  # each scanned layer rebuilt on its own
    (False, dict(MEGATRON, recompute="full", recompute_every=2)),  # every 2nd layer
    (False, dict(MEGATRON, schedule="interleaved", virtual_stages=2, microbatch=2)),
    (True, dict(MEGATRON, schedule="interleaved", virtual_stages=2, microbatch=2)),
], ids=["tied-full-recompute", "full-every-2nd", "interleaved", "tied-interleaved"])
def test_scanned_llama_tied_and_interleaved_match_the_jitted_step(tied, config):
  loss, params, batch = zoo.llama_loss(dataclasses.replace(LLAMA, tied=tied))
  plan, _ = run_and_check(loss, params, batch, **config)
  stages = stage_layers(plan)
  if config.get("virtual_stages") == 2:  # chunks of one layer each, in turn
    assert {"layers_0", "layers_2"} <= set(stages[0]) and {"layers_1", "layers_3"} <= set(
        stages[1])
  if tied:  # the head reads the embedding's table on the last stage
    assert "token_embedder.attend" in stages[-1] or "token_embedder#2" in stages[-1]


def nnx_scanned(width: int = 16, layers: int = 4, vocab: int = 32, seq: int = 8):
  """A decoder written as flax nnx writes a stack: blocks made by
  `nnx.vmap`, run by `nnx.scan`; its loss over `nnx.split`'s state."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.LayerNorm(width, rngs=rngs)
      self.up = nnx.Linear(width, 2 * width, rngs=rngs)
      self.down = nnx.Linear(2 * width, width, rngs=rngs)

    def __call__(self, x):
      return x + self.down(nnx.gelu(self.up(self.norm(x))))

  class Decoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, width, rngs=rngs)

      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def blocks(rngs):
        return Block(rngs)

      self.blocks = blocks(rngs)
      self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def run(x, block):
        return block(x)

      return self.head(run(self.embed(tokens), self.blocks))

  graphdef, state = nnx.split(Decoder(nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)

  def loss(params, inputs, targets):
    logits = nnx.merge(graphdef, params)(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  tokens = jax.random.randint(jax.random.key(1), (BATCH, seq + 1), 0, vocab)
  return loss, params, (tokens[:, :-1], tokens[:, 1:])


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
def test_an_nnx_scan_decoder_runs_as_its_layers():
  loss, params, batch = nnx_scanned()
  plan, _ = run_and_check(loss, params, batch, **MEGATRON)
  assert [len(s) for s in stage_layers(plan)] == [2, 2]


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
def test_plan_cluster_places_a_scanned_stack_by_its_layers():
  loss, params, batch = zoo.llama_loss(LLAMA)
  plan = cluster.plan_cluster(loss, params, *batch, devices=8, global_batch=BATCH,
                              hardware="cpu", budget=BUDGET, widths=[1, 2])
  named = {n for s in plan.placement.stages for n in s.layers}
  assert {f"layers_{i}" for i in range(LLAMA.layers)} <= named
  step = plan.train_step(loss, TX, params, *batch)
  assert_trains_as_jitted(step, loss, TX, params, batch)


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
def test_selective_recompute_leaves_a_layers_own_remat_in_charge():
  """The llama remats its own layers (`nn.remat`, nothing saved): under a
  stage's selective policy they keep what their own policy keeps, as the
  plan prices them, not everything the outer policy would save."""
  loss, params, batch = zoo.llama_loss(LLAMA)
  run_and_check(loss, params, batch, pipeline=2, data=4, microbatch=2, recompute="selective")
