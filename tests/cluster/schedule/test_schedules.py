"""Schedules as practised: overlap, interleaved 1F1B, recompute modes, stated splits."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abstract_gpt_loss, saved_dot_outputs

import automap
from automap import cluster
from automap._src.cluster.placement import stage_times
from automap._src.cluster.profile import layers as layers_lib
from automap._src.ir.naming import is_backward
from automap._src.models.gpt import Block, GPTConfig
from automap._src.plan import planner
from automap.cluster import Layer, LayerCost, LayerGraph

GiB = 2**30


def flat(hbm: float = 1e12, bandwidth: float = 1e9) -> automap.Hardware:
  """One flat interconnect with no latency: transfers and rings are bytes / bandwidth."""
  return automap.Hardware(name="flat", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12,
                          hbm_capacity=hbm, link_bandwidth=bandwidth, link_latency=0.0,
                          network_bandwidth=bandwidth, network_latency=0.0, devices_per_node=64)


def blocks(n: int, edge: float = 0.0, **cost) -> LayerGraph:
  """n equal blocks: forward 1 s, backward 2 s, 1e9 bytes of parameters, 0.5e9 stashed."""
  c = dict(forward=1.0, backward=2.0, params=1e9, activations=0.5e9) | cost
  return LayerGraph.chain([Layer(f"b{i}", {1: LayerCost(**c)}) for i in range(n)], edge)


@pytest.mark.parametrize("comm, compute, pieces, critical", [
    (4.0, 8.0, 4, 1.0),    # hides behind compute but for the first piece
    (8.0, 4.0, 4, 5.0),    # 2 + 3 pieces of (2 - 1) outlasting compute
    (3.0, 9.0, 1, 3.0),    # one piece: nothing to overlap with
    (0.0, 5.0, 3, 0.0),
])
def test_exposed_communication_is_the_two_stream_critical_path(comm, compute, pieces, critical):
  """Hand-built schedule: piece i of communication must precede piece i + 1
  of compute (a gather) on its own stream; exposed = makespan - compute."""
  c, w = comm / pieces, compute / pieces
  comm_end = work_end = 0.0
  for _ in range(pieces):
    comm_end = comm_end + c
    work_end = max(work_end, comm_end) + w
  assert stage_times.exposed(comm, compute, pieces) == pytest.approx(work_end - compute)
  assert stage_times.exposed(comm, compute, pieces) == pytest.approx(critical)


def test_data_parallel_sync_hides_behind_the_last_backward():
  graph = blocks(4)
  hw = flat()
  # 2 replicas: an all-reduce of 4e9 bytes moves 2 * 1/2 * 4e9 / 1e9 = 4 s.
  kept = cluster.place(graph, devices=2, microbatches=2, hardware=hw, optimizer="sgd", zero=0,
                       recompute=False, data_parallel=2, stages=1)
  after = cluster.place(graph, devices=2, microbatches=2, hardware=hw, optimizer="sgd", zero=0,
                        recompute=False, data_parallel=2, stages=1, overlap=False)
  (stage,) = kept.stages
  assert stage.sync_total == pytest.approx(4.0)
  # Beside 8 s of backward in 4 pieces, only the last layer's 1 s is exposed.
  assert stage.sync == pytest.approx(1.0)
  assert after.time - kept.time == pytest.approx(3.0)
  assert kept.communication["sync_total"] == pytest.approx(4.0)


def test_tensor_parallel_collectives_overlap_the_matmuls_when_asked():
  """2 layers, 1.6 s of their 6 s in tensor-parallel collectives: beside the
  other 4.4 s in 8 pieces only the first piece, 0.2 s, stays exposed."""
  graph = blocks(2, collectives=0.8)
  config = cluster.ClusterConfig()
  plain = cluster.price_placement(graph, config, global_batch=1, hardware=flat())
  hidden = cluster.price_placement(graph, config, global_batch=1, hardware=flat(),
                                   overlap_tensor=True)
  assert plain.time == pytest.approx(6.0) and plain.stages[0].collectives == pytest.approx(1.6)
  assert hidden.time == pytest.approx(4.6) and hidden.stages[0].collectives == pytest.approx(0.2)


def test_interleaving_shrinks_the_bubble_by_the_chunks_per_stage():
  """8 blocks on 2 stages, 4 microbatches: 1F1B takes (m + S - 1) T; with v = 2
  chunks per stage (m + (S - 1) / v) T plus two more transfers per stage."""
  graph = blocks(8, edge=1e8)
  hw = flat()
  common = dict(devices=2, microbatches=4, hardware=hw, optimizer="sgd", zero=0,
                recompute=False, stages=2, data_parallel=1)
  plain = cluster.place(graph, virtual_stages=1, **common)
  woven = cluster.place(graph, virtual_stages=2, **common)
  send = 1e8 / 1e9
  assert plain.stages[0].time == pytest.approx(4 * 3 + 2 * send)
  assert plain.time == pytest.approx((4 + 1) * (12 + 2 * send))
  # Stage 0 holds chunks 0 and 2: chunk 2 receives, chunks 0 and 2 send: 3 transfers each way.
  assert woven.virtual_stages == 2
  assert [s.layers for s in woven.stages] == [("b0", "b1", "b4", "b5"), ("b2", "b3", "b6", "b7")]
  assert woven.stages[0].transfers == pytest.approx(2 * 3 * send)
  assert woven.bubble == pytest.approx(0.5 * max(s.time for s in woven.stages))
  assert woven.time == pytest.approx((4 + 0.5) * max(s.time for s in woven.stages))
  assert woven.time < plain.time
  # Memory: Megatron-LM's warm-up, (S - i - 1) * 2 + (v - 1) * S + 1 chunks, 1/v each.
  assert [s.in_flight for s in woven.stages] == [2.5, 1.5]
  assert woven.stages[0].memory == pytest.approx(2 * 4e9 + 2.5 * 4 * 0.5e9)
  interleaved = cluster.get_schedule("interleaved")
  assert interleaved.in_flight(0, 4, 8, 2) == pytest.approx(4 + 3 / 2)  # p + (p - 1) / v


def test_the_search_interleaves_only_where_it_pays_and_is_legal():
  graph = blocks(8, edge=1e6)
  found = cluster.place(graph, devices=4, microbatches=8, hardware=flat(), optimizer="sgd",
                        zero=0, recompute=False, data_parallel=1, virtual_stages=None)
  assert found.virtual_stages > 1
  plain = cluster.place(graph, devices=4, microbatches=8, hardware=flat(), optimizer="sgd",
                        zero=0, recompute=False, data_parallel=1)
  assert found.time < plain.time
  # 3 blocks cannot make 2 chunks on each of 2 stages: the plain plan stands.
  short = cluster.place(blocks(3, edge=1e6), devices=2, microbatches=8, hardware=flat(),
                        optimizer="sgd", zero=0, recompute=False, data_parallel=1, stages=2,
                        virtual_stages=None)
  assert short.virtual_stages == 1


def test_blocks_that_do_not_divide_leave_the_end_chunks_one_short():
  """70 blocks on 12 stages, as BLOOM ran: 5 at each end, 6 between."""
  graph = LayerGraph.chain([Layer.of("embed", 0.1, 0.1, 1e8, 1e7)]
                           + list(blocks(70).layers) + [Layer.of("head", 0.1, 0.1, 1e8, 1e7)])
  plan = cluster.price_placement(graph, cluster.ClusterConfig(pipeline=12), global_batch=12,
                                 hardware=flat())
  counts = [sum(name.startswith("b") for name in s.layers) for s in plan.stages]
  assert counts == [5] + [6] * 10 + [5]
  assert plan.stages[0].layers[0] == "embed" and plan.stages[-1].layers[-1] == "head"


def test_gpipe_takes_1f1b_time_and_holds_every_microbatch():
  """12 blocks on 3 stages, 6 microbatches: GPipe runs every forward before
  the backwards, so each stage stashes all 6 where 1F1B's stage i holds 3 - i."""
  graph = blocks(12, edge=0.1e9, forward=1.0, backward=2.0, params=1e9, activations=0.5e9)
  priced = {}
  for schedule in ("1f1b", "gpipe"):
    config = cluster.ClusterConfig(pipeline=3, microbatch=1, schedule=schedule)
    priced[schedule] = cluster.price_placement(graph, config, global_batch=6, hardware=flat(),
                                               optimizer="sgd")
  one, gpipe = priced["1f1b"], priced["gpipe"]
  assert gpipe.schedule == "gpipe" and one.schedule == "1f1b"
  assert gpipe.time == pytest.approx(one.time)
  assert [s.in_flight for s in one.stages] == [3, 2, 1]
  assert [s.in_flight for s in gpipe.stages] == [6, 6, 6]
  for a, b in zip(one.stages, gpipe.stages):
    assert b.memory - a.memory == pytest.approx((6 - a.in_flight) * 4 * 0.5e9)
  assert type(gpipe).from_json(gpipe.to_json()) == gpipe


