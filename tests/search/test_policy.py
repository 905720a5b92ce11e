"""The learned policy: features, the network under jit, weights, training."""

import numpy as np
import pytest
from helpers import SMALL, gpt_step, graph_network_step, mesh

import automap
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.search import mcts
from automap._src.search.actions import ActionSpace
from automap._src.search.policy import features, learned, synthetic, train
from automap._src.search.policy import network as model
from automap._src.sharding.mesh import MeshSpec


def space_of(step_args, shape=(4, 2), hardware="tpu-v4"):
  step, args = step_args
  program = Program.build(trace.trace(step, args), MeshSpec(("data", "model"), shape),
                          automap.HARDWARE[hardware])
  return ActionSpace(program)


@pytest.fixture(scope="module")
def gpt_space():
  return space_of(gpt_step(SMALL))


@pytest.fixture(scope="module")
def shipped():
  policy = learned.load()
  assert policy is not None
  return policy


def test_features_describe_classes_layouts_costs_and_actions(gpt_space):
  space = gpt_space
  state = space.program.initial_state()
  featurize = features.Featurizer(space)
  actions = space.legal(state)
  before = featurize(state, actions)
  g = space.program.graph
  classes = len(np.unique(space.colour))
  assert before.nodes.shape == (classes, features.NODE_FEATURES) and classes < g.num_values
  assert before.actions.shape == (len(actions) + 1, features.ACTION_FEATURES)
  assert before.action_group[-1] == -1 and before.actions[-1, 2] == 1  # stop
  assert len(before.senders) == len(before.receivers) == len(before.edges) > 0
  assert before.senders.max() < classes and before.receivers.max() < classes
  # Each group's member weights sum to one over its classes.
  m = before.members
  for i in range(len(space.groups)):
    assert m[m[:, 1] == i, 2].sum() == pytest.approx(1.0)
  # The classes' shares of compute and communication add up to the step's.
  assert before.nodes[:, -2].sum() == pytest.approx(before.globals[features.MAX_AXES + 8])
  assert before.nodes[:, -1].sum() == pytest.approx(before.globals[features.MAX_AXES + 9],
                                                    abs=1e-6)
  # Nothing encodes the space's order: the same action reads the same
  # wherever it is listed.
  flipped = featurize(state, actions[::-1])
  np.testing.assert_array_equal(flipped.actions[:-1], before.actions[:-1][::-1])
  space.apply(state, actions[0])  # data parallelism on every axis
  after = featurize(state, space.legal(state))
  tiled = np.unique(features.Featurizer(space).cls[(state >= 0).any(axis=1)])
  changed = np.flatnonzero((before.nodes != after.nodes).any(axis=1))
  assert set(tiled) <= set(changed)  # every class with a newly tiled member reads differently
  model = space.program.model
  speed = np.log(Tracker(model, state).step_time
                 / Tracker(model, space.program.initial_state()).step_time)
  assert after.globals[features.MAX_AXES + 10] == pytest.approx(speed, abs=1e-6)
  assert after.globals[features.MAX_AXES + 9] > 0  # data parallelism communicates


@pytest.mark.heavy
def test_network_runs_under_jit_on_padded_batches_without_recompiling(shipped):
  traces = []
  net = model.PolicyNet(shipped.width, shipped.rounds)

  def apply(params, batch):
    traces.append(1)
    return net.apply({"params": params}, batch)

  import jax
  fn = jax.jit(apply)
  batches = []
  for nodes in (300, 400):  # two programs of one bucket
    space = space_of(graph_network_step(nodes, 2 * nodes, 8), shape=(2, 4))
    state = space.program.initial_state()
    f = features.Featurizer(space)(state, space.legal(state))
    batches.append(model.pad(f))
  assert [b.graph.nodes.shape for b in batches] == [batches[0].graph.nodes.shape] * 2
  for b in batches:
    logits = fn(shipped.params, b)
    k = int(b.action_mask.sum())
    assert np.isfinite(np.asarray(logits[:k])).all()
    assert (np.asarray(logits[k:]) == model.NEG).all()
  assert len(traces) == 1


