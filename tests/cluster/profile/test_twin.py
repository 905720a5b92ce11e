"""A deep scanned stack is profiled through a shallow twin (its first layers
and its last), and the twin's profile, written out to every layer, is the
profile of the whole stack."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import automap
from automap import cluster, zoo
from automap._src.cluster import cluster_plan
from automap._src.cluster.profile import layers as layers_lib
from automap._src.cluster.profile import twin as twin_lib
from automap._src.plan import planner

BUDGET = automap.Budget(episodes=20, seconds=30, progress=False)  # the llama's search
LAYERS = 9
WIDTH, BATCH = 32, 8


def stack_loss(*, reads_whole: bool = False, stacks_outputs: bool = False,
               two_stacks: bool = False):
  """A pure-JAX stack over stacked `blocks`: a gate shared by every block,
  a bias computed before the stack and read by every block, and what
  makes a twin impossible where asked: the stacked weights read whole
  outside the scan (weight decay), each block's output stacked, or a
  second stack of as many blocks under the same name."""

  def loss(params, x, y):
    with jax.named_scope("embed"):
      h = jnp.tanh(x @ params["embed"])
    with jax.named_scope("bias"):
      b = jnp.tanh(h.mean(0) @ params["bias"])

    def body(h, w):
      with jax.named_scope("block"):
        h = h + jnp.tanh(h @ w["kernel"] + b[None]) * params["gate"][None]
        return h, (jnp.mean(h) if stacks_outputs else None)

    h, means = jax.lax.scan(body, h, params["blocks"])
    if two_stacks:
      h, _ = jax.lax.scan(body, h, params["more"])
    with jax.named_scope("head"):
      out = jnp.mean((h @ params["head"] - y) ** 2)
    if stacks_outputs:
      out = out + jnp.mean(means)
    if reads_whole:
      out = out + 1e-4 * jnp.sum(params["blocks"]["kernel"] ** 2)
    return out

  k = jax.random.split(jax.random.key(0), 5)
  params = {"embed": jax.random.normal(k[0], (WIDTH, WIDTH)) / 8,
            "bias": jax.random.normal(k[1], (WIDTH, WIDTH)) / 8,
            "gate": jnp.ones((WIDTH,)),
            "blocks": {"kernel": jax.random.normal(k[2], (LAYERS, WIDTH, WIDTH)) / 8},
            "head": jax.random.normal(k[3], (WIDTH, WIDTH)) / 8}
  if two_stacks:
    params["more"] = {"kernel": jax.random.normal(k[4], (LAYERS, WIDTH, WIDTH)) / 8}
  x = jax.random.normal(k[4], (BATCH, WIDTH))
  return loss, params, (x, x)


def profiles(loss, params, batch, width: int):
  """The step's profile through its twin and in full, at `width`: laid
  out by a rule (Megatron-LM's layout) where the width splits it, so that
  what differs is the writing out, not a search's luck on two programs."""
  split_loss, split, twin = cluster_plan.layers_of(loss, params, batch)
  assert twin is not None and twin.kept == (0, 1, 2, 3, LAYERS - 2, LAYERS - 1)
  measured = {}
  for name, used in (("twin", twin), ("full", None)):
    measured[name] = layers_lib.measure(split_loss, split, batch, widths=[width],
                                        hardware=automap.HARDWARE["tpu-v4"],
                                        search=planner.megatron, twin=used)
  return measured["twin"], measured["full"]


def layer_names(profile, width):
  return layers_lib.LayerCut.of(profile.programs[(BATCH, width)][0].graph).names


def assert_same_graph(a, b):
  assert [layer.name for layer in a.layers] == [layer.name for layer in b.layers]
  for x, y in zip(a.layers, b.layers):
    assert x.structure == y.structure
    for t in y.widths:
      costs = [(f, getattr(x.widths[t], f.name), getattr(y.widths[t], f.name))
               for f in dataclasses.fields(y.widths[t])]
      for f, got, want in costs:
        assert got == (want if want is None else pytest.approx(want, rel=1e-9)), (x.name, f.name)
  assert a.edges == b.edges
  assert a.shared == b.shared


@pytest.mark.parametrize("width", [1, 2])
def test_the_twins_profile_written_out_is_the_whole_stacks(width):
  loss, params, batch = stack_loss()
  twin, full = profiles(loss, params, batch, width)
  # The twin traced six blocks of nine; the profile has all nine.
  kept = (0, 1, 2, 3, LAYERS - 2, LAYERS - 1)
  assert layer_names(twin, width) == ["embed", "bias", *(f"block_{j}" for j in kept), "head"]
  assert len(layer_names(full, width)) == LAYERS + 3
  a, b = twin.graphs[BATCH][width], full.graphs[BATCH][width]
  assert_same_graph(a, b)
  # The bias reaches every block, and the gate is held by every block.
  assert {d for s, d, _ in a.edges if s == "bias"} == {f"block_{j}" for j in range(LAYERS)}
  assert len(a.shared[0].layers) == LAYERS
  assert twin.specs == full.specs
  assert f"0/blocks/kernel/{LAYERS - 2}" in twin.specs[width]
  # The share of the weights left whole is the whole step's, not the twin's.
  assert twin.params_count == 4 + 6 and full.params_count == 4 + LAYERS
  assert twin.replicated_share(BATCH, width) == pytest.approx(
      full.replicated_share(BATCH, width), rel=1e-12)


@pytest.mark.parametrize("why", ["reads_whole", "stacks_outputs", "two_stacks"])
def test_a_loss_needing_its_stack_whole_is_profiled_in_full(why):
  loss, params, batch = stack_loss(**{why: True})
  twin, full = profiles(loss, params, batch, 1)
  blocks = 2 * LAYERS if why == "two_stacks" else LAYERS
  assert len(layer_names(twin, 1)) == len(layer_names(full, 1)) == blocks + 3
  assert_same_graph(twin.graphs[BATCH][1], full.graphs[BATCH][1])


def test_a_short_stack_or_none_has_no_twin():
  loss, params, batch = stack_loss()
  short = jax.tree.map(lambda x: x[:twin_lib.FRONT + twin_lib.BACK] if x.ndim == 3 else x,
                       params)
  assert cluster_plan.layers_of(loss, short, batch)[2] is None
  assert cluster_plan.layers_of(lambda p, x, y: loss(params, x, y), {}, batch)[2] is None


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_a_deep_llama_is_priced_as_in_full_and_its_plan_runs(monkeypatch):
  """A scanned llama of 8 layers on 2 stages x tensor 2 x data 2, priced
  through its twin and in full: the same time, memory, stages and
  shardings; the plan's step runs and matches jax.grad's loss."""
  loss, params, batch = zoo.llama_loss(zoo.LlamaConfig(
      vocab=128, embed=64, mlp=128, heads=4, kv_heads=2, head_dim=16, layers=8, seq=16,
      batch=8))
  config = cluster.ClusterConfig(pipeline=2, tensor=2, data=2, microbatch=2,
                                 recompute="selective")
  plans = {}
  for name in ("twin", "full"):
    if name == "full":
      monkeypatch.setattr(cluster_plan.Twin, "of", classmethod(lambda cls, *a: None))
    plans[name] = cluster.price_cluster(loss, params, *batch, config=config, global_batch=8,
                                        hardware="tpu-v4", budget=BUDGET)
  twin, full = plans["twin"], plans["full"]
  assert twin.time == pytest.approx(full.time, rel=1e-9)
  assert twin.memory == pytest.approx(full.memory, rel=1e-9)
  assert [s.layers for s in twin.placement.stages] == [s.layers for s in full.placement.stages]
  assert twin.shardings == full.shardings
  step = twin.train_step(loss, optax.sgd(0.0), params, *batch)
  _, value = step(step.init(params), *batch)
  np.testing.assert_allclose(value, loss(params, *batch), rtol=1e-5)


def test_a_twin_whose_deep_layers_differ_is_not_written_out():
  """Layers 2 and 3 of the twin both stand as deep in the stack as any
  layer it does not keep; where their costs differ, the stack has roles
  the twin does not see, and `Twin.graph` declines (profiled in full)."""
  loss, params, batch = stack_loss()
  twin = cluster_plan.layers_of(loss, params, batch)[2]

  def graph(deep_backward: float):
    names = ["embed", *(f"block_{j}" for j in twin.kept), "head"]
    return cluster.LayerGraph.chain([cluster.Layer.of(
        n, 1.0, deep_backward if n == "block_3" else 2.0, 8.0, 4.0) for n in names], 16.0)

  written = twin.graph(graph(2.0))
  assert [layer.name for layer in written.layers] == [
      "embed", *(f"block_{j}" for j in range(LAYERS)), "head"]
  assert len(written.edges) == LAYERS + 1
  assert twin.graph(graph(2.5)) is None
