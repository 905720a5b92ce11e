"""The accelerator model: area, operator latency, and the operator-scheduling ILP
against hand-worked cases, a brute force over every schedule and lower bounds."""

import itertools
import math
import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from automap._src.cluster.accelerator import chip as acc_lib
from automap._src.cluster.accelerator import scheduling as scheduling_lib
from automap._src.cluster.accelerator.chip import (
  AREA_BUDGET,
  TPU_V4_LIKE,
  Accelerator,
  AcceleratorError,
  Op,
  latency,
)
from automap._src.cluster.accelerator.scheduling import (
  schedule,
  schedule_latencies,
  schedule_layers,
)

MiB = 2**20


def intervals(s, single, spread, cores):
  """Per core, the (start, end) of every op that holds it."""
  ends = s.ends(single, spread)
  held = [[] for _ in range(cores)]
  for i, (a, b) in enumerate(zip(s.start, ends)):
    for c in (range(cores) if s.spread[i] else [s.core[i]]):
      held[c].append((a, b))
  return held


def check_valid(s, single, spread, edges, cores):
  n = len(single)
  assert len(s.start) == len(s.spread) == len(s.core) == n
  assert s.status in ("optimal", "feasible")
  ends = s.ends(single, spread)
  tol = 1e-9 * max(s.makespan, 1e-30)
  assert math.isclose(s.makespan, max(ends, default=0.0), rel_tol=1e-12)
  assert all(x >= 0 for x in s.start)
  for i in range(n):
    assert (s.core[i] == -1) == s.spread[i]
    assert s.spread[i] or 0 <= s.core[i] < cores
  for i, j in edges:
    assert s.start[j] >= ends[i] - tol, (i, j)
  for held in intervals(s, single, spread, cores):
    held.sort()
    for (_, b), (c, _) in zip(held, held[1:]):
      assert c >= b - tol


def brute_force(single, spread, edges, cores):
  """The least makespan over every placement and every order consistent with
  the edges, each op as early as both allow (every schedule is no better)."""
  n = len(single)
  preds = [[i for i, j in edges if j == k] for k in range(n)]
  orders = [p for p in itertools.permutations(range(n))
            if all(p.index(i) < p.index(j) for i, j in edges)]
  best = math.inf
  for place in itertools.product(range(-1, cores), repeat=n):
    for order in orders:
      free = [0.0] * cores
      end = [0.0] * n
      for i in order:
        used = range(cores) if place[i] < 0 else (place[i],)
        start = max([end[p] for p in preds[i]] + [free[c] for c in used])
        end[i] = start + (spread[i] if place[i] < 0 else single[i])
        for c in used:
          free[c] = end[i]
      best = min(best, max(end))
  return best


def random_dag(rng, n, density):
  return [(i, j) for j in range(n) for i in range(j) if rng.random() < density]


def lower_bounds(single, spread, edges, cores):
  best = [min(a, b) for a, b in zip(single, spread)]
  finish = list(best)
  for i, j in sorted(edges, key=lambda e: e[1]):  # sources precede targets
    finish[j] = max(finish[j], finish[i] + best[j])
  return max(finish), sum(min(a, b * cores) for a, b in zip(single, spread)) / cores


# --- scheduling ---------------------------------------------------------------


def test_two_independent_ops_run_side_by_side_when_spreading_gains_too_little():
  s = schedule_latencies([4.0, 4.0], [2.5, 2.5], [], cores=2)
  assert s.makespan == pytest.approx(4.0)
  assert s.spread == (False, False) and sorted(s.core) == [0, 1]
  assert s.start == (0.0, 0.0) and s.status == "optimal"


def test_two_independent_ops_run_spread_back_to_back_when_spreading_pays():
  s = schedule_latencies([4.0, 4.0], [1.5, 1.5], [], cores=2)
  assert s.makespan == pytest.approx(3.0)
  assert s.spread == (True, True) and s.core == (-1, -1)
  assert sorted(s.start) == pytest.approx([0.0, 1.5])