def test_recompute_modes_keep_what_practice_keeps():
  """12 blocks on 3 stages: the middle stage holds 4 blocks, 2 microbatches in flight."""
  c = dict(forward=1.0, backward=2.0, params=1e9, activations=0.5e9, selective=0.2e9,
           selective_forward=0.25, dots=0.15e9, dots_forward=0.5)
  graph = blocks(12, edge=0.1e9, **c)
  config = dict(tensor=1, pipeline=3, data=1, microbatch=1)
  memory, time = {}, {}
  for mode in ("none", "full", "selective", "dots"):
    plan = cluster.price_placement(graph, cluster.ClusterConfig(**config, recompute=mode),
                                   global_batch=6, hardware=flat(), optimizer="sgd")
    middle = plan.stages[1]
    assert middle.in_flight == 2 and middle.recompute_mode == mode
    memory[mode], time[mode] = middle.memory - 2 * 4e9, middle.compute
  assert memory["none"] == pytest.approx(2 * 4 * 0.5e9)
  # Full: every block's input per microbatch, one block rebuilt at a time.
  assert memory["full"] == pytest.approx(2 * 4 * 0.1e9 + 0.5e9)
  # Selective: all but the scores per microbatch, one block's scores rebuilt.
  assert memory["selective"] == pytest.approx(2 * 4 * 0.3e9 + 0.2e9)
  # Dots: every block's input and matmul outputs per microbatch, one block's
  # rest rebuilt at a time.
  assert memory["dots"] == pytest.approx(2 * 4 * (0.1e9 + 0.15e9) + 0.35e9)
  assert time == pytest.approx({"none": 12.0, "full": 16.0, "selective": 13.0, "dots": 14.0})


