"""A cluster plan compiled with XLA:TPU for a TPU slice, stage by stage on
its block of the slice's compile-only devices, nothing run, and each
stage's compiled program read beside the plan's price for it."""

import jax
import jax.numpy as jnp
import optax
import pytest

import automap
from automap import cluster
from automap._src.models import gpt, zoo

pytest.importorskip("libtpu", reason="XLA:TPU's compiler (libtpu) is not installed: "
                    "pip install -e '.[tpu]'")
pytestmark = pytest.mark.tpu

# TPU-sized widths (multiples of 128), so that XLA:TPU's tiles are not padding.
GPT = gpt.GPTConfig(vocab=512, seq=64, hidden=256, heads=4, layers=4)  # tied embeddings
BATCH = 16
TX = optax.adam(1e-3)


@pytest.fixture(scope="module")
def compiled():
  """A 2-stage split of 8 v5p chips ("v5p-16" counts TensorCores), priced as
  the slice's chip, and its stages compiled with XLA:TPU."""
  loss, params, batch = zoo.gpt_loss(GPT, BATCH)
  config = cluster.ClusterConfig(tensor=2, pipeline=2, data=2, microbatch=2, zero=1)
  with pytest.warns(cluster.ReplicatedWeightsWarning):
    plan = cluster.price_cluster(loss, params, *batch, config=config, global_batch=BATCH,
                                 devices="v5p-16", budget=automap.Budget(episodes=8))
  mesh = automap.tpu_mesh("v5p-16")
  return plan, plan.compile_stages(loss, TX, params, *batch, devices=mesh)


@pytest.mark.heavy
def test_a_slice_prices_as_its_chip_and_each_stage_compiles_on_its_own_block(compiled):
  plan, stages = compiled
  assert (plan.hardware, plan.devices) == ("tpu-v5p", 8)
  assert [s.mesh for s in stages] == [{"data": 2, "tensor": 2}] * 2
  assert {s.device_kind for s in stages} == {"TPU v5"}
  for s in stages:
    # Every program the step runs: each chunk's forward, its backward
    # (before and at the stage's last), the update.
    assert sorted(p.key[0] for p in s.programs) == ["backward", "backward", "forward", "update"]
    assert sum(p.calls for p in s.programs if p.key[0] == "forward") == 4  # microbatches
    # Held against the v5p's 95 GiB of HBM.
    assert s.hardware.name == "tpu-v5p" and s.capacity == automap.HARDWARE["tpu-v5p"].hbm_capacity
    assert s.fits and 0 < s.largest_program <= s.memory[0] < 0.001 * s.capacity
    assert all(p.seconds and p.seconds > 0 for p in s.programs)


@pytest.mark.heavy
def test_each_stage_compiles_to_the_collectives_and_memory_its_plan_priced(compiled):
  _, stages = compiled
  for s in stages:
    ratios = s.ratios()
    # The searched layout at tensor=2 keeps the weights whole and splits the
    # batch over the tensor group: its gradients are all-reduced over
    # "tensor" every microbatch, byte for byte as priced.
    assert abs(ratios["tensor"] - 1) <= 0.001, s.table()
    assert {k for k, axes in s.collectives if axes == ("tensor",)} == {"all-reduce"}
    # ZeRO 1 over "data": the gradients reduce-scattered, the updated shards
    # all-gathered, byte for byte as priced, but for two things. Parameters
    # with no dim ZeRO can shard (whole over the replicas) are all-reduced,
    # which the plan prices as reduce-scattered (half the bytes); and stage
    # 1's copy of the tied embedding is refreshed from stage 0 after the
    # update, not gathered.
    data = {kind: nbytes for (kind, axes), nbytes in s.collectives.items() if axes == ("data",)}
    assert set(data) == {"all-gather", "reduce-scatter", "all-reduce"}
    assert data["all-reduce"] <= 0.003 * s.data[0]
    assert data["reduce-scatter"] + data["all-reduce"] / 2 == s.predicted_data["reduce-scatter"]
    copied = GPT.vocab * GPT.hidden * 4 if s.stage == 1 else 0
    assert data["all-gather"] + copied == s.predicted_data["all-gather"]
    assert abs(ratios["data"] - 1) <= 0.06, s.table()
    assert {axes for _, axes in s.collectives} == {("data",), ("tensor",)}
    # Held between programs (parameters, Adam's shards, accumulators, the
    # 1F1B stashes), from the compiled layouts: within 1.5% of the plan.
    assert abs(ratios["held"] - 1) <= 0.015, s.table()
    # With the largest temporary (XLA:TPU's backward working set, which the
    # plan counts as one rebuilt layer) 1.58x and 1.69x the plan's memory.
    assert 1.0 < ratios["memory"] <= 1.8, s.table()
    # XLA:TPU's optimal_seconds of the stage's programs beside the plan's
    # busy time: 1.07x and 1.26x.
    assert 0.9 <= ratios["seconds"] <= 1.4, s.table()


def _dense_stack(params, x, y):
  for i, (w, b) in enumerate(params):
    with jax.named_scope(f"dense_{i}"):
      x = jnp.tanh(x @ w + b[None])
  return jnp.mean((x - y) ** 2)


def _hand_plan(stages: int) -> cluster.ClusterPlan:
  """A plan stated by hand, nothing priced: a dense layer per stage, each
  stage one device, two data-parallel replicas of microbatches of 8."""
  placed = tuple(cluster.Stage((f"dense_{s}",), 1, False, s, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                               0.0, 0.0) for s in range(stages))
  placement = cluster.Placement(2, 2, 0, placed, 2 * stages, 0.0)
  return cluster.ClusterPlan(placement, 8, 32, 2 * stages, "tpu-v6e", {})


def _dense_args(layers: int):
  params = [(jnp.zeros((128, 128)), jnp.zeros(128)) for _ in range(layers)]
  return params, jnp.zeros((32, 128)), jnp.zeros((32, 128))


def test_a_hand_plan_compiles_on_a_slice_and_refuses_to_run_there():
  params, x, y = _dense_args(2)
  step = _hand_plan(2).train_step(_dense_stack, TX, params, x, y, devices="v6e-4")
  assert step.compile_only
  stages = step.compile_stages()
  assert [s.mesh for s in stages] == [{"data": 2, "tensor": 1}] * 2
  assert [s.hardware.name for s in stages] == ["tpu-v6e"] * 2
  # The stages' devices are the slice's, apart.
  first, second = (set(mesh.devices.flat) for mesh in step.meshes)
  assert len(first | second) == 4
  for s in stages:
    # ZeRO 0: the gradients all-reduced over "data" once per batch, as a
    # dense layer's weight and bias (f32) are.
    assert s.collectives == {("all-reduce", ("data",)): 4 * (128 * 128 + 128)}
    assert s.tensor == (0.0, 0.0) and s.fits
  with pytest.raises(cluster.PlacementError, match="compile_stages"):
    step.init(params)


def test_a_slice_too_small_for_the_plan_is_refused():
  params, x, y = _dense_args(3)
  with pytest.raises(cluster.PlacementError, match="uses 6 devices.*got 4"):
    _hand_plan(3).compile_stages(_dense_stack, TX, params, x, y, devices="v6e-4")