def test_chain_runs_in_order():
  single, spread = [2.0, 3.0, 1.0], [1.5, 1.0, 0.8]
  edges = [(0, 1), (1, 2)]
  s = schedule_latencies(single, spread, edges, cores=4)
  check_valid(s, single, spread, edges, 4)
  # Nothing runs beside a chain, so each op takes its faster mode.
  assert s.makespan == pytest.approx(1.5 + 1.0 + 0.8)
  assert s.start == pytest.approx((0.0, 1.5, 2.5))


def test_diamond():
  # 0 -> {1, 2} -> 3: the middle pair runs side by side on one core each.
  single, spread = [1.0, 4.0, 4.0, 1.0], [0.5, 3.0, 3.0, 0.5]
  edges = [(0, 1), (0, 2), (1, 3), (2, 3)]
  s = schedule_latencies(single, spread, edges, cores=2)
  check_valid(s, single, spread, edges, 2)
  assert s.makespan == pytest.approx(0.5 + 4.0 + 0.5)
  assert s.spread == (True, False, False, True)
  assert s.core[1] != s.core[2]
  assert s.start == pytest.approx((0.0, 0.5, 0.5, 4.5))


@pytest.mark.parametrize("seed", range(6))
def test_small_random_dags_match_brute_force(seed):
  rng = random.Random(seed)
  n, cores = 5, 2
  single = [rng.uniform(1, 10) for _ in range(n)]
  spread = [x / cores * rng.uniform(0.7, 2.0) for x in single]
  edges = random_dag(rng, n, 0.3)
  s = schedule_latencies(single, spread, edges, cores)
  check_valid(s, single, spread, edges, cores)
  best = brute_force(single, spread, edges, cores)
  assert s.status == "optimal"
  # Optimal in integer ticks; a tick moves no latency by more than 0.05%.
  assert best * (1 - 1e-12) <= s.makespan <= best * (1 + 1e-3)


@pytest.mark.parametrize("seed,cores", [(0, 2), (1, 4), (2, 8)])
def test_random_dag_of_15_ops_is_valid_and_above_its_lower_bounds(seed, cores):
  rng = random.Random(seed)
  n = 15
  single = [rng.uniform(1, 10) for _ in range(n)]
  spread = [x / cores * rng.uniform(0.8, 2.5) for x in single]
  edges = random_dag(rng, n, 0.2)
  s = schedule_latencies(single, spread, edges, cores, seconds=2.0)
  check_valid(s, single, spread, edges, cores)
  path, work = lower_bounds(single, spread, edges, cores)
  assert s.makespan >= path * (1 - 1e-12) and s.makespan >= work * (1 - 1e-12)
  # Never worse than either trivial schedule: everything spread, in sequence,
  # or everything on one core.
  assert s.makespan <= min(sum(spread), sum(single)) * (1 + 1e-3)
  # No worse than the greedy schedule that seeds the solver.
  greedy = schedule_latencies(single, spread, edges, cores, seconds=0)
  check_valid(greedy, single, spread, edges, cores)
  assert s.makespan <= greedy.makespan * (1 + 1e-12)


def test_time_limit_is_honoured_on_a_larger_instance():
  rng = random.Random(7)
  n, cores = 60, 8
  single = [rng.uniform(1, 10) for _ in range(n)]
  spread = [x / cores * rng.uniform(0.8, 2.5) for x in single]
  edges = random_dag(rng, n, 0.05)
  began = time.perf_counter()
  s = schedule_latencies(single, spread, edges, cores, seconds=1.0)
  assert time.perf_counter() - began < 3.0
  check_valid(s, single, spread, edges, cores)


def test_zero_latencies_and_no_ops():
  assert schedule_latencies([], [], [], cores=4).makespan == 0.0
  single, spread = [0.0, 2.0, 0.0], [0.0, 1.0, 0.0]
  edges = [(0, 1), (1, 2)]
  s = schedule_latencies(single, spread, edges, cores=2)
  check_valid(s, single, spread, edges, 2)
  assert s.makespan == pytest.approx(1.0)