def test_dots_mode_needs_traced_layers():
  """Hand-built layers carry no matmul outputs: the planner leaves "dots"
  out of its choices, and asking for it by name says what is missing."""
  graph = blocks(4)
  plan = cluster.place(graph, devices=2, microbatches=4, hardware=flat(hbm=5e9),
                       optimizer="sgd", zero=0)
  assert {s.recompute_mode for s in plan.stages} <= {"none", "full", "selective"}
  with pytest.raises(cluster.PlacementError, match="LayerCost.dots.*lacks"):
    cluster.price_placement(graph, cluster.ClusterConfig(recompute="dots"), global_batch=2,
                            hardware=flat())


def test_mixed_precision_keeps_float32_master_weights_gradients_and_moments():
  graph = blocks(1, params=2e9)  # 1e9 bf16 parameters
  plan = cluster.price_placement(graph, cluster.ClusterConfig(), global_batch=1,
                                 hardware=flat(), optimizer="adam", mixed_precision=True)
  # 2 (bf16) + 4 (fp32 gradients) + 4 (master) + 8 (moments) bytes per parameter: 18.
  assert plan.stages[0].memory - 0.5e9 == pytest.approx(18e9)
  sharded = cluster.price_placement(graph, cluster.ClusterConfig(data=4, zero=1), global_batch=4,
                                    hardware=flat(), optimizer="adam", mixed_precision=True)
  assert sharded.stages[0].memory - 0.5e9 == pytest.approx(6e9 + 12e9 / 4)


def test_zero_3_gathers_one_parameter_array_at_a_time():
  """Stage 3 shards the bf16 parameters too, and gathers one array whole at
  a time (DeepSpeed gathers a submodule's before it runs, XLA's FSDP each
  weight for its matmul): the largest array, not the whole layer. A layer
  traced from a real block knows its largest array; one built by hand
  without it is taken whole."""
  def stage3(graph):
    plan = cluster.price_placement(graph, cluster.ClusterConfig(data=4, zero=3), global_batch=4,
                                   hardware=flat(), optimizer="adam", mixed_precision=True)
    return plan.stages[0].memory - 0.5e9

  state = 18e9 / 4  # 1e9 parameters: every byte of their 18 sharded four ways
  assert stage3(blocks(1, params=2e9, largest_param=0.5e9)) == pytest.approx(
      state + 0.5e9 * 3 / 4)
  assert stage3(blocks(1, params=2e9)) == pytest.approx(state + 2e9 * 3 / 4)
  with pytest.raises(cluster.PlacementError, match="largest_param .* must not exceed params"):
    LayerCost(forward=1.0, backward=2.0, params=1e9, activations=0.0, largest_param=2e9)
  loss, params, batch = gpt_step()
  profile = layers_lib.measure(loss, params, batch, widths=[1], hardware=automap.HARDWARE["a100"],
                               search=planner.searcher(None))
  cost = {layer.name: layer.widths[1] for layer in profile.at(4).layers}["block_0"]
  assert cost.largest_param == 64 * 256 * 4  # the MLP's [64, 256] float32 kernels
  assert cost.largest_param < cost.params


