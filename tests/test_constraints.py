"""The user's own sharding constraints: honoured, priced, and used as hints."""

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import automap

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
MEGATRON_DP = (P(None, "model"), P("model", None), P("data"))
BUDGET = automap.Budget(episodes=40)
HIDDEN = P("data", "model")


def mlp_step(w1, w2, x, spec=HIDDEN):
  """Two-layer MLP train step (SGD) with the hidden activation constrained."""
  def loss(w1, w2):
    h = jnp.tanh(x @ w1)
    if spec is not None:
      h = jax.lax.with_sharding_constraint(h, spec)
    return ((h @ w2) ** 2).mean()
  g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
  return w1 - 0.1 * g1, w2 - 0.1 * g2


def mlp_args():
  k = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(k[0], (128, 512)) * 0.05,
          jax.random.normal(k[1], (512, 128)) * 0.05,
          jax.random.normal(k[2], (64, 128)))


def assert_priced_as_compiled(fn, args, specs):
  cost = automap.evaluate(fn, *args, mesh=MESH, in_shardings=specs, hardware="cpu")
  comm, memory, _ = compile_as_written(fn, args, MESH, specs)
  assert cost.total_comm_bytes == pytest.approx(sum(comm.values()), rel=0.05, abs=1024)
  assert cost.peak_memory == pytest.approx(memory, rel=0.15)
  return cost


@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P("data", None)])
def test_evaluate_prices_a_constrained_layout_as_xla_compiles_it(spec):
  # Agreeing with propagation or not, the constraint is the value's layout.
  assert_priced_as_compiled(lambda *a: mlp_step(*a, spec=spec), mlp_args(), MEGATRON_DP)


def test_constraint_matches_propagation_no_extra_gathers():
  args = mlp_args()
  kept = automap.evaluate(mlp_step, *args, mesh=MESH, in_shardings=MEGATRON_DP,
                          hardware="cpu")
  ignored = automap.evaluate(mlp_step, *args, mesh=MESH, in_shardings=MEGATRON_DP,
                             hardware="cpu", constraints="ignore")
  plain = automap.evaluate(lambda *a: mlp_step(*a, spec=None), *args, mesh=MESH,
                           in_shardings=MEGATRON_DP, hardware="cpu")
  assert kept.comm_bytes == ignored.comm_bytes == plain.comm_bytes


