"""search_accelerator: architecture and placement searched together on a real program."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import automap
from automap import cluster
from automap._src.cluster.accelerator import chip as acc_lib
from automap._src.cluster.accelerator import cosearch, pass_times, scheduling
from automap._src.cluster.accelerator import passes as passes_lib
from automap._src.cost.hardware import get_hardware
from automap._src.models import gpt
from automap._src.plan import planner

CONFIG = gpt.GPTConfig(vocab=256, seq=32, hidden=64, heads=4, layers=2)
BUDGET = automap.Budget(episodes=8, seconds=10, progress=False)
# A small grid around the baseline keeps the test quick.
SPACE = {"tensor_units": (4, 8, 16), "array": (64, 128), "vector_units": (2, 4),
         "vector_width": (128,), "buffer": (64 * 2**20, 128 * 2**20)}


def gpt_workload(name="gpt", depth=None):
  model = gpt.GPT(CONFIG)
  _, (params, _, batch) = gpt.make_train_step(CONFIG, 4, abstract=True)

  def loss(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  repeat = {} if depth is None else {"block_1": depth - 1}
  return cluster.Workload(loss, params, (batch,), global_batch=64, name=name, repeat=repeat)


def mlp_workload():
  def loss(params, x):
    for i, w in enumerate(params):
      with jax.named_scope(f"dense_{i}"):
        x = jax.nn.relu(x @ w)
    return jnp.mean(x**2)

  params = [jax.ShapeDtypeStruct((256, 256), jnp.float32) for _ in range(3)]
  return cluster.Workload(loss, params, (jax.ShapeDtypeStruct((16, 256), jnp.float32),),
                           global_batch=64, name="mlp")


@pytest.mark.heavy
def test_the_search_never_loses_to_the_baseline_and_stays_in_budget():
  plan = cosearch.search_accelerator(
      gpt_workload(depth=6), devices=8, space=SPACE, widths=(1, 2), microbatches=(2, 4),
      schedule_seconds=0.2, budget=BUDGET, progress=False)
  assert plan.score >= 1.0
  assert plan.accelerator.area() <= plan.area_budget * (1 + 1e-9)
  (result,), (base,) = plan.results, plan.baseline_results
  assert result.throughput == pytest.approx(plan.score * base.throughput)
  names = [n for s in result.placement.stages for n in s.layers]
  assert sum(n.startswith("block_1") for n in names) == 5  # the repeated block, 5 copies
  # Every point of the largest bucket got a ratio bound; a point's list
  # schedule <= its CP-SAT schedule <= its placed bound <= its ratio bound.
  by = {how: {a: x for a, x, h in plan.history if h == how}
        for how in ("ratio", "bound", "dominated", "greedy", "exact")}
  grid = cosearch._grid_points(plan.area_budget, acc_lib.TPU_V4_LIKE, SPACE)
  assert {a for a in grid if a.area() > 0.9 * plan.area_budget} <= set(by["ratio"]) <= set(grid)
  assert by["exact"] and set(by["exact"]) <= set(by["greedy"]) <= set(by["bound"])
  assert not set(by["dominated"]) & set(by["bound"])
  for a, x in by["dominated"].items():
    assert x <= by["ratio"][a]
  for a, x in by["exact"].items():
    assert by["greedy"][a] * (1 - 1e-9) <= x <= by["bound"][a] * (1 + 1e-9)
    assert by["bound"][a] <= by["ratio"][a] * (1 + 1e-6)
  assert cluster.AcceleratorPlan.from_json(plan.to_json()) == plan
  assert "tensor units" in plan.explain()


def test_more_area_never_hurts_a_search_of_the_whole_grid():
  """One area bucket (the whole budget) and no gap: the best list-scheduled
  point of the grid is found, and a larger grid holds the smaller one."""
  small = cosearch.search_accelerator(
      mlp_workload(), devices=4, space=SPACE, widths=(1, 2), microbatches=(4,),
      schedule_seconds=0.2, budget=BUDGET, progress=False, bucket=1.0, gap=0.0)
  large = cosearch.search_accelerator(
      mlp_workload(), devices=4, space=SPACE, widths=(1, 2), microbatches=(4,),
      schedule_seconds=0.2, budget=BUDGET, progress=False, bucket=1.0, gap=0.0,
      area_budget=2 * acc_lib.AREA_BUDGET)
  listed = lambda plan: max(x for _, x, h in plan.history if h == "greedy")  # noqa: E731
  assert listed(large) >= listed(small) * (1 - 1e-9)
  assert large.score >= listed(large) * (1 - 1e-9)  # CP-SAT only shortens schedules


@pytest.mark.heavy
def test_one_architecture_for_two_models():
  plan = cosearch.search_accelerator(
      [gpt_workload(), mlp_workload()], devices=4, space=SPACE, widths=(1, 2),
      microbatches=(4,), schedule_seconds=0.2, budget=BUDGET, progress=False)
  assert [r.workload for r in plan.results] == ["gpt", "mlp"]
  ratios = [r.throughput / b.throughput for r, b in zip(plan.results, plan.baseline_results)]
  assert plan.score == pytest.approx((ratios[0] * ratios[1]) ** 0.5)


def test_candidates_are_the_grid_within_budget():
  points = cosearch._grid_points(acc_lib.AREA_BUDGET, acc_lib.TPU_V4_LIKE, SPACE)
  assert acc_lib.TPU_V4_LIKE in points
  assert all(p.area() <= acc_lib.AREA_BUDGET for p in points)
  grid = 1
  for options in SPACE.values():
    grid *= len(options)
  assert 1 < len(points) < grid


def test_bad_arguments():
  with pytest.raises(cluster.PlacementError, match="workloads must be"):
    cosearch.search_accelerator([], devices=8)
  with pytest.raises(cluster.PlacementError, match="must divide"):
    cosearch.search_accelerator(gpt_workload(), devices=8, microbatches=(3,))


@pytest.fixture(scope="module")
def profiled():
  search = planner.searcher(BUDGET)
  return passes_lib.profile_workload(gpt_workload(depth=6), get_hardware("tpu-v4"), (1, 2),
                                     (2, 4), search)


def bound_of(p: passes_lib.LayerPass, acc: acc_lib.Accelerator) -> float:
  """A pass's lower bound, op by op: its critical path at each op's best
  latency, or its work over every core."""
  single = [acc_lib.latency(op, acc, 1) for op in p.ops]
  spread = [acc_lib.latency(op, acc, acc.tensor_units) for op in p.ops]
  finish = [min(a, b) for a, b in zip(single, spread)]
  for i, j in p.edges:
    finish[j] = max(finish[j], finish[i] + min(single[j], spread[j]))
  work = sum(min(a, b * acc.tensor_units) for a, b in zip(single, spread)) / acc.tensor_units
  return max(max(finish, default=0.0), work)


def test_the_op_table_prices_every_op_as_latency_does():
  ops = [acc_lib.Op.matmul(f"mm{i}", m=m, n=n, k=k, batch=b)
         for i, (m, n, k, b) in enumerate(itertools.product((1, 96, 4096), (64, 5000),
                                                            (7, 8192), (1, 12)))]
  ops += [acc_lib.Op("add", "vector", elements=e, bytes=3.0 * e) for e in (0, 1, 1e3, 3.3e8)]
  ops += [acc_lib.Op("nobytes", "tensor", m=300, n=200, k=100)]
  table = acc_lib.OpTable(ops)
  for acc in cosearch._grid_points(math.inf, acc_lib.TPU_V4_LIKE, SPACE):
    for cores in (1, acc.tensor_units):
      assert np.array_equal(table.latency(acc, cores),
                            [acc_lib.latency(op, acc, cores) for op in ops])


def test_bounds_of_every_pass_at_once_are_those_op_by_op(profiled):
  passes = passes_lib.all_passes(profiled)
  bounds = pass_times.PassBounds(passes)
  for acc in cosearch._grid_points(acc_lib.AREA_BUDGET, acc_lib.TPU_V4_LIKE, SPACE)[::3]:
    want = [bound_of(p, acc) for p in passes]
    np.testing.assert_allclose(bounds(acc), want, rtol=1e-12)
    for p, low in zip(passes[::5], bounds(acc)[::5]):
      assert low <= scheduling.schedule(p.ops, p.edges, acc, seconds=0).makespan * (1 + 1e-12)


def test_lazy_scheduling_places_as_scheduling_every_pass_does(profiled):
  passes = passes_lib.all_passes(profiled)
  bounds = pass_times.PassBounds(passes)
  hw = get_hardware("tpu-v4")
  knobs = cluster.PlacementOptions()
  for acc in (acc_lib.TPU_V4_LIKE, acc_lib.Accelerator(tensor_units=16, array=64)):
    lazy = pass_times.PassTimes(acc, 0.0, "greedy", bounds)
    eager = pass_times.PassTimes(acc, 0.0, "greedy", bounds)
    for p in passes:
      eager.schedule(p)
    got = cosearch._place_on(lazy, profiled, acc, hw, 8, (2, 4), knobs)
    want = cosearch._place_on(eager, profiled, acc, hw, 8, (2, 4), knobs)
    assert got.throughput == pytest.approx(want.throughput, rel=1e-12)
    assert len(lazy.scheduled) < len(passes)  # only the passes of the pairs it places


def test_a_point_no_faster_on_every_pass_places_no_faster(profiled):
  """What lets the search bound a point by another's placement at bound."""
  bounds = pass_times.PassBounds(passes_lib.all_passes(profiled))
  hw = get_hardware("tpu-v4")
  knobs = cluster.PlacementOptions()
  fast = acc_lib.TPU_V4_LIKE
  for slow in (acc_lib.Accelerator(vector_units=1), acc_lib.Accelerator(buffer=16 * 2**20),
               acc_lib.Accelerator(vector_units=1, hbm_capacity=16 * 2**30)):
    assert np.all(bounds(slow) >= bounds(fast))
    times = [cosearch._place_on(pass_times.PassTimes(acc, 0.0, "bound", bounds), profiled, acc,
                                hw, 8, (2, 4), knobs).placement.time for acc in (fast, slow)]
    assert times[1] >= times[0] * (1 - 1e-12)


