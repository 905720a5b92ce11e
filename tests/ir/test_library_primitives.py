"""Rules for primitives that solver and linear-algebra code binds: each is
priced as XLA compiles it, with no primitive left without a rule."""

import warnings

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap
from automap._src.ir.graph import UnknownPrimitiveWarning

M = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def priced_as_compiled(fn, args, specs):
  """`evaluate`'s collective bytes and XLA's, with no rule missing."""
  with warnings.catch_warnings():
    warnings.simplefilter("error", UnknownPrimitiveWarning)
    cost = automap.evaluate(fn, *args, mesh=M, in_shardings=specs, hardware="cpu")
  compiled, _, _ = compile_as_written(fn, args, M, specs)
  return cost.comm_bytes, compiled


def test_a_batch_of_lu_factorisations_splits_by_the_batch():
  """Each matrix stays whole; a batch split over devices needs no collective
  (the pivots and permutation split alike)."""
  a = jnp.eye(16)[None].repeat(8, 0) * 2.0 + 0.1
  b = jnp.ones((8, 16, 3))
  predicted, compiled = priced_as_compiled(
      lambda a, b: jax.lax.linalg.triangular_solve(jax.lax.linalg.lu(a)[0], b, left_side=True),
      (a, b), (P("data"), P("data")))
  assert predicted == compiled == {}


def test_a_whole_matrix_dim_is_gathered_first():
  """Split along a matrix dim, the matrices are gathered before the
  factorisation, as XLA's partitioner does."""
  a = jnp.eye(16)[None].repeat(8, 0) * 2.0 + 0.1
  predicted, compiled = priced_as_compiled(lambda a: jax.lax.linalg.lu(a)[0], (a,),
                                           (P(None, "model"),))
  assert predicted == pytest.approx(compiled, rel=0.05) and compiled


def test_stack_keeps_its_new_dim_whole_and_the_others_split():
  def fn(x, y):
    return jnp.stack([jnp.tanh(x), y], axis=1) * 2.0
  x = jnp.ones((64, 32))
  predicted, compiled = priced_as_compiled(fn, (x, x), (P("data"), P("data")))
  assert predicted == compiled == {}


def test_equinox_solver_primitives_have_rules():
  """optimistix's fixed point, differentiated implicitly: lineax's
  `linear_solve` inside equinox's `vprim` (walked as its implementation),
  `lu`, and equinox's loop markers, with the batch split."""
  optx = pytest.importorskip("optimistix")
  w = jnp.eye(32) * 0.3

  def loss(w, x):
    def fixed(h, args):
      w, u = args
      return jnp.tanh(w @ h + u)
    def one(u):
      return optx.fixed_point(fixed, optx.FixedPointIteration(rtol=1e-4, atol=1e-4),
                              jnp.zeros_like(u), (w, u), max_steps=8,
                              adjoint=optx.ImplicitAdjoint(), throw=False).value
    return jnp.sum(jax.vmap(one)(x) ** 2)

  x = jnp.ones((16, 32)) * 0.1
  predicted, compiled = priced_as_compiled(jax.grad(loss), (w, x), (P(), P("data")))
  # XLA also combines the loop's convergence flag over every device (132 B).
  assert sum(predicted.values()) == pytest.approx(sum(compiled.values()), rel=0.05)
