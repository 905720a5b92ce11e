"""Splits, slices, pads and concatenates along a tiled dim, priced as XLA
partitions them: halo exchanges keep a sliced dim tiled, and a tiled
concatenation moves its tiles aside with all-to-alls."""

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost.hardware import get_hardware
from automap._src.plan import planner
from automap._src.sharding.state import spec_of

HIDDEN = 64


def fused_qkv(x, w):
  """q, k and v out of one [hidden, 3 * hidden] projection."""
  q, k, v = jnp.split(x @ w, 3, axis=-1)
  return (jax.nn.softmax(q * k, axis=-1) * v).sum()


def fused_qkv_grad(x, w):
  return jax.grad(fused_qkv, argnums=1)(x, w)


def concatenated(a, b, c):
  return jax.lax.with_sharding_constraint(jnp.concatenate([a, b, c], -1),
                                          P(None, None, "model")) * 2


def padded(x):
  return jax.lax.with_sharding_constraint(jnp.pad(x, ((0, 0), (0, 0), (2, 6))),
                                          P(None, None, "model"))


X, W = jnp.ones((8, 16, HIDDEN)), jnp.ones((HIDDEN, 3 * HIDDEN))
CASES = {
    "split": (fused_qkv, (X, W), (P("data"), P(None, "model"))),
    "split backward": (fused_qkv_grad, (X, W), (P("data"), P(None, "model"))),
    "concatenate": (concatenated, (X, X, X), (P(None, None, "model"),) * 3),
    "pad": (padded, (jnp.ones((8, 16, 192)),), (P(None, None, "model"),)),
}


@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_tiled_dim_routes_are_priced_as_compiled(name, shape):
  fn, args, specs = CASES[name]
  m = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  cost = automap.evaluate(fn, *args, mesh=m, in_shardings=specs, hardware="cpu")
  compiled, _, _ = compile_as_written(fn, args, m, specs)
  assert cost.comm_bytes == pytest.approx(compiled), (cost.comm_bytes, compiled)
  # No whole operand gathered on the tiled dim: halos or all-to-alls only.
  assert not any(k == "all-gather" for k, _ in compiled)


def test_a_split_keeps_its_dim_tiled_into_the_pieces():
  """Propagation carries the projection's tiling through the split, each
  piece tiled alike, as XLA's propagation does."""
  m = jax.make_mesh((4, 2), ("data", "model"))
  program = planner.build_program(fused_qkv, (X, W), m, get_hardware("cpu"))
  state = program.state_from_specs([P("data"), P(None, "model")])
  g = program.graph
  (split,) = [o for o in range(g.num_ops) if g.prims[o] == "split"]
  for v in g.results[split]:
    assert spec_of(state, program.mesh, v, 3) == P("data", None, "model")


def pieces_tiled(x, w):
  """The step as a user writes it, asking for the pieces tiled."""
  tiled = P("data", None, "model")
  q, k, v = (jax.lax.with_sharding_constraint(t, tiled)
             for t in jnp.split(x @ w, 3, axis=-1))
  return (jax.nn.softmax(q * k, axis=-1) * v).sum()


def test_a_plan_through_tiled_pieces_runs_exactly():
  m = jax.make_mesh((4, 2), ("data", "model"))
  x = jax.random.normal(jax.random.key(0), X.shape)
  w = jax.random.normal(jax.random.key(1), W.shape) / 8
  step = jax.grad(pieces_tiled, argnums=1)
  plan = automap.search(step, x, w, mesh=m, hardware="cpu",
                        hints=automap.Hints(fixed={"0": P("data"), "1": P(None, "model")}),
                        budget=automap.Budget(episodes=10))
  report = automap.verify(plan, step, x, w, mesh=m)
  assert report.max_rel_error < 1e-5
  assert report.comm_error < 0.01, report.table()
  assert report.compiled_comm_bytes.get(("collective-permute", ("model",)), 0) > 0
