"""`cond` and `while` partitioned: branches and bodies laid out like any
other ops, operands and carries sharded, as XLA compiles them."""

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
X, W = jnp.arange(16 * 64.0).reshape(16, 64) / 1e3, jnp.eye(64) / 2 + 0.01


def branches(x, w, flag):
  """Each branch a projection of its own; the result's reduction is
  all-reduced whichever runs."""
  h = jax.lax.cond(flag > 0, lambda x: jnp.tanh(x @ w), lambda x: jnp.sin(x @ w) * 2, x)
  return h.sum()


def data_dependent_branch(x, w):
  """The branch index is a reduction over tiled data: XLA computes it."""
  return jax.lax.cond(x.sum() > 0, lambda x: x @ w, lambda x: jnp.cos(x @ w), x).sum()


def loop(x, w):
  """Three steps of a projection carried in a while loop: the carry keeps
  one layout, the body's result is gathered back to it."""
  def body(c):
    i, y = c
    return i + 1, jnp.tanh(y @ w)
  return jax.lax.while_loop(lambda c: c[0] < 3, body, (0, x))[1].sum()


CASES = {
    "cond": (branches, (X, W, jnp.int32(1)), (P("data"), P(None, "model"), P())),
    "data-dependent cond": (data_dependent_branch, (X, W), (P("data"), P(None, "model"))),
    "while": (loop, (X, W), (P("data"), P(None, "model"))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_control_flow_is_priced_as_compiled(name):
  fn, args, specs = CASES[name]
  cost = automap.evaluate(fn, *args, mesh=MESH, in_shardings=specs, hardware="cpu")
  compiled, peak, _ = compile_as_written(fn, args, MESH, specs)
  assert cost.comm_bytes == pytest.approx(compiled), (cost.comm_bytes, compiled)
  assert cost.peak_memory == pytest.approx(peak, rel=0.15)


@pytest.mark.parametrize("name", sorted(CASES))
def test_plans_through_control_flow_run_exactly(name):
  fn, args, _ = CASES[name]
  plan = automap.search(fn, *args, mesh=MESH, hardware="cpu",
                        hints=automap.Hints(fixed={"1": P(None, "model")}),
                        budget=automap.Budget(episodes=10))
  report = automap.verify(plan, fn, *args, mesh=MESH)
  assert report.max_rel_error < 1e-5
  assert report.comm_error < 0.05, report.table()


def test_a_loop_carry_is_sharded():
  """The while loop's carry is not gathered: it stays tiled on the batch."""
  fn, args, specs = CASES["while"]
  plan = automap.search(fn, *args, mesh=MESH, hardware="cpu",
                        hints=automap.Hints(fixed={"0": P("data")}),
                        budget=automap.Budget(episodes=10))
  tiled = [s for s in plan.constraints.values() if s != P()]
  assert tiled and all(s[0] == "data" for s in tiled if len(s)), plan.constraints
