"""Pricing what ran, as a user states it: the repeated block found by the
ops it computes, and a split refused before any search."""

import jax
import jax.numpy as jnp
import optax
import pytest

import automap
from automap import cluster
from automap._src.cluster import layers as layers_lib
from automap._src.cluster import placement
from automap._src.ir import graph as graph_lib
from automap._src.ir import trace as trace_lib
from automap._src.models.gpt import GPT, GPTConfig
from automap.cluster import Layer, LayerCost, LayerGraph


def gpt_step(layers: int = 4):
  config = GPTConfig(vocab=256, seq=32, hidden=64, heads=4, layers=layers, dtype=jnp.bfloat16)
  model = GPT(config)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             jnp.zeros((1, 32), jnp.int32)))["params"]

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

  tokens = jax.ShapeDtypeStruct((4, 32), jnp.int32)
  return loss, params, (tokens, tokens)


def traced_outline(layers: int = 4) -> LayerGraph:
  loss, params, batch = gpt_step(layers)
  traced = trace_lib.trace(jax.value_and_grad(loss), (params, *batch))
  return layers_lib.outline(graph_lib.build(traced), len(jax.tree.leaves(params)), [1])


def test_the_blocks_of_a_stack_share_one_structure_wherever_they_sit():
  """The first block reads the embedding and the last feeds the final norm;
  refined only over the edges inside each layer, all four still match, and
  the embedding and the norm are kinds of their own."""
  graph = traced_outline(4)
  kinds = {layer.name: layer.structure for layer in graph.layers}
  blocks = [kinds[f"block_{i}"] for i in range(4)]
  assert len(set(blocks)) == 1
  others = {kinds[n] for n in kinds if not n.startswith("block_")}
  assert blocks[0] not in others
  assert len({kinds["embed"], kinds["ln_f"]}) == 2


def test_blocks_priced_apart_are_still_one_block():
  """Copies of one block whose costs differ (the last a little dearer, a
  plan that laid one out apart) are cut into chunks by their structure; a
  graph built by hand, with no structure, falls back on equal costs."""
  cost = dict(forward=1.0, backward=2.0, params=1e9, activations=1e8)
  dearer = dict(cost, forward=1.006, params=1.01e9)
  layers = [Layer("embed", {1: LayerCost(**dict(cost, params=3e9))}, "e")]
  layers += [Layer(f"layer{i}", {1: LayerCost(**(dearer if i == 5 else cost))}, "b")
             for i in range(6)]
  graph = LayerGraph.chain(layers)
  masks = placement.chunks(graph, 6)
  assert masks is not None and [bin(m).count("1") for m in masks] == [2, 1, 1, 1, 1, 1]
  unknown = LayerGraph.chain([Layer(x.name, x.widths) for x in layers])
  assert placement.chunks(unknown, 6) is None  # five equal blocks of unlike names


def test_a_split_the_blocks_cannot_carry_is_refused_before_any_search(monkeypatch):
  def no_search(program, request):
    raise AssertionError("searched before the split was checked")

  monkeypatch.setattr(layers_lib.driver, "run", no_search)
  monkeypatch.setattr(layers_lib, "_SEARCHED", type(layers_lib._SEARCHED)())
  loss, params, batch = gpt_step(4)
  config = cluster.ClusterConfig(pipeline=4, virtual_stages=2, schedule="interleaved", tensor=2)
  with pytest.raises(cluster.PlacementError, match="fewer blocks than pipeline=4 x virtual"):
    cluster.price_cluster(loss, params, *batch, config=config, global_batch=32, hardware="cpu")


def test_a_split_into_as_many_chunks_as_blocks_prices():
  loss, params, batch = gpt_step(4)
  config = cluster.ClusterConfig(pipeline=2, virtual_stages=2, schedule="interleaved")
  plan = cluster.price_cluster(loss, params, *batch, config=config, global_batch=8,
                               hardware="cpu", budget=automap.Budget(episodes=2, progress=False))
  assert len(plan.placement.stages) == 2


