"""XLA's combiners merge independent collectives of one kind and axes into
one tuple collective: counted as compiled."""

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written, gpt_step
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap
from automap._src.models.gpt import megatron_specs
from automap._src.run import compiled as hlo


def counts(compiled, mesh) -> dict:
  out: dict = {}
  for c in hlo.collectives(compiled.as_text(), mesh):
    out[(c.kind, c.axes)] = out.get((c.kind, c.axes), 0) + 1
  return out


def sibling_projections(x, wq, wk, wv):
  """Three column-parallel projections of one input: the gradient's three
  row-parallel partial sums are independent, so XLA all-reduces them as one."""
  return (jnp.tanh(x @ wq) * jnp.tanh(x @ wk) * jnp.tanh(x @ wv)).sum()


def test_sibling_all_reduces_are_one_collective():
  mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  args = (jnp.ones((8, 64)),) + (jnp.ones((64, 128)),) * 3
  specs = (P("data"),) + (P(None, "model"),) * 3
  step = jax.grad(sibling_projections)
  cost = automap.evaluate(step, *args, mesh=mesh, in_shardings=specs, hardware="cpu")
  _, _, compiled = compile_as_written(step, args, mesh, specs)
  assert counts(compiled, mesh) == {("all-reduce", ("model",)): 1}
  assert cost.comm_count == {("all-reduce", ("model",)): 1}


@pytest.mark.heavy
@pytest.mark.parametrize("shape", [(4, 2), (2, 4)])
def test_a_megatron_step_counts_its_collectives_as_compiled(shape):
  """Forward and backward all-reduces depend on each other (none merge);
  the gradient reductions over the data axis merge into one."""
  step, args = gpt_step()
  mesh = jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2)
  specs = megatron_specs(args)
  cost = automap.evaluate(step, *args, mesh=mesh, in_shardings=specs, hardware="cpu")
  _, _, compiled = compile_as_written(step, args, mesh, specs)
  assert cost.comm_count == counts(compiled, mesh)
  assert cost.comm_count[("all-reduce", ("data",))] == 1
