"""A collective inside a loop runs every trip: the compiled program's
accounting (`compiled.collectives`, the referee) counts it so."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.run.compiled import collectives

MESH = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def test_a_scanned_weights_gather_runs_every_trip():
  def loss(ws, x):
    x, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean(x ** 2)

  ws, x = jnp.ones((5, 64, 64)), jnp.ones((16, 64))
  shardings = (NamedSharding(MESH, P(None, "data")), NamedSharding(MESH, P("data")))
  compiled = jax.jit(jax.grad(loss), in_shardings=shardings).lower(ws, x).compile()
  gathers = [c for c in collectives(compiled.as_text(), MESH) if c.kind == "all-gather"]
  assert gathers and all(c.trips == 5 for c in gathers)


def test_a_collective_outside_loops_runs_once():
  x = jnp.ones((16, 64))
  compiled = jax.jit(lambda x: x.sum(0), in_shardings=NamedSharding(MESH, P("data"))).lower(
      x).compile()
  (reduction,) = collectives(compiled.as_text(), MESH)
  assert reduction.trips == 1
