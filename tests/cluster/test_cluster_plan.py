"""plan_cluster on a real flax model: layer costs from the cost model, placed."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import automap
from automap import cluster
from automap._src.cli import main as cli
from automap._src.cluster.execute import stage_layouts
from automap._src.cluster.profile import layers as layers_lib
from automap._src.cost.tracker import Tracker
from automap._src.models import gpt
from automap._src.plan import planner

CONFIG = gpt.GPTConfig(vocab=256, seq=32, hidden=64, heads=4, layers=4)
BUDGET = automap.Budget(episodes=12, seconds=20, progress=False)


def gpt_loss():
  model = gpt.GPT(CONFIG)
  _, (params, _, batch) = gpt.make_train_step(CONFIG, 8, abstract=True)

  def loss(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return loss, params, batch


def param_bytes(params) -> float:
  return float(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params)))


def test_layers_follow_the_model_in_program_order():
  loss, params, batch = gpt_loss()
  profile = layers_lib.measure(loss, params, (batch,), widths=[1, 2], hardware=automap.HARDWARE[
      "tpu-v4"], search=lambda program: program.initial_state())
  graph = profile.graphs[8][1]
  names = [layer.name for layer in graph.layers]
  blocks = [n for n in names if n.startswith("block_")]
  assert blocks == [f"block_{i}" for i in range(CONFIG.layers)]
  assert names.index("embed") < names.index("block_0") and names.index("ln_f") > names.index(
      "block_3")
  # Edges only run forward, and each block hands the next one [B, S, H] floats.
  order = {n: i for i, n in enumerate(names)}
  assert all(order[a] < order[b] for a, b, _ in graph.edges)
  hidden = 8 * CONFIG.seq * CONFIG.hidden * 4
  assert dict(((a, b), n) for a, b, n in graph.edges)[("block_1", "block_2")] == hidden
  # Each block's parameters are read by that block alone.
  block = param_bytes(params["block_0"])
  for i in range(CONFIG.layers):
    assert graph.layers[order[f"block_{i}"]].widths[1].params == block
  costs = [layer.widths[1] for layer in graph.layers if layer.name.startswith("block_")]
  assert all(c.forward > 0 and c.backward > c.forward and c.activations > 0 for c in costs)


def test_wider_tensor_parallel_groups_step_faster():
  loss, params, batch = gpt_loss()
  # Compute-bound (slow matmuls, fast links): splitting this small model's
  # compute pays, as it does a large model's on a real accelerator.
  hw = dataclasses.replace(automap.HARDWARE["tpu-v4"], name="compute-bound", flops=2e12,
                           fp32_flops=2e12, link_latency=1e-6)

  profile = layers_lib.measure(loss, params, (batch,), widths=[1, 4], hardware=hw,
                               search=planner.searcher(BUDGET), sizes=[16])
  one, four = profile.graphs[8][1], profile.graphs[8][4]
  # The layers' seconds add up to the cost model's serial step time of the
  # searched sharding (the cluster model overlaps collectives itself),
  # which beats one device's step.
  step = lambda g, t: sum(c.widths[t].forward + c.widths[t].backward for c in g.layers)  # noqa: E731
  program, state = profile.programs[(8, 4)]
  assert step(four, 4) == pytest.approx(Tracker(program.model, state).serial_step_time,
                                        rel=0.02)
  assert step(four, 4) < step(one, 1)
  assert sum(c.widths[4].params for c in four.layers) <= sum(c.widths[1].params
                                                             for c in one.layers)
  # Twice the batch, traced again: the same parameters, and about twice the
  # time where activations dominate (the blocks; the embedding's lookups
  # and the tied head's weight reads stay); sizes not traced scale
  # linearly from the nearest that was.
  doubled, guessed = profile.at(16), profile.at(32)
  for a, b, c in zip(doubled.layers, one.layers, guessed.layers):
    assert a.widths[1].params == b.widths[1].params == c.widths[1].params
    assert b.widths[1].forward < a.widths[1].forward <= 2 * b.widths[1].forward * 1.01
    if a.name.startswith("block_"):
      assert 1.2 * b.widths[1].forward < a.widths[1].forward
    assert c.widths[1].forward == pytest.approx(2 * a.widths[1].forward)


@pytest.mark.heavy
def test_plan_cluster_pipelines_when_memory_is_short():
  loss, params, batch = gpt_loss()
  total = param_bytes(params)
  # Adam: parameters, gradients and two moments are 4x the parameters; a
  # quarter of that per device leaves no room for one replica of everything.
  limit = total * 1.6
  plan = cluster.plan_cluster(loss, params, batch, devices=8, global_batch=32, hardware="tpu-v4",
                              memory_limit=limit, optimizer="adam", zero=0, budget=BUDGET,
                              microbatches=[1, 4, 8])
  p = plan.placement
  assert len(p.stages) > 1
  assert all(s.memory <= limit for s in p.stages)
  layers = [n for s in p.stages for n in s.layers]
  assert layers[0] == "embed" and [n for n in layers if n.startswith("block_")] == [
      f"block_{i}" for i in range(CONFIG.layers)]
  assert p.devices <= 8 and 32 % plan.microbatch == 0
  assert plan.throughput == pytest.approx(32 / plan.time)
  text = plan.explain()
  assert "pipeline stage(s)" in text and "block_0" in text and "recompute" in text
  # With the memory to spare, the same program goes data parallel.
  roomy = cluster.plan_cluster(loss, params, batch, devices=8, global_batch=32,
                               hardware="tpu-v4", optimizer="adam", budget=BUDGET,
                               microbatches=[1, 4, 8])
  assert roomy.time <= plan.time


@pytest.mark.heavy
def test_cluster_plan_round_trips(tmp_path, capsys):
  loss, params, batch = gpt_loss()
  plan = cluster.plan_cluster(loss, params, batch, devices=4, global_batch=16, widths=[1, 2],
                              budget=BUDGET)
  plan.save(tmp_path / "cluster.json")
  assert cluster.ClusterPlan.load(tmp_path / "cluster.json") == plan
  assert set(plan.shardings) == {s.width for s in plan.placement.stages}
  assert cli.main(["explain", str(tmp_path / "cluster.json")]) == 0
  assert "automap cluster plan" in capsys.readouterr().out


# A cluster plan saved by schema 1, which kept each layout as the text of its
# tuple of entries.
TEXT_LAYOUTS_PLAN = """{"devices": 2, "global_batch": 4, "hardware": "tpu-v4",
 "memory_limit": null, "microbatch": 2, "peak_flops": 2.75e14, "schema": 1,
 "placement": {"context": 1, "data_parallel": 1, "devices": 2, "microbatches": 2,
  "offload": "none", "offload_activations": [], "recompute_every": 1, "schedule": "1f1b",
  "shard_group": null, "time": 0.0072, "virtual_stages": 1, "zero": 0,
  "stages": [{"bytes_in": 0.0, "bytes_out": 0.0, "collectives": 0.0, "comm_bytes": 0.0,
   "compute": 0.0036, "first_device": 0, "flops": 0.0, "in_flight": 1, "layers": ["a", "b"],
   "memory": 4200000.0, "param_bytes": 1000000.0, "recompute": false,
   "recompute_mode": "none", "sync": 0.0, "sync_total": 0.0, "time": 0.0036,
   "transfers": 0.0, "width": 2, "zero": 0.0, "zero_total": 0.0}]},
 "shardings": {"2": {"0/a/kernel": "(None, 'model')", "0/b/bias": "()",
  "0/b/kernel": "(('context', 'model'), None)", "1/inputs": "('model',)"}}}"""


def test_a_plan_saved_with_text_layouts_loads_as_partition_specs(tmp_path):
  old = tmp_path / "old.json"
  old.write_text(TEXT_LAYOUTS_PLAN)
  plan = cluster.ClusterPlan.load(old)
  assert plan.shardings == {2: {"0/a/kernel": P(None, "model"), "0/b/bias": P(),
                                "0/b/kernel": P(("context", "model"), None),
                                "1/inputs": P("model")}}
  # The stages read them as they read a plan just made.
  kernel = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  assert stage_layouts.tensor_spec(plan.shardings[2]["0/a/kernel"], kernel, 2,
                                   "0/a/kernel") == (None, "tensor")
  assert stage_layouts.splits_batch(plan.shardings[2], ["1/inputs"])
  # Saved again, the layouts are JSON lists of entries, and load as they were.
  plan.save(tmp_path / "new.json")
  data = plan.to_json()
  assert data["schema"] == 2
  assert data["shardings"]["2"]["0/b/kernel"] == [["context", "model"], None]
  assert cluster.ClusterPlan.load(tmp_path / "new.json") == plan


def test_a_plan_of_an_unknown_schema_is_refused():
  data = cluster.ClusterPlan.from_json(json.loads(TEXT_LAYOUTS_PLAN)).to_json()
  with pytest.raises(cluster.PlacementError, match="schema 3 is not 1 or 2; plan it again"):
    cluster.ClusterPlan.from_json(data | {"schema": 3})


@pytest.mark.parametrize("kwargs, match", [
    ({"global_batch": 0}, "global_batch must be a positive int"),
    ({"widths": [16]}, "widths must be ints in 1..devices=8"),
    ({"microbatches": [3]}, "divide global_batch=32"),
])
def test_plan_cluster_bad_arguments(kwargs, match):
  loss, params, batch = gpt_loss()
  args = {"devices": 8, "global_batch": 32} | kwargs
  with pytest.raises(cluster.PlacementError, match=match):
    cluster.plan_cluster(loss, params, batch, budget=BUDGET, **args)


def mlp_loss(params, x, y):
  for i, (w, b) in enumerate(params):
    with jax.named_scope(f"dense_{i}"):
      x = jnp.tanh(x @ w + b[None, :])
  return jnp.mean((x - y) ** 2)


def test_plain_jax_function_with_named_scopes():
  params = [(jnp.zeros((32, 32)), jnp.zeros(32)) for _ in range(3)]
  x = jnp.zeros((16, 32))
  plan = cluster.plan_cluster(mlp_loss, params, x, x, devices=4, global_batch=64,
                              widths=[1, 2], budget=BUDGET)
  assert [n for s in plan.placement.stages for n in s.layers] == ["dense_0", "dense_1",
                                                                  "dense_2"]
  with pytest.raises(cluster.PlacementError, match="leading .batch. dimension"):
    cluster.plan_cluster(mlp_loss, params, x, x[:8], devices=4, global_batch=64, budget=BUDGET)


def test_a_tpu_slice_named_as_the_cluster_prices_as_its_chip():
  params = [(jnp.zeros((32, 32)), jnp.zeros(32)) for _ in range(3)]
  x = jnp.zeros((16, 32))
  # A slice's name needs no compiler: "v6e-8" is 8 chips, "v5p-16" 8 (v5p
  # names count TensorCores).
  plan = cluster.plan_cluster(mlp_loss, params, x, x, devices="v6e-8", global_batch=64,
                              widths=[1, 2], budget=BUDGET)
  assert (plan.devices, plan.hardware) == (8, "tpu-v6e")
  config = cluster.ClusterConfig(data=8, microbatch=8)
  priced = cluster.price_cluster(mlp_loss, params, x, x, config=config, global_batch=64,
                                 devices="v5p-16", budget=BUDGET)
  assert (priced.devices, priced.hardware) == (8, "tpu-v5p")
  # A hardware given still prices it.
  assert cluster.price_cluster(mlp_loss, params, x, x, config=config, global_batch=64,
                               devices="v5p-16", hardware="tpu-v4",
                               budget=BUDGET).hardware == "tpu-v4"


@pytest.mark.parametrize("devices, match", [
    ("v5p-8", "uses 6 devices; the slice 'v5p-8' has 4"),
    ("v9-8", "unknown TPU slice 'v9-8'"),
    ("h100-8", "names a GPU"),
    (0, "devices must be a positive int"),
    (2.5, "devices must be a positive int, a TPU slice's name"),
])
def test_a_cluster_too_small_or_unknown_is_refused_before_tracing(devices, match):
  def untraceable(*args):
    raise AssertionError("traced")

  with pytest.raises(cluster.PlacementError, match=match):
    cluster.price_cluster(untraceable, [jnp.zeros(2)], jnp.zeros((16, 2)),
                          config=cluster.ClusterConfig(pipeline=3, data=2, microbatch=8),
                          global_batch=64, devices=devices)


def test_options_object_and_keywords_plan_alike():
  params = [(jnp.zeros((32, 32)), jnp.zeros(32)) for _ in range(3)]
  x = jnp.zeros((16, 32))
  keywords = {"optimizer": "momentum", "zero": (0, 1), "recompute": False, "widths": [1, 2],
              "microbatches": [4, 8], "budget": BUDGET, "seed": 1, "memory_limit": 1e9}
  by_keywords = cluster.plan_cluster(mlp_loss, params, x, x, devices=4, global_batch=64,
                                     **keywords)
  by_options = cluster.plan_cluster(mlp_loss, params, x, x, devices=4, global_batch=64,
                                    options=cluster.ClusterOptions(**keywords))
  assert by_options == by_keywords
  assert by_options.explain() == by_keywords.explain()


@pytest.mark.parametrize("fields, error, match", [
    ({"microbatches": [4, 0]}, cluster.PlacementError,
     r"ClusterOptions.microbatches must be positive ints, got \[4, 0\]; e.g. microbatches="),
    ({"widths": ()}, cluster.PlacementError, r"ClusterOptions.widths must be positive ints"),
    ({"zero": "all"}, cluster.PlacementError, r"ClusterOptions.zero must be a stage in 0..3"),
    ({"optimizer": "lion"}, cluster.PlacementError, r"ClusterOptions.optimizer must be one of"),
    ({"budget": 20}, TypeError, r"ClusterOptions.budget must be an automap.Budget.*Budget\("),
    ({"seed": -1}, TypeError, r"ClusterOptions.seed must be a non-negative integer"),
])
def test_bad_cluster_options_name_the_field(fields, error, match):
  with pytest.raises(error, match=match):
    cluster.ClusterOptions(**fields)
  loss, params, batch = gpt_loss()
  # Given as keywords, they fail the same way, before any tracing.
  with pytest.raises(error, match=match):
    cluster.plan_cluster(loss, params, batch, devices=8, global_batch=32, **fields)


def test_plan_cluster_refuses_an_option_given_both_ways():
  loss, params, batch = gpt_loss()
  with pytest.raises(TypeError, match=r"plan_cluster\(\) got seed= as keyword\(s\) and options"):
    cluster.plan_cluster(loss, params, batch, devices=8, global_batch=32,
                         options=cluster.ClusterOptions(budget=BUDGET), seed=1)


def test_cluster_names_live_in_automap_cluster_and_the_old_ones_warn():
  """Cluster planning has its own namespace; the top-level names it once had
  still work, with a DeprecationWarning naming the new home."""
  assert not set(cluster.__all__) & set(automap.__all__)
  for name in cluster.__all__:
    with pytest.warns(DeprecationWarning, match=f"automap.cluster.{name}"):
      assert getattr(automap, name) is getattr(cluster, name)
  with pytest.raises(AttributeError, match="no attribute 'plan_clusters'"):
    automap.plan_clusters  # noqa: B018