@pytest.mark.parametrize("fields, match", [
    ({"tensor": 0}, r"ClusterConfig.tensor must be a positive int"),
    ({"recompute": "attention"}, r"ClusterConfig.recompute must be one of"),
    ({"schedule": "zero-bubble"}, r"ClusterConfig.schedule must be one of"),
    ({"virtual_stages": 2}, r"needs schedule='interleaved'"),
    ({"schedule": "gpipe", "pipeline": 2, "virtual_stages": 2}, r"'gpipe' runs one chunk"),
    ({"schedule": "interleaved", "pipeline": 2}, r"needs virtual_stages >= 2"),
    ({"zero": 4}, r"ClusterConfig.zero must be a ZeRO stage"),
])
def test_bad_configurations_name_the_field(fields, match):
  with pytest.raises(cluster.PlacementError, match=match):
    cluster.ClusterConfig(**fields)


def test_configurations_that_do_not_fit_the_batch_or_cluster_say_how():
  graph = blocks(4)
  with pytest.raises(cluster.PlacementError, match=r"microbatch=3 x data=2 = 6 .* does not "
                     r"divide global_batch=16"):
    cluster.price_placement(graph, cluster.ClusterConfig(data=2, microbatch=3), global_batch=16,
                            hardware=flat())
  with pytest.raises(cluster.PlacementError, match=r"= 16 devices do not fit devices=8"):
    cluster.price_placement(graph, cluster.ClusterConfig(tensor=1, pipeline=4, data=4),
                            global_batch=16, hardware=flat(), devices=8)
  with pytest.raises(cluster.PlacementError, match=r"fewer blocks than pipeline=5"):
    cluster.price_placement(graph, cluster.ClusterConfig(pipeline=5), global_batch=5,
                            hardware=flat())
  with pytest.raises(cluster.PlacementError, match=r"3 microbatches per replica and "
                     r"pipeline=2 stages, the interleaved schedule needs .* multiple of"):
    cluster.price_placement(graph, cluster.ClusterConfig(
        pipeline=2, schedule="interleaved", virtual_stages=2), global_batch=3, hardware=flat())
  with pytest.raises(cluster.PlacementError, match=r"tensor=2: layers .* not priced"):
    cluster.price_placement(graph, cluster.ClusterConfig(tensor=2), global_batch=1,
                            hardware=flat())
  with pytest.raises(cluster.PlacementError, match=r"PlacementOptions.recompute must be"):
    cluster.PlacementOptions(recompute="some")
  with pytest.raises(TypeError, match=r"got recompute=, which the ClusterConfig states"):
    cluster.price_placement(graph, cluster.ClusterConfig(), global_batch=1, hardware=flat(),
                            recompute="full")


def test_a_stated_split_equals_the_planner_held_to_it():
  """A 1F1B split stated as a config prices what the DP finds when fixed to it."""
  graph = blocks(8, edge=1e7)
  hw = flat(hbm=40e9)
  stated = cluster.price_placement(graph, cluster.ClusterConfig(pipeline=4, data=2, microbatch=1),
                                   global_batch=16, hardware=hw, optimizer="sgd")
  held = cluster.place(graph, devices=8, microbatches=16, hardware=hw, optimizer="sgd", zero=0,
                       recompute=False, data_parallel=2, stages=4)
  assert [len(s.layers) for s in held.stages] == [2, 2, 2, 2]
  assert stated.time == pytest.approx(held.time)
  assert [s.memory for s in stated.stages] == pytest.approx([s.memory for s in held.stages])


