"""The cost model against arithmetic and against compiled HLO."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import SMALL, gpt_step, loss_and_grads, megatron_specs, mesh, random_input_tilings
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost import analysis, collectives, compiler, hardware, program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.run import compiled as hlo
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import flat_specs, set_spec


@pytest.mark.heavy
def test_megatron_dp_prediction_matches_the_formula_and_xla():
  step, args = gpt_step()
  m = mesh((4, 2))
  specs = megatron_specs(args)
  c = automap.evaluate(step, *args, mesh=m, in_shardings=specs, hardware="tpu-v4")
  b, s, h, beta, d = 8, SMALL.seq, SMALL.hidden, 4, 4
  activation = b // d * s * h * beta
  # Megatron's four all-reduces per layer: after attention and after the MLP
  # forward; after the MLP's first layer and after the q/k/v projections
  # backward, whose three partial sums XLA:TPU adds before reducing them
  # once (`AllReduceReassociate`).
  assert c.comm_count[("all-reduce", ("model",))] == SMALL.layers * 4
  assert c.comm_bytes[("all-reduce", ("model",))] == SMALL.layers * 4 * activation
  # XLA:CPU reduces each projection's (its combiner merges the three into
  # one tuple all-reduce, they being independent): as it compiles them.
  on_cpu = automap.evaluate(step, *args, mesh=m, in_shardings=specs, hardware="cpu")
  assert on_cpu.comm_count[("all-reduce", ("model",))] == SMALL.layers * 4
  assert on_cpu.comm_bytes[("all-reduce", ("model",))] == SMALL.layers * 6 * activation
  shardings = jax.tree.map(lambda p: NamedSharding(m, p), specs,
                           is_leaf=lambda x: isinstance(x, P))
  compiled = jax.jit(step, in_shardings=shardings).lower(*args).compile()
  found = hlo.summarize(hlo.collectives(compiled.as_text(), m))
  for key, predicted in on_cpu.comm_bytes.items():
    assert found.get(key, 0) == pytest.approx(predicted, rel=0.05), key
  assert set(found) == set(on_cpu.comm_bytes)
  params = sum(x.size for x in jax.tree.leaves(args[0]))
  model_split = sum(
      x.size // 2 if spec != P() else x.size
      for x, spec in zip(jax.tree.leaves(args[0]),
                         jax.tree.leaves(specs[0], is_leaf=lambda x: isinstance(x, P))))
  # The gradient all-reduce over 'data' carries this device's parameter share.
  assert c.comm_bytes[("all-reduce", ("data",))] >= model_split * beta
  assert model_split < params


def test_incremental_tracker_equals_a_fresh_evaluation():
  step, args = gpt_step()
  prog = program.Program.build(trace.trace(step, args),
                               MeshSpec(("data", "model"), (4, 2)),
                               hardware.get_hardware("cpu"))
  state = prog.initial_state()
  tracker = Tracker(prog.model, state)
  prop = prog.propagator()
  for v, d, a in random_input_tilings(prog.graph, seed=0, count=25):
    tracker.update(prop.tile(state, v, d, a))
  fresh = Tracker(prog.model, state.copy())
  assert tracker.step_time == pytest.approx(fresh.step_time, rel=1e-9)
  assert tracker.peak_memory == pytest.approx(fresh.peak_memory, rel=1e-9)
  np.testing.assert_allclose(tracker.bytes, fresh.bytes, rtol=1e-9, atol=1e-6)


def test_sharding_reduces_flops_and_memory():
  step, args = gpt_step()
  m = mesh((8, 1))
  replicated = automap.evaluate(step, *args, mesh=m, in_shardings=P())
  dp = automap.evaluate(step, *args, mesh=m,
                        in_shardings=megatron_specs(args, model=None))
  assert dp.flops < replicated.flops / 4
  assert replicated.comm_bytes == {}
  # Without an optimizer's results to hold them, activations set the peak:
  # splitting the batch shrinks it (priced for XLA:CPU, whose compiled peaks
  # here are 6.2 MB and 5.1 MB; priced 5.5 MB and 5.0 MB: XLA's heap leaves
  # gaps between the replicated step's temporaries the model does not count).
  fn, grads_args = loss_and_grads(args)
  replicated = automap.evaluate(fn, *grads_args, mesh=m, in_shardings=P(), hardware="cpu")
  dp = automap.evaluate(fn, *grads_args, mesh=m, in_shardings=(P(), P("data")),
                        hardware="cpu")
  assert dp.peak_memory < 0.95 * replicated.peak_memory


@pytest.mark.heavy
def test_results_buffers_hold_temporaries_made_before_them():
  """Activations die before Adam makes the new state, so its buffers hold
  them (XLA's buffer assignment shares live-out allocations): a replicated
  step peaks at little more than its arguments and results. A (loss, grads)
  step's gradient buffers hold only what dies before each is made (a later
  layer's activations in an earlier layer's gradient), so less of it."""
  step, args = gpt_step()
  fn, grads_args = loss_and_grads(args)
  replicated = (MeshSpec(("data",), (8,)), hardware.get_hardware("cpu"))
  peaks = {}
  for name, f, a in (("step", step, args), ("grads", fn, grads_args)):
    prog = program.Program.build(trace.trace(f, a), *replicated)
    tracker = Tracker(prog.model, prog.initial_state())
    peaks[name] = tracker.peak()[0] / tracker.live.max()
  assert peaks["step"] < 0.25
  assert 2 * peaks["step"] < peaks["grads"] < 0.9
  report = automap.verify(automap.search(step, *args, mesh=mesh((8, 1)), hardware="cpu"),
                          step, *args, mesh=mesh((8, 1)), check_numerics=False)
  assert report.memory_error < 0.15, report.table()


def test_cpu_reductions_store_the_producers_they_share():
  """XLA:CPU's library reductions take in only producers nothing else reads:
  a layer norm's scale and rsqrt, read by the forward pass and broadcast
  into backward reductions, are stored broadcast from the forward pass to
  the backward one. Priced so, Megatron's (loss, grads) memory is near
  XLA's, and it holds at least what the TPU and GPU rule (fused wherever
  recomputing moves fewer bytes) does."""
  step, args = gpt_step()
  fn, grads_args = loss_and_grads(args)
  m = mesh((2, 4))
  specs = (megatron_specs(args)[0], P())
  cpu = hardware.get_hardware("cpu")
  assert not cpu.compiler.fuses_shared_producers
  traced = trace.trace(fn, grads_args)

  def peak(xla: compiler.Compiler) -> float:
    prog = program.Program.build(traced, MeshSpec.of(m), cpu, compiler=xla)
    return Tracker(prog.model, prog.state_from_specs(flat_specs(specs, grads_args))).peak_memory

  shared = peak(compiler.XLA_CPU)
  fused = peak(dataclasses.replace(compiler.XLA_CPU, fuses_shared_producers=True))
  assert shared == automap.evaluate(fn, *grads_args, mesh=m, in_shardings=specs,
                                    hardware=cpu).peak_memory
  shardings = jax.tree.map(lambda p: NamedSharding(m, p), specs,
                           is_leaf=lambda x: isinstance(x, P))
  compiled, _ = hlo.compiled_memory(
      jax.jit(fn, in_shardings=shardings).lower(*grads_args).compile())
  assert abs(shared - compiled) < 0.1 * compiled
  assert fused <= shared


@pytest.mark.parametrize("op,stored", [
    (jnp.tanh, True),  # expensive: computed once, its buffer read by both
    (jnp.sin, False),  # cheap for reals: recomputed in each reader
    (lambda x: 1.0 / x, True),  # a float division is expensive...
    (lambda x: x / 3.0, False),  # ...unless by a constant (a multiplication)
])
def test_an_expensive_op_two_fusions_read_is_stored_once(op, stored):
  """XLA's fusion never duplicates an expensive op into several consumers
  (`InstructionFusion::ShouldFuse`): read by two loop fusions, a tanh is a
  fusion of its own whose buffer both read, a sine is recomputed in each.
  Checked against the compiled program's fusions."""
  def fn(x, z):
    y = op(x)
    return y * z, y + z

  args = (jnp.ones((64, 64)), jnp.ones((64, 64)))
  entry = jax.jit(fn).lower(*args).compile().as_text().split("ENTRY")[1]
  assert entry.count(" fusion(") == (3 if stored else 2)
  g = program.Program.build(trace.trace(fn, args), MeshSpec(("data",), (8,)),
                            hardware.get_hardware("cpu")).graph
  made = g.results[0][0]  # the op's result (the first equation)
  cpu = compiler.XLA_CPU
  assert analysis.materialized(g, cpu.fuses_shared_producers, cpu.expensive)[0][made] == stored
  assert not analysis.materialized(g, cpu.fuses_shared_producers)[0][made]


