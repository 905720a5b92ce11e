"""Pricing what ran, as a user states it: the repeated block found by the
ops it computes, and a split refused before any search."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import abstract_gpt_loss, assert_stage_compiles_as_priced

import automap
from automap import cluster
from automap._src.cluster import cluster_plan
from automap._src.cluster.placement import dp as placement
from automap._src.cluster.profile import layers as layers_lib
from automap._src.ir import graph as graph_lib
from automap._src.ir import trace as trace_lib
from automap._src.models.gpt import GPTConfig
from automap._src.plan import planner
from automap.cluster import Layer, LayerCost, LayerGraph


def gpt_step(layers: int = 4, dtype=jnp.bfloat16):
  return abstract_gpt_loss(GPTConfig(vocab=256, seq=32, hidden=64, heads=4, layers=layers,
                                     dtype=dtype))


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

  monkeypatch.setattr(planner, "run", no_search)
  monkeypatch.setattr(planner, "SEARCHED", type(planner.SEARCHED)())
  loss, params, batch = gpt_step(4)
  config = cluster.ClusterConfig(pipeline=4, virtual_stages=2, schedule="interleaved", tensor=2)
  with pytest.raises(cluster.PlacementError, match="fewer blocks than pipeline=4 x virtual"):
    cluster.price_cluster(loss, params, *batch, config=config, global_batch=32, hardware="cpu")


@pytest.mark.heavy
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


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_sequence_parallelism_splits_the_activations_between_the_matmuls():
  """Stated, the per-width search keeps every activation handed between
  layers (and everything of its shape inside them but merged heads) split
  along the sequence, so each stage stashes less; compiled, the step moves
  the collective bytes the cost model prices and computes what the
  unpartitioned step does."""
  from jax.sharding import Mesh

  loss, params, batch = gpt_step(2, jnp.float32)  # XLA:CPU widens bfloat16 gathers
  plans = {}
  for sp in (False, True):
    config = cluster.ClusterConfig(tensor=2, sequence_parallel=sp)
    plans[sp] = cluster.price_cluster(loss, params, *batch, config=config, global_batch=4,
                                      hardware="a100", budget=BUDGET)
  assert plans[True].placement.stages[0].memory < plans[False].placement.stages[0].memory

  profile = layers_lib.measure(loss, params, batch, widths=[2],
                               hardware=automap.HARDWARE["a100"],
                               search=planner.searcher(BUDGET),
                               sequence_parallel=True)
  program, state = profile.programs[(4, 2)]
  pinned = layers_lib.sequence_layouts(program.graph, len(jax.tree.leaves(params)), 2)
  assert len(pinned) > 10 and all(state[v, 0] == 1 for v, _ in pinned)
  mesh = Mesh(jax.devices()[:2], ("model",))
  step = assert_stage_compiles_as_priced(program, state, mesh, (params, *batch))

  real = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape) * 0.02, params)
  tokens = jax.random.randint(jax.random.key(2), (4, 32), 0, 256)
  value, grads = step(real, tokens, tokens)
  ref_value, ref_grads = jax.value_and_grad(loss)(real, tokens, tokens)
  assert float(value) == pytest.approx(float(ref_value), rel=1e-5)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    assert jnp.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_sequence_parallelism_needs_a_tensor_group():
  with pytest.raises(cluster.PlacementError, match="tensor=1 has none"):
    cluster.ClusterConfig(sequence_parallel=True)


def wider_step():
  """A 2-block GPT of width 512: 26 MB of float32 parameters."""
  return abstract_gpt_loss(GPTConfig(vocab=256, seq=128, hidden=512, heads=8, layers=2,
                                     dtype=jnp.bfloat16))


@pytest.mark.slow
def test_a_plan_leaving_the_stated_tensor_group_whole_is_flagged():
  """With memory to spare the search prices a 2-wide group that keeps every
  weight whole (the sequence split instead): that is not the tensor
  parallelism stated, and price_cluster says so. Held to less memory than
  whole weights and gradients need, it splits them, and says nothing."""
  import warnings

  loss, params, batch = wider_step()
  config = cluster.ClusterConfig(tensor=2)
  budget = automap.Budget(episodes=4, progress=False)
  with pytest.warns(cluster.ReplicatedWeightsWarning, match="leaves 100% of the parameters"):
    cluster.price_cluster(loss, params, *batch, config=config, global_batch=4,
                          hardware="a100", budget=budget, memory_limit=None)
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  with warnings.catch_warnings():
    warnings.simplefilter("error", cluster.ReplicatedWeightsWarning)
    held = cluster.price_cluster(loss, params, *batch, config=config, global_batch=4,
                                 hardware="a100", budget=budget, memory_limit=1.3 * weights)
  assert "model" in held.shardings[2]["0/block_0/mlp/wi/kernel"]


@pytest.mark.heavy
def test_stated_sequence_parallelism_prices_megatrons_layout_where_it_is_faster():
  """A transformer whose matmuls outweigh its weights' traffic: under
  sequence-parallel pins the search at the stated width leaves most weights
  whole (the pins' split along the sequence reaches them first), where
  Megatron-LM's layout (column- then row-parallel weights, the pinned
  activations gathered and reduce-scattered at the pins) is faster and
  leaner. price_cluster prices that one, and says nothing."""
  import warnings

  loss, params, batch = abstract_gpt_loss(GPTConfig(vocab=256, seq=1024, hidden=2048, heads=8,
                                                    layers=2, dtype=jnp.bfloat16))
  config = cluster.ClusterConfig(tensor=4, sequence_parallel=True)
  hw = automap.HARDWARE["a100"]
  budget = automap.Budget(episodes=4, progress=False)
  profiles = cluster_plan.stated_profiles(loss, params, batch, config, hw,
                                          planner.searcher(budget, 0, None))
  count = len(jax.tree.leaves(params))
  whole = {name: layers_lib.replicated_share(*p.programs[(1, 4)], count)
           for name, p in profiles.items()}
  assert whole["Megatron"] < 0.01
  program, state = profiles["Megatron"].programs[(1, 4)]
  pinned = layers_lib.sequence_layouts(program.graph, count, 4)
  assert len(pinned) > 10 and all(state[v, 0] == 1 for v, _ in pinned)
  # Each gradient comes back in its parameter's layout: the MLP's first by
  # columns, the second by rows.
  g, traced = program.graph, program.traced
  for name, dim in (("mlp/wi/kernel", 1), ("mlp/wo/kernel", 0)):
    w = g.inputs[list(traced.in_paths).index(f"0/block_0/{name}")]
    grad = g.outputs[list(traced.out_paths).index(f"1/block_0/{name}")]
    assert state[w, 0] == state[grad, 0] == dim
  with warnings.catch_warnings():
    warnings.simplefilter("error", cluster.ReplicatedWeightsWarning)
    plan = cluster.price_cluster(loss, params, *batch, config=config, global_batch=4,
                                 hardware=hw, budget=budget)
  assert plan.fits
  assert "model" in plan.shardings[4]["0/block_0/mlp/wi/kernel"]
  assert "model" in plan.shardings[4]["0/block_1/attn/out/kernel"]
  searched = cluster.price_placement(profiles["searched"].at(1), config, global_batch=4,
                                     hardware=hw)
  assert plan.time <= searched.time


@pytest.mark.heavy
def test_stated_tensor_parallelism_never_prices_over_memory_where_megatron_fits():
  """A small transformer whose search at the stated width, with memory to
  spare, keeps every weight whole: held to a limit only Megatron-LM's
  layout fits, price_cluster prices that one (it fits, and splits the
  weights), whatever the search found."""
  loss, params, batch = wider_step()
  config = cluster.ClusterConfig(tensor=4, sequence_parallel=True)
  budget = automap.Budget(episodes=4, progress=False)
  with pytest.warns(cluster.ReplicatedWeightsWarning):
    free = cluster.price_cluster(loss, params, *batch, config=config, global_batch=4,
                                 hardware="a100", budget=budget, memory_limit=None)
  megatron = cluster_plan.stated_profiles(loss, params, batch, config, automap.HARDWARE["a100"],
                                          planner.searcher(budget, 0, None))["Megatron"]
  lean = cluster.price_placement(megatron.at(1), config, global_batch=4, hardware="a100")
  limit = (lean.stages[0].memory + free.memory) / 2
  assert lean.stages[0].memory < limit < free.memory
  held = cluster.price_cluster(loss, params, *batch, config=config, global_batch=4,
                               hardware="a100", budget=budget, memory_limit=limit)
  assert held.fits
  assert "model" in held.shardings[4]["0/block_0/mlp/wi/kernel"]


@pytest.mark.heavy
@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_the_width_search_has_the_memory_of_a_devices_share(monkeypatch):
  """A device of a 2-stage split holds half the layers, and under ZeRO 3
  over 2 replicas half of their state again: the per-width search of the
  whole traced step is held to the capacity times that share."""
  limits = []
  run = planner.run
  monkeypatch.setattr(planner, "run", lambda program, request: limits.append(
      request.memory_limit) or run(program, request))
  monkeypatch.setattr(planner, "SEARCHED", type(planner.SEARCHED)())
  loss, params, batch = gpt_step(4)
  budget = automap.Budget(episodes=2, progress=False)
  for config, share in ((cluster.ClusterConfig(tensor=2, pipeline=2), 2),
                        (cluster.ClusterConfig(tensor=2, pipeline=2, data=2, zero=3), 4),
                        (cluster.ClusterConfig(tensor=2, pipeline=2, data=2, zero=1), 2)):
    planner.SEARCHED.clear()
    cluster.price_cluster(loss, params, *batch, config=config, global_batch=8,
                          hardware="a100", budget=budget, memory_limit=1e6)
    assert limits[-1] == share * 1e6


def test_recomputing_every_kth_layer_prices_that_share_of_the_stage():
  """Every 2nd of 4 layers rebuilt in full: half the forward again, and
  per microbatch half the layers keep their inputs, half everything."""
  layers = [Layer(f"b{i}", {1: LayerCost(1.0, 2.0, 1e9, 1e8)}) for i in range(4)]
  graph = LayerGraph.chain(layers, 1e7)
  kw = dict(global_batch=1, hardware="a100", optimizer="sgd")
  none, full, half = (cluster.price_placement(graph, cluster.ClusterConfig(**c), **kw).stages[0]
                      for c in (dict(), dict(recompute="full"),
                                dict(recompute="full", recompute_every=2)))
  assert (none.compute, full.compute, half.compute) == pytest.approx((12.0, 16.0, 14.0))
  # Kept: 4e8 without recompute; 3e7 of inputs and one layer rebuilt (1e8) in full.
  assert half.memory - full.memory == pytest.approx(0.5 * (4e8 - 3e7))
  assert none.memory - half.memory == pytest.approx(4e8 - (1e8 + 0.5 * 3e7 + 0.5 * 4e8))
  placement = cluster.price_placement(graph, cluster.ClusterConfig(recompute="full",
                                                                  recompute_every=2), **kw)
  assert placement.recompute_every == 2
  assert type(placement).from_json(placement.to_json()) == placement
  zero3 = cluster.price_placement(graph, cluster.ClusterConfig(recompute="full", zero=3,
                                                              recompute_every=2), **kw)
  plan = cluster.ClusterPlan(zero3, 1, 1, 1, "a100", {})
  with pytest.raises(cluster.PlacementError, match="recompute_every=2 with ZeRO 3"):
    plan.train_step(lambda w, x: jnp.mean(x @ w), optax.sgd(0.1), jnp.zeros((8, 8)),
                    jnp.zeros((1, 8)))
  with pytest.raises(cluster.PlacementError, match="recompute='none' recomputes nothing"):
    cluster.ClusterConfig(recompute_every=2)
  with pytest.raises(cluster.PlacementError, match="recompute_every must be a positive int"):
    cluster.ClusterConfig(recompute="full", recompute_every=0)
