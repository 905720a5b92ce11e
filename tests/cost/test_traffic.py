"""HBM traffic as XLA's fusions move it, against XLA's own accounting of the
same program compiled here (`cost_analysis()["bytes accessed"]`)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import gpt_step, megatron_specs, mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost import compiler
from automap._src.cost.analysis import canonical_copies
from automap._src.cost.model import CostModel
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.plan import planner
from automap._src.run import compiled as hlo
from automap._src.sharding.mesh import MeshSpec

ONE = mesh((1,), ("data",))
X = jnp.ones((256, 256))


def predicted_and_compiled(fn, args, m=ONE, specs=None) -> tuple[float, float]:
  cost = automap.evaluate(fn, *args, mesh=m, in_shardings=specs, hardware="cpu")
  specs = specs if specs is not None else jax.tree.map(lambda _: P(), args)
  shardings = jax.tree.map(lambda p: NamedSharding(m, p), specs,
                           is_leaf=lambda x: isinstance(x, P))
  compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
  return cost.memory_traffic, hlo.compiled_traffic(compiled)


def chain(x, y):  # one loop fusion: reads x and y, writes its result
  return jnp.tanh(x * y + 1.0) * 2.0


def shared(x):  # y is fused into both readers: each reads x
  y = x * 2.0 + 1.0
  return jnp.tanh(y), jnp.exp(y)


def heads(x, w):  # contracts (d, h) against (h, d) dims: both operands copied
  return jnp.einsum("bshd,khd->bsk", x, w)


def matrix(x, w):  # a matrix product read transposed: no copy
  return jnp.einsum("sk,nk->sn", x, w)


@pytest.mark.parametrize("fn,args,arrays", [
    (chain, (X, X), 3),
    (shared, (X,), 4),
    (heads, (jnp.ones((8, 16, 4, 32)), jnp.ones((128, 4, 32))), 7 / 4),
    (matrix, (jnp.ones((128, 256)), jnp.ones((512, 256))), 7 / 2),
], ids=lambda a: getattr(a, "__name__", ""))
def test_fusions_read_stored_values_and_write_results_as_compiled(fn, args, arrays):
  """Counted in arrays of X's size: a fused chain reads each input and
  writes its result once; a producer fused into two readers is computed,
  and reads its input, in each; a contraction XLA's dot decomposition
  transposes reads and writes a copy of each operand first."""
  predicted, compiled = predicted_and_compiled(fn, args)
  assert predicted == arrays * X.nbytes
  # XLA adds a tuple's pointer table (8 bytes an output) to a multi-output program.
  assert predicted == pytest.approx(compiled, abs=16)


def test_a_producer_is_duplicated_into_each_fusion_that_reads_it():
  spec = MeshSpec(("data",), (1,))
  program = Program.build(trace.trace(shared, (X,), spec), spec, automap.HARDWARE["cpu"])
  g, a = program.graph, program.model.analysis
  runs = {g.prims[o]: int(a.copies[o]) for o in range(g.num_ops)}
  assert runs == {"mul": 2, "add": 2, "tanh": 1, "exp": 1}
  compiled = jax.jit(shared).lower(X).compile().as_text()
  fusions = [line for line in compiled.splitlines() if " fusion(" in line]
  assert len(fusions) == 2 and all("%x" in line for line in fusions)


def test_dot_decomposition_copies_operands_out_of_its_order():
  def rule(fn, *shapes):
    spec = MeshSpec(("data",), (1,))
    args = [jnp.ones(s) for s in shapes]
    g = Program.build(trace.trace(fn, args, spec), spec, automap.HARDWARE["cpu"]).graph
    o = g.prims.index("dot_general")
    return g.rules[o], g.operand_shapes[o]

  assert canonical_copies(*rule(heads, (8, 16, 4, 32), (128, 4, 32))) == (True, True)
  assert canonical_copies(*rule(matrix, (128, 256), (512, 256))) == (False, False)
  # Free dims leading, contracting dims in the dimension numbers' order.
  in_order = lambda x, w: jax.lax.dot_general(x, w, (((2, 3), (0, 1)), ((), ())))  # noqa: E731
  assert canonical_copies(*rule(in_order, (8, 16, 4, 32), (4, 32, 128))) == (False, False)
  x, w = jnp.ones((8, 16, 4, 32)), jnp.ones((4, 32, 128))
  assert predicted_and_compiled(in_order, (x, w)) == (3 * x.nbytes, 3 * x.nbytes)


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["data parallel", "megatron"])
def test_a_train_steps_traffic_is_within_15_percent_of_xlas(layout):
  step, args = gpt_step()
  m = mesh((4, 2))
  specs = megatron_specs(args) if layout == "megatron" else megatron_specs(args, "data", None)
  predicted, compiled = predicted_and_compiled(step, args, m, specs)
  assert predicted == pytest.approx(compiled, rel=0.15)


def test_a_fused_chain_takes_the_time_of_one_pass_over_memory():
  """Ten elementwise ops in one fusion read and write HBM once: the step's
  compute is at most that traffic at HBM bandwidth beside the ops' FLOPs
  at the vector units' rate, not ten passes."""
  def ten(x):
    for _ in range(10):
      x = jnp.sin(x) * 1.5
    return x

  big = jnp.ones((1024, 1024))
  hw = automap.HARDWARE["tpu-v4"]
  cost = automap.evaluate(ten, big, mesh=ONE, hardware=hw)
  assert cost.memory_traffic == 2 * big.nbytes
  one_pass, flops = 2 * big.nbytes / hw.hbm_bandwidth, cost.flops / (hw.fp32_flops / 16)
  assert max(one_pass, flops) <= cost.compute_time <= (one_pass + flops) * (1 + 1e-9)
  assert cost.compute_time < 0.5 * (10 * one_pass + flops)


