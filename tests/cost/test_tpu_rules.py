"""The cost model's XLA:TPU rules, each against XLA:TPU's own compile.

Every rule `compiler.XLA_TPU` holds that XLA:GPU or XLA:CPU does otherwise
is read off libtpu's compiled HLO for a compile-only v5p slice here, and
priced as compiled: collective bytes per device by kind and mesh axes.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost import compiler as compiler_lib

pytest.importorskip("libtpu", reason="XLA:TPU's compiler (libtpu) is not installed: "
                    "pip install -e '.[tpu]'")
pytestmark = pytest.mark.tpu
S = jax.ShapeDtypeStruct
_WIDTH, _HIDDEN, _BATCH = 1024, 4096, 4096


def _mlp_step(params, x):
  """One SGD step of a two-matrix MLP; the weights f32 at the default
  matmul precision."""
  def loss(params):
    h = jax.nn.relu(x @ params["w1"])
    return jnp.mean((h @ params["w2"]) ** 2)
  value, grads = jax.value_and_grad(loss)(params)
  return jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), value


@functools.cache
def _checked(mesh, weights: P, batch: P, precision=None) -> automap.Check:
  """`automap.check` of the MLP step, `w1` tiled on its hidden dim and
  `w2` on its rows by `weights`' axes (FSDP), the batch by `batch`'s."""
  step = _mlp_step
  if precision is not None:
    def step(params, x):
      with jax.default_matmul_precision(precision):
        return _mlp_step(params, x)
  params = {"w1": S((_WIDTH, _HIDDEN), jnp.float32), "w2": S((_HIDDEN, _WIDTH), jnp.float32)}
  x = S((_BATCH, _WIDTH), jnp.float32)
  shardings = ({"w1": NamedSharding(mesh, P(None, weights[0])),
                "w2": NamedSharding(mesh, P(weights[0], None))},
               NamedSharding(mesh, batch))
  return automap.check(step, params, x, mesh=mesh, hardware="tpu-v5p",
                       in_shardings=shardings)


def _bytes(check: automap.Check) -> tuple[dict, dict]:
  """(predicted, compiled) collective bytes per device by (kind, axes), the
  compiled collective-permutes of a few hundred KiB that lay XLA:TPU's
  reduce-scatter tiles out aside."""
  compiled = {k: v for k, v in check.report.compiled_comm_bytes.items()
              if k[0] != "collective-permute"}
  return dict(check.predicted.comm_bytes), compiled


def _assert_priced_as_compiled(check: automap.Check, rel: float = 0.02) -> None:
  predicted, compiled = _bytes(check)
  assert set(predicted) == set(compiled), (predicted, compiled)
  for key, nbytes in compiled.items():
    # XLA:TPU pads a reduce-scatter's tile to its (8, 128) tiles: 1.6% here.
    assert predicted[key] == pytest.approx(nbytes, rel=rel), key


@pytest.mark.heavy
def test_an_f32_dot_operand_is_gathered_as_bf16():
  """At the default precision XLA:TPU converts an f32 weight to bf16
  before its FSDP all-gather: half the bytes on the wire."""
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  check = _checked(mesh, P("data"), P("data"))
  gathers = [c for c in check.report.collectives if c.kind == "all-gather"]
  assert gathers and {c.dtype for c in gathers} == {"bf16"}
  # The forward's two gathers, each weight's whole matrix in bf16.
  assert check.report.compiled_comm_bytes["all-gather", ("data",)] == 2 * _WIDTH * _HIDDEN * 2
  _assert_priced_as_compiled(check)


@pytest.mark.slow
def test_at_highest_precision_an_f32_dot_operand_is_gathered_as_f32():
  """At "highest" the dots run in f32, and so do their gathers."""
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  exact = _checked(mesh, P("data"), P("data"), precision="highest")
  assert exact.report.compiled_comm_bytes["all-gather", ("data",)] == 2 * _WIDTH * _HIDDEN * 4
  _assert_priced_as_compiled(exact)


@pytest.mark.heavy
def test_no_reduce_scatter_over_every_device():
  """An FSDP gradient tiled over all 8 chips is all-reduced whole and
  sliced (one all-reduce, combined with the loss's); tiled over 4 of
  them, XLA:TPU forms its all-reduce-scatter fusion."""
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  every = _checked(mesh, P(("data", "model")), P(("data", "model")))
  assert {c.kind for c in every.report.collectives} == {"all-gather", "all-reduce"}
  # Both f32 gradients whole, and the loss.
  assert every.report.compiled_comm_bytes["all-reduce", ("data", "model")] == (
      2 * _WIDTH * _HIDDEN * 4 + 4)
  _assert_priced_as_compiled(every)
  some = _checked(mesh, P("data"), P("data"))
  scatters = [c for c in some.report.collectives if c.kind == "reduce-scatter"]
  assert scatters and {c.form for c in scatters} == {"all-reduce-scatter fusion"}
  _assert_priced_as_compiled(some)


@pytest.mark.heavy
def test_a_partial_sum_is_scattered_before_it_is_reduced_over_the_rest():
  """The batch over (data, model), the weights over data: each gradient is
  reduce-scattered over data, then its quarter all-reduced over model."""
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  check = _checked(mesh, P("data"), P(("data", "model")))
  compiled = check.report.compiled_comm_bytes
  assert compiled["all-reduce", ("model",)] == 2 * _WIDTH * _HIDDEN * 4 // 4
  _assert_priced_as_compiled(check)


def test_the_rules_are_xla_tpus_alone():
  """XLA:GPU and XLA:CPU keep the forms the partitioner emits."""
  tpu, gpu, cpu = compiler_lib.XLA_TPU, compiler_lib.XLA_GPU, compiler_lib.XLA_CPU
  assert (tpu.narrows_dot_operands, tpu.scatters_every_device, tpu.scatters_first) == (
      True, False, True)
  for other in (gpu, cpu):
    assert (other.narrows_dot_operands, other.scatters_every_device, other.scatters_first) == (
        False, True, False)


@pytest.mark.heavy
def test_on_chip_memory_is_what_the_hbm_allocation_leaves_out():
  """Data parallel, a batch of 64: v5p keeps the two 16 MiB gradients in
  HBM and allocates what is priced; v6e's memory-space assignment places
  them on-chip (layouts `S(1)`), and its HBM allocation has no temporaries
  at all. The price is XLA:TPU's before that assignment."""
  allocations = {}
  for topology, hardware in (("v5p-16", "tpu-v5p"), ("v6e-8", "tpu-v6e")):
    mesh = automap.tpu_mesh(topology, (4, 2), ("data", "model"))
    params = {"w1": S((_WIDTH, _HIDDEN), jnp.float32), "w2": S((_HIDDEN, _WIDTH), jnp.float32)}
    shardings = ({"w1": NamedSharding(mesh, P()), "w2": NamedSharding(mesh, P())},
                 NamedSharding(mesh, P(("data", "model"))))
    check = automap.check(_mlp_step, params, S((64, _WIDTH), jnp.float32), mesh=mesh,
                          hardware=hardware, in_shardings=shardings)
    allocations[topology] = check.report.compiled_memory
    predicted = check.predicted.peak_memory
  weights = 2 * _WIDTH * _HIDDEN * 4
  # Arguments and results: the weights in and out.
  assert allocations["v6e-8"] == pytest.approx(2 * weights, rel=0.01)
  assert allocations["v5p-16"] == pytest.approx(2 * weights + weights / 2, rel=0.02)
  assert predicted == pytest.approx(allocations["v5p-16"], rel=0.02)


@pytest.mark.heavy
def test_two_partial_sums_added_are_all_reduced_once():
  """Two dots contracting over `model`, their partial results added: XLA:TPU
  reassociates the two all-reduces into one of the sum (XLA's
  `AllReduceReassociate`); XLA:CPU has no such pass and reduces both (in
  one tuple all-reduce, twice the bytes)."""
  def fn(x, w1, w2):
    return x @ w1 + jnp.tanh(x) @ w2

  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  args = (S((512, _WIDTH), jnp.float32), S((_WIDTH, _HIDDEN), jnp.float32),
          S((_WIDTH, _HIDDEN), jnp.float32))
  shardings = (NamedSharding(mesh, P("data", "model")), NamedSharding(mesh, P("model")),
               NamedSharding(mesh, P("model")))
  check = automap.check(fn, *args, mesh=mesh, hardware="tpu-v5p", in_shardings=shardings)
  reduced = [c for c in check.report.collectives if c.kind == "all-reduce"]
  assert len(reduced) == 1 and reduced[0].nbytes == 512 // 4 * _HIDDEN * 4
  assert check.predicted.comm_count == {("all-reduce", ("model",)): 1}
  _assert_priced_as_compiled(check)
  on_cpu = automap.evaluate(fn, *args, mesh=mesh, hardware="cpu", in_shardings=shardings)
  assert on_cpu.comm_bytes == {("all-reduce", ("model",)): 2 * reduced[0].nbytes}


@functools.cache
def _two_layer_fsdp_tp(layers: int) -> automap.Check:
  """`layers` bf16 matmuls of a (512, 1024) batch tiled over `fsdp`, each
  weight (1024, 1024) f32 tiled P('fsdp', 'tensor'): FSDP with tensor
  parallelism, on 8 v5p chips."""
  def step(ws, x):
    def loss(ws):
      h = x.astype(jnp.bfloat16)
      for w in ws:
        h = jnp.tanh(h @ w.astype(jnp.bfloat16))
      return jnp.sum(jnp.square(h.astype(jnp.float32)))
    return jax.tree.map(lambda w, g: w - 0.1 * g, ws, jax.grad(loss)(ws))

  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("fsdp", "tensor"))
  ws = [S((_WIDTH, _WIDTH), jnp.float32)] * layers
  shardings = ([NamedSharding(mesh, P("fsdp", "tensor"))] * layers,
               NamedSharding(mesh, P("fsdp", None)))
  return automap.check(step, ws, S((512, _WIDTH), jnp.float32), mesh=mesh,
                       hardware="tpu-v5p", in_shardings=shardings)


