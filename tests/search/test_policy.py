"""The learned policy: features, the network under jit, weights, training."""

import numpy as np
import pytest
from helpers import SMALL, gpt_step, graph_network_step, mesh

import automap
from automap._src.cost.program import Program
from automap._src.ir import trace
from automap._src.search import mcts
from automap._src.search.actions import ActionSpace
from automap._src.search.policy import compare, features, learned, synthetic, train
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


def test_features_describe_layouts_and_actions(gpt_space):
  space = gpt_space
  state = space.program.initial_state()
  featurize = features.Featurizer(space)
  actions = space.legal(state)
  before = featurize(state, actions)
  g = space.program.graph
  assert before.nodes.shape == (g.num_values, features.NODE_FEATURES)
  assert before.actions.shape == (len(actions) + 1, features.ACTION_FEATURES)
  assert before.action_group[-1] == -1 and before.actions[-1, 2] == 1  # stop
  assert len(before.senders) == len(before.receivers) == len(before.edges) > 0
  space.apply(state, actions[0])  # data parallelism on every axis
  after = featurize(state, space.legal(state))
  changed = np.flatnonzero((before.nodes != after.nodes).any(axis=1))
  tiled = np.flatnonzero((state >= 0).any(axis=1))
  assert set(tiled) <= set(changed)  # every newly tiled value reads differently
  assert after.globals[features.MAX_AXES + 3] > 0  # memory pressure


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
    logits, value = fn(shipped.params, b)
    k = int(b.action_mask.sum())
    assert np.isfinite(np.asarray(logits[:k])).all() and np.isfinite(float(value))
    assert (np.asarray(logits[k:]) == model.NEG).all()
  assert len(traces) == 1


def test_prior_is_a_distribution_over_exactly_the_legal_actions(gpt_space, shipped):
  state = gpt_space.program.initial_state()
  actions = gpt_space.legal(state)
  p = shipped.priors(gpt_space, state, actions)
  assert p.shape == (len(actions) + 1,)
  assert (p > 0).all() and p.sum() == pytest.approx(1.0)
  gpt_space.apply(state, actions[0])
  fewer = gpt_space.legal(state)
  assert shipped.priors(gpt_space, state, fewer).shape == (len(fewer) + 1,)


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
  np.savez(other, **(arrays | {"__schema__": np.array("automap-policy-features/0")}))
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
  rng = np.random.default_rng(1)
  examples = []
  for seed in range(2):
    examples += train.examples_of(synthetic.sample(rng), 30, seed)
  assert examples and all(abs(ex.target.sum() - 1) < 1e-6 for ex in examples)
  net = model.PolicyNet(16, 1)
  import jax
  params = net.init(jax.random.key(0), examples[0].batch)["params"]
  before = train.evaluate(net, params, examples)["cross_entropy"]
  params, history = train.train(examples, [], epochs=3, seed=0, width=16, rounds=1,
                                learning_rate=3e-3, log=lambda s: None)
  scores = train.evaluate(net, params, examples)
  assert scores["cross_entropy"] < before
  assert history[-1]["train_loss"] < history[0]["train_loss"]
  # The value head is judged against the best constant guess (the median).
  zero = np.mean([abs(ex.value) for ex in examples])
  assert 0 <= scores["value_error_constant"] <= zero + 1e-9
  assert np.isfinite(scores["value_error"])


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


def test_search_trails_time_each_new_best_plan(gpt_space, shipped):
  program = gpt_space.program
  path = compare.trail(program, gpt_space, None, 0, 40)
  episodes, _, step = path.T
  assert episodes[0] == 0 and (np.diff(episodes) > 0).all() and episodes[-1] <= 40
  assert (np.diff(step) < 0).all(), "each row is a strictly better plan"
  search = mcts.Search(program, gpt_space, None, 0)
  assert step[-1] == search.run(40, float("inf")).score[1]  # the trail ends on the result
  # A target is reached by the first plan within 1% of it, or never.
  e, _ = compare.reach(path, step[-1])
  within = step <= step[-1] * (1 + compare.TOLERANCE)
  assert within[episodes == e].all() and not within[episodes < e].any()
  assert compare.reach(path, step[0] * 1.005)[0] == 0
  assert compare.reach(path, step[-1] * 0.9) == (np.inf, np.inf)
  assert compare.medians([path, path], step[-1]) == compare.reach(path, step[-1])
  assert compare.final([path]) == step[-1]
  slower = np.array([[0.0, 0.0, step[-1] * 1.01]])
  assert compare.worse({"uniform": [path], "policy": [slower]})
  assert not compare.worse({"uniform": [path], "policy": [path]})
  assert not compare.worse({"uniform": [slower], "policy": [path]})
  assert compare.speedup(np.inf, np.inf) == 1 and compare.speedup(np.inf, 4.0) == np.inf
  assert compare.speedup(8.0, np.inf) == 0 and compare.speedup(8.0, 2.0) == 4
  trails = compare.compare(program, gpt_space, shipped, (0,), 10)
  assert set(trails) == {"uniform", "policy"}
  assert compare.best_found(trails) == min(t[-1, 2] for ts in trails.values() for t in ts)


def test_training_reports_the_search_effect_of_its_priors():
  samples = [synthetic.sample(np.random.default_rng(3))]
  # Uniform priors against themselves: the same searches, step for step.
  same = train.search_effect(samples, mcts.UniformPolicy(), 20, log=lambda s: None)
  assert same == {"median": 1.0, "geomean": 1.0, "worse": 0, "programs": 1}