def test_a_gather_fuses_into_its_one_loop_fused_reader():
  """XLA never duplicates a gather (it deems it expensive), so it is fused
  only into a sole reader that loop-fuses, as a concatenation does."""
  import jax.numpy as jnp

  def fn(table, idx, x, w):
    once = jnp.concatenate([table[idx], x], axis=-1) @ w
    twice = table[idx + 1]
    return once, twice @ w[:16] + twice.sum()

  args = (jnp.ones((64, 16)), jnp.zeros(32, jnp.int32), jnp.ones((32, 16)), jnp.ones((32, 8)))
  g = program.Program.build(trace.trace(fn, args), MeshSpec(("data",), (8,)),
                            hardware.get_hardware("tpu-v4")).graph
  stored, _ = analysis.materialized(g)
  gathered = [v for o, p in enumerate(g.prims) if p == "gather" for v in g.results[o]]
  assert [bool(stored[v]) for v in gathered] == [False, True]


@pytest.mark.parametrize("have,want", [
    (P(None, "a"), P("a", None)),  # an axis moves: one all-to-all
    (P(None, "a"), P(("a", "b"), None)),  # and another arrives beside it
    (P(None, "b"), P(("a", "b"), None)),  # ... as the major one
    (P(None, "a"), P(("a", "c"), None)),
])
def test_reshards_move_axes_as_xla_does(have, want):
  """An axis moving between dims is exchanged all-to-all, unless another
  axis arrives on its target dim too: then XLA gathers the whole array."""
  m = mesh((2, 2, 2), ("a", "b", "c"))
  x = jnp.ones((8, 8))
  prog = program.Program.build(trace.trace(lambda x: x * 2, (x,)), MeshSpec.of(m),
                               hardware.get_hardware("cpu"))
  rows = []
  for spec in (have, want):
    state = prog.initial_state()
    set_spec(state, prog.mesh, 0, (8, 8), spec, "x")
    rows.append(state[0])
  comms = []
  prog.model.transition(comms, rows[0], rows[1], 8 * 8 * 4 / 2, 0)
  names = prog.mesh.axis_names
  predicted = {(collectives.KINDS[k], tuple(n for a, n in enumerate(names) if mask >> a & 1)): b
               for k, mask, b, *_ in comms}
  f = jax.jit(lambda x: x * 2, in_shardings=NamedSharding(m, have),
              out_shardings=NamedSharding(m, want))
  assert hlo.summarize(hlo.collectives(f.lower(x).compile().as_text(), m)) == predicted


