"""Context parallelism stated in a ClusterConfig: each sample's sequence
split over part of every stage, priced on a (context, model) mesh and
checked against the compiled step."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import abstract_gpt_loss, assert_stage_compiles_as_priced
from jax.sharding import Mesh

import automap
from automap import cluster
from automap._src.cluster.profile import layers as layers_lib
from automap._src.models.gpt import GPTConfig
from automap._src.plan import planner

BUDGET = automap.Budget(episodes=2, seconds=10, progress=False)


def gpt_step(seq: int = 64):
  return abstract_gpt_loss(GPTConfig(vocab=256, seq=seq, hidden=64, heads=4, layers=2,
                                     dtype=jnp.float32))


def context_profile(loss, params, batch):
  """The step profiled on 4 devices, all of one context group."""
  return layers_lib.measure(loss, params, batch, widths=[4], hardware=automap.HARDWARE["a100"],
                            search=planner.searcher(BUDGET), context=4)


def test_a_stage_is_tensor_times_context_devices():
  config = cluster.ClusterConfig(tensor=2, context=4, pipeline=2, data=3)
  assert config.width == 8 and config.devices == 48
  with pytest.raises(cluster.PlacementError, match="context must be a positive int"):
    cluster.ClusterConfig(context=0)


def test_the_sequence_split_over_the_context_group_shrinks_each_devices_share():
  loss, params, batch = gpt_step()
  plans = {c: cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(
      context=c), global_batch=4, hardware="a100", budget=BUDGET) for c in (1, 4)}
  one, four = (plans[c].placement for c in (1, 4))
  assert four.devices == 4 and four.context == 4 and four.stages[0].width == 4
  # Every device runs a quarter of each sample's tokens: a quarter of the
  # dense FLOPs, a little more for attention over keys it gathers.
  assert 0.25 <= four.stages[0].flops / one.stages[0].flops < 0.35
  assert four.stages[0].memory < one.stages[0].memory
  assert cluster.Placement.from_json(four.to_json()) == four


def test_context_parallelism_compiles_to_the_collectives_priced():
  loss, params, batch = gpt_step()
  program, state = context_profile(loss, params, batch).programs[(4, 4)]
  assert program.mesh.axis_names == ("context", "model")
  g = program.graph
  for v in g.inputs[len(jax.tree.leaves(params)):]:  # the tokens, split along the sequence
    assert state[v].tolist() == [1, -1]
  mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("context", "model"))
  assert_stage_compiles_as_priced(program, state, mesh, (params, *batch))


def test_weight_gradients_are_reduced_over_the_context_group_once_per_batch():
  # As Megatron-LM and Llama 3 run it: the context group's partial weight
  # gradients are accumulated over the microbatches and reduced with the
  # sync, so one replica still syncs, and a microbatch carries no reduction.
  from automap._src.cluster.profile import context as context_lib

  loss, params, batch = gpt_step()
  program, state = context_profile(loss, params, batch).programs[(4, 4)]
  g = program.graph
  count = len(jax.tree.leaves(params))
  forward = layers_lib.LayerCut.of(g).forward
  deferred = context_lib.deferred_seconds(program, state, set(g.inputs[:count]), forward)
  made = {g.names[g.results[o][0]] for o in np.flatnonzero(deferred)}
  assert deferred.sum() > 0 and len(made) >= count // 2
  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(context=4),
                               global_batch=4, hardware="a100", budget=BUDGET)
  stage = plan.placement.stages[0]
  assert stage.sync_total > 0
