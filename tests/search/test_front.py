"""Memory in the objective: of the plans within `time_tolerance` of the
fastest the search saw, the plan is the one of least peak memory, and the
time/memory front it chose from is reported."""

from __future__ import annotations

import dataclasses

import pytest
from helpers import SMALL, gpt_step, mesh

import automap
from automap._src.cost.tracker import Tracker
from automap._src.plan import planner
from automap._src.search import front
from automap._src.search.actions import ActionSpace
from automap._src.search.mcts import score_of

M = mesh((4, 2))


def _experts():
  # Wide enough for Megatron's activation all-reduces (its vocabulary-
  # parallel embedding's among them) to stay within the front's reach.
  fn, args = gpt_step(dataclasses.replace(SMALL, hidden=256))
  program = planner.build_program(fn, args, M, "tpu-v4")
  space = ActionSpace(program)
  dp, mt = program.initial_state(), program.initial_state()
  space.experts.data_parallel(dp)
  space.experts.data_parallel(mt, [0])
  space.experts.megatron(mt, 1)
  return program, dp, mt


@pytest.mark.heavy
def test_the_least_peak_within_the_tolerance_is_chosen_and_the_front_kept():
  program, dp, mt = _experts()
  t_dp, t_mt = Tracker(program.model, dp), Tracker(program.model, mt)
  # Megatron + DP holds less and is slower: the trade the tolerance decides.
  assert t_mt.peak_memory < t_dp.peak_memory and t_mt.step_time > t_dp.step_time
  ratio = t_mt.step_time / t_dp.step_time
  assert ratio < 2  # within the front's reach
  best, other = (dp, score_of(t_dp, None)), [(mt, score_of(t_mt, None))]
  state, _, points = front.choose(program, other, best, tolerance=0.0)
  assert state is dp
  assert points == [(t_dp.step_time, t_dp.peak_memory), (t_mt.step_time, t_mt.peak_memory)]
  state, score, _ = front.choose(program, other, best, tolerance=ratio - 1 + 1e-6)
  assert state is mt and score[1] == t_mt.step_time
  # A plan over the memory limit never enters the band.
  limit = (t_dp.peak_memory + t_mt.peak_memory) / 2
  state, _, _ = front.choose(program, [(dp, score_of(t_dp, limit))],
                             (mt, score_of(t_mt, limit)), tolerance=0.99)
  assert state is mt


@pytest.mark.heavy
def test_a_wider_tolerance_never_raises_the_peak_and_stays_in_its_band():
  # A batch large enough that splitting it pays for its gradient reductions:
  # plans trade time for memory (at 8 the replicated step is fastest).
  fn, args = gpt_step(batch=64)
  budget = automap.Budget(episodes=40, seconds=60)
  fastest = automap.search(fn, *args, mesh=M, budget=budget, time_tolerance=0.0)
  lean = automap.search(fn, *args, mesh=M, budget=budget, time_tolerance=0.5)
  assert lean.cost.peak_memory <= fastest.cost.peak_memory
  assert lean.cost.step_time <= 1.5 * fastest.stats["front"][0][0] * (1 + 1e-9)
  text = lean.explain()
  assert "time/memory front" in text and "<- the plan" in text


def test_the_default_memory_limit_is_the_devices_capacity():
  fn, args = gpt_step()
  plan = automap.search(fn, *args, mesh=M, hardware="tpu-v4",
                        budget=automap.Budget(episodes=5, seconds=60))
  assert plan.memory_limit == automap.HARDWARE["tpu-v4"].hbm_capacity
  assert "of the 32.0 GiB limit" in plan.explain()
  unlimited = automap.search(fn, *args, mesh=M, memory_limit=None,
                             budget=automap.Budget(episodes=5, seconds=60))
  assert unlimited.memory_limit is None
  with pytest.raises(ValueError, match="time_tolerance must be a fraction"):
    automap.SearchOptions(time_tolerance=1.5)
  with pytest.raises(TypeError, match="'device'"):
    automap.SearchOptions(memory_limit="lots")
