"""The learned filter: decisions, their scores once per search, the prior
they give every node, weights, labels and training."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL, gpt_step, graph_network_step, mesh

import automap
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.search import mcts
from automap._src.search.actions import ActionSpace, Tile
from automap._src.search.policy import decisions, features, labels, learned, synthetic, train
from automap._src.search.policy import network as model
from automap._src.search.tactics import expert_states
from automap._src.sharding.mesh import MeshSpec


def space_of(step_args, shape=(4, 2), hardware="tpu-v4"):
  step, args = step_args
  names = ("data", "fsdp", "model")[-len(shape):]
  program = Program.build(trace.trace(step, args), MeshSpec(names, shape),
                          automap.HARDWARE[hardware])
  return ActionSpace(program)


@pytest.fixture(scope="module")
def gpt_space():
  return space_of(gpt_step(SMALL))


@pytest.fixture(scope="module")
def cube_space():
  return space_of(gpt_step(SMALL), shape=(2, 2, 2))


@pytest.fixture(scope="module")
def shipped():
  policy = learned.load()
  assert policy is not None
  return policy


def test_decisions_cover_every_action_once_and_price_one_step(gpt_space):
  dec = decisions.describe(gpt_space)
  actions = list(gpt_space.tactics) + list(gpt_space.tiles)
  assert sum(len(a) for a in dec.actions) == len(actions)
  assert {a for acts in dec.actions for a in acts} == set(actions)
  assert dec.features.shape == (len(dec.keys), decisions.FEATURES)
  assert np.isfinite(dec.features).all()
  # The one-step change in log step time is the tracker's, from the start.
  program = gpt_space.program
  start = program.initial_state()
  base = Tracker(program.model, start).step_time
  dp = next(a for a in gpt_space.tactics if a.name == "data-parallel" and len(a.axes) == 2)
  state = start.copy()
  gpt_space.apply(state, dp)
  want = np.log(Tracker(program.model, state).step_time / base)
  got = dec.features[dec.index[decisions.key_of(gpt_space, dp)], decisions._STEP + 4]
  assert got == pytest.approx(want, abs=1e-5) and want != 0


def test_a_dims_role_is_what_its_readers_factor_rules_make_it():
  """x @ w: w's dim 0 is contracted, its dim 1 carried to the result from
  w alone (free); x's dim 0 is free too, and both read the same wherever
  they sit in the action space."""
  x, w = np.ones((64, 32), np.float32), np.ones((32, 16), np.float32)
  space = space_of((lambda x, w: jnp.tanh(x @ w), (x, w)))
  dec = decisions.describe(space)
  g = space.program.graph
  role = decisions._ROLE
  size = space.program.mesh.axis_sizes[0]
  of = {g.shapes[grp.members[0]]: i for i, grp in enumerate(space.groups)}
  w_rows = dec.features[[dec.index[("tile", of[(32, 16)], d, size)] for d in (0, 1)]]
  np.testing.assert_allclose(w_rows[0, role:role + 4], [1, 0, 0, 0])
  np.testing.assert_allclose(w_rows[1, role:role + 4], [0, 0, 1, 0])
  x_row = dec.features[dec.index[("tile", of[(64, 32)], 0, size)]]
  np.testing.assert_allclose(x_row[role:role + 4], [0, 0, 1, 0])


def test_equal_size_axes_score_alike(cube_space, shipped):
  policy = shipped.with_limit(None)
  state = cube_space.program.initial_state()
  actions = cube_space.legal(state)
  p = policy.priors(cube_space, state, actions)
  by_key: dict = {}
  for action, prior in zip(actions, p[:-1]):
    by_key.setdefault(decisions.key_of(cube_space, action), []).append(prior)
  multi = [v for v in by_key.values() if len(v) > 1]
  assert multi  # (2, 2, 2): every tiling has three interchangeable axes
  for priors in multi:
    np.testing.assert_allclose(priors, priors[0], rtol=1e-12)


def test_prior_is_a_distribution_over_exactly_the_legal_actions(gpt_space, shipped):
  policy = shipped.with_limit(None)
  state = gpt_space.program.initial_state()
  actions = gpt_space.legal(state)
  p = policy.priors(gpt_space, state, actions)
  k = len(actions)
  assert p.shape == (k + 1,)
  assert (p > 0).all() and p.sum() == pytest.approx(1.0)
  # "stop" keeps its uniform share; the actions share the rest as
  # softmax(score / T) mixed with the calibrated uniform share.
  assert p[-1] == pytest.approx(1 / (k + 1))
  dec, scores = policy.scores(gpt_space)
  z = scores[dec.rows_of(gpt_space, actions)] / policy.temperature
  want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  np.testing.assert_allclose(p[:-1] / (1 - p[-1]),
                             (1 - policy.epsilon) * want + policy.epsilon / k, rtol=1e-6)
  gpt_space.apply(state, actions[0])
  fewer = gpt_space.legal(state)
  q = policy.priors(gpt_space, state, fewer)
  assert q.shape == (len(fewer) + 1,) and q.sum() == pytest.approx(1.0)


def test_scores_are_computed_once_per_search(gpt_space, shipped):
  policy = shipped.with_limit(None)
  search = mcts.Search(gpt_space.program, gpt_space, None, 0, policy=policy)
  search.run(60, 60.0)
  expanded = [n for n in search.table.values() if n.actions is not None]
  assert len(expanded) > 1 and policy.forwards == 1
  # Widening admits each node's actions in score order.
  dec, scores = policy.scores(gpt_space)
  for node in expanded:
    s = scores[dec.rows_of(gpt_space, node.actions)]
    assert (np.diff(s) <= 1e-12).all()


def test_the_driver_binds_the_filter_to_the_searchs_memory_limit(gpt_space):
  from automap._src.search import driver

  request = automap.SearchOptions(policy="learned", memory_limit=2e6)
  policy = driver.policy_for(request, gpt_space.program)
  assert isinstance(policy, learned.LearnedPolicy) and policy.memory_limit == 2e6
  dec, _ = policy.scores(gpt_space)
  assert (dec.features[:, decisions._SETTING] == 1).all()


@pytest.mark.heavy
def test_network_runs_under_jit_on_padded_batches_without_recompiling(shipped):
  traces = []
  net = model.PolicyNet(shipped.width, shipped.rounds)

  def apply(params, batch):
    traces.append(1)
    return net.apply({"params": params}, batch)

  fn = jax.jit(apply)
  batches = []
  for nodes in (300, 400):  # two programs of one bucket
    space = space_of(graph_network_step(nodes, 2 * nodes, 8), shape=(2, 4))
    batches.append(learned.batch_of(space, decisions.describe(space)))
  assert [b.graph.nodes.shape for b in batches] == [batches[0].graph.nodes.shape] * 2
  for b in batches:
    logits = fn(shipped.params, b)
    k = int(b.action_mask.sum())
    assert np.isfinite(np.asarray(logits[:k])).all()
    assert (np.asarray(logits[k:]) == model.NEG).all()
  assert len(traces) == 1


def test_shipped_weights_are_small_and_of_this_schema(shipped):
  assert os.path.getsize(learned.DEFAULT_WEIGHTS) < 4 * 2**20
  assert learned.digest().startswith(features.SCHEMA)
  assert 0 < shipped.epsilon <= 1


def test_unusable_weights_fall_back_to_uniform_with_a_warning(tmp_path):
  missing = tmp_path / "none.npz"
  with pytest.warns(learned.PolicyWarning, match="no policy weights"):
    assert learned.load(str(missing)) is None
  corrupt = tmp_path / "corrupt.npz"
  corrupt.write_bytes(b"not a zip file")
  with pytest.warns(learned.PolicyWarning, match="unreadable"):
    assert learned.load(str(corrupt)) is None
  with np.load(learned.DEFAULT_WEIGHTS) as data:
    arrays = {k: data[k] for k in data.files}
  foreign = tmp_path / "foreign.npz"
  np.savez(foreign, **(arrays | {"__schema__": np.array("automap-policy-features/2")}))
  with pytest.warns(learned.PolicyWarning, match="trained on features"):
    assert learned.load(str(foreign)) is None
  damaged = tmp_path / "damaged.npz"
  key = next(k for k in arrays if not k.startswith("__"))
  np.savez(damaged, **(arrays | {key: np.zeros((3, 1), np.float32)}))
  with pytest.warns(learned.PolicyWarning, match="do not fit"):
    assert learned.load(str(damaged)) is None
  # A search given such a file still runs, with uniform priors.
  x = np.ones((16, 32), np.float32)
  w = np.ones((32, 32), np.float32)
  with pytest.warns(learned.PolicyWarning):
    plan = automap.search(lambda x, w: x @ w, x, w, mesh=mesh((4, 2)), policy=str(corrupt),
                          budget=automap.Budget(episodes=10))
  assert plan.stats["policy"] == "uniform"


@pytest.mark.heavy
def test_searches_take_the_learned_filter_by_default():
  step, args = gpt_step(SMALL)
  m = mesh((4, 2))
  guided = automap.search(step, *args, mesh=m, budget=automap.Budget(episodes=30))
  uniform = automap.search(step, *args, mesh=m, budget=automap.Budget(episodes=30),
                           policy="uniform")
  assert guided.stats["policy"] == "learned" and uniform.stats["policy"] == "uniform"
  report = automap.verify(guided, step, *args, mesh=m)
  assert report.max_rel_error < 1e-3 and report.comm_error < 0.05
  with pytest.raises(TypeError, match="policy must be"):
    automap.search(step, *args, mesh=m, policy=3)


def test_past_the_filters_size_the_search_runs_and_reports_uniform_priors(monkeypatch):
  step, args = gpt_step(SMALL)
  monkeypatch.setattr(learned, "MAX_VALUES", 10)  # this program has hundreds of values
  plan = automap.search(step, *args, mesh=mesh((4, 2)), budget=automap.Budget(episodes=10))
  assert plan.stats["policy"] == "uniform"


def test_labels_are_the_share_of_near_best_plans_taking_each_decision(gpt_space):
  dec = decisions.describe(gpt_space)
  experts = expert_states(gpt_space.program, gpt_space)
  dp, megatron = experts["data parallel"], experts["Megatron"]
  y = labels.labels(gpt_space, dec, [dp, megatron])
  assert y.shape == (len(dec.keys),) and set(np.unique(y)) <= {0.0, 0.5, 1.0}
  row = lambda action: dec.index[decisions.key_of(gpt_space, action)]  # noqa: E731
  every = next(a for a in gpt_space.tactics if a.name == "data-parallel" and len(a.axes) == 2)
  last = next(a for a in gpt_space.tactics if a.name == "megatron"
              and a.axes == (gpt_space.real_axes[-1],))
  assert y[row(every)] == 0.5  # one plan of two takes data parallelism
  assert y[row(last)] >= 0.5  # and one Megatron
  # Each plan contains exactly the decisions that label it.
  one = labels.labels(gpt_space, dec, [dp])
  layouts = labels.tactic_layouts(gpt_space, dec)
  start = gpt_space.program.initial_state()
  np.testing.assert_array_equal(one, labels.contains(gpt_space, dec, dp, layouts, start))
  # A tiling is taken where an axis of its size tiles that dim of the group.
  g = gpt_space.program.graph
  batch_group = next(i for i, grp in enumerate(gpt_space.groups)
                     if grp.members[0] in gpt_space.data)
  size = gpt_space.program.mesh.axis_sizes[0]
  assert one[dec.index[("tile", batch_group, 0, size)]] == 1
  assert g.rank(gpt_space.groups[batch_group].members[0]) >= 1


@pytest.mark.heavy
def test_teachers_find_near_best_plans_within_one_percent(gpt_space):
  found = labels.plans(gpt_space.program, gpt_space, None,
                       labels.Teachers(seeds=1, episodes=20, uniform_seeds=0, refine_tries=50))
  best = labels.near_best(found)
  assert best and len({s.tobytes() for s in best}) == len(best)
  top = found[0][1]
  scores = {s.tobytes(): sc for s, sc in found}
  assert all(scores[s.tobytes()][1] <= top[1] * (1 + labels.NEAR) for s in best)
  experts = expert_states(gpt_space.program, gpt_space).values()
  priced = [mcts.score_of(Tracker(gpt_space.program.model, s), None) for s in experts]
  assert not any(mcts.better(p, top) for p in priced)  # no expert beats the teachers


@pytest.mark.slow
def test_a_few_training_steps_lower_the_loss(tmp_path):
  teachers = labels.Teachers(seeds=1, episodes=15, uniform_seeds=0, refine_tries=30)
  train.generate(str(tmp_path), 3, [0, 1], teachers, workers=1, log=lambda s: None)
  examples = [train.load_example(str(tmp_path), i) for i in (0, 1)]
  assert all(e.labels.max() > 0 for e in examples)
  net = model.PolicyNet(16, 1)
  params = net.init(jax.random.key(0), examples[0].batch)["params"]
  before = train.evaluate(16, 1, params, examples)
  params, history = train.fit(examples, [], epochs=4, seed=0, width=16, rounds=1,
                              learning_rate=3e-3, log=lambda s: None)
  after = train.evaluate(16, 1, params, examples)
  assert after["bce"] + after["listwise"] < before["bce"] + before["listwise"]
  assert history[-1]["train_loss"] < history[0]["train_loss"]
  assert 0 < train.calibrate(16, 1, params, examples) <= 1


def test_a_deep_policy_guides_nodes_below_the_policy_depth(gpt_space):
  class Counting:
    def __init__(self):
      self.calls = 0

    def priors(self, space, state, actions):
      self.calls += 1
      return np.full(len(actions) + 1, 1.0 / (len(actions) + 1))

    def value(self, space, state):
      return None

  shallow, deep = Counting(), Counting()
  search = mcts.Search(gpt_space.program, gpt_space, None, 0, policy=shallow,
                       settings=mcts.MCTSSettings(policy_depth=0), deep_policy=deep)
  search.run(100, 60.0)
  expanded = [n for n in search.table.values() if n.actions is not None]
  assert shallow.calls == 1 and deep.calls == len(expanded) - 1 > 0


def test_the_corpus_holds_out_whole_families_and_samples_limits():
  rng = np.random.default_rng(0)
  samples = [synthetic.sample(rng) for _ in range(100)]
  names = {train.family_of(s[0]) for s in samples}
  assert len(names) == len(synthetic.FAMILIES) >= 8
  held = ("t5", "vit", "moe", "encoder", "expert", "mp", "graph", "ssm")
  assert not any(n.lower().startswith(held) for n in names)
  limits = [s[5] for s in samples]
  assert any(x is None for x in limits) and all(x is None or 0.3 <= x <= 0.9 for x in limits)
  assert {len(s[3]) for s in samples} == {2, 3}


def test_weights_are_written_byte_for_byte_reproducibly(tmp_path, shipped):
  a, b = tmp_path / "a.npz", tmp_path / "b.npz"
  for path in (a, b):
    learned.save(str(path), shipped.params, shipped.width, shipped.rounds,
                 shipped.temperature, shipped.epsilon)
  assert a.read_bytes() == b.read_bytes()
  again = learned.load(str(a))
  assert again is not None and again.epsilon == shipped.epsilon


def test_every_action_maps_to_one_decision_row(gpt_space):
  dec = decisions.describe(gpt_space)
  state = gpt_space.program.initial_state()
  actions = gpt_space.legal(state)
  rows = dec.rows_of(gpt_space, actions)
  assert len(rows) == len(actions) and rows.max() < len(dec.keys)
  tile = next(a for a in actions if isinstance(a, Tile))
  assert tile in dec.actions[dec.index[decisions.key_of(gpt_space, tile)]]


def test_expert_parallelism_is_described_as_the_tiling_it_is(shipped):
  # In the tilings' columns: the expert dim of every layer's experts, each
  # read as a batch dim by the contractions that apply them; the shipped
  # filter scores it and the prior covers it.
  from automap._src.models import moe

  space = space_of(moe.make_train_step("einsum", experts=8, width=64, hidden=128, groups=8,
                                       group_size=32, layers=2, abstract=True), shape=(2, 4))
  dec = decisions.describe(space)
  ep = next(a for a in space.tactics if a.name == "expert" and a.axes == (1,))
  row = dec.features[dec.index[decisions.key_of(space, ep)]]
  assert row[decisions._KIND] == 1 and row[decisions._DIM] == 1
  roles = row[decisions._ROLE:decisions._ROLE + 4]
  assert roles[1] == roles.max() > 0  # batch
  assert row[decisions._STEP + 9] == 1  # it changes the start state
  state = space.program.initial_state()
  actions = space.legal(state)
  assert ep in actions
  p = shipped.with_limit(None).priors(space, state, actions)
  assert p.shape == (len(actions) + 1,) and (p > 0).all() and p.sum() == pytest.approx(1.0)


def test_decisions_of_one_outcome_are_scored_once(gpt_space):
  """Data parallelism on an axis and a tiling of the batch's propagation
  class over it lay out the same values the same way: one keeps its score,
  the rest drop to the least, so widening tries distinct plans first."""
  dec = decisions.describe(gpt_space)
  data = gpt_space.real_axes[0]
  dp = next(a for a in gpt_space.tactics if a.name == "data-parallel" and a.axes == (data,))
  same = np.flatnonzero(dec.outcome == dec.outcome[dec.index[decisions.key_of(gpt_space, dp)]])
  assert len(same) > 1
  logits = np.linspace(0.0, 1.0, len(dec.keys))
  scored = learned.distinct(dec, logits)
  kept = same[np.argmax(logits[same])]
  assert scored[kept] == logits[kept]
  assert (scored[same[same != kept]] == logits.min()).all()
  alone = np.bincount(dec.outcome) == 1
  only = alone[dec.outcome]
  np.testing.assert_array_equal(scored[only], logits[only])


def test_a_prior_whose_plans_all_overflow_is_retried_with_uniform_priors(gpt_space):
  """A prior that only ever stops leaves the replicated start, over a limit
  data parallelism meets: the driver searches again with uniform priors."""
  from automap._src.search import driver

  class Stopping:
    def priors(self, space, state, actions):
      return np.append(np.zeros(len(actions)), 1.0)

    def value(self, space, state):
      return None

  program = gpt_space.program
  start = Tracker(program.model, program.initial_state()).peak_memory
  dp = Tracker(program.model, expert_states(program, gpt_space)["data parallel"]).peak_memory
  assert dp < start
  request = automap.SearchOptions(memory_limit=(dp + start) / 2,
                                  budget=automap.Budget(episodes=30, progress=False))
  found = driver.run_mcts(program, gpt_space, request, 60.0, Stopping())
  assert found.stats["uniform_after"] > 0 and found.score[0] == 0