def test_placement_with_virtual_stages_round_trips_through_json():
  graph = blocks(8, edge=1e6)
  plan = cluster.price_placement(graph, cluster.ClusterConfig(
      pipeline=2, schedule="interleaved", virtual_stages=2, recompute="selective"),
      global_batch=4, hardware=flat())
  assert cluster.Placement.from_json(plan.to_json()) == plan


def gpt_step(layers: int = 2):
  return abstract_gpt_loss(GPTConfig(vocab=256, seq=64, hidden=64, heads=4, layers=layers,
                                     dtype=jnp.bfloat16))


def test_selective_recompute_drops_exactly_the_attention_scores():
  """On a traced GPT: the dropped values are the [batch, heads, seq, seq]
  ones between q.k and the product with v, and nothing else."""
  from automap._src.ir import graph as graph_lib
  from automap._src.ir import trace as trace_lib
  loss, params, batch = gpt_step()
  g = graph_lib.build(trace_lib.trace(jax.value_and_grad(loss), (params, *batch)))
  forward = np.array([not is_backward(s) for s in g.scopes])
  scores = layers_lib.attention_scores(g, forward, len(jax.tree.leaves(params)))
  dropped = set(np.flatnonzero(scores))
  # Scores [batch 4, heads 4, q 64, k 64], their masked softmax and its row
  # statistics [4, 4, 64(, 1)]; never q, k, v or the attention output [4, 64, 4, 16].
  assert all(tuple(g.shapes[v])[:3] == (4, 4, 64) for v in dropped)
  square = {v for v in range(g.num_values) if tuple(g.shapes[v]) == (4, 4, 64, 64)
            and g.producer[v] >= 0 and forward[g.producer[v]]
            and g.prims[g.producer[v]] != "broadcast_in_dim"}  # the causal mask
  assert square and square <= dropped


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
def test_price_cluster_prices_a_traced_step_as_stated():
  loss, params, batch = gpt_step(layers=4)
  config = cluster.ClusterConfig(tensor=2, pipeline=2, data=2, microbatch=2, recompute="selective")
  budget = automap.Budget(episodes=2, seconds=10, progress=False)
  given = cluster.price_cluster(loss, params, *batch, config=config, global_batch=32,
                                hardware="a100", budget=budget, mixed_precision=True)
  p = given.placement
  assert (p.data_parallel, len(p.stages), p.microbatches) == (2, 2, 8)
  assert {s.width for s in p.stages} == {2} and p.devices == 8
  assert all(s.recompute_mode == "selective" for s in p.stages)
  assert given.fits and 0 < given.mfu < 1
  assert given.achieved_flops == pytest.approx(given.mfu * automap.HARDWARE["a100"].flops)
  text = given.explain()
  assert "MFU" in text and "exposed of" in text and "selective" in text
  planned = cluster.plan_cluster(loss, params, *batch, devices=8, global_batch=32,
                                 hardware="a100", budget=budget, mixed_precision=True,
                                 microbatches=(2,), widths=(2,))
  assert planned.time <= p.time * (1 + 1e-9)
  assert "this plan is" in planned.explain(against=given)
  with pytest.raises(cluster.PlacementError, match="does not divide global_batch=30"):
    cluster.price_cluster(loss, params, *batch, config=config, global_batch=30, hardware="a100")


@pytest.mark.heavy
def test_dots_policy_keeps_what_jax_saves():
  """Per block, the bytes the "dots" mode keeps besides the block's input are
  the dot_general outputs JAX itself saves as residuals of a block under
  `jax.checkpoint(policy=dots_with_no_batch_dims_saveable)`: q, k, v, the
  attention output projection and the MLP's first layer, not its last."""
  config = GPTConfig(vocab=256, seq=64, hidden=64, heads=4, layers=2, dtype=jnp.bfloat16)
  block = Block(config)
  x = jnp.zeros((4, 64, 64), jnp.bfloat16)
  p = block.init(jax.random.key(0), x)
  saved = saved_dot_outputs(lambda p, x: block.apply(p, x).astype(jnp.float32).sum(), p, x)
  assert len(saved) == 5
  jax_bytes = sum(saved)
  loss, params, batch = gpt_step()
  profile = layers_lib.measure(loss, params, batch, widths=[1], hardware=automap.HARDWARE["a100"],
                               search=planner.searcher(None))
  costs = {layer.name: layer.widths[1] for layer in profile.at(4).layers}
  for name in ("block_0", "block_1"):
    assert costs[name].dots == jax_bytes
    # Everything but the five projections is rerun: less than the forward.
    assert 0 < costs[name].dots_forward < costs[name].forward


