"""XLA:TPU as referee: compile-only TPU meshes by their slice names, and
XLA:TPU's scheduled module read right (each form it emits, compiled with
libtpu for real topologies)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap import zoo
from automap._src.run.compiled import (
  collectives,
  compiled_host_memory,
  compiled_memory,
  compiled_seconds,
)

pytest.importorskip("libtpu", reason="XLA:TPU's compiler (libtpu) is not installed: "
                    "pip install -e '.[tpu]'")
pytestmark = pytest.mark.tpu
S = jax.ShapeDtypeStruct


def _compile(fn, mesh, in_specs, args, out_specs=None):
  shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
  jitted = jax.jit(fn, in_shardings=jax.tree.map(shard, in_specs),
                   out_shardings=None if out_specs is None else jax.tree.map(shard, out_specs))
  return jitted.lower(*args).compile()


@pytest.mark.parametrize("name, chips, devices, kind", [
    ("v5p-16", 8, 8, "TPU v5"),          # v5p counts TensorCores: two per chip
    ("v4-16", 8, 8, "TPU v4"),
    ("v6e-8", 8, 8, "TPU v6 lite"),      # v6e counts chips
    ("v5e-16", 16, 16, "TPU v5 lite"),
    ("tpu7x-4", 4, 8, "TPU7x"),          # two devices per TPU7x chip
])
def test_slice_names_count_as_cloud_tpu_counts(name, chips, devices, kind):
  tpu = automap.parse_slice(name)
  assert (tpu.chips, tpu.num_devices) == (chips, devices)
  mesh = automap.tpu_mesh(name, (devices // 2, 2), ("data", "model"))
  assert mesh.shape == {"data": devices // 2, "model": 2}
  assert {d.device_kind for d in mesh.devices.flat} == {kind}
  assert len({d.id for d in mesh.devices.flat}) == devices


def test_default_shapes_are_cloud_tpus():
  shapes = {n: automap.parse_slice(n).topology for n in
            ("v5p-8", "v5p-256", "v5p-512", "v5p-2048", "v4-128", "v6e-256", "v5e-8")}
  assert shapes == {"v5p-8": (2, 2, 1), "v5p-256": (4, 4, 8), "v5p-512": (4, 8, 8),
                    "v5p-2048": (8, 8, 16), "v4-128": (4, 4, 4), "v6e-256": (16, 16),
                    "v5e-8": (2, 4)}
  assert automap.parse_slice("v5p:4x4x12").chips == 192


def test_several_slices_spread_over_the_leading_axis():
  mesh = automap.tpu_mesh("v5p-16", (4, 4), ("data", "model"), slices=2)
  slices = np.vectorize(lambda d: d.slice_index)(mesh.devices)
  assert (slices[:2] == 0).all() and (slices[2:] == 1).all()
  # The cost model prices the axis that crosses slices on the data-centre network.
  hw = automap._src.cost.hardware.on_mesh(automap.HARDWARE["tpu-v5p"], mesh)
  assert hw.devices_per_node == 8


@pytest.mark.parametrize("name, shape, slices, message", [
    ("v5p-12", None, 1, "power of two"),
    ("v9-8", None, 1, "unknown TPU slice 'v9-8'"),
    ("h100-8", None, 1, "names a GPU"),
    ("v5p-16", (3, 3), 1, "holds 9 devices"),
    ("v5p-8", None, 0, "slices must be a positive int"),
    ("v5p:4x4", None, 1, "3-D tori"),
])
def test_bad_slices_name_the_fix(name, shape, slices, message):
  with pytest.raises(automap.MeshError, match=message) as info:
    automap.tpu_mesh(name, shape, slices=slices)
  assert isinstance(info.value, automap.TopologyError)


def test_a_missing_compiler_says_how_to_install_it(monkeypatch):
  import importlib.util

  found = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda n, *a: None if n == "libtpu" else found(n, *a))
  with pytest.raises(automap.TopologyError, match=r"pip install 'automap\[tpu\]'"):
    automap.tpu_mesh("v5p-8")


@pytest.mark.heavy
def test_an_fsdp_step_reads_as_xla_tpu_compiles_it():
  """An f32 weight gathered as bf16 where the dot runs in bf16; its gradient
  all-reduced whole in one tuple with the loss's, then sliced; a roll's
  collective-permute as an async start / done pair; memory and XLA:TPU's
  own time estimate."""
  mesh = automap.tpu_mesh("v5p-16", (8,), ("data",))

  def step(w, x):
    loss, g = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.1 * g, loss

  compiled = _compile(step, mesh, (P("data"), P("data")),
                      (S((4096, 4096), jnp.float32), S((64, 4096), jnp.bfloat16)))
  found = collectives(compiled.as_text(), mesh)
  gather = next(c for c in found if c.kind == "all-gather" and c.nbytes > 2**20)
  assert (gather.dtype, gather.converted_from) == ("bf16", "f32")
  assert gather.nbytes == 4096 * 4096 * 2 and gather.axes == ("data",)
  reduced = [c for c in found if c.kind in ("all-reduce", "reduce-scatter")]
  grad = max(reduced, key=lambda c: c.nbytes)
  # Either form keeps one device's eighth of the f32 gradient.
  kept = grad.sliced_nbytes if grad.kind == "all-reduce" else grad.nbytes
  assert kept == 4096 * 4096 * 4 // 8 + (4 if grad.combined == 2 else 0)
  memory, stats = compiled_memory(compiled)
  assert memory == (stats.argument_size_in_bytes + stats.output_size_in_bytes
                    - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
  assert memory > 4096 * 4096 * 4 // 8 * 2  # the weight's tile in and out
  assert compiled_host_memory(stats) == 0.0
  assert 0 < compiled_seconds(compiled) < 1


def test_reduce_scatters_permutes_and_all_to_alls():
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))

  def step(w1, w2, x):
    def loss(w1, w2):
      return jnp.mean((jnp.tanh(x @ w1) @ w2) ** 2)
    value, (g1, g2) = jax.value_and_grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - g1, w2 - g2, value

  compiled = _compile(step, mesh, (P("data"), P(None, "data"), P("data")),
                      (S((1024, 4096), jnp.float32), S((4096, 1024), jnp.float32),
                       S((64, 1024), jnp.bfloat16)))
  found = collectives(compiled.as_text(), mesh)
  scatters = [c for c in found if c.kind == "reduce-scatter"]
  assert scatters and all(c.axes == ("data",) for c in scatters)
  # XLA:TPU's reduce-scatter: an all-reduce and a dynamic-slice fused, one
  # device's quarter of the gradient kept.
  assert {c.form for c in scatters} == {"all-reduce-scatter fusion"}
  # w1's f32 gradient: a quarter per device, padded to XLA:TPU's tiles.
  assert 1024 * 4096 * 4 // 4 <= max(c.nbytes for c in scatters) < 1024 * 4096 * 4 // 3
  # A resharding of dim 0 to dim 1 is an all-to-all; a roll along a
  # sharded dim a permute of the rows that cross devices.
  x = (S((1024, 1024), jnp.float32),)
  swapped = _compile(lambda x: jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(None, "data"))), mesh, P("data"), x, out_specs=P(None, "data"))
  assert [(c.kind, c.axes, c.nbytes) for c in collectives(swapped.as_text(), mesh)] == [
      ("all-to-all", ("data",), 1024 * 1024 * 4 // 4)]
  rolled = _compile(lambda x: jnp.roll(x, 1, axis=0), mesh, P("data"), x, out_specs=P("data"))
  kinds = {(c.kind, c.axes, c.form) for c in collectives(rolled.as_text(), mesh)}
  assert ("collective-permute", ("data",), "async") in kinds


def test_collectives_in_a_scan_run_its_trip_count():
  """XLA:TPU records no known_trip_count: the trips are read off the loop's
  condition, through the fusions the collectives sit in."""
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))

  def loss(ws, x):
    h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return h.sum()

  compiled = _compile(jax.grad(loss), mesh, (P(None, "data", "model"), P("data")),
                      (S((6, 1024, 1024), jnp.float32), S((64, 1024), jnp.float32)))
  assert "known_trip_count" not in compiled.as_text()
  found = collectives(compiled.as_text(), mesh)
  assert found and {c.trips for c in found} == {6}


def test_combined_gradients_are_one_tuple_all_reduce():
  mesh = automap.tpu_mesh("v6e-8", (4, 2), ("data", "model"))

  def step(p, x):
    loss = lambda p: jnp.mean((jnp.tanh(x @ p["a"]) @ p["b"]) ** 2)  # noqa: E731
    value, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - b, p, g), value

  params = {"a": S((1024, 1024), jnp.float32), "b": S((1024, 1024), jnp.float32)}
  compiled = _compile(step, mesh, ({"a": P(), "b": P()}, P("data")),
                      (params, S((64, 1024), jnp.float32)))
  reduced = [c for c in collectives(compiled.as_text(), mesh) if c.kind == "all-reduce"]
  assert len(reduced) == 1
  assert reduced[0].combined == 3 and reduced[0].nbytes == 2 * 1024 * 1024 * 4 + 4
  assert reduced[0].axes == ("data",)


@pytest.mark.heavy
def test_verify_compares_a_plan_with_xla_tpu():
  fn, args = zoo.mlp()
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  plan = automap.search(fn, *args, mesh=mesh, hardware="tpu-v5p",
                        budget=automap.Budget(episodes=10, seconds=10))
  report = automap.verify(plan, fn, *args, mesh=mesh)  # numerics cannot run here
  assert report.platform == "tpu" and report.max_rel_error is None
  assert report.compiled_seconds is not None and report.compiled_seconds > 0
  assert report.compiled_memory > 0
  assert bool(report.collectives) == (report.predicted.total_comm_bytes > 0)
  assert "XLA estimate" in report.table()
  step = automap.partition(fn, mesh=mesh, hardware="tpu-v5p",
                           budget=automap.Budget(episodes=10, seconds=10))
  compiled = step.lower(*args).compile()
  assert compiled_memory(compiled)[0] == pytest.approx(report.compiled_memory, rel=0.01)
  with pytest.raises(automap.MeshError, match="compile-only"):
    step(*args)


@pytest.mark.heavy
def test_a_step_over_two_slices_compiles_and_prices_the_crossing_on_the_network():
  fn, args = zoo.mlp(width=512, hidden=2048, batch=64)
  dp = jax.tree.map(lambda x: P("data") if x.ndim == 2 and x.shape[0] == 64 else P(), args)
  one = automap.tpu_mesh("v5p-32", (2, 8), ("data", "model"))            # 16 chips, one slice
  two = automap.tpu_mesh("v5p-16", (2, 8), ("data", "model"), slices=2)  # 2 slices of 8
  priced = {n: automap.evaluate(fn, *args, mesh=m, in_shardings=dp) for n, m in
            (("one", one), ("two", two))}
  # Same bytes; the gradients' all-reduce over "data" crosses the slices'
  # data-centre network on two, ICI on one.
  assert priced["one"].comm_bytes == priced["two"].comm_bytes
  assert priced["two"].comm_time > 2 * priced["one"].comm_time
  found = automap.check(fn, *args, mesh=two, in_shardings=dp)
  assert found.fits and "in 2 slices" in found.mesh
  # XLA:TPU reduces across slices through its Megascale runtime: host
  # transfers over the data-centre network, the gradients' bytes arriving.
  reduced = [c for c in found.report.collectives if c.kind == "all-reduce"]
  assert {(c.axes, c.form) for c in reduced} == {(("data",), "megascale")}
  assert sum(c.nbytes for c in reduced) >= 2 * 512 * 2048 * 4  # both f32 gradients


def test_xla_tpus_estimate_leaves_collectives_out():
  """XLA:TPU's optimal_seconds prices a 64 MiB all-reduce as an elementwise
  op over its input: it is reported beside automap's clock, not as a
  referee of communication."""
  mesh = automap.tpu_mesh("v5p-16", (8,), ("data",))
  x = (S((8 * 4096, 4096), jnp.float32),)
  reduced = _compile(lambda x: jnp.sum(x.reshape(8, -1, 4096), axis=0), mesh, P("data"), x,
                     out_specs=P())
  local = _compile(lambda x: x * 2.0, mesh, P("data"), x, out_specs=P("data"))
  assert [(c.kind, c.nbytes) for c in collectives(reduced.as_text(), mesh)] == [
      ("all-reduce", 4096 * 4096 * 4)]
  assert compiled_seconds(reduced) == pytest.approx(compiled_seconds(local), rel=1e-6)
