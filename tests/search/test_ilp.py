"""The ILP backend: exact optima on programs small enough to check by hand."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL, gpt_step, mesh
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.search import ilp
from automap._src.sharding.mesh import MeshSpec

B, D, H = 8, 256, 1024
# Compute-bound devices (memory traffic is free) with a slow link: times
# are sums of FLOPs over peaks and of latency plus bytes over bandwidth.
# Compiled by XLA:CPU, as the tests verify it: no reduce-scatters.
FLOPS, LINK, LATENCY = 1e12, 1e9, 1e-6
HW = automap.Hardware(
    name="test", flops=FLOPS, fp32_flops=FLOPS, hbm_bandwidth=1e30, hbm_capacity=2**30,
    link_bandwidth=LINK, link_latency=LATENCY, network_bandwidth=LINK,
    network_latency=LATENCY, devices_per_node=8, platform="cpu")
# Per device, unsharded: two matmuls on the matrix units, the relu on the
# vector units (a sixteenth of the peak).
COMPUTE = (2 * B * D * H + 2 * B * H * D) / FLOPS + B * H / (FLOPS / 16)


def mlp(x, w1, w2):
  return jnp.maximum(x @ w1, 0.0) @ w2


def mlp_args():
  k = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k[0], (B, D)),
          jax.random.normal(k[1], (D, H)) / 16,
          jax.random.normal(k[2], (H, D)) / 16)


def exhaustive_best(program: Program, memory_limit: float | None) -> float:
  """The least step time over every layout of every value (one mesh axis)."""
  g, model = program.graph, program.model
  options = [[-1] + list(range(g.rank(v))) for v in range(g.num_values)]
  best = np.inf
  for rows in itertools.product(*options):
    state = np.array(rows, np.int8)[:, None]
    if any(n % 2 for v, d in enumerate(rows) if d >= 0 for n in [g.shapes[v][d]]):
      continue
    tracker = Tracker(model, state)
    if memory_limit is None or tracker.peak_memory <= memory_limit:
      best = min(best, tracker.step_time)
  return best


@pytest.mark.parametrize("shape,names", [((2,), ("x",)), ((2, 2), ("x", "y"))])
def test_unconstrained_optimum_is_data_parallel(shape, names):
  # No plan runs fewer FLOPs per device than COMPUTE / devices, and any
  # collective adds time; tiling the batch over every device reaches that
  # bound with no collective, so it is the optimum, and the only one (any
  # other tiling contracts a tiled dim and must combine partial sums).
  m = mesh(shape, names)
  plan = automap.search(mlp, *mlp_args(), mesh=m, hardware=HW, search="ilp")
  devices = int(np.prod(shape))
  assert plan.stats["status"] == "optimal"
  assert plan.cost.step_time == pytest.approx(COMPUTE / devices, rel=1e-9)
  assert plan.stats["objective"] == pytest.approx(COMPUTE / devices, rel=1e-6)
  assert plan.cost.comm_bytes == {}
  batch = names if len(names) > 1 else names[0]
  assert plan.in_specs == (P(batch), P(), P())  # ties go to fewer bytes held
  assert plan.out_specs == (P(batch),)


def test_memory_limit_forces_megatron():
  # 1.2 MB per device cannot hold both 1 MiB weights whole, nor gather
  # either of them: each must stay halved, and every op can still run half
  # its FLOPs. What remains is the cheapest collective such a plan needs:
  # - w1 by columns (H), w2 by rows (H): all-reduce the partial sums of
  #   y [B, D] (Megatron);
  # - both by columns: all-gather relu(h) [B, H] for dot2;
  # - w1 by rows (D): partial sums of h [B, H] to all-reduce first.
  # With H = 4 D the all-reduce of y moves the fewest bytes.
  m = mesh((2,), ("x",))
  args = mlp_args()
  limit = 1_200_000
  plan = automap.search(mlp, *args, mesh=m, hardware=HW, search="ilp",
                        memory_limit=limit)
  all_reduce = 2 * LATENCY + 2 * (1 / 2) * B * D * 4 / LINK
  all_gather = LATENCY + (1 / 2) * B * H * 4 / LINK
  assert all_reduce < all_gather
  assert plan.stats["status"] == "optimal"
  assert plan.cost.step_time == pytest.approx(COMPUTE / 2 + all_reduce, rel=1e-9)
  assert plan.in_specs[1:] == (P(None, "x"), P("x"))
  assert plan.cost.comm_bytes == {("all-reduce", ("x",)): B * D * 4}
  assert plan.cost.peak_memory <= limit
  report = automap.verify(plan, mlp, *args, mesh=m)
  assert report.max_rel_error < 1e-5
  assert report.comm_error < 0.05, report.table()
  assert report.compiled_memory <= limit


@pytest.mark.parametrize("limit", [None, 1_200_000])
def test_optimum_matches_exhaustive_enumeration(limit):
  program = Program.build(trace.trace(mlp, mlp_args()), MeshSpec(("x",), (2,)),
                          HW)
  result = ilp.solve(program, ilp.SolverSettings(memory_limit=limit))
  tracker = Tracker(program.model, result.state)
  assert result.status == "optimal"
  assert tracker.step_time == pytest.approx(exhaustive_best(program, limit), rel=1e-9)
  assert result.objective == pytest.approx(tracker.step_time, rel=1e-6)


def test_unmeetable_memory_limit_names_the_least_peak():
  m = mesh((2,), ("x",))
  args = mlp_args()
  program = Program.build(trace.trace(mlp, args), MeshSpec.of(m), HW)
  limit = program.memory_lower_bound() * 1.01  # above the bound; below any plan
  with pytest.raises(automap.MemoryLimitError, match=r"least peak .* reaches is [\d,]+ bytes"):
    automap.search(mlp, *args, mesh=m, hardware=HW, search="ilp", memory_limit=limit)


@pytest.mark.slow
def test_train_step_plan_is_faithful_and_no_worse_than_its_warm_start():
  m = mesh((4, 2))
  step, args = gpt_step(SMALL)
  # The budget covers the warm start and building the model too: room for
  # a loaded machine, so the solver itself always gets to a solution.
  # time_tolerance=0: the fastest plan, not the least peak within 1% of it.
  plan = automap.search(step, *args, mesh=m, hardware="cpu", search="ilp",
                        budget=automap.Budget(seconds=40), time_tolerance=0)
  assert plan.stats["status"] in ("optimal", "feasible")
  # (The warm start's time is the search's running sum: equal up to rounding.)
  assert plan.cost.step_time <= plan.stats["warm_start"]["step_time"] * (1 + 1e-9)
  report = automap.verify(plan, step, *args, mesh=m)
  assert report.max_rel_error < 1e-3
  assert report.comm_error < 0.05, report.table()


@pytest.mark.parametrize("shape,names", [
    ((4, 2), ("data", "model")), pytest.param((2,), ("data",), marks=pytest.mark.slow)])
@pytest.mark.slow
def test_solver_objective_is_the_cost_models_price_of_its_solution(shape, names):
  # Feasible solutions included: attention's dots read operands tiled on
  # different contracting dims in some of them unless the model forbids it.
  # The step's embedding lookups are XLA's to route by the layouts their
  # operands arrive in, which the solver takes to be those it wants: within
  # 3% there (which feasible solution the time limit stops at varies with
  # the machine's load), exact elsewhere (the MLP below).
  step, args = gpt_step(SMALL)
  program = Program.build(trace.trace(step, args), MeshSpec(names, shape),
                          automap.HARDWARE["cpu"])
  result = ilp.solve(program, ilp.SolverSettings(seconds=30))
  assert result.status in ("optimal", "feasible")
  assert result.bound <= result.objective
  assert result.objective == pytest.approx(
      Tracker(program.model, result.state).step_time, rel=0.03)


def test_solver_objective_without_lookups_is_exactly_the_price_of_its_solution():
  program = Program.build(trace.trace(mlp, mlp_args()), MeshSpec(("data", "model"), (4, 2)),
                          automap.HARDWARE["cpu"])
  result = ilp.solve(program, ilp.SolverSettings(seconds=12))
  assert result.status == "optimal"
  assert result.objective == pytest.approx(
      Tracker(program.model, result.state).step_time, rel=1e-6)


@pytest.mark.heavy
def test_timeout_falls_back_to_the_warm_start_with_a_warning():
  m = mesh((4, 2))
  step, args = gpt_step(SMALL)
  with pytest.warns(automap.SearchWarning, match="found no solution within"):
    plan = automap.search(step, *args, mesh=m, hardware="cpu", search="ilp",
                          budget=automap.Budget(seconds=0.2))
  assert plan.stats["status"] == "unknown"
  # The warm start, or an expert layout faster than it (`driver.against_experts`).
  if plan.stats["kept"] == "warm start":
    assert plan.cost.step_time == pytest.approx(plan.stats["warm_start"]["step_time"])
  else:
    assert plan.stats["kept"].startswith("expert: ")
    assert plan.cost.step_time < plan.stats["warm_start"]["step_time"]


def test_unknown_search_is_named():
  with pytest.raises(ValueError, match="search must be one of"):
    automap.search(mlp, *mlp_args(), mesh=mesh((2,), ("x",)), search="greedy")


def test_search_method_is_part_of_the_cache_key(tmp_path):
  m = mesh((2,), ("x",))
  a = automap.search(mlp, *mlp_args(), mesh=m, hardware=HW, cache=tmp_path)
  b = automap.search(mlp, *mlp_args(), mesh=m, hardware=HW, cache=tmp_path, search="ilp")
  assert a.stats["strategy"] == "mcts" and b.stats["strategy"] == "ilp"
  assert not b.stats.get("cached")


def test_partition_runs_the_ilp_plan():
  m = mesh((2, 2), ("x", "y"))
  args = mlp_args()
  step = automap.partition(mlp, mesh=m, hardware=HW, search="ilp", cache=False)
  out = step(*args)
  assert step.plan.stats["strategy"] == "ilp"
  np.testing.assert_allclose(out, mlp(*args), rtol=1e-5, atol=1e-5)
  assert out.sharding.spec == step.plan.out_specs[0]


def column_totals(x):
  """Totals of running sums along the rows: the running sum needs whole
  rows, so its result is made replicated or tiled by rows, and the
  totals' reduction reads it so."""
  return jnp.cumsum(jnp.sin(x), axis=1).sum(0)