def scanned_step(params, x):
  """A scan over rematerialised layers, constraints on the carry and inside."""
  def layer(h, w):
    h = jax.lax.with_sharding_constraint(h, P("data", None))
    h = jnp.tanh(h @ w["in"])
    h = jax.lax.with_sharding_constraint(h, P("data", "model"))
    return h @ w["out"], None

  def loss(params):
    h = jax.lax.scan(jax.checkpoint(layer), x, params)[0]
    return (h ** 2).mean()

  grads = jax.grad(loss)(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_constraints_inside_scanned_remat_layers_are_priced():
  k = jax.random.split(jax.random.key(1), 3)
  params = {"in": jax.random.normal(k[0], (3, 128, 256)) * 0.05,
            "out": jax.random.normal(k[1], (3, 256, 128)) * 0.05}
  x = jax.random.normal(k[2], (64, 128))
  specs = ({"in": P(None, None, "model"), "out": P(None, "model", None)}, P("data"))
  assert_priced_as_compiled(scanned_step, (params, x), specs)


class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(512, use_bias=False)(x)
    h = nn.with_logical_constraint(jnp.tanh(h), ("batch", "mlp"))
    return nn.Dense(128, use_bias=False)(h)


def flax_step(params, x):
  grads = jax.grad(lambda p: (MLP().apply(p, x) ** 2).mean())(params)
  return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_flax_logical_constraints_under_the_active_rules():
  x = jax.random.normal(jax.random.key(2), (64, 128))
  params = MLP().init(jax.random.key(3), x)
  specs = ({"params": {"Dense_0": {"kernel": P(None, "model")},
                       "Dense_1": {"kernel": P("model", None)}}}, P("data"))
  with nn.logical_axis_rules([("batch", "data"), ("mlp", None)]):
    ruled = assert_priced_as_compiled(flax_step, (params, x), specs)
  free = automap.evaluate(flax_step, params, x, mesh=MESH, in_shardings=specs,
                          hardware="cpu")
  # Hidden kept whole on "model" by the rules: the compiled step gathers it.
  assert ruled.total_comm_bytes > free.total_comm_bytes


def hlo_has_local_shape(compiled, shape: str) -> bool:
  return re.search(rf"\bf32\[{shape}\]", compiled.as_text()) is not None


def test_keep_compiles_the_constraints_layouts():
  args = mlp_args()
  plan = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu", budget=BUDGET)
  assert plan.program_constraints == "keep"
  report = automap.verify(plan, mlp_step, *args, mesh=MESH)
  assert report.max_rel_error < 1e-5
  assert report.comm_error < 0.05, report.table()
  # The hidden [64, 512] activation, tiled 4 x 2: [16, 256] on each device.
  fn = automap.partition(mlp_step, mesh=MESH, hardware="cpu", budget=BUDGET, cache=False)
  assert hlo_has_local_shape(fn.lower(*args).compile(), "16,256")


def test_hints_and_ignore_never_plan_worse_than_the_program_without_them():
  args = mlp_args()
  bare = automap.search(lambda *a: mlp_step(*a, spec=None), *args, mesh=MESH,
                        hardware="cpu", budget=BUDGET)
  kept = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu", budget=BUDGET)
  for mode in ("hints", "ignore"):
    plan = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu", budget=BUDGET,
                          constraints=mode)
    assert plan.program_constraints == mode
    assert plan.cost.step_time <= bare.cost.step_time * (1 + 1e-9)
    assert plan.cost.step_time < kept.cost.step_time  # the constraint costs here
    report = automap.verify(plan, mlp_step, *args, mesh=MESH)
    assert report.max_rel_error < 1e-5
    assert report.comm_error < 0.05, report.table()


def test_hints_start_from_the_users_layout_when_it_is_best():
  # Constrained as the best plan lays it out: the hinted plan is that layout.
  args = mlp_args()
  best = automap.search(lambda *a: mlp_step(*a, spec=None), *args, mesh=MESH,
                        hardware="cpu", budget=automap.Budget(episodes=2))
  plan = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu",
                        budget=automap.Budget(episodes=2), constraints="hints")
  assert plan.stats["start"] in ("search", "your layout")
  assert plan.cost.step_time <= best.cost.step_time * (1 + 1e-9)


def test_partition_runs_each_mode_with_the_numerics_of_the_program_as_written():
  args = mlp_args()
  with jax.set_mesh(MESH):
    expected = jax.jit(mlp_step)(*args)
  for mode in ("keep", "hints", "ignore"):
    fn = automap.partition(mlp_step, mesh=MESH, hardware="cpu", budget=BUDGET,
                           constraints=mode, cache=False)
    for e, a in zip(expected, fn(*args)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-5, atol=1e-6)


def test_explain_shows_the_users_layout_priced_alike():
  args = mlp_args()
  plan = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu", budget=BUDGET,
                        constraints="ignore")
  yours = plan.yardsticks["your layout"]
  kept = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu", budget=BUDGET)
  assert yours.cost.step_time >= kept.cost.step_time * (1 - 1e-9)
  assert "your layout" in plan.explain()
  bare = automap.search(lambda *a: mlp_step(*a, spec=None), *args, mesh=MESH,
                        hardware="cpu", budget=BUDGET)
  assert "your layout" not in bare.yardsticks


def test_plans_keep_their_mode_through_json():
  args = mlp_args()
  plan = automap.search(mlp_step, *args, mesh=MESH, hardware="cpu", budget=BUDGET,
                        constraints="hints")
  loaded = automap.Plan.from_json(plan.to_json())
  assert loaded.program_constraints == "hints"
  assert automap.verify(loaded, mlp_step, *args, mesh=MESH).max_rel_error < 1e-5