def test_cpu_library_reductions_take_in_no_gather():
  """XLA:CPU implements a reduction of 4096 elements or more as a library
  fusion, which cannot take in a gather: the gathered rows are stored. A
  smaller one is loop-fused with the gather, as on TPU."""
  def fn(table, idx, w):
    return jnp.sum(table[idx] * w, axis=0)

  for rows, library in ((32, False), (256, True)):
    args = (jnp.ones((64, 64)), jnp.zeros(rows, jnp.int32), jnp.ones((rows, 64)))
    g = program.Program.build(trace.trace(fn, args), MeshSpec(("data",), (8,)),
                              hardware.get_hardware("cpu")).graph
    (gathered,) = [g.results[o][0] for o, p in enumerate(g.prims) if p == "gather"]
    assert not analysis.materialized(g, fuses_shared=True)[0][gathered]
    assert analysis.materialized(g, fuses_shared=False)[0][gathered] == library
    compiled = jax.jit(fn).lower(*args).compile().as_text()
    assert ("kind=kCustom" in compiled) == library


def test_hardware_catalogue_and_validation():
  for name in ("tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p", "a100", "h100", "h200", "cpu"):
    hw = hardware.get_hardware(name)
    assert hw.flops > 0 and hw.link_bandwidth > hw.network_bandwidth * 0.5
  with pytest.raises(automap.HardwareError, match="hbm_bandwidth"):
    automap.Hardware(name="bad", flops=1e12, fp32_flops=1e12, hbm_bandwidth=-1.0,
                     hbm_capacity=1e9, link_bandwidth=1e9, link_latency=0,
                     network_bandwidth=1e9, network_latency=0, devices_per_node=8)
  with pytest.raises(automap.HardwareError, match="one of"):
    hardware.get_hardware("tpu-v9")


