"""FSDP (ZeRO-3) as XLA compiles it, with and without remat, unrolled and
scanned: each weight is gathered before its matmul and freed after, gathered
again where remat recomputes the forward (JAX lowers the recomputation
behind an optimization barrier, so XLA may not reuse the first gather), and
XLA:CPU's breadth-first schedule makes every gather as soon as its shard
exists, at the program's start."""

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap

LAYERS, WIDTH, BATCH = 4, 256, 64
MESHES = {
    "8": jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,)),
    "4x2": jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2),
}


def fsdp_step(remat: bool, scan: bool):
  """The weight gradients of `LAYERS` layers of tanh(h @ w)."""
  def layer(h, w):
    return jnp.tanh(h @ w)
  if remat:
    layer = jax.checkpoint(layer)

  def loss(ws, x):
    if scan:
      x, _ = jax.lax.scan(lambda h, w: (layer(h, w), None), x, ws)
    else:
      for w in ws:
        x = layer(x, w)
    return jnp.mean(x ** 2)
  return jax.grad(loss)


def args_and_specs(mesh_name: str, scan: bool):
  every = tuple(MESHES[mesh_name].axis_names)
  w = jnp.ones((WIDTH, WIDTH)) / WIDTH
  x = jnp.ones((BATCH, WIDTH))
  if scan:
    return (jnp.stack([w] * LAYERS), x), (P(None, every), P(every))
  return ([w] * LAYERS, x), ([P(every)] * LAYERS, P(every))


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scan"])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_fsdp_is_priced_as_compiled(mesh_name, scan, remat):
  mesh = MESHES[mesh_name]
  step = fsdp_step(remat, scan)
  args, specs = args_and_specs(mesh_name, scan)
  cost = automap.evaluate(step, *args, mesh=mesh, in_shardings=specs, hardware="cpu")
  compiled, peak, _ = compile_as_written(step, args, mesh, specs)
  assert cost.comm_bytes == pytest.approx(compiled, rel=0.05)
  assert cost.peak_memory == pytest.approx(peak, rel=0.15)


def test_remat_gathers_the_weights_again():
  """Unrolled, remat doubles the weights' gathers: the forward's and the
  recomputation's, which the backward reads too."""
  mesh = MESHES["8"]
  args, specs = args_and_specs("8", scan=False)
  plain, remat = (automap.evaluate(fsdp_step(r, False), *args, mesh=mesh, in_shardings=specs,
                                   hardware="cpu") for r in (False, True))
  gathers = ("all-gather", ("data",))
  assert remat.comm_count[gathers] - plain.comm_count[gathers] == LAYERS
  assert remat.comm_bytes[gathers] - plain.comm_bytes[gathers] == LAYERS * WIDTH * WIDTH * 4
