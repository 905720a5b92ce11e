"""Export: a plan as PartitionSpec pytrees, placed arrays and logical-axis rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpt_step, mesh
from jax.sharding import NamedSharding, PartitionSpec

import automap
from automap._src.plan.plan import Plan, PlanError

P = PartitionSpec


def _logical(init, names):
  return nn.with_logical_partitioning(init, names)


class MLP(nn.Module):
  """Two layers annotated with logical names, flax style."""

  hidden: int = 1024
  second: tuple = ("mlp", "embed")

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.hidden, name="wi", kernel_init=_logical(
        nn.initializers.lecun_normal(), ("embed", "mlp")), bias_init=_logical(
        nn.initializers.zeros_init(), ("mlp",)))(x)
    return nn.Dense(x.shape[-1], name="wo", use_bias=False, kernel_init=_logical(
        nn.initializers.lecun_normal(), self.second))(jax.nn.relu(h))


def _step(model, tx):
  def step(params, opt_state, x, y):
    def loss(p):
      return jnp.mean((model.apply({"params": p}, x) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def _setup(model, batch=16, width=256):
  x = jax.random.normal(jax.random.key(0), (batch, width))
  y = jax.random.normal(jax.random.key(1), (batch, width))
  boxed = model.init(jax.random.key(2), x)["params"]
  params = nn.meta.unbox(boxed)
  tx = optax.adam(1e-3)
  return _step(model, tx), (params, tx.init(params), x, y), boxed


@pytest.fixture(scope="module")
def mlp_plan():
  step, args, boxed = _setup(MLP())
  fn = automap.partition(step, mesh=mesh((4, 2)), cache=False,
                         budget=automap.Budget(episodes=40, seconds=30))
  out = fn(*args)
  return fn, step, args, boxed, out


def test_specs_of_params_and_optimizer_state_match_the_plan(mlp_plan):
  fn, _, (params, opt_state, _, _), _, out = mlp_plan
  plan = fn.plan
  assert plan.specs(params) == plan.in_shardings[0]
  assert plan.specs(opt_state) == plan.in_shardings[1]
  # The optimizer's moments have the params' structure: at= picks one.
  mu = opt_state[0].mu
  assert plan.specs(mu, at="1/0/mu") == plan.in_shardings[1][0].mu
  # The results come back on the specs the plan gave their arguments.
  new_params = out[0]
  for leaf, spec in zip(jax.tree.leaves(new_params), jax.tree.leaves(
      plan.specs(params), is_leaf=lambda s: isinstance(s, PartitionSpec))):
    assert leaf.sharding.is_equivalent_to(NamedSharding(fn.mesh, spec), leaf.ndim)


def test_a_loaded_plan_exports_the_same_specs(mlp_plan, tmp_path):
  fn, _, (params, opt_state, _, _), _, _ = mlp_plan
  fn.plan.save(tmp_path / "plan.json")
  loaded = Plan.load(tmp_path / "plan.json")
  assert loaded.in_tree is None
  assert loaded.specs(params) == fn.plan.specs(params)
  assert loaded.specs(opt_state, at=1) == fn.plan.specs(opt_state)


def test_shard_like_places_real_params_on_the_plan(mlp_plan):
  fn, step, args, _, out = mlp_plan
  params, opt_state, x, y = args
  placed = automap.shard_like(params, fn.plan, fn.mesh)
  specs = fn.plan.specs(params)
  for leaf, spec in zip(jax.tree.leaves(placed), jax.tree.leaves(
      specs, is_leaf=lambda s: isinstance(s, PartitionSpec))):
    assert leaf.sharding == NamedSharding(fn.mesh, spec)
  # Placed arguments run unchanged, with the unpartitioned numerics.
  again = fn(placed, automap.shard_like(opt_state, fn.plan, fn.mesh), x, y)
  expected = jax.jit(step)(*args)
  for a, b, c in zip(jax.tree.leaves(again), jax.tree.leaves(out),
                     jax.tree.leaves(expected)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    # Adam's first step is lr * g / |g|: where a gradient is near zero its
    # summation order shows, up to a few percent of lr (1e-3).
    np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=5e-5)


def test_logical_rules_reproduce_every_parameter_layout(mlp_plan):
  fn, _, (params, *_), boxed, _ = mlp_plan
  rules = fn.plan.logical_rules(boxed)
  assert rules.exact, rules.mismatches
  # The plan tiles the hidden (mlp) dimension: the rules say so.
  assert any(name == "mlp" and axes for name, axes in rules.rules), rules.rules
  names = nn.get_partition_spec(boxed)
  got = jax.tree.map(lambda n: nn.logical_to_mesh_axes(tuple(n), rules.rules), names,
                     is_leaf=lambda s: isinstance(s, PartitionSpec))
  want = fn.plan.specs(params)
  for g, w, p in zip(jax.tree.leaves(got, is_leaf=lambda s: isinstance(s, PartitionSpec)),
                     jax.tree.leaves(want, is_leaf=lambda s: isinstance(s, PartitionSpec)),
                     jax.tree.leaves(params)):
    assert NamedSharding(fn.mesh, g).is_equivalent_to(NamedSharding(fn.mesh, w), p.ndim)
  # The same rules from the names alone (as flax's get_partition_spec gives them).
  assert fn.plan.logical_rules(names).rules == rules.rules


def test_a_layout_no_rules_express_is_reported_not_hidden():
  # Both kernels are named (embed, mlp), but the plan is pinned to tile
  # `embed` of one and `mlp` of the other over the same mesh axis: no rule
  # order gives both.
  model = MLP(second=("embed", "mlp"))
  step, args, boxed = _setup(model)
  plan = automap.search(step, *args, mesh=mesh((4, 2)), budget=automap.Budget(
      episodes=4, seconds=10), hints=automap.Hints(fixed={
          "0/wi/kernel": P(None, "model"), "0/wo/kernel": P("model", None)}))
  rules = plan.logical_rules(boxed, at=0)
  assert not rules.exact
  assert set(rules.mismatches) & {"wi/kernel", "wo/kernel"}
  for path, (planned, given) in rules.mismatches.items():
    assert planned != given, path


def test_export_errors_name_the_leaf_and_the_fix():
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)),
                        budget=automap.Budget(episodes=2, seconds=10))
  with pytest.raises(PlanError, match="at="):
    plan.specs({"not": jnp.zeros(3)})
  with pytest.raises(PlanError, match="shape"):
    plan.specs(jax.tree.map(lambda x: jnp.zeros(x.shape + (1,)), args[0]))
  with pytest.raises(PlanError, match="argument '5'"):
    plan.specs(args[0], at=5)
  with pytest.raises(PlanError, match="plan is for"):
    automap.shard_like(args[0], plan, mesh((2, 4), ("model", "data")))