def test_prior_is_a_distribution_over_exactly_the_legal_actions(gpt_space, shipped):
  state = gpt_space.program.initial_state()
  actions = gpt_space.legal(state)
  p = shipped.priors(gpt_space, state, actions)
  assert p.shape == (len(actions) + 1,)
  assert (p > 0).all() and p.sum() == pytest.approx(1.0)
  # "stop" keeps its uniform share; the actions share the rest as
  # softmax(logits / T) mixed with a uniform share.
  k = len(actions)
  assert p[-1] == pytest.approx(1 / (k + 1))
  z = shipped.logits(gpt_space, state, actions)[:k] / shipped.temperature
  want = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
  np.testing.assert_allclose(p[:-1] / (1 - p[-1]),
                             (1 - learned.EPSILON) * want + learned.EPSILON / k, rtol=1e-5)
  gpt_space.apply(state, actions[0])
  fewer = gpt_space.legal(state)
  assert shipped.priors(gpt_space, state, fewer).shape == (len(fewer) + 1,)


def test_forward_passes_are_cached_per_state(gpt_space, shipped):
  policy = learned.LearnedPolicy(shipped.params, shipped.width, shipped.rounds)
  search = mcts.Search(gpt_space.program, gpt_space, None, 0, policy=policy)
  search.run(60, 60.0)
  expanded = [n for n in search.table.values() if n.actions is not None]
  assert policy.forwards == len(expanded) > 1  # every depth, once per state
  again = mcts.Search(gpt_space.program, gpt_space, None, 1, policy=policy)
  again.run(1, 60.0)  # the root's priors: already known
  assert policy.forwards == len(expanded)


def test_shipped_weights_are_small_and_of_this_schema():
  import os
  assert os.path.getsize(learned.DEFAULT_WEIGHTS) < 4 * 2**20
  assert learned.digest().startswith(features.SCHEMA)


def test_unusable_weights_fall_back_to_uniform_with_a_warning(tmp_path, shipped):
  missing = tmp_path / "none.npz"
  with pytest.warns(learned.PolicyWarning, match="no policy weights"):
    assert learned.load(str(missing)) is None
  corrupt = tmp_path / "corrupt.npz"
  corrupt.write_bytes(b"not a zip file")
  with pytest.warns(learned.PolicyWarning, match="unreadable"):
    assert learned.load(str(corrupt)) is None
  other = tmp_path / "other.npz"
  with np.load(learned.DEFAULT_WEIGHTS) as data:
    arrays = {k: data[k] for k in data.files}
  np.savez(other, **(arrays | {"__schema__": np.array("automap-policy-features/1")}))
  with pytest.warns(learned.PolicyWarning, match="trained on features"):
    assert learned.load(str(other)) is None
  # A search given such a file still runs, with uniform priors.
  x = np.ones((16, 32), np.float32)
  w = np.ones((32, 32), np.float32)
  with pytest.warns(learned.PolicyWarning):
    plan = automap.search(lambda x, w: x @ w, x, w, mesh=mesh((4, 2)), policy=str(corrupt),
                          budget=automap.Budget(episodes=10))
  assert plan.stats["policy"] == "uniform"


@pytest.mark.heavy
def test_searches_take_the_shipped_policy_on_request():
  step, args = gpt_step(SMALL)
  m = mesh((4, 2))
  guided = automap.search(step, *args, mesh=m, budget=automap.Budget(episodes=30),
                          policy="learned")
  uniform = automap.search(step, *args, mesh=m, budget=automap.Budget(episodes=30))
  assert guided.stats["policy"] == "learned" and uniform.stats["policy"] == "uniform"
  report = automap.verify(guided, step, *args, mesh=m)
  assert report.max_rel_error < 1e-3 and report.comm_error < 0.05
  with pytest.raises(TypeError, match="policy must be"):
    automap.search(step, *args, mesh=m, policy=3)


