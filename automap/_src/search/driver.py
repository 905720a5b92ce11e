"""The search driver: a program and a request in, the best state found out.

`run` checks the memory limit and runs the requested backend: MCTS followed
by refinement of its best plans, or the ILP warm-started from MCTS.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings

from rich import progress as progress_lib

from automap._src.cost.hardware import Hardware
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import constraints as constraints_lib
from automap._src.search import front as front_lib
from automap._src.search import ilp, mcts, refine
from automap._src.search.actions import ActionSpace
from automap._src.search.request import (
  MemoryLimitError,
  SearchOptions,
  SearchWarning,
  bytes_per_device,
)
from automap._src.search.tactics import expert_states
from automap._src.sharding import propagation_kernels as kernels
from automap._src.sharding.state import State


@dataclasses.dataclass
class Found:
  """What a search found: its best state and how it got there."""

  state: State
  score: mcts.Score  # (bytes over the memory limit, step seconds)
  stats: dict  # what the inputs determine: saved with the plan
  timings: dict[str, float]  # wall seconds of this run: kept on the Plan only
  # Other plans the search saw, (state, score): where the time/memory front is.
  candidates: list = dataclasses.field(default_factory=list, repr=False)


def check_memory_limit(program: Program, memory_limit: float | None) -> None:
  if memory_limit is None:
    return
  if not memory_limit > 0:
    raise MemoryLimitError(
        f"memory_limit must be a positive number of bytes, got {memory_limit!r}.")
  bound = program.memory_lower_bound()
  if memory_limit < bound:
    raise MemoryLimitError(
        f"memory_limit={memory_limit:,.0f} bytes per device is below the "
        f"lower bound of {bound:,.0f} bytes (arguments and results spread "
        f"evenly over {program.mesh.num_devices} devices). Raise the limit "
        "or use more devices.")


def policy_for(request: SearchOptions, program: Program) -> mcts.Policy | None:
  """The priors `request.policy` names: None for uniform ones, the
  cost model's one-step lookahead, else the learned policy (flax and jraph
  are imported only then)."""
  if request.policy == "uniform":
    return None
  limit = bytes_per_device(request.memory_limit, program.hardware)
  if request.policy == "lookahead":
    from automap._src.search.policy.baselines import LookaheadPolicy

    return LookaheadPolicy(program, limit)
  from automap._src.search.policy import learned

  if not 0 < program.graph.num_values <= learned.MAX_VALUES:
    # Past its size the filter steps aside: uniform priors, and the plan's
    # stats say "uniform", as the search that ran.
    return None
  shipped = learned.cached(None if request.policy == "learned" else request.policy)
  return None if shipped is None else shipped.with_limit(limit)


def run(program: Program, request: SearchOptions, policy: mcts.Policy | None = None) -> Found:
  """The best state the requested backend finds for `program`. `policy`
  guides MCTS (default: the one `request.policy` names, `policy_for`).
  The request's memory limit is resolved against the program's hardware
  here, once: every step below reads the resolved one."""
  request = request.resolved(program.hardware)
  check_memory_limit(program, request.memory_limit)
  policy = policy if policy is not None else policy_for(request, program)
  space = ActionSpace(program, request.hints.groups)
  try:
    if request.search == "ilp":
      found = _ilp(program, space, request, policy)
    else:
      found = _mcts(program, space, request, request.budget.seconds, policy)
    if ((program.constraints == constraints_lib.HINTS and program.has_constraints)
        or (request.start == "your layout" and program.has_user_layout)):
      found = from_user_layout(program, space, request, found)
    found = with_least_memory(program, found, request.time_tolerance)
    found = as_compiled(program, found, request.memory_limit)
    return against_experts(program, space, found, request.memory_limit,
                           request.time_tolerance)
  except SystemError as e:
    # Ctrl-C landing inside a compiled kernel's call (while numba compiles,
    # loads or boxes) surfaces as a SystemError around it.
    if kernels.interrupted(e):
      raise KeyboardInterrupt from None
    raise


# Share of the seconds MCTS leaves to refining its best plans, and the
# moves refinement may try per episode of the budget: bounded by tries, not
# by the clock, a search is reproducible. It ends sooner when no move helps.
_REFINE_SHARE = 0.2
_REFINE_TRIES = 10


def run_mcts(program: Program, space: ActionSpace, request: SearchOptions,
             seconds: float, policy: mcts.Policy | None = None) -> Found:
  """MCTS (uniform priors where `policy` is None), then refinement of its
  best plans (`search/refine.py`)."""
  return _mcts(program, space, request.resolved(program.hardware), seconds, policy)


def _mcts(program: Program, space: ActionSpace, request: SearchOptions,
          seconds: float, policy: mcts.Policy | None) -> Found:
  """`run_mcts` for a request whose memory limit is resolved."""
  t0 = time.perf_counter()
  budget = request.budget
  run = mcts.Search(program, space, request.memory_limit, request.seed, policy=policy,
                    settings=mcts.MCTSSettings(policy_depth=getattr(policy, "depth", None)))
  show = budget.progress if budget.progress is not None else sys.stderr.isatty()
  searching = seconds * (1 - _REFINE_SHARE)
  if not show:
    result = run.run(budget.episodes, searching, patience=budget.patience)
  else:
    with progress_lib.Progress(
        *progress_lib.Progress.get_default_columns(),
        progress_lib.TextColumn("{task.fields[best]}"), transient=True) as bar:
      task = bar.add_task(f"automap: searching {program.mesh}",
                          total=budget.episodes, best="")
      result = run.run(budget.episodes, searching, lambda s: bar.update(
          task, completed=s.episodes,
          best=f"best {s.best.score[1] * 1e3:.3f} ms, {s.best.score[0]:,.0f} B over"),
          patience=budget.patience)
  stats = {"strategy": "mcts", "policy": "uniform" if policy is None else getattr(
               policy, "name", "learned"),
           "episodes": result.episodes,
           "episode_of_best": result.episode_of_best,
           "improved_at": list(run.improved_at),
           "evaluations": result.evaluations, "states": result.nodes,
           "actions": [space.describe(a) for a in result.path],
           "groups": len(space.groups)}
  start = time.perf_counter()
  state, score, finished, seen = finish(program, space, run, request.memory_limit,
                                        budget.episodes, seconds - (start - t0), request.seed,
                                        retry=policy is not None, patience=budget.patience)
  stats.update(finished)
  return Found(state, score, stats,
               {"search": time.perf_counter() - t0, "to_best": result.seconds_to_best,
               "refine": time.perf_counter() - start}, seen)


def finish(program: Program, space: ActionSpace, search: mcts.Search,
           memory_limit: float | None, episodes: int, seconds: float, seed: int = 0,
           retry: bool = False, patience: int | None = None
           ) -> tuple[State, mcts.Score, dict, list]:
  """A search's final plan: refinement of the plans it saw
  (`refine.refine_best`, `_REFINE_TRIES` moves per episode of `episodes`)
  within `seconds`, and with `retry` (a prior led it), where every plan
  is over the memory limit, the same episodes (and `patience`) again with
  uniform priors, whose order tries the tactics first, and refinement over both
  searches' plans. Returns (state, score, stats, every plan seen). The
  user's search and the policy benchmark (`policy/compare.py`) both end
  here, so what is measured is what ships."""
  deadline = time.perf_counter() + seconds
  seen = [(n.state, n.score) for n in search.table.values()]
  state, score, moves = refine.refine_best(program, space, seen, memory_limit, seconds,
                                           _REFINE_TRIES * episodes)
  stats = {}
  if retry and score[0] > 0:
    left = deadline - time.perf_counter()
    again = mcts.Search(program, space, memory_limit, seed)
    again.run(episodes, max(left, 0.0) * (1 - _REFINE_SHARE), patience=patience)
    seen += [(n.state, n.score) for n in again.table.values()]
    retried = refine.refine_best(program, space, seen, memory_limit,
                                 deadline - time.perf_counter(), _REFINE_TRIES * episodes)
    stats["uniform_after"] = again.episodes
    if mcts.better(retried[1], score):
      state, score, moves = retried
  stats["refine_moves"] = moves
  return state, score, stats, seen


def from_user_layout(program: Program, space: ActionSpace, request: SearchOptions,
                     found: Found) -> Found:
  """The better of `found` and the program's own layout refined (its
  constraints as hints: refinement may leave any of them whole; the
  arguments' stated layouts as a start). So a program with hints is never
  planned worse than the same program without them, and a search started
  from your layout never ends worse than it."""
  start = program.user_layout()
  score = mcts.score_of(Tracker(program.model, start), request.memory_limit)
  state, score, moves = refine.refine_best(
      program, space, [(start, score)], request.memory_limit,
      request.budget.seconds * _REFINE_SHARE, _REFINE_TRIES * request.budget.episodes)
  seen = found.candidates + [(found.state, found.score), (state, score)]
  if not mcts.better(score, found.score):
    return dataclasses.replace(found, stats=dict(found.stats, start="search"), candidates=seen)
  return Found(state, score, dict(found.stats, start="your layout", refine_moves=moves),
               found.timings, seen)


# Points of the time/memory front a plan keeps in its stats.
_FRONT_POINTS = 12


def with_least_memory(program: Program, found: Found, tolerance: float) -> Found:
  """`found` as the plan of least peak among those the search saw within
  `tolerance` of its step time (`search/front.py`), the front in its stats."""
  state, score, points = front_lib.choose(program, found.candidates,
                                          (found.state, found.score), tolerance)
  stats = dict(found.stats, front=[[t, m] for t, m in points[:_FRONT_POINTS]])
  if state is not found.state:
    stats["least_memory"] = {"step_time": found.score[1], "chosen_step_time": score[1]}
  return dataclasses.replace(found, state=state, score=score, stats=stats)


# Runners-up whose sealed values are laid out as XLA lays them out
# (`Program.as_compiled`) before a plan is kept.
_RESEALED = 4


def as_compiled(program: Program, found: Found, limit: float | None) -> Found:
  """`found` re-priced with the values inside sealed calls laid out as XLA's
  propagation lays them out, or the best of the search's few best plans so
  re-priced: the search scores them as its own propagation spreads them."""
  if not program.sealed_inside.any():
    return found
  seen, best = set(), None
  ranked = [(found.state, found.score)] + sorted(found.candidates, key=lambda c: c[1])
  for state, _ in ranked:
    key = state.tobytes()
    if key in seen:
      continue
    seen.add(key)
    state = program.as_compiled(state)
    score = mcts.score_of(Tracker(program.model, state), limit)
    if best is None or score < best[1]:
      best = (state, score)
    if len(seen) == _RESEALED:
      break
  return dataclasses.replace(found, state=best[0], score=best[1])


def against_experts(program: Program, space: ActionSpace, found: Found,
                    limit: float | None, tolerance: float = 0.0) -> Found:
  """`found`, or the best of the expert strategies (`tactics.EXPERTS`: FSDP
  splits every argument over every axis, FSDP+TP adds Megatron on the last)
  where one beats it: within the memory limit where `found` is not, or
  faster by more than `tolerance` (the share of step time `found` may have
  given up for memory). A search never returns worse than the hand-written
  layouts on its own mesh, however short its budget."""
  best, over = found, found.score[0] > 0
  for name, state in expert_states(program, space).items():
    state = program.as_compiled(state)
    score = mcts.score_of(Tracker(program.model, state), limit)
    better = score < best.score if over else (
        score[0] <= 0 and score[1] * (1 + tolerance) < best.score[1])
    if better:
      best = Found(state, score, dict(found.stats, kept=f"expert: {name}"), found.timings,
                   found.candidates + [(state, score)])
      over = score[0] > 0
  return best


# Share of Budget.seconds the ILP's warm start (MCTS) may take.
_WARM_SHARE = 0.25


def run_ilp(program: Program, space: ActionSpace, request: SearchOptions,
            policy: mcts.Policy | None = None) -> Found:
  """Solves the ILP from MCTS's best plan (a warm start within a quarter of
  the budget's seconds) and keeps the better of the two; on a timeout
  without a solution, the warm start, with a warning."""
  return _ilp(program, space, request.resolved(program.hardware), policy)


def _ilp(program: Program, space: ActionSpace, request: SearchOptions,
         policy: mcts.Policy | None) -> Found:
  """`run_ilp` for a request whose memory limit is resolved."""
  t0 = time.perf_counter()
  limit, budget = request.memory_limit, request.budget
  warm = _mcts(program, space, request, budget.seconds * _WARM_SHARE, policy)
  result = ilp.solve(program, ilp.SolverSettings(
      seconds=budget.seconds - (time.perf_counter() - t0), memory_limit=limit,
      seed=request.seed), hint=warm.state)
  timings = {"search": time.perf_counter() - t0, "warm_start": warm.timings["search"]}
  stats = {"strategy": "ilp", "status": result.status, "memory_rounds": result.rounds,
           "choices": result.ops, "variables": result.variables,
           "objective": result.objective, "bound": result.bound,
           "warm_start": {k: warm.stats[k] for k in ("episodes", "actions")}
           | {"step_time": warm.score[1]}}
  if result.status == "infeasible":
    least, at = result.least_memory
    g = program.graph
    raise MemoryLimitError(
        f"no strategy meets memory_limit={limit:,.0f} bytes per device: the "
        f"least peak any choice of per-op strategies reaches is {least:,.0f} "
        f"bytes, at op {at} ({g.prims[at]} in {g.scopes[at] or 'the top level'!r}). "
        "Raise the limit or use more devices.")
  if result.state is None:
    warnings.warn(SearchWarning(
        f"search='ilp' found no solution within {budget.seconds:g} s "
        f"({result.variables:,} variables); using its warm start, MCTS's best "
        "plan, instead. Give a larger Budget(seconds=...) or use search='mcts'."),
        stacklevel=4)
    return Found(warm.state, warm.score, dict(stats, kept="warm start"), timings,
                 warm.candidates)
  score = mcts.score_of(Tracker(program.model, result.state), limit)
  seen = warm.candidates + [(result.state, score)]
  if warm.score < score:  # the solver's classes could not express the start
    return Found(warm.state, warm.score, dict(stats, kept="warm start"), timings, seen)
  return Found(result.state, score, stats, timings, seen + [(warm.state, warm.score)])


# Device counts above this get the shapes practice uses, not every one.
_EVERY_SHAPE = 64
# Tensor-parallel widths tried at scale: within a node, at most 16.
_TENSOR = (1, 2, 4, 8, 16)


def mesh_shapes(devices: int, hardware: Hardware | None = None) -> list[tuple[int, ...]]:
  """The ways to lay `devices` out as a mesh of 1 to 3 axes, each of size
  at least 2 (one axis of 1 for a single device). Above 64 devices, the
  shapes large runs use (their axis roles major to minor): (fsdp, tensor)
  for tensor widths of 1-16 that fit a node or slice of `hardware`, and
  where the devices span several, (data, fsdp, tensor) with `data` the
  slices or nodes, each axis's collectives on its own links."""
  if devices == 1:
    return [(1,)]
  if devices <= _EVERY_SHAPE:
    out = [(devices,)]
    for a in range(2, devices):
      if devices % a == 0:
        out.append((a, devices // a))
        for b in range(2, devices // a):
          if (devices // a) % b == 0 and devices // a // b > 1:
            out.append((a, b, devices // a // b))
    return sorted(out, key=len)
  node = hardware.devices_per_node if hardware is not None else devices
  spans = devices // node if devices > node and devices % node == 0 else 1
  out = []
  for t in _TENSOR:
    if devices % t or t > node:
      continue
    rest = devices // t
    out.append(tuple(n for n in (rest, t) if n > 1))
    if spans > 1 and rest % spans == 0 and rest // spans > 1:
      out.append(tuple(n for n in (spans, rest // spans, t) if n > 1))
  return sorted(set(out), key=lambda s: (len(s), s))


__all__ = ["Found", "against_experts", "as_compiled", "check_memory_limit", "finish",
           "mesh_shapes", "run", "run_ilp", "run_mcts"]