def test_fused_attention_stashes_no_scores_and_prices_their_flops():
  """Flash attention as one kernel: the scores and their mask leave the
  stash, the kernel runs at its FLOPs' rate, and the backward rebuilds the
  scores."""
  loss, params, batch = gpt_step()
  hw = automap.HARDWARE["a100"]
  search = planner.searcher(None)
  plain = layers_lib.measure(loss, params, batch, widths=[1], hardware=hw, search=search)
  fused = layers_lib.measure(loss, params, batch, widths=[1], hardware=hw, search=search,
                             fused_attention=True)
  blocks_seen = 0
  for a, b in zip(plain.at(4).layers, fused.at(4).layers):
    ca, cb = a.widths[1], b.widths[1]
    assert cb.flops == pytest.approx(ca.flops)
    assert cb.selective == 0 and cb.selective_forward == 0
    # The scores leave the stash, and the causal mask broadcast to their
    # shape (bool, [4, 4, 64, 64]) with them.
    mask = 4 * 4 * 64 * 64 if ca.selective else 0
    assert cb.activations == pytest.approx(ca.activations - ca.selective - mask)
    if ca.selective:
      blocks_seen += 1
      assert cb.forward < ca.forward
  assert blocks_seen == 2


@pytest.mark.heavy
def test_with_megatrons_fused_kernels_selective_recompute_keeps_32_sbh_a_layer():
  """Korthikanti et al. 2022, Table 2: selective recompute keeps 34sbh bytes
  of a layer's activations (bf16), two of them dropout's masks, which this
  GPT does not draw. With its norms and GELU saving only their inputs and
  the causal mask added inside the softmax, as Megatron-LM's fused kernels
  do (`GPTConfig.fused_kernels`), a block stashes exactly that beside the
  scores: each norm's input and output, q, k, v, attention's output, the
  MLP's hidden layer before and after the GELU. JAX's own GELU and norm
  keep their tanh, products and float32 centred input besides."""
  s, b, h = 64, 4, 64
  kept = {}
  for fused in (False, True):
    config = GPTConfig(vocab=256, seq=s, hidden=h, heads=4, layers=2, dtype=jnp.bfloat16,
                       fused_kernels=fused)
    loss, params, batch = abstract_gpt_loss(config, b)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)
    profile = layers_lib.measure(loss, params, batch, widths=[1],
                                 hardware=automap.HARDWARE["a100"], search=planner.searcher(None))
    costs = {layer.name: layer.widths[1] for layer in profile.at(b).layers}
    kept[fused] = [costs[f"block_{i}"].activations - costs[f"block_{i}"].selective
                   for i in range(2)]
  assert kept[True] == pytest.approx([32 * s * b * h] * 2, rel=0.01)
  assert all(k > 1.5 * 32 * s * b * h for k in kept[False])


@pytest.mark.heavy
def test_fused_kernels_change_what_is_kept_not_what_is_computed():
  from automap._src.models.gpt import GPT
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 64)
  config = GPTConfig(vocab=64, seq=16, hidden=32, heads=2, layers=2)
  params = jax.jit(GPT(config).init)(jax.random.key(0), tokens)["params"]

  def loss(fused, p):
    logits = GPT(dataclasses.replace(config, fused_kernels=fused)).apply({"params": p}, tokens)
    return jnp.mean(jax.nn.logsumexp(logits, -1))

  plain, fused = (jax.jit(jax.value_and_grad(functools.partial(loss, f)))(params)
                  for f in (False, True))
  assert float(fused[0]) == pytest.approx(float(plain[0]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(fused[1]), jax.tree.leaves(plain[1])):
    assert jnp.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fused_attention_ops_are_the_score_chain_both_ways():
  from automap._src.ir import graph as graph_lib
  from automap._src.ir import trace as trace_lib
  loss, params, batch = gpt_step()
  g = graph_lib.build(trace_lib.trace(jax.value_and_grad(loss), (params, *batch)))
  cut = layers_lib.LayerCut.of(g)
  scores = layers_lib.attention_scores(g, cut.forward, len(jax.tree.leaves(params)))
  fused = layers_lib.fused_attention_ops(g, cut, scores)
  backward = fused & ~cut.forward
  assert backward.any() and (fused & cut.forward).any()
  # Every fused backward op touches a [4, 4, 64(, 64 | 1)] value: score-shaped.
  for o in np.flatnonzero(backward):
    shapes = [tuple(g.shapes[v])[:3] for v in (*g.operands[o], *g.results[o]) if v >= 0]
    assert (4, 4, 64) in shapes
  # Each layer's q.k and p.v contractions, forward, are in.
  dots = [o for o in np.flatnonzero(fused & cut.forward) if g.prims[o] == "dot_general"]
  assert len(dots) == 2 * 2


def test_stated_fields_and_impossible_interleaving_are_refused_by_name():
  with pytest.raises(cluster.PlacementError, match="virtual_stages=2 fits: it needs 2 or more"):
    cluster.place(blocks(4), devices=2, microbatches=3, hardware=flat(), virtual_stages=2)
  with pytest.raises(cluster.PlacementError, match="recompute_mode must be one of"):
    dataclasses.replace(cluster.price_placement(blocks(2), cluster.ClusterConfig(),
                                                global_batch=1, hardware=flat()).stages[0],
                        recompute_mode="some")
  loss, params, batch = gpt_step()
  with pytest.raises(TypeError, match="got recompute=, which the ClusterConfig states"):
    cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(),
                          global_batch=4, hardware="a100", recompute="full")


