"""`plan.guard.fit_by_compile`: which plans are compiled, in what order, and
what is kept, against a compiler whose allocations are given."""

import jax
import pytest

import automap
from automap import zoo
from automap._src.plan import build, guard, planner
from automap._src.search.request import SearchOptions

pytestmark = pytest.mark.slow  # one search of a step, shared; the tpu tier runs the guard


@pytest.fixture(scope="module")
def searched():
  fn, args = zoo.mlp()
  mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  program = planner.build_program(fn, args, mesh, "tpu-v5p")
  request = SearchOptions(budget=automap.Budget(episodes=30, seconds=600)).resolved(
      program.hardware)
  found = planner.run(program, request)
  return program, found, build.plan_of(program, found, request.memory_limit)


def _compiler(allocations):
  """A compiler allocating the given bytes to the n-th plan it compiles."""
  seen = []

  def compile_plan(plan):
    seen.append(plan)
    memory = allocations[len(seen) - 1]
    return (None, "RESOURCE_EXHAUSTED: out of HBM") if memory is None else (memory, None)
  compile_plan.seen = seen
  return compile_plan


def test_the_best_plan_is_kept_where_it_fits(searched):
  program, found, best = searched
  compiler = _compiler([100.0])
  kept = guard.fit_by_compile(program, found, best, 1000.0, 3, compiler)
  assert kept.in_specs == best.in_specs and len(compiler.seen) == 1
  assert kept.stats["compiled"] == {"limit": 1000.0, "fits": True, "plans": [
      {"step_time": best.cost.step_time, "predicted_peak": best.cost.peak_memory,
       "compiled": 100.0, "refusal": None}]}


def test_runners_up_are_compiled_fastest_first_until_one_fits(searched):
  program, found, best = searched
  if len({s.tobytes() for s, sc in found.candidates if sc[0] <= 0} - {found.state.tobytes()}) < 2:
    pytest.skip("the search saw fewer than two other plans")
  compiler = _compiler([None, 2000.0, 500.0])
  kept = guard.fit_by_compile(program, found, best, 1000.0, 3, compiler)
  tried = kept.stats["compiled"]["plans"]
  assert [t["compiled"] for t in tried] == [None, 2000.0, 500.0]
  assert tried[0]["refusal"].startswith("RESOURCE_EXHAUSTED")
  times = [p.cost.step_time for p in compiler.seen[1:]]
  assert times == sorted(times)  # runners-up fastest first
  assert kept.in_specs == compiler.seen[2].in_specs
  assert len({tuple(map(str, p.in_specs)) + tuple(map(str, p.constraints.values()))
              for p in compiler.seen}) == 3  # three distinct plans


def test_none_fitting_is_an_error_naming_what_the_compiler_said(searched):
  program, found, best = searched
  with pytest.raises(automap.MemoryLimitError, match="compiled 2,000 bytes"):
    guard.fit_by_compile(program, found, best, 1000.0, 1, _compiler([2000.0]))
