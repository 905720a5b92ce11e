"""Actions and propagation on the sharding state."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mlp
from jax.sharding import PartitionSpec as P

from automap._src.ir import graph, trace
from automap._src.sharding.mesh import MeshError, MeshSpec
from automap._src.sharding.propagation import Propagator
from automap._src.sharding.state import empty_state, set_spec, spec_of

MESH = MeshSpec(("data", "model"), (4, 2))


def mlp_graph():
  args = (jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 16)))
  return graph.build(trace.trace(mlp, args))


def test_one_column_split_propagates_a_megatron_mlp():
  g = mlp_graph()
  x, w1, w2 = g.inputs
  state = empty_state(g, MESH)
  prop = Propagator(g, MESH)
  changed = prop.tile(state, w1, 1, 1)  # w1 columns over 'model'
  spec = lambda v: spec_of(state, MESH, v, g.rank(v))  # noqa: E731
  assert spec(w1) == P(None, "model")
  assert spec(w2) == P("model")  # rows: contracted with the split hidden
  assert spec(x) == P()  # the input is not touched
  (out,) = g.outputs
  assert spec(out) == P()  # a partial sum: the result stays whole
  assert set(changed) == {v for v in range(g.num_values) if (state[v] >= 0).any()}


def test_propagation_is_incremental():
  g = mlp_graph()
  x, w1, _ = g.inputs
  state = empty_state(g, MESH)
  prop = Propagator(g, MESH)
  prop.tile(state, x, 0, 0)
  before = state.copy()
  changed = prop.tile(state, w1, 1, 1)
  moved = np.nonzero((state != before).any(axis=1))[0]
  assert sorted(changed.tolist()) == moved.tolist()


def test_an_axis_never_tiles_an_indivisible_dim():
  args = (jnp.ones((6, 16)), jnp.ones((16, 32)), jnp.ones((32, 16)))
  g = graph.build(trace.trace(mlp, args))
  state = empty_state(g, MESH)
  prop = Propagator(g, MESH)
  assert not prop.can_tile(state, g.inputs[0], 0, 0)  # 6 rows over 4
  assert len(prop.tile(state, g.inputs[0], 0, 0)) == 0
  prop.tile(state, g.inputs[1], 1, 0)
  for v in range(g.num_values):
    for a, d in enumerate(state[v]):
      if d >= 0:
        assert g.shapes[v][d] % MESH.axis_sizes[a] == 0


def test_fixed_values_are_never_changed_by_propagation():
  g = mlp_graph()
  x, w1, w2 = g.inputs
  fixed = np.zeros(g.num_values, bool)
  fixed[w2] = True
  state = empty_state(g, MESH)
  Propagator(g, MESH, fixed).tile(state, w1, 1, 1)
  assert (state[w2] < 0).all()


def test_set_spec_validates_rank_axes_and_divisibility():
  g = mlp_graph()
  state = empty_state(g, MESH)
  x = g.inputs[0]
  with pytest.raises(MeshError, match="rank 2"):
    set_spec(state, MESH, x, (8, 16), P("data", None, None), "x")
  with pytest.raises(MeshError, match="'batch'"):
    set_spec(state, MESH, x, (8, 16), P("batch"), "x")
  with pytest.raises(MeshError, match="not divisible"):
    set_spec(state, MESH, x, (6, 16), P("data"), "x")
  set_spec(state, MESH, x, (8, 16), P(("data", "model")), "x")
  assert spec_of(state, MESH, x, 2) == P(("data", "model"))


def test_compiled_propagation_matches_its_python_source():
  from helpers import gpt_step, random_input_tilings

  from automap._src.sharding import propagation_kernels as kernels

  step, args = gpt_step()
  g = graph.build(trace.trace(step, args))
  compiled, interpreted = Propagator(g, MESH), Propagator(g, MESH)
  spread = kernels.spread
  for v, d, a in random_input_tilings(g, seed=1, count=20):
    state = empty_state(g, MESH)
    changed = compiled.tile(state, v, d, a)
    reference = empty_state(g, MESH)
    kernels.spread = spread.py_func
    try:
      expected = interpreted.tile(reference, v, d, a)
    finally:
      kernels.spread = spread
    np.testing.assert_array_equal(state, reference)
    np.testing.assert_array_equal(changed, expected)


def seeded(fn, args, specs):
  """The graph of fn and its arguments' layouts spread as XLA's
  propagation spreads them (`Propagator.seed_all`)."""
  g = graph.build(trace.trace(fn, args))
  state = empty_state(g, MESH)
  for v, spec in zip(g.inputs, specs):
    set_spec(state, MESH, v, g.shapes[v], spec, "test")
  fixed = np.zeros(g.num_values, bool)
  fixed[list(g.inputs)] = True
  Propagator(g, MESH, fixed).seed_all(state)
  return g, lambda v: spec_of(state, MESH, v, g.rank(v))


BOTH = ("data", "model")


@pytest.mark.parametrize("order", ["weight first", "batch first"])
def test_a_conflict_between_factors_goes_to_the_larger_operand(order):
  """dot(w, x) with w tiled on its output dim and x on its batch, both over
  every axis: the result cannot have both, and Shardy gives it the larger
  operand's (x's), whichever operand comes first."""
  w, x = jnp.ones((256, 256)), jnp.ones((32, 64, 256))
  if order == "weight first":
    fn, args = (lambda w, x: jnp.einsum("oi,bsi->obs", w, x)), (w, x)
    specs, batch_dim = (P(BOTH), P(BOTH)), 1
  else:
    fn, args = (lambda x, w: jnp.einsum("bsi,oi->bso", x, w)), (x, w)
    specs, batch_dim = (P(BOTH), P(BOTH)), 0
  g, spec = seeded(fn, args, specs)
  (out,) = g.outputs
  assert spec(out) == P(*([None] * batch_dim), BOTH)


def test_a_broadcast_scale_does_not_tile_the_activation_it_scales():
  """x * gamma, gamma tiled on the feature dim and x on the batch: the
  scale's broadcast propagates forward only once every pass-through op has
  spread, so the product keeps the batch tiling (the scale is gathered)."""
  fn = lambda x, gamma: jnp.tanh(x) * gamma[None]  # noqa: E731
  g, spec = seeded(fn, (jnp.ones((32, 256)), jnp.ones((256,))), (P(BOTH), P(BOTH)))
  (out,) = g.outputs
  assert spec(out) == P(BOTH)


def test_a_hidden_dim_tiled_over_two_axes_splits_into_heads_and_head_width():
  """Shardy's compound factors: hidden tiled (data, model), data filling
  the 4 heads, reaches the heads x head-width split as data on heads and
  model on head width, and the merge back as (data, model) on hidden;
  2 heads cannot hold data, so it stops there."""
  for heads, expected in ((4, P(None, None, "data", "model")), (2, P())):
    def attend(x, heads=heads):
      q = x.reshape(8, 17, heads, 64 // heads)
      return (q * q).reshape(8, 17, 64)

    g = graph.build(trace.trace(attend, (jnp.ones((8, 17, 64)),)))
    state = empty_state(g, MESH)
    (x,), (out,) = g.inputs, g.outputs
    set_spec(state, MESH, x, g.shapes[x], P(None, None, ("data", "model")), "x")
    Propagator(g, MESH).seed_all(state)
    split = [v for v in range(g.num_values) if g.rank(v) == 4]
    assert {spec_of(state, MESH, v, 4) for v in split} == {expected}
    if heads == 4:
      assert spec_of(state, MESH, out, 3) == P(None, None, ("data", "model"))
