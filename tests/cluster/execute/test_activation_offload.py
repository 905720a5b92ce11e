"""Activation offload stated, priced and run: the activations a model names
with `checkpoint_name` go to pinned host memory in each layer's forward and
come back for its backward (MaxText's `remat_policy: custom` at "offload"),
the rest rebuilt from each layer's input."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest
from helpers import assert_trains_as_jitted

import automap
from automap import cluster
from automap._src.cost.hardware import get_hardware
from automap._src.models import llama, zoo

LLAMA = llama.LlamaConfig(vocab=64, embed=32, mlp=64, heads=4, kv_heads=2, head_dim=8,
                          layers=4, seq=16, batch=16)
BATCH = 16
BUDGET = automap.Budget(episodes=8)
TX = optax.adam(1e-2, eps=1e-3)
HOST = dataclasses.replace(get_hardware("cpu"), host_bandwidth=10e9)  # bytes/s per direction
PROJECTIONS = ("query_proj", "key_proj", "value_proj", "out_proj")
SPLIT = dict(pipeline=2, data=4, microbatch=2)


def priced(recompute, names=(), hardware=HOST):
  loss, params, batch = zoo.llama_loss(LLAMA)
  config = cluster.ClusterConfig(**SPLIT, recompute=recompute, offload_activations=names)
  return cluster.price_cluster(loss, params, *batch, config=config, global_batch=BATCH,
                               hardware=hardware, budget=BUDGET)


@pytest.mark.slow
def test_offload_keeps_full_recomputes_device_memory_and_reruns_less():
  full, offload, none = priced("full"), priced("offload", PROJECTIONS), priced("none")
  for a, b in zip(offload.placement.stages, full.placement.stages):
    assert a.recompute_mode == "offload"
    assert a.memory == pytest.approx(b.memory)  # each layer's input on the device
  # The projections come back from the host instead of being rebuilt.
  assert none.time <= offload.time < full.time


@pytest.mark.heavy
def test_offload_is_refused_where_it_cannot_be_priced_or_names_nothing():
  with pytest.raises(cluster.PlacementError, match="state both or neither"):
    cluster.ClusterConfig(**SPLIT, offload_activations=PROJECTIONS)
  with pytest.raises(cluster.PlacementError, match="state both or neither"):
    cluster.ClusterConfig(**SPLIT, recompute="offload")
  with pytest.raises(cluster.PlacementError, match="host link"):
    priced("offload", PROJECTIONS, hardware="cpu")
  with pytest.raises(cluster.PlacementError, match=r"\['query_prj'\] name no value"):
    priced("offload", ("query_prj",))


@pytest.mark.filterwarnings("ignore::automap.cluster.ReplicatedWeightsWarning")
@pytest.mark.slow
def test_offloaded_activations_run_in_pinned_host_memory_and_train_as_jitted():
  loss, params, batch = zoo.llama_loss(LLAMA)
  plan = priced("offload", PROJECTIONS)
  step = plan.train_step(loss, TX, params, *batch)
  state = assert_trains_as_jitted(step, loss, TX, params, batch)
  checks, _ = step.check(state, *batch)
  for check in checks:
    ratios = check.ratios()
    assert abs(ratios["data"] - 1) <= 0.05 and abs(ratios["received"] - 1) <= 0.05, check
    assert 0.85 <= ratios["held"] <= 1.15, check  # offloaded values are off the device
  # Each stage's forward returns its layers' named projections in host
  # memory, as the compiled program places them (XLA:CPU reports no host
  # bytes in memory_analysis, so the outputs are counted instead).
  rows = SPLIT["microbatch"]  # per replica
  per_layer = 4 * rows * LLAMA.seq * (2 * LLAMA.heads * LLAMA.head_dim
                                      + 2 * LLAMA.kv_heads * LLAMA.head_dim)
  for c, stage in enumerate(plan.placement.stages):
    program, types = step.programs[("forward", c)]
    compiled = program.lower(*types).compile()
    outs = zip(jax.tree.leaves(compiled.output_shardings), jax.tree.leaves(compiled.out_info))
    host = [info for sharding, info in outs if sharding.memory_kind == "pinned_host"]
    layers = sum(name.startswith("layers_") for name in stage.layers)
    # The four named projections, each stacked over the stage's layers (the
    # layers run as one scan), replicas first.
    assert len(host) == 4 and {info.shape[1] for info in host} == {layers}
    nbytes = sum(np.prod(i.shape) * i.dtype.itemsize for i in host) / SPLIT["data"]
    assert nbytes == layers * per_layer
    assert "S(5)" in compiled.as_text()