def test_options_object_and_keywords_search_alike():
  keywords = {"space": {"tensor_units": (4, 8), "array": (64, 128)}, "widths": (1, 2),
              "microbatches": (4,), "schedule_seconds": 0.0, "finalists": 1, "gap": 0.0,
              "budget": BUDGET, "progress": False, "optimizer": "sgd", "zero": (0, 1)}
  by_keywords = cluster.search_accelerator(mlp_workload(), devices=4, **keywords)
  by_options = cluster.search_accelerator(mlp_workload(), devices=4,
                                          options=cluster.CoSearchOptions(**keywords))
  assert by_options == by_keywords
  assert by_options.history == by_keywords.history


@pytest.mark.parametrize("fields, error, match", [
    ({"gap": -0.1}, cluster.PlacementError,
     r"CoSearchOptions.gap must be a finite number >= 0, got -0.1; the default is 0.01"),
    ({"bucket": 0}, cluster.PlacementError, r"CoSearchOptions.bucket must be a finite number > 0"),
    ({"finalists": 1.5}, cluster.PlacementError, r"CoSearchOptions.finalists must be an int >= 0"),
    ({"space": {"arrays": (64,)}}, cluster.PlacementError,
     r"CoSearchOptions.space: 'arrays' is not an Accelerator field; the fields are \['tensor_"),
    ({"space": {"array": ()}}, cluster.PlacementError,
     r"CoSearchOptions.space\['array'\] must be a non-empty sequence"),
    ({"widths": (1, 0)}, cluster.PlacementError, r"CoSearchOptions.widths must be positive ints"),
    ({"baseline": "tpu-v4"}, TypeError,
     r"CoSearchOptions.baseline must be an automap.cluster.Accel"),
    ({"progress": "yes"}, cluster.PlacementError, r"CoSearchOptions.progress must be True"),
])
def test_bad_cosearch_options_name_the_field(fields, error, match):
  with pytest.raises(error, match=match):
    cluster.CoSearchOptions(**fields)
  with pytest.raises(error, match=match):
    cluster.search_accelerator(mlp_workload(), devices=4, **fields)


def test_search_accelerator_refuses_an_option_given_both_ways():
  with pytest.raises(TypeError, match=r"search_accelerator\(\) got gap=, bucket= as keyword"):
    cluster.search_accelerator(mlp_workload(), devices=4, options=cluster.CoSearchOptions(),
                               gap=0.0, bucket=1.0)
