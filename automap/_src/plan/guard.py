"""A plan held to the compiler's own allocation: the search's best plans
compiled in turn until one fits the memory limit by the compiler's count."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from automap._src.cost.program import Program
from automap._src.plan import build
from automap._src.plan.plan import Plan
from automap._src.search.driver import Found
from automap._src.search.request import MemoryLimitError

# A plan compiled: (the device bytes the compiler allocates, or None where
# it refused the program; its refusal message, or None).
CompilePlan = Callable[[Plan], tuple[float | None, str | None]]


def fit_by_compile(program: Program, found: Found, best: Plan, limit: float,
                   plans: int, compile_plan: CompilePlan) -> Plan:
  """The first of the search's plans, best first, whose compiled
  allocation fits `limit`: `best`, then the runners-up the search saw that
  its prices put within the limit, fastest first, at most `plans` compiled.

  Args:
    program: the program searched.
    found: the search's result (its state and the candidates it saw).
    best: the plan of `found`, as the search chose it.
    limit: bytes per device the compiled allocation must fit.
    plans: the most plans compiled.
    compile_plan: compiles a plan for the mesh (`CompilePlan`).

  Returns:
    That plan, `stats["compiled"]` recording each plan compiled (its
    predicted step time and peak, the compiled allocation or the refusal)
    and the limit.

  Raises:
    automap.MemoryLimitError: none of the plans compiled fits, with what the
      compiler said of each.
  """
  ranked = [found.state] + [
      s for s, score in sorted(found.candidates, key=lambda c: c[1]) if score[0] <= 0]
  seen, tried, t0 = set(), [], time.perf_counter()
  for i, state in enumerate(ranked):
    if len(tried) >= plans:
      break
    key = state.tobytes()
    if key in seen:
      continue
    seen.add(key)
    plan = best if i == 0 else build.make_plan(program, state, dict(best.stats),
                                               best.memory_limit)
    memory, refusal = compile_plan(plan)
    tried.append({"step_time": plan.cost.step_time, "predicted_peak": plan.cost.peak_memory,
                  "compiled": memory, "refusal": refusal})
    if refusal is None and memory is not None and memory <= limit:
      record = {"limit": limit, "fits": True, "plans": tried}
      kept = dataclasses.replace(plan, stats=dict(plan.stats, compiled=record))
      kept.timings.update(best.timings, compile_check=time.perf_counter() - t0)
      return kept
  said = "; ".join(
      f"plan {i + 1} (predicted {t['predicted_peak']:,.0f} bytes): "
      + (f"refused: {t['refusal']}" if t["refusal"] else f"compiled {t['compiled']:,.0f} bytes")
      for i, t in enumerate(tried))
  raise MemoryLimitError(
      f"verify='compile': none of the {len(tried)} best plans the search found fits "
      f"memory_limit={limit:,.0f} bytes per device by the compiler's own allocation "
      f"({said}). Raise verify_plans, give a larger budget, lower the limit the search "
      "plans to, or use more devices.")


__all__ = ["CompilePlan", "fit_by_compile"]