AUTO = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
STACK, TILE, OUT = jnp.ones((4, 256, 96)), jnp.ones((256, 96)), jnp.ones((96, 32))


def _to(spec):
  return lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(AUTO, spec))


@pytest.mark.parametrize("fn,spec,relaid", [
    # A reduction's result is no loop fusion: its tile is copied on its
    # own; the copy back joins the multiply's fusion.
    (lambda x, w: _to(P())(x.sum(0)) * 2, P(None, None, "model"), TILE.nbytes),
    # Read by a dot, the copy back is a fusion of its own too.
    (lambda x, w: _to(P())(x.sum(0)) @ w, P(None, None, "model"), 3 * TILE.nbytes),
    # Gathered along the major dim: no copy.
    (lambda x, w: _to(P())(x.sum(0)) @ w, P(None, "model", None), 0),
], ids=["read by a multiply", "read by a dot", "major dim"])
def test_an_all_gather_along_a_minor_dim_is_relaid_as_compiled(fn, spec, relaid):
  """XLA lays an all-gather's gathered dim out major (XLA:GPU's layout
  assignment; XLA:CPU compiles the same): gathering columns, the tile is
  copied into that layout and the result back, each copy joining a loop
  fusion beside it where there is one."""
  cost = automap.evaluate(fn, STACK, OUT, mesh=AUTO, in_shardings=(spec, P()), hardware="cpu")
  shardings = (NamedSharding(AUTO, spec), NamedSharding(AUTO, P()))
  compiled = jax.jit(fn, in_shardings=shardings).lower(STACK, OUT).compile()
  assert cost.memory_traffic == hlo.compiled_traffic(compiled)
  assert ("{0,1} all-gather(" in compiled.as_text()) == (relaid > 0)
  program = planner.build_program(fn, (STACK, OUT), AUTO, "cpu")
  in_place = CostModel(program.graph, program.mesh, program.model.hw,
                       dataclasses.replace(compiler.XLA_CPU, major_collective_dims=False))
  unrelaid = Tracker(in_place, program.state_from_specs([spec, P()])).cost()
  assert cost.memory_traffic - unrelaid.memory_traffic == relaid


@pytest.mark.parametrize("reader", ["mul", "dot"])
def test_an_all_to_all_runs_as_slices_and_a_concatenation(reader):
  """XLA:CPU and XLA:GPU split an all-to-all's operand into a buffer per
  peer and concatenate what arrives (`AllToAllDecomposer`); a loop-fused
  reader takes the concatenation in, a dot does not."""
  then = (lambda y, w: y * 2) if reader == "mul" else (lambda y, w: y @ w)
  fn = lambda x, w: then(_to(P("model", None))(jnp.sin(x)), w)  # noqa: E731
  shardings = (NamedSharding(AUTO, P(None, "model")), NamedSharding(AUTO, P()))
  cost = automap.evaluate(fn, TILE, OUT, mesh=AUTO, in_shardings=(P(None, "model"), P()),
                          hardware="cpu")
  compiled = jax.jit(fn, in_shardings=shardings).lower(TILE, OUT).compile()
  assert " all-to-all(" in compiled.as_text()
  # XLA counts each slice's fusion reading a little more than its slice.
  assert cost.memory_traffic == pytest.approx(hlo.compiled_traffic(compiled), rel=0.1)