@pytest.mark.heavy
def test_a_few_training_steps_lower_the_loss():
  examples = []
  for index in range(2):
    ex, known = train.examples_of(3, index, None, 16, 1, None, 20, 40, 0)
    examples += ex
    assert known.score[1] > 0
  assert examples and all(abs(ex.target.sum() - 1) < 1e-6 for ex in examples)
  net = model.PolicyNet(16, 1)
  import jax
  params = net.init(jax.random.key(0), examples[0].batch)["params"]
  before = train.evaluate(16, 1, params, examples)["cross_entropy"]
  params, history = train.train(examples, [], epochs=3, seed=0, width=16, rounds=1,
                                learning_rate=3e-3, log=lambda s: None)
  assert train.evaluate(16, 1, params, examples)["cross_entropy"] < before
  assert history[-1]["train_loss"] < history[0]["train_loss"]


def test_targets_are_each_actions_progress_to_the_best_plan(gpt_space):
  state = gpt_space.program.initial_state()
  actions = gpt_space.legal(state)
  best = state.copy()
  gpt_space.apply(best, actions[0])  # the best plan: one action away
  gain = train.progress(gpt_space, state, actions, best)
  assert gain[0] == (best != state).sum() and gain[-1] == 0
  assert gain.max() == gain[0]
  t = train.target_of(gain)
  assert t.sum() == pytest.approx(1) and t[0] == t.max() and t[-1] == 0
  assert (t[gain <= 0] == 0).all()
  # At the best plan nothing makes progress: no example.
  assert train.target_of(train.progress(gpt_space, best, gpt_space.legal(best), best)) is None


def test_policy_guides_only_the_shallow_nodes(gpt_space):
  class Counting(learned.LearnedPolicy):
    def __init__(self):
      self.calls = 0

    def priors(self, space, state, actions):
      self.calls += 1
      return np.full(len(actions) + 1, 1.0 / (len(actions) + 1))

  policy = Counting()
  search = mcts.Search(gpt_space.program, gpt_space, None, 0, policy=policy,
                       settings=mcts.MCTSSettings(policy_depth=0))
  search.run(100, 60.0)
  expanded = [n for n in search.table.values() if n.actions is not None]
  assert len(expanded) > 1
  assert policy.calls == 1  # the root's


def test_training_reports_the_search_effect_of_its_priors():
  _, known = train.examples_of(3, 0, None, 16, 1, None, 10, 40, 0)
  # Uniform priors against themselves: the same searches, step for step.
  same = train.search_effect(3, [0], {0: known}, mcts.UniformPolicy(), 60, log=lambda s: None)
  assert same == {"median": 1.0, "geomean": 1.0, "programs": 1}


def test_the_corpus_holds_out_whole_families_and_samples_limits():
  rng = np.random.default_rng(0)
  samples = [synthetic.sample(rng) for _ in range(60)]
  names = {s[0].split()[0] for s in samples}
  assert len(names) == len(synthetic.FAMILIES)
  held = ("t5", "vit", "moe", "encoder", "expert", "mp", "graph")
  assert not any(n.lower().startswith(held) for n in names)
  limits = [s[5] for s in samples]
  assert any(x is None for x in limits) and all(x is None or 0.3 <= x <= 0.9 for x in limits)
  assert {len(s[3]) for s in samples} == {2, 3}


def test_weights_are_written_byte_for_byte_reproducibly(tmp_path, shipped):
  a, b = tmp_path / "a.npz", tmp_path / "b.npz"
  learned.save(str(a), shipped.params, shipped.width, shipped.rounds)
  learned.save(str(b), shipped.params, shipped.width, shipped.rounds)
  assert a.read_bytes() == b.read_bytes()
  again = learned.load(str(a))
  assert again is not None and again.temperature == shipped.temperature