def test_running_cost_equals_a_fresh_one_after_jumps_between_states():
  """Incremental updates leave no residue when the search jumps between
  states, also for a copy read inside a loop (priced per step) and outside."""
  import jax.numpy as jnp

  def fn(x, w):
    h = jnp.tanh(x @ w)
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), h, None, length=3)[0].sum()

  args = (jnp.ones((32, 64)), jnp.ones((64, 64)))
  prog = program.Program.build(trace.trace(fn, args), MeshSpec(
      ("data", "model"), (2, 4)), hardware.get_hardware("tpu-v4"))
  prop = prog.propagator()
  rng = np.random.default_rng(0)
  g = prog.graph
  states = []
  for _ in range(12):  # states the search might visit: a few tiles each
    s = prog.initial_state()
    for _ in range(4):
      v = int(rng.integers(g.num_values))
      if g.rank(v):
        prop.tile(s, v, int(rng.integers(g.rank(v))), int(rng.integers(2)),
                  propagate=bool(rng.integers(2)))
    states.append(s)
  state = prog.initial_state()
  tracker = Tracker(prog.model, state)
  for i in rng.integers(len(states), size=200):  # jump between them
    diff = np.flatnonzero((state != states[i]).any(axis=1))
    state[diff] = states[i][diff]
    tracker.update(diff)
  fresh = Tracker(prog.model, state)
  assert tracker.step_time == pytest.approx(fresh.step_time, rel=1e-9)
  assert tracker.peak_memory == pytest.approx(fresh.peak_memory, rel=1e-9)


def test_collective_over_several_axes_runs_axis_by_axis():
  # Ring over each axis in turn, fastest link first: the bytes on the wire
  # are one flat ring's, the latency steps (4 - 1) + (2 - 1), not 8 - 1.
  hw = automap.Hardware(
      name="two-speed", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12, hbm_capacity=2**30,
      link_bandwidth=1e9, link_latency=1e-6, network_bandwidth=1e8, network_latency=1e-5,
      devices_per_node=2)
  g = program.Program.build(trace.trace(lambda x: x * 2, (np.ones((8, 8), np.float32),)),
                            MeshSpec(("node", "chip"), (4, 2)), hw).model
  nbytes = 8e6
  # Within a node ("chip"): the whole buffer; across nodes: a half of it.
  rs = (1e-6 + nbytes / 2 / 1e9) + (3e-5 + 3 / 4 * nbytes / 2 / 1e8)
  assert g.comm_time(collectives.ALL_REDUCE, 0b11, nbytes) == pytest.approx(2 * rs, rel=1e-12)
  assert g.comm_time(collectives.ALL_GATHER, 0b11, nbytes) == pytest.approx(rs, rel=1e-12)
  assert g.comm_time(collectives.REDUCE_SCATTER, 0b11, nbytes / 8) == pytest.approx(rs, rel=1e-12)
  flat = 2 * 7 * 1e-5 + 2 * 7 / 8 * nbytes / 1e8
  assert g.comm_time(collectives.ALL_REDUCE, 0b11, nbytes) < flat
  # One axis: one ring.
  assert g.comm_time(collectives.ALL_REDUCE, 0b10, nbytes) == pytest.approx(
      2 * (1e-6 + nbytes / 2 / 1e9), rel=1e-12)


def test_layout_hash_collisions_never_merge_two_layouts(monkeypatch):
  """The memo finds entries by a hash of the layouts; when every layout
  hashes alike, costs still come out as the exact memo gives them."""
  from automap._src.cost import kernels

  step, args = gpt_step()
  traced = trace.trace(step, args)
  mesh_spec = MeshSpec(("data", "model"), (4, 2))
  hw = hardware.get_hardware("tpu-v4")
  exact = program.Program.build(traced, mesh_spec, hw)
  monkeypatch.setattr(kernels, "_layout_hash", lambda *_: np.uint64(7))
  monkeypatch.setattr(kernels, "find_entries", kernels.find_entries.py_func)
  monkeypatch.setattr(kernels, "insert_entries", kernels.insert_entries.py_func)
  colliding = program.Program.build(traced, mesh_spec, hw)
  prop = exact.propagator()
  state = exact.initial_state()
  trackers = [Tracker(p.model, state) for p in (exact, colliding)]
  rng = np.random.default_rng(0)
  g = exact.graph
  for _ in range(6):
    v = int(rng.choice(g.inputs))
    if g.rank(v):
      changed = prop.tile(state, v, int(rng.integers(g.rank(v))), int(rng.integers(2)))
      for t in trackers:
        t.update(changed)
      a, b = (t.cost() for t in trackers)
      assert (a.step_time, a.peak_memory, a.comm_bytes) == (
          b.step_time, b.peak_memory, b.comm_bytes)
  assert len(colliding.model.memo) == len(exact.model.memo) > 1