BUDGET = automap.Budget(episodes=2, seconds=10, progress=False)


def test_weights_held_in_float32_are_traced_so_and_keep_no_master_copy():
  """MaxText holds float32 weights and computes in bfloat16 (flax's `dtype`
  over `param_dtype`): the stated dtype recasts the parameters before
  tracing, and the matmuls stay bfloat16."""
  loss, params, batch = gpt_step(2)
  mixed = cluster.price_cluster(loss, params, *batch,
                                config=cluster.ClusterConfig(weights="bfloat16"),
                                global_batch=4, hardware="a100", budget=BUDGET,
                                mixed_precision=True)
  held = cluster.price_cluster(loss, params, *batch,
                               config=cluster.ClusterConfig(weights="float32"),
                               global_batch=4, hardware="a100", budget=BUDGET)
  a, b = mixed.placement.stages[0], held.placement.stages[0]
  assert b.param_bytes == 2 * a.param_bytes
  assert b.flops == pytest.approx(a.flops, rel=0.02)
  assert b.compute < 1.5 * a.compute  # bfloat16 matmuls both
  # Weights, gradients and moments: 16 bytes per parameter against 18, but
  # the float32 run also stashes the bfloat16 copies its matmuls read.
  assert b.memory > a.memory
  with pytest.raises(cluster.PlacementError, match="weights='float32' keeps no float32 master"):
    cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(weights="float32"),
                          global_batch=4, hardware="a100", budget=BUDGET, mixed_precision=True)


def four_blocks() -> LayerGraph:
  """Four blocks of 1e9 parameter bytes and 1e8 stashed bytes each."""
  return LayerGraph.chain([Layer(f"b{i}", {1: LayerCost(1.0, 2.0, 1e9, 1e8)}) for i in range(4)])


def test_a_graphs_parameter_bytes_are_held_in_the_stated_dtype():
  """Float32 weights: the weights, float32 gradients and two moments, 4
  bytes each per element (4 per weight byte); bfloat16 ones under mixed
  precision: 1 + 2 (float32 gradients) + 6 (float32 master and moments)."""
  graph, kw = four_blocks(), dict(global_batch=1, hardware="a100", optimizer="adam")
  f32 = cluster.price_placement(graph, cluster.ClusterConfig(weights="float32"), **kw)
  bf16 = cluster.price_placement(graph, cluster.ClusterConfig(weights="bfloat16"),
                                 mixed_precision=True, **kw)
  assert f32.stages[0].memory == pytest.approx(4e9 * 4 + 4e8)
  assert bf16.stages[0].memory == pytest.approx(4e9 * 9 + 4e8)


def test_gradients_reduced_in_bfloat16_halve_their_bytes():
  graph = four_blocks()
  kw = dict(global_batch=4, hardware="a100", mixed_precision=True, optimizer="adam")
  f32 = cluster.price_placement(graph, cluster.ClusterConfig(data=4), **kw)
  bf16 = cluster.price_placement(graph, cluster.ClusterConfig(data=4, gradients="bfloat16"), **kw)
  # 16-bit weights: float32 gradients are 2 bytes per weight byte, bfloat16 ones 1.
  assert f32.stages[0].memory - bf16.stages[0].memory == pytest.approx(4e9)
  assert bf16.stages[0].sync_total == pytest.approx(f32.stages[0].sync_total / 2, rel=0.01)
  stated = cluster.price_placement(graph, cluster.ClusterConfig(data=4, gradients="float32"), **kw)
  assert stated.stages[0].memory == f32.stages[0].memory


@pytest.mark.parametrize("fields, match", [
    (dict(weights="int8"), "ClusterConfig.weights must be a floating dtype"),
    (dict(gradients="fp8-ish"), "ClusterConfig.gradients must be a floating dtype"),
])
def test_dtypes_are_checked_by_name(fields, match):
  with pytest.raises(cluster.PlacementError, match=match):
    cluster.ClusterConfig(**fields)
  assert cluster.ClusterConfig(weights=jnp.bfloat16).weights == "bfloat16"
