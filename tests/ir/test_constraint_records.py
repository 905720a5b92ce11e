"""The program's own layout constraints in the IR: recorded, not ops."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from automap._src.ir import constraints, graph, trace
from automap._src.sharding.mesh import MeshSpec

MESH = MeshSpec(("data", "model"), (4, 2))
X = jnp.ones((16, 32))
W = jnp.ones((32, 64))


def mlp(x, w, constrain=True):
  h = jnp.tanh(x @ w)
  if constrain:
    h = jax.lax.with_sharding_constraint(h, P("data", "model"))
  return (h * 2.0).sum()


def build(fn, *args):
  return graph.build(trace.trace(fn, args, MESH))


def test_a_constraint_is_recorded_on_its_operand_and_takes_no_op():
  with_c, without = build(mlp, X, W), build(lambda x, w: mlp(x, w, False), X, W)
  assert with_c.prims == without.prims
  assert with_c.shapes == without.shapes
  (c,) = with_c.constraints
  assert with_c.prims[with_c.producer[c.value]] == "tanh"
  assert c.spec == P("data", "model")
  assert dict(c.axes) == {"data": 4, "model": 2}
  assert without.constraints == ()


def test_constraints_inside_scan_and_remat_bodies_are_recorded():
  def layer(h, w):
    h = jax.lax.with_sharding_constraint(jnp.tanh(h @ w), P("data"))
    return h, None

  def step(h, ws):
    return jax.lax.scan(jax.checkpoint(layer), h, ws)[0].sum()

  g = build(step, jnp.ones((16, 32)), jnp.ones((3, 32, 32)))
  assert g.constraints
  for c in g.constraints:
    assert c.spec == P("data")
    op = g.producer[c.value]
    assert g.trips[op] == 3  # in the body
    assert g.sealed[c.value]  # inside the rematerialised call


def test_strip_removes_every_constraint_and_keeps_the_numbers():
  def step(h, ws):
    def layer(h, w):
      return jax.lax.with_sharding_constraint(jnp.tanh(h @ w), P("data")), None
    h = jax.lax.with_sharding_constraint(h, P(None, "model"))
    return jax.lax.scan(jax.checkpoint(layer), h, ws)[0].sum()

  args = (jnp.ones((16, 32)) * 0.1, jnp.ones((3, 32, 32)) * 0.1)
  traced = trace.trace(step, args, MESH)
  stripped = traced.without_constraints()
  assert "sharding_constraint" in str(traced.jaxpr)
  assert "sharding_constraint" not in str(stripped.jaxpr)
  run = jax.jit(lambda *a: jax.core.eval_jaxpr(stripped.jaxpr.jaxpr, stripped.jaxpr.consts, *a))
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  with jax.set_mesh(mesh):
    expected = jax.jit(step)(*args)
  np.testing.assert_allclose(run(*args)[0], expected, rtol=1e-5)
  assert graph.build(stripped).prims == graph.build(traced).prims


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.Dense(64, use_bias=False)(x)
    return nn.with_logical_constraint(h, ("batch", "mlp"))


def test_flax_logical_constraints_resolve_under_the_rules_of_the_trace():
  params = Block().init(jax.random.key(0), X)

  def fn(p, x):
    return Block().apply(p, x)

  assert build(fn, params, X).constraints == ()  # no rules: flax adds none
  with nn.logical_axis_rules([("batch", "data"), ("mlp", "model")]):
    (c,) = build(fn, params, X).constraints
  assert c.spec == P("data", "model")
  assert "Block" in c.scope or "Dense" in c.scope or c.scope == ""


def test_without_a_mesh_nothing_resolves_a_bare_spec():
  try:
    trace.trace(mlp, (X, W))
  except (RuntimeError, ValueError) as e:
    assert "mesh" in str(e)
  else:
    raise AssertionError("a bare PartitionSpec needs a mesh in context")


def test_explicit_axis_reshard_is_a_clear_error():
  def fn(x):
    return jax.sharding.reshard(x, P("data")).sum()

  try:
    trace.trace(fn, (X,), MESH)
  except ValueError as e:
    assert "with_sharding_constraint" in str(e)
  else:
    raise AssertionError("reshard cannot be traced on the Auto view")


def test_modes_are_checked():
  assert constraints.check_mode("hints", "here") == "hints"
  try:
    constraints.check_mode("fixed", "here")
  except ValueError as e:
    assert "'keep'" in str(e) and "fixed" in str(e)
  else:
    raise AssertionError