def test_compilers_by_platform():
  assert compiler.compiler_for("cuda") is compiler.compiler_for("gpu") is compiler.XLA_GPU
  assert compiler.compiler_for("cpu") is compiler.XLA_CPU
  assert {name: hw.compiler for name, hw in automap.HARDWARE.items()} == {
      **{name: compiler.XLA_TPU
         for name in ("tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "tpu7x")},
      **{name: compiler.XLA_GPU for name in ("a100", "h100", "h200", "b200", "gb200")},
      "cpu": compiler.XLA_CPU}
  with pytest.raises(ValueError, match="platform must be one of .* got 'metal'"):
    compiler.compiler_for("metal")
  with pytest.raises(automap.HardwareError, match="Hardware.platform must be one of"):
    dataclasses.replace(automap.HARDWARE["h100"], platform="npu")


def test_old_hardware_flags_still_price_with_a_deprecation_warning():
  """Hardware once carried XLA's behaviours itself; specs written so warn,
  and price as the platform whose compiler behaves so."""
  fields = dict(
      name="old", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e11, hbm_capacity=2**30,
      link_bandwidth=1e10, link_latency=1e-6, network_bandwidth=1e9, network_latency=1e-5,
      devices_per_node=8)
  with pytest.warns(DeprecationWarning, match="platform"):
    old = automap.Hardware(**fields, reduce_scatter=False, reduce_in_f32=True,
                           fuses_shared_producers=False)
  step, args = gpt_step()
  fn, grads_args = loss_and_grads(args)
  traced = trace.trace(fn, grads_args)
  specs = flat_specs((megatron_specs(args)[0], P()), grads_args)

  def priced(hw: hardware.Hardware, xla: compiler.Compiler | None = None) -> automap.Cost:
    prog = program.Program.build(traced, MeshSpec(("data", "model"), (2, 4)), hw, compiler=xla)
    return Tracker(prog.model, prog.state_from_specs(specs)).cost()

  tpu = automap.Hardware(**fields)
  # Whether collectives run asynchronously, the schedule, and the rules
  # read off XLA:TPU's compile were never flags: they stay the platform's
  # (tpu here), so only those differ from XLA:CPU's.
  in_place = lambda c: dataclasses.replace(  # noqa: E731
      c, exposed_comm_time=c.comm_time, step_time=c.serial_step_time)
  tpu_rules = ("scatters_every_device", "scatters_first", "narrows_dot_operands",
               "reassociates_all_reduces")
  in_order = dataclasses.replace(
      compiler.XLA_CPU, breadth_first=False,
      **{rule: getattr(compiler.XLA_TPU, rule) for rule in tpu_rules})
  assert in_place(priced(old)) == priced(tpu, in_order)
  assert priced(old) != priced(tpu)


def test_a_small_long_lived_temporary_holds_back_only_its_own_class():
  """One large (class 0) and one small (class 1) temporary alive at op 2; the
  large dies at 3, the small lives on to 9 (a gradient the optimizer reads
  last). A large result buffer made at op 5 hosts the large temporary
  there, as XLA's buffer assignment shares a live-out allocation between
  values that do not interfere; it cannot host the small one, which
  outlives it being made."""
  from automap._src.cost import kernels

  start, end = np.array([1, 0]), np.array([3, 9])
  foot = np.array([1000.0, 10.0])
  fits = np.array([0, 1])  # class of the smallest buffer each fits
  made, slot = np.array([5]), np.array([0])  # one large buffer, made at op 5

  def held(t):
    return kernels.hosted_at(t, start, end, foot, fits, made, slot)

  assert held(2) == 1000.0  # the large one lives in the result's buffer
  assert held(4) == 0.0  # only the small one is alive: it outlives the buffer's making
  assert held(6) == 0.0  # the buffer is made: it hosts nothing more
  live = np.array([10.0, 1010.0, 1010.0, 1010.0, 10.0, 10.0, 10.0])
  assert kernels.peak_after_hosting(live, start, end, foot, fits, made, slot) == (10.0, 0)


def test_temporaries_take_the_result_buffers_made_after_they_die():
  """Three equal temporaries alive at op 2, dying at 3, 6 and 8; result
  buffers of their size made at 4, 7 and 9. Each buffer holds one
  temporary that dies before it is made: all three are held (the one dying
  last takes the buffer made last), though the latest death is after the
  first buffer is made. A larger temporary alive beside them takes a
  buffer only if one of its size or more is made after it dies."""
  from automap._src.cost import kernels

  start, end = np.array([0, 1, 2, 0]), np.array([3, 6, 8, 5])
  foot = np.array([100.0, 100.0, 100.0, 400.0])
  made, slot = np.array([4, 7, 9]), np.array([1, 1, 1])  # class 1: 100 bytes
  fits = np.array([1, 1, 1, 0])  # the 400-byte one needs a class-0 buffer: none
  assert kernels.hosted_at(2, start, end, foot, fits, made, slot) == 300.0
  assert kernels.hosted_at(5, start, end, foot, fits, made, slot) == 200.0
  slot = np.array([0, 1, 1])  # the buffer made at 4 is large, but made before op 5
  assert kernels.hosted_at(2, start, end, foot, fits, made, slot) == 300.0
  slot = np.array([1, 0, 1])  # one made at 7 is large: the 400-byte one takes it
  assert kernels.hosted_at(2, start, end, foot, fits, made, slot) == 600.0


def test_the_hosted_peak_is_every_ops_live_less_its_hosting_at_its_most():
  """`peak_after_hosting` prices the hosting once per run of ops between
  temporaries' starts and ends; on random programs it is still the most of
  live less hosted over every op, at the earliest op where that ties."""
  from automap._src.cost import kernels

  rng = np.random.default_rng(0)
  for _ in range(500):
    n, temps, buffers = rng.integers(1, 40), rng.integers(0, 12), rng.integers(1, 8)
    live = rng.integers(0, 8, n).astype(float)
    start = rng.integers(0, n, temps)
    end = np.minimum(start + rng.integers(-1, 12, temps), n - 1)
    foot, fits = rng.integers(1, 4, temps).astype(float), rng.integers(1, 4, temps)
    made, slot = np.sort(rng.integers(0, n + 3, buffers)), rng.integers(0, 4, buffers)
    net = [live[t] - kernels.hosted_at(t, start, end, foot, fits, made, slot) for t in range(n)]
    assert kernels.peak_after_hosting(live, start, end, foot, fits, made, slot) == (
        max(net), int(np.argmax(net)))


def test_matmul_rate_pads_to_the_tile_and_scales_by_efficiency():
  hw = dataclasses.replace(automap.HARDWARE["tpu-v4"], matmul_efficiency=0.8, matmul_tile=128)
  peak = 275e12 * 0.8
  assert hw.matmul_rate(2, 256, 512) == pytest.approx(peak)
  assert hw.matmul_rate(2, 96, 512) == pytest.approx(peak * 96 / 128)
  assert hw.matmul_rate(2, 200, 130) == pytest.approx(peak * 200 / 256 * 130 / 256)
  assert hw.matmul_rate(4, 96, 512) == pytest.approx(hw.fp32_flops * 0.8 * 96 / 128)
  with pytest.raises(automap.HardwareError, match="matmul_efficiency must be a share"):
    dataclasses.replace(hw, matmul_efficiency=1.5)
  with pytest.raises(automap.HardwareError, match="matmul_tile must be a positive int"):
    dataclasses.replace(hw, matmul_tile=2.5)


def test_a_matmul_is_priced_on_its_padded_tiles_per_device():
  """[64, 96] x [96, 200] per device on 128-wide tiles: 96 of 128 contracted
  and 200 of 256 output columns are useful, so it takes 128/96 * 256/200 as
  long as on a tile-free spec; sharding the rows leaves the ratio."""
  x = jax.ShapeDtypeStruct((128, 96), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((96, 200), jnp.bfloat16)
  fast = dataclasses.replace(automap.HARDWARE["tpu-v4"], hbm_bandwidth=1e30, matmul_tile=1)
  tiled = dataclasses.replace(fast, matmul_tile=128)
  m = mesh((2, 4))
  specs = (P("data"), P())
  times = [automap.evaluate(jnp.dot, x, w, mesh=m, in_shardings=specs, hardware=hw).compute_time
           for hw in (fast, tiled)]
  assert times[1] / times[0] == pytest.approx(128 / 96 * 256 / 200)