def test_a_reductions_strategy_is_its_operands_layout_as_priced():
  """A reduction computes in its operand's layout as made and reshards
  only its result: the solver may not price it tiled by columns on an
  operand made whole (a free slice on the way in, which XLA never makes),
  so its objective is the cost model's price of its solution. (The
  exhaustive optimum slices the running sum's result after making it,
  a layout no strategy makes: the solver stays at or above it.)"""
  program = Program.build(trace.trace(column_totals, (jnp.ones((B, D)),)),
                          MeshSpec(("x",), (2,)), HW)
  result = ilp.solve(program, ilp.SolverSettings())
  tracker = Tracker(program.model, result.state)
  assert result.status == "optimal"
  assert result.objective == pytest.approx(tracker.step_time, rel=1e-6)
  assert tracker.step_time >= exhaustive_best(program, None)


@pytest.mark.heavy
@pytest.mark.parametrize("layouts", [
    "data parallel", pytest.param("megatron", marks=pytest.mark.slow),
    pytest.param("fsdp", marks=pytest.mark.slow)])
def test_linear_overlap_model_is_checked_against_the_schedule(layouts):
  """On tpu-v4 the solver minimises a linear model of the overlapped
  schedule (`StepTime.objective`): compute + blocking communication +
  what of the hideable communication compute cannot cover. On the expert
  layouts of a GPT step it lies within 30% of the schedule `Tracker`
  prices, never above the serial sum (counting the all-reduces XLA:TPU
  reassociates away, which the linear model keeps); on XLA:CPU it is the
  serial sum."""
  from automap._src.models.gpt import megatron_specs
  from automap._src.sharding.state import flat_specs

  step, args = gpt_step(SMALL)
  m = mesh((4, 2))
  if layouts == "data parallel":
    specs = (jax.tree.map(lambda _: P(), args[0]), jax.tree.map(lambda _: P(), args[1]),
             P("data"))
  elif layouts == "megatron":
    specs = megatron_specs(args)
  else:
    specs = jax.tree.map(lambda a: P(("data", "model")) if a.shape and a.shape[0] % 8 == 0
                         else P(), args)
  for hardware in ("tpu-v4", "cpu"):
    program = Program.build(trace.trace(step, args, m), MeshSpec.of(m),
                            automap.HARDWARE[hardware])
    state = program.state_from_specs(flat_specs(specs, args))
    form = ilp._Formulation(program, ilp.SolverSettings())
    linear = ilp.linear_seconds(form, form.decisions(state))
    tracker = Tracker(program.model, state)
    if hardware == "cpu":
      assert linear == pytest.approx(tracker.step_time, rel=0.02)
      continue
    assert tracker.step_time < tracker.serial_step_time
    # The linear model prices each all-reduce XLA's reassociation removes
    # (`reassociate`): never above the serial sum with them.
    serial = tracker.serial_step_time + float(tracker.reassociated()[2].sum())
    assert linear <= serial * 1.02
    assert linear == pytest.approx(tracker.step_time, rel=0.3)