def test_a_constraint_naming_an_axis_the_mesh_lacks_names_its_scope():
  other = jax.make_mesh((4, 2), ("data", "seq"), axis_types=(AxisType.Auto,) * 2)

  def fn(x, w):
    with jax.named_scope("hidden"):
      h = jax.lax.with_sharding_constraint(x @ w, NamedSharding(other, P("data", "seq")))
    return h.sum()

  x, w = jnp.ones((16, 32)), jnp.ones((32, 64))
  with pytest.raises(automap.MeshError, match=r"(?s)'seq'.*hidden|hidden.*'seq'"):
    automap.search(fn, x, w, mesh=MESH, hardware="cpu", budget=BUDGET)
  # Ignored, the constraint is neither checked nor compiled.
  plan = automap.search(fn, x, w, mesh=MESH, hardware="cpu", budget=BUDGET,
                        constraints="ignore")
  assert automap.verify(plan, fn, x, w, mesh=MESH, check_numerics=False).comm_error < 0.05


def test_a_constraint_for_a_mesh_of_another_shape_is_an_error():
  other = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)

  def fn(x, w):
    return jax.lax.with_sharding_constraint(x @ w, NamedSharding(other, P("data"))).sum()

  with pytest.raises(automap.MeshError, match="2 devices"):
    automap.evaluate(fn, jnp.ones((16, 32)), jnp.ones((32, 64)), mesh=MESH,
                     in_shardings=P(), hardware="cpu")


def test_two_layouts_for_one_value_and_a_pin_against_a_constraint_are_errors():
  def twice(x, w):
    h = x @ w
    a = jax.lax.with_sharding_constraint(h, P("data"))
    b = jax.lax.with_sharding_constraint(h, P(None, "model"))
    return (a * b).sum()

  x, w = jnp.ones((16, 32)), jnp.ones((32, 64))
  with pytest.raises(automap.MeshError, match="one layout"):
    automap.search(twice, x, w, mesh=MESH, hardware="cpu", budget=BUDGET)

  def on_argument(x, w):
    return (jax.lax.with_sharding_constraint(x, P("data")) @ w).sum()

  with pytest.raises(automap.MeshError, match=r"in_shardings.*P\('data',?\)"):
    automap.evaluate(on_argument, x, w, mesh=MESH, in_shardings=(P("model"), P()),
                     hardware="cpu")
  cost = automap.evaluate(on_argument, x, w, mesh=MESH, in_shardings=(P("data"), P()),
                          hardware="cpu")
  assert cost.step_time > 0


def test_constraints_option_is_checked_and_part_of_the_options():
  with pytest.raises(ValueError, match="constraints must be one of"):
    automap.SearchOptions(constraints="fixed")
  with pytest.raises(ValueError, match="constraints must be"):
    automap.evaluate(mlp_step, *mlp_args(), mesh=MESH, in_shardings=MEGATRON_DP,
                     constraints="hints")
  options = automap.SearchOptions(constraints="hints")
  assert dataclasses.replace(options, seed=1).constraints == "hints"


def test_a_plan_searched_on_an_abstract_mesh_verifies_on_devices():
  args = mlp_args()
  abstract = jax.sharding.AbstractMesh((4, 2), ("data", "model"),
                                       axis_types=(AxisType.Auto,) * 2)
  plan = automap.search(mlp_step, *args, mesh=abstract, hardware="cpu", budget=BUDGET)
  report = automap.verify(plan, mlp_step, *args, mesh=MESH)
  assert report.max_rel_error < 1e-5 and report.comm_error < 0.05


def test_shard_map_over_the_mesh_planned_on_still_traces():
  # Traced with the mesh in context, the program's shard_map finds its own mesh.
  def fn(x):
    doubled = jax.shard_map(lambda a: a * 2, mesh=MESH, in_specs=P("data"), out_specs=P("data"))
    return doubled(x).sum()

  x = jnp.arange(32.0).reshape(8, 4)
  partitioned = automap.partition(fn, mesh=MESH, hardware="cpu", budget=BUDGET, cache=False)
  assert float(partitioned(x)) == float(x.sum() * 2)