def test_one_core_takes_the_faster_mode():
  s = schedule_latencies([3.0, 1.0], [2.0, 2.0], [], cores=1)
  assert s.makespan == pytest.approx(3.0) and s.spread == (True, False)


@pytest.mark.parametrize("edges", [[(0, 1), (1, 0)], [(0, 1), (1, 2), (2, 0)]])
def test_cyclic_edges_are_rejected(edges):
  with pytest.raises(AcceleratorError, match="cycle"):
    schedule_latencies([1.0] * 3, [1.0] * 3, edges, cores=2)


@pytest.mark.parametrize("single,spread,edges,cores,match", [
    ([1.0, 1.0], [1.0], [], 2, "one latency per op"),
    ([1.0, -1.0], [1.0, 1.0], [], 2, "single latencies"),
    ([1.0, 1.0], [1.0, math.nan], [], 2, "spread latencies"),
    ([1.0, 1.0], [1.0, 1.0], [(0, 2)], 2, "edge"),
    ([1.0, 1.0], [1.0, 1.0], [(1, 1)], 2, "edge"),
    ([1.0, 1.0], [1.0, 1.0], [], 0, "cores"),
])
def test_bad_scheduling_inputs_are_rejected(single, spread, edges, cores, match):
  with pytest.raises(AcceleratorError, match=match):
    schedule_latencies(single, spread, edges, cores)


def layer(prefix):
  ops = [Op.matmul(f"{prefix}.qkv", m=512, n=3 * 1024, k=1024),
         Op.matmul(f"{prefix}.scores", m=512, n=512, k=64, batch=16),
         Op(f"{prefix}.softmax", "vector", elements=16 * 512 * 512, bytes=4 * 16 * 512 * 512),
         Op.matmul(f"{prefix}.mix", m=512, n=64, k=512, batch=16),
         Op.matmul(f"{prefix}.out", m=512, n=1024, k=1024),
         Op(f"{prefix}.norm", "vector", elements=8 * 512 * 1024, bytes=4 * 512 * 1024)]
  return ops, [(0, 1), (0, 3), (1, 2), (2, 3), (3, 4), (4, 5)]


def test_schedule_on_an_accelerator_uses_its_latencies():
  ops, edges = layer("l0")
  s = schedule(ops, edges, TPU_V4_LIKE, seconds=2.0)
  single = [latency(op, TPU_V4_LIKE, 1) for op in ops]
  spread = [latency(op, TPU_V4_LIKE, TPU_V4_LIKE.tensor_units) for op in ops]
  check_valid(s, single, spread, edges, TPU_V4_LIKE.tensor_units)
  # A chain but for one edge: the sum of each op's faster mode, nearly.
  assert s.makespan <= sum(map(min, single, spread)) * (1 + 1e-3)


def test_schedule_layers_solves_each_distinct_layer_once(monkeypatch):
  calls = []
  solve = scheduling_lib.schedule
  monkeypatch.setattr(scheduling_lib, "schedule", lambda *a, **k: calls.append(a) or solve(*a, **k))
  other = ([Op.matmul("x", m=256, n=256, k=256)], [])
  got = schedule_layers([layer("l0"), layer("l1"), other, layer("l2")], TPU_V4_LIKE, seconds=1)
  assert len(calls) == 2
  assert got[0] is got[1] is got[3] and got[2] is not got[0]


# --- latency ------------------------------------------------------------------