def test_a_tied_embedding_is_held_once_by_the_stage_that_reads_it_twice():
  """The token lookup and the tied output head read one embedding: the
  profile records it as shared, and a stage holding both holds it once."""
  loss, params, batch = gpt_step()
  profile = layers_lib.measure(loss, params, batch, widths=[1], hardware=automap.HARDWARE["cpu"],
                               search=planner.searcher(None))
  graph = profile.at(4)
  (tied,) = graph.shared
  embedding = params["embed"]["embedding"]
  assert tied.params[1] == embedding.size * embedding.dtype.itemsize
  assert tied.layers[0] == "embed" and len(tied.layers) == 2
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  one = cluster.price_placement(graph, cluster.ClusterConfig(), global_batch=4, hardware="cpu")
  assert one.stages[0].param_bytes == whole
  # Split where the head sits on the last stage: each stage holds a copy.
  two = cluster.price_placement(graph, cluster.ClusterConfig(pipeline=2), global_batch=4,
                                hardware="cpu")
  assert sum(s.param_bytes for s in two.stages) == whole + tied.params[1]



@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
def test_pricing_several_splits_of_one_model_searches_each_width_once(monkeypatch):
  """The per-width sharding search is kept by program, width, hardware,
  budget and memory: a second split at the same width reuses it (and
  prices alike)."""
  searched = []
  run = planner.run
  monkeypatch.setattr(planner, "run",
                      lambda program, request: searched.append(program) or run(program, request))
  monkeypatch.setattr(planner, "SEARCHED", type(planner.SEARCHED)())
  loss, params, batch = gpt_step()
  budget = automap.Budget(episodes=4)
  plans = []
  # Splits alike in what a device holds of the step (no pipeline, no ZeRO 3).
  for split in (dict(tensor=2, data=2), dict(tensor=2, data=2, zero=1)):
    plans.append(cluster.price_cluster(loss, params, *batch,
                                       config=cluster.ClusterConfig(**split), global_batch=4,
                                       hardware="cpu", budget=budget))
    if len(plans) == 1:
      first = len(searched)  # the example's batch, and the microbatch's
  assert first >= 1 and len(searched) == first
  assert plans[0].shardings == plans[1].shardings
  # Another budget is another search.
  cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(tensor=2, data=2),
                        global_batch=4, hardware="cpu", budget=automap.Budget(episodes=5))
  assert len(searched) > first


def test_a_stage_holding_a_shared_parameter_once_fits_where_twice_would_not():
  """Two layers reading one 20-byte parameter (sgd: 40 bytes with its
  gradient) on one device with 50 bytes: the stage fits, and the planner's
  bounds must not count the parameter twice to rule it out."""
  tied = cluster.Shared(("lookup", "head"), {1: 20.0})
  graph = LayerGraph.chain([Layer(n, {1: LayerCost(1.0, 2.0, 20.0, 0.0)})
                            for n in ("lookup", "head")])
  graph = LayerGraph(graph.layers, graph.edges, (tied,))
  plan = cluster.place(graph, devices=1, microbatches=1, hardware=flat(), optimizer="sgd",
                       memory_limit=50.0, zero=0)
  assert [s.memory for s in plan.stages] == [40.0]
