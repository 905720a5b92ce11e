"""Refinement: single-layout moves after MCTS reach plans no tiling sequence
expresses, never make a plan worse, and keep a step's carried state in the
layout it came in; climbing adds the tilings untiling cannot."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL, gpt_step, mesh

import automap
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.search import ilp, mcts
from automap._src.search.actions import ActionSpace
from automap._src.search.refine import Refiner, climb, refine_best
from automap._src.sharding.mesh import MeshSpec

EXPERTS, WIDTH, HIDDEN, TOKENS, CAPACITY = 8, 64, 256, 256, 64


def moe(router, wi, wo, x):
  """Top-1 mixture of experts (Switch-style dense dispatch)."""
  probs = jax.nn.softmax(x @ router)
  onehot = jax.nn.one_hot(jnp.argmax(probs, -1), EXPERTS, dtype=x.dtype)
  slot = (jnp.cumsum(onehot, axis=0) - 1) * onehot
  dispatch = onehot[:, :, None] * jax.nn.one_hot(slot.astype(jnp.int32), CAPACITY,
                                                 dtype=x.dtype)
  h = jax.nn.gelu(jnp.einsum("tec,tm,emh->ech", dispatch, x, wi))
  out = jnp.einsum("tec,ech,ehm->tm", dispatch, h, wo)
  return out * (probs * onehot).sum(-1, keepdims=True)


def moe_step(params, x):
  grads = jax.grad(lambda p: jnp.mean(moe(*p, x) ** 2))(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def moe_args():
  k = jax.random.split(jax.random.key(0), 4)
  return ((jax.random.normal(k[0], (WIDTH, EXPERTS)),
           jax.random.normal(k[1], (EXPERTS, WIDTH, HIDDEN)) / 8,
           jax.random.normal(k[2], (EXPERTS, HIDDEN, WIDTH)) / 16),
          jax.random.normal(k[3], (TOKENS, WIDTH)))


def program_of(fn, args, shape, names=("data",)):
  return Program.build(trace.trace(fn, args), MeshSpec(names, shape),
                       automap.HARDWARE["cpu"])


@pytest.mark.heavy
def test_refinement_keeps_the_router_whole_beside_expert_parallel_weights():
  # Tiling the experts spreads, through the one-hot dispatch, into the
  # router's [tokens, experts] softmax, whose reductions then each pay a
  # collective. The optimum (the ILP's, derived per value) stops at the
  # dispatch; MCTS alone cannot, refinement of its runners-up does.
  args = moe_args()
  program = program_of(moe_step, args, (8,))
  searched = mcts.Search(program, ActionSpace(program), None).run(200, 60)
  optimum = ilp.solve(program, ilp.SolverSettings(seconds=60))
  assert optimum.status == "optimal"
  m = mesh((8,), ("data",))
  plan = automap.search(moe_step, *args, mesh=m, hardware="cpu",
                        budget=automap.Budget(episodes=200))
  assert plan.stats["refine_moves"] > 0
  assert plan.cost.step_time < 0.8 * searched.score[1]
  assert plan.cost.step_time <= optimum.objective * 1.02
  router, wi, wo, x = plan.in_specs
  assert router == jax.sharding.PartitionSpec()
  assert wi == wo == jax.sharding.PartitionSpec("data")
  report = automap.verify(plan, moe_step, *args, mesh=m)
  assert report.max_rel_error < 1e-4
  assert report.comm_error < 0.05, report.table()


@pytest.mark.parametrize("tactic", ["data-parallel", "megatron", "fsdp"])
def test_refinement_never_worsens_a_plan_and_keeps_carried_state_in_place(tactic):
  step, args = gpt_step(SMALL)
  program = program_of(step, args, (4, 2), ("data", "model"))
  space = ActionSpace(program)
  state = program.initial_state()
  for action in space.tactics:
    if action.name == tactic:
      space.apply(state, action)
      break
  before = mcts.score_of(Tracker(program.model, state), None)
  refined, score, moves = Refiner(program, space.colour, None).run(state, 30)
  assert score <= before
  # The running score is the re-priced one (up to summation order).
  assert score == pytest.approx(mcts.score_of(Tracker(program.model, refined), None),
                                rel=1e-9)
  assert (moves > 0) == (score < before)
  for v, u in program.carried_pairs():
    if (state[v] == state[u]).all():
      assert (refined[v] == refined[u]).all()


def _at_fsdp_peak():
  """The small GPT step on (4, 2), its FSDP layout (every argument over
  both axes) and a memory limit just above that layout's peak."""
  step, args = gpt_step(SMALL)
  program = program_of(step, args, (4, 2), ("data", "model"))
  space = ActionSpace(program)
  fsdp = program.initial_state()
  space.experts.fsdp(fsdp, 0)
  space.experts.fsdp(fsdp, 1)
  return program, space, fsdp, Tracker(program.model, fsdp).peak_memory * 1.001


def test_refinement_stays_within_the_memory_limit():
  program, space, state, limit = _at_fsdp_peak()
  refined, score, _ = Refiner(program, space.colour, limit).run(state, 30)
  assert score[0] == 0.0
  assert Tracker(program.model, refined).peak_memory <= limit


def test_refinement_without_time_returns_the_best_candidate_unchanged():
  program = program_of(moe_step, moe_args(), (8,))
  space = ActionSpace(program)
  run = mcts.Search(program, space, None)
  run.run(20, 60)
  candidates = [(n.state, n.score) for n in run.table.values()]
  state, score, moves = refine_best(program, space, candidates, None, 0.0)
  assert moves == 0 and score == run.best.score
  np.testing.assert_array_equal(state, run.best.state)


def test_climbing_takes_the_best_action_while_it_helps_and_reaches_the_limit():
  """Replicated, the GPT step is over a limit at FSDP's peak; untiling
  cannot help it, each climb's round takes the action of best score (the
  limit's excess first), and the climb ends at a plan within the limit
  that no single action improves."""
  program, space, _, limit = _at_fsdp_peak()
  start = program.initial_state()
  assert mcts.score_of(Tracker(program.model, start), limit)[0] > 0
  untiled, _, moves = Refiner(program, space.colour, limit).run(start, 30)
  assert moves == 0
  climbed, score, priced = climb(program, space, start, limit, float("inf"))
  assert score[0] == 0.0 and Tracker(program.model, climbed).peak_memory <= limit
  assert score == pytest.approx(mcts.score_of(Tracker(program.model, climbed), limit))
  # A local optimum: no legal action from it beats it.
  for action in space.legal(climbed):
    after = climbed.copy()
    space.apply(after, action)
    assert not mcts.better(mcts.score_of(Tracker(program.model, after), limit), score)
  assert priced >= len(space.legal(start))
  # Bounded by tries: one round prices every legal action, then it stops.
  _, _, once = climb(program, space, start, limit, 1)
  assert once == len(space.legal(start))