def test_latency_by_hand():
  acc = Accelerator(tensor_units=2, array=128, vector_units=1, vector_width=128,
                    buffer=64 * MiB, hbm_bandwidth=1e12, clock=1e9)
  op = Op.matmul("mm", m=256, n=384, k=1000)  # 2 x 3 tiles, 1000 + 256 cycles each
  cycle = 1e-9
  one = acc_lib.latency_breakdown(op, acc, 1)
  assert one.compute == pytest.approx(6 * 1256 * cycle)
  assert one.memory == pytest.approx(op.bytes / 0.5e12)
  assert one.total == pytest.approx(6 * 1256 * cycle + acc_lib.DISPATCH_CYCLES * cycle)
  both = acc_lib.latency_breakdown(op, acc, 2)
  assert both.compute == pytest.approx(3 * 1256 * cycle)
  assert both.overhead == pytest.approx((acc_lib.DISPATCH_CYCLES + acc_lib.SYNC_CYCLES) * cycle)
  vec = Op("add", "vector", elements=1e6, bytes=0)
  assert latency(vec, acc, 1) == pytest.approx(1e6 / 64 * cycle + acc_lib.DISPATCH_CYCLES * cycle)


def test_traffic_restreams_only_past_the_buffer():
  op = Op.matmul("mm", m=4096, n=4096, k=4096)  # 96 MiB at 2 bytes
  assert acc_lib.hbm_traffic(op, 128 * MiB) == op.bytes
  # The smaller input (32 MiB) fits in half the buffer: it stays resident.
  assert acc_lib.hbm_traffic(op, 64 * MiB) == op.bytes
  blocked = acc_lib.hbm_traffic(op, 16 * MiB)
  assert blocked > op.bytes
  assert acc_lib.hbm_traffic(op, 4 * MiB) > blocked
  vec = Op("gelu", "vector", elements=1e9, bytes=4e9)
  assert acc_lib.hbm_traffic(vec, 1.0) == vec.bytes  # a stream reuses nothing


accelerators = st.builds(
    Accelerator,
    tensor_units=st.integers(1, 16),
    array=st.sampled_from([16, 32, 64, 128, 256]),
    vector_units=st.integers(1, 8),
    vector_width=st.sampled_from([32, 64, 128, 256]),
    buffer=st.floats(1 * MiB, 512 * MiB),
    hbm_bandwidth=st.floats(1e11, 5e12),
)
tensor_ops = st.builds(
    lambda m, n, k, batch, itemsize: Op.matmul("mm", m=m, n=n, k=k, batch=batch,
                                               itemsize=itemsize),
    st.integers(1, 16384), st.integers(1, 16384), st.integers(1, 16384), st.integers(1, 64),
    st.sampled_from([1, 2, 4]))
vector_ops = st.builds(lambda e, b: Op("v", "vector", elements=e, bytes=b),
                       st.floats(0, 1e10), st.floats(0, 1e11))
ops = st.one_of(tensor_ops, vector_ops)
bigger = {"vector_units": lambda a: a.vector_units * 2,
          "vector_width": lambda a: a.vector_width * 2,
          "hbm_bandwidth": lambda a: a.hbm_bandwidth * 1.7,
          "buffer": lambda a: a.buffer * 3}


def no_slower(new, old):
  return new <= old * (1 + 1e-12)


@given(accelerators, ops, st.sampled_from(sorted(bigger)), st.data())
def test_more_resources_are_never_slower(acc, op, field, data):
  cores = data.draw(st.integers(1, acc.tensor_units))
  more = Accelerator(**{**acc.__dict__, field: bigger[field](acc)})
  assert no_slower(latency(op, more, cores), latency(op, acc, cores))


@given(accelerators, ops, st.integers(1, 16))
def test_more_tensor_units_never_slow_a_spread_op(acc, op, extra):
  # From one unit to two an op starts paying to synchronise the cores.
  if acc.tensor_units == 1:
    acc = Accelerator(**{**acc.__dict__, "tensor_units": 2})
  more = Accelerator(**{**acc.__dict__, "tensor_units": acc.tensor_units + extra})
  assert no_slower(latency(op, more, more.tensor_units), latency(op, acc, acc.tensor_units))


@given(accelerators, ops, st.data())
def test_spreading_never_slows_the_compute(acc, op, data):
  cores = data.draw(st.integers(1, acc.tensor_units))
  wider = data.draw(st.integers(cores, acc.tensor_units))
  assert no_slower(acc_lib.latency_breakdown(op, acc, wider).compute,
                   acc_lib.latency_breakdown(op, acc, cores).compute)
  assert no_slower(acc_lib.latency_breakdown(op, acc, wider).memory,
                   acc_lib.latency_breakdown(op, acc, cores).memory)