# A weight's gradient tile, bf16 as its dot makes it: (1024 / 4) x (1024 / 2).
_TILE = _WIDTH // 4 * _WIDTH // 2 * 2


@pytest.mark.heavy
def test_a_gradient_whose_rows_come_tiled_over_tensor_is_all_reduced_whole():
  """XLA:TPU reduce-scatters a weight's gradient over `fsdp` where the dot
  already computes in the weight's layout on `tensor` (one layer: its rows
  come from the batch's untiled features); where its rows come tiled over
  `tensor` from the layer before, it all-reduces the whole partial
  gradient over `fsdp` and reshards after, for every layer."""
  one, two = _bytes(_two_layer_fsdp_tp(1))[1], _bytes(_two_layer_fsdp_tp(2))[1]
  assert one[("reduce-scatter", ("fsdp",))] == _TILE
  assert ("all-reduce", ("fsdp",)) not in one
  assert two[("all-reduce", ("fsdp",))] == 2 * 4 * _TILE
  assert ("reduce-scatter", ("fsdp",)) not in two


@pytest.mark.heavy
def test_the_whole_gradient_all_reduce_is_priced():
  """The rule as priced: a partial sum is reduce-scattered only where the
  dot's operands come tiled as its result on every other axis."""
  for layers in (1, 2):
    predicted, compiled = _bytes(_two_layer_fsdp_tp(layers))
    for kind in ("all-reduce", "reduce-scatter"):
      assert predicted.get((kind, ("fsdp",)), 0) == compiled.get((kind, ("fsdp",)), 0), kind
