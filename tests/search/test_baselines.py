"""Priors that learn nothing (one-step lookahead, the oracle) and the
measurement that compares priors: episodes to a fixed target, censored."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL, gpt_step

import automap
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.search import mcts
from automap._src.search.actions import ActionSpace, Tactic
from automap._src.search.policy import baselines, compare
from automap._src.search.tactics import expert_states
from automap._src.sharding.mesh import MeshSpec


@pytest.fixture(scope="module")
def space():
  step, args = gpt_step(SMALL)
  program = Program.build(trace.trace(step, args), MeshSpec(("data", "model"), (4, 2)),
                          automap.HARDWARE["tpu-v4"])
  return ActionSpace(program)


def _priced(space, state, action, limit=None):
  """log(step seconds) (+ log excess over `limit`) after `action`, priced
  from scratch."""
  s = state.copy()
  space.apply(s, action)
  t = Tracker(space.program.model, s)
  cost = np.log(t.step_time)
  if limit is not None and t.peak_bound() > limit:
    cost += max(0.0, np.log(t.peak_memory / limit))
  return cost


def test_lookahead_prices_each_action_one_step_ahead(space):
  program = space.program
  state = program.initial_state()
  actions = space.legal(state)
  policy = baselines.LookaheadPolicy(program)
  p = policy.priors(space, state, actions)
  assert p.shape == (len(actions) + 1,) and np.isclose(p.sum(), 1) and (p > 0).all()
  base = np.log(Tracker(program.model, state).step_time)
  want = np.array([_priced(space, state, a) for a in actions]) - base
  np.testing.assert_allclose(policy.changes(space, state, actions)[:-1], want, atol=1e-9)
  # The prior falls as the priced change rises: the softmax of -change.
  k = np.argsort(want, kind="stable")
  assert (np.diff(p[:-1][k]) <= 1e-12).all()
  assert np.argmax(p[:-1]) == np.argmin(want) and want.min() < 0
  # Its working state is left where it was asked about; a state's changes
  # are priced once.
  priced = policy.priced
  policy.priors(space, state, actions)
  assert policy.priced == priced


def test_lookahead_charges_the_excess_over_a_memory_limit(space):
  program = space.program
  state = program.initial_state()
  dp = expert_states(program, space)["data parallel"]
  limit = 0.5 * Tracker(program.model, dp).peak_memory
  actions = space.legal(state)
  policy = baselines.LookaheadPolicy(program, limit)
  t = Tracker(program.model, state)
  base = np.log(t.step_time) + max(0.0, np.log(t.peak_memory / limit))
  want = np.array([_priced(space, state, a, limit) for a in actions]) - base
  np.testing.assert_allclose(policy.changes(space, state, actions)[:-1], want, atol=1e-9)
  free = np.array([_priced(space, state, a) for a in actions]) - np.log(t.step_time)
  assert not np.allclose(want, free), "the limit changes what an action is worth"


def test_oracle_puts_the_known_path_first(space):
  state = space.program.initial_state()
  actions = space.legal(state)
  path = [actions[7], actions[2]]
  p = baselines.OraclePolicy(path).priors(space, state, actions)
  assert np.isclose(p.sum(), 1) and (p > 0).all()
  assert p[7] > p[2] > p[0] and np.allclose(np.delete(p, [2, 7]), p[0])
  # With none of its actions legal it is uniform.
  q = baselines.OraclePolicy(path).priors(space, state, actions[8:])
  assert np.allclose(q, 1 / (len(actions) - 7))


def test_an_oracle_search_follows_its_path_to_the_plan(space):
  program = space.program
  path = [Tactic("megatron", (1,)), Tactic("data-parallel", (0,))]
  state = program.initial_state()
  for action in path:
    space.apply(state, action)
  target = mcts.score_of(Tracker(program.model, state), None)
  run = compare.run(program, space, baselines.OraclePolicy(path), 0, target, None, cap=100,
                    final_episodes=20)
  assert run.episodes <= 2 * len(path)
  uniform = compare.run(program, space, None, 0, target, None, cap=100, final_episodes=20)
  assert run.episodes <= uniform.episodes


def test_runs_are_censored_and_end_on_a_refined_plan(space):
  program = space.program
  root = mcts.score_of(Tracker(program.model, program.initial_state()), None)
  unreachable = (0.0, root[1] * 1e-6)
  run = compare.run(program, space, None, 0, unreachable, None, cap=30, final_episodes=20)
  assert run.episodes == np.inf and run.seconds == np.inf and run.capped > 0
  searched = mcts.Search(program, space, None, 0).run(20, float("inf")).score
  assert run.final[1] <= searched[1] and run.final[0] == 0
  assert compare.Run.from_json(run.to_json()) == run
  # The root is its own target at episode 0.
  assert compare.run(program, space, None, 0, root, None, cap=30, final_episodes=5).episodes == 0
  assert compare.within((0.0, 1.009), (0.0, 1.0)) and not compare.within((0.0, 1.02), (0.0, 1.0))
  assert not compare.within((1.0, 0.5), (0.0, 1.0))


def test_a_tilings_only_space_has_no_tactics_and_runs_end_at_the_target(space):
  program = space.program
  tiles = ActionSpace(program, with_tactics=False)
  state = program.initial_state()
  legal = tiles.legal(state)
  assert legal and not tiles.tactics and all(not isinstance(a, Tactic) for a in legal)
  assert [a for a in space.legal(state) if not isinstance(a, Tactic)] == legal
  dp = expert_states(program, space)["data parallel"]
  target = mcts.score_of(Tracker(program.model, dp), None)
  run = compare.run(program, tiles, None, 0, target, None, cap=300, final_episodes=None)
  assert np.isfinite(run.episodes) and compare.within(run.final, target)


def test_searches_take_the_lookahead_prior_on_request():
  x = np.ones((64, 128), np.float32)
  w1 = np.ones((128, 256), np.float32)
  w2 = np.ones((256, 128), np.float32)

  def mlp(x, w1, w2):
    return (jnp.tanh(x @ w1) @ w2).sum()

  m = jax.make_mesh((4, 2), ("data", "model"))
  guided = automap.search(mlp, x, w1, w2, mesh=m, budget=automap.Budget(episodes=12),
                          policy="lookahead")
  uniform = automap.search(mlp, x, w1, w2, mesh=m, budget=automap.Budget(episodes=12),
                           policy="uniform")
  assert guided.stats["policy"] == "lookahead" and uniform.stats["policy"] == "uniform"
  # A prior reorders the search; it never makes the plan found worse here,
  # where the best plan is one step from replication.
  assert guided.cost.step_time <= uniform.cost.step_time * 1.001
  with pytest.raises(TypeError, match="'lookahead'"):
    automap.search(mlp, x, w1, w2, mesh=m, policy=3)