@given(accelerators, st.integers(1, 8), st.integers(1, 8), st.integers(1, 8192),
       st.integers(1, 8), st.sampled_from(["one", "all"]))
def test_a_larger_array_is_never_slower_on_large_ops(acc, mi, ni, k, batch, where):
  # M and N multiples of the larger array, with a tile of it for every core.
  if acc.array > 128:
    acc = Accelerator(**{**acc.__dict__, "array": 128})
  larger = Accelerator(**{**acc.__dict__, "array": 2 * acc.array})
  side = larger.array
  batch *= acc.tensor_units
  op = Op.matmul("mm", m=mi * side, n=ni * side, k=k, batch=batch)
  cores = 1 if where == "one" else acc.tensor_units
  assert no_slower(latency(op, larger, cores), latency(op, acc, cores))


def test_latency_rejects_bad_core_counts():
  op = Op.matmul("mm", m=128, n=128, k=128)
  for cores in (0, TPU_V4_LIKE.tensor_units + 1, 1.5):
    with pytest.raises(AcceleratorError, match="cores"):
      latency(op, TPU_V4_LIKE, cores)


@pytest.mark.parametrize("kwargs,match", [
    ({"kind": "conv"}, "kind"),
    ({"kind": "tensor", "m": 0}, "m must"),
    ({"kind": "tensor", "elements": 5}, "elements"),
    ({"kind": "vector", "k": 8}, "vector op"),
    ({"kind": "vector", "bytes": -1}, "bytes"),
    ({"kind": "vector", "elements": math.inf}, "elements"),
])
def test_bad_ops_are_rejected(kwargs, match):
  with pytest.raises(AcceleratorError, match=match):
    Op("x", **kwargs)


# --- area ---------------------------------------------------------------------


def test_baseline_fills_the_budget():
  assert TPU_V4_LIKE.area() == AREA_BUDGET
  assert AREA_BUDGET == pytest.approx(acc_lib.BASELINE_AREA)
  assert sum(acc_lib.BASELINE_SHARES.values()) == pytest.approx(1.0)
  assert TPU_V4_LIKE.peak_flops == pytest.approx(2 * 8 * 128**2 * 1.05e9)


@pytest.mark.parametrize("field,value", [
    ("tensor_units", 16), ("array", 256), ("vector_units", 4), ("vector_width", 256),
    ("buffer", 256 * MiB), ("hbm_bandwidth", 2.4e12)])
def test_more_of_anything_costs_area(field, value):
  more = Accelerator(**{**TPU_V4_LIKE.__dict__, field: value})
  assert more.area() > AREA_BUDGET


def test_doubling_tensor_units_adds_their_share():
  double = Accelerator(tensor_units=16)
  share = acc_lib.BASELINE_SHARES["mac"]
  assert double.area() == pytest.approx(AREA_BUDGET * (1 + share))


def test_area_model_is_swappable():
  model = acc_lib.AreaModel(mac=0.0, lane=0.0, sram=0.0, hbm=0.0, fixed=100.0)
  assert Accelerator(tensor_units=64).area(model) == 100.0
  with pytest.raises(AcceleratorError, match="shares"):
    acc_lib.AreaModel.calibrated(TPU_V4_LIKE, 400.0, {"mac": 1.0})


@pytest.mark.parametrize("field,value,match", [
    ("tensor_units", 0, "positive int"),
    ("tensor_units", True, "positive int"),
    ("vector_units", 1.5, "positive int"),
    ("array", 100, "power of two.*64 or 128"),
    ("buffer", -1.0, "positive finite"),
    ("clock", math.inf, "positive finite"),
    ("hbm_bandwidth", "fast", "positive finite"),
])
def test_bad_accelerators_are_rejected(field, value, match):
  with pytest.raises(AcceleratorError, match=f"Accelerator.{field}.*{match}"):
    Accelerator(**{field: value})
