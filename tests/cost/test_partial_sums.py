"""A contraction's partial sums, finished as XLA:CPU's dot partitioner does:
all-reduced and sliced, regrouped by a permute, or, where the contracted
axes land on a dim the op's own layout tiles (a mixture of experts'
combine: tokens over `data`, wanted over `(data, expert)`), sliced in
place or made whole and sliced."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.run import compiled as hlo

A = jax.ShapeDtypeStruct((16, 64, 8), jnp.float32)  # [G, S, X]
B = jax.ShapeDtypeStruct((8, 16, 256), jnp.float32)  # [X, G, M]


def combine(out, mesh):
  def fn(a, b):  # X contracted: its split leaves partial sums
    y = jnp.einsum("gsx,xgm->gsm", a, b)
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, out))
  return fn


CASES = [
    # mesh, a's layout, b's layout, the result's: its collectives as compiled.
    ((2, 4), P("data", None, "expert"), P("expert", "data"), P("data")),
    ((2, 4), P("data", None, "expert"), P("expert", "data"), P("data", "expert")),
    # A batch dim both operands arrive tiled on: made whole over `data`
    # after the all-reduce, then sliced.
    ((2, 4), P("data", None, "expert"), P("expert", "data"), P(("data", "expert"))),
    # Tiled in one operand only (a Switch layer's combine): the partial
    # tile holds the target's, all-reduced over `expert` and sliced in place.
    ((2, 4), P("data", None, "expert"), P("expert"), P(("data", "expert"))),
    # An axis left unused, as large as the contracted ones: the tile is
    # reduced and permuted into place.
    ((2, 2, 2), P("a", None, "b"), P("b", "a"), P(("a", "b"))),
]


@pytest.mark.parametrize("shape,a_spec,b_spec,out", CASES)
def test_partial_sums_finish_as_compiled(shape, a_spec, b_spec, out):
  names = ("data", "expert") if len(shape) == 2 else ("a", "b", "c")
  mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape))
  fn = combine(out, mesh)
  cost = automap.evaluate(fn, A, B, mesh=mesh, in_shardings=(a_spec, b_spec), hardware="cpu")
  shardings = (NamedSharding(mesh, a_spec), NamedSharding(mesh, b_spec))
  with jax.set_mesh(mesh):
    compiled = jax.jit(fn, in_shardings=shardings).lower(A, B).compile()
  found = hlo.summarize(hlo.collectives(compiled.as_text(), mesh))
  assert set(found) == set(cost.comm_bytes)
  for key, nbytes in found.items():
    assert cost.comm_bytes[key] == pytest.approx(nbytes, rel=0.01), key


@pytest.mark.parametrize("out", [P("c"), P(None, "c"), P()])
def test_the_axes_left_partial_after_a_scatter_reduce_at_once(out):
  # Contracted over three axes, one of which the result is split over:
  # that one is reduced (and sliced), then the other two in one all-reduce
  # over both; with nothing scattered, each factor's axes apart.
  mesh = jax.make_mesh((2, 2, 2), ("a", "b", "c"), axis_types=(AxisType.Auto,) * 3)
  lhs = jax.ShapeDtypeStruct((16, 8, 8, 8), jnp.float32)  # [G, X, E, K]
  rhs = jax.ShapeDtypeStruct((8, 8, 8, 64), jnp.float32)  # [X, E, K, M]
  specs = (P(None, "a", "b", "c"), P("a", "b", "c"))

  def fn(x, w):
    y = jnp.einsum("gxek,xekm->gm", x, w)
    return jax.lax.with_sharding_constraint(y, NamedSharding(mesh, out))

  cost = automap.evaluate(fn, lhs, rhs, mesh=mesh, in_shardings=specs, hardware="cpu")
  with jax.set_mesh(mesh):
    compiled = jax.jit(fn, in_shardings=tuple(NamedSharding(mesh, s) for s in specs)).lower(
        lhs, rhs).compile()
  found = hlo.summarize(hlo.collectives(compiled.as_text(), mesh))
  assert set(found) == set(cost.comm_bytes)
  for key, nbytes in found.items():
    assert cost.comm_bytes[key] == pytest.approx(nbytes, rel=0.01), key
