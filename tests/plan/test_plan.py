"""Plans as data: JSON round trip, explain, fingerprints."""

import json

import jax
import jax.numpy as jnp
import pytest
from helpers import gpt_step, megatron_specs, mesh, mlp, planned
from jax.sharding import PartitionSpec as P

import automap
from automap._src.plan import build


@pytest.mark.heavy
def test_plan_round_trips_through_json(tmp_path):
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu",
                        budget=automap.Budget(episodes=20))
  path = tmp_path / "plan.json"
  plan.save(path)
  loaded = automap.Plan.load(path)
  assert loaded == plan
  assert loaded.to_json() == json.loads(path.read_text())
  # A loaded plan carries no pytree structure: its specs come keyed by path.
  assert loaded.in_shardings["0/block_0/mlp/wi/kernel"] == plan.in_specs[
      plan.in_paths.index("0/block_0/mlp/wi/kernel")]
  # And it verifies against the program it was made for.
  report = automap.verify(loaded, step, *args, mesh=mesh((4, 2)))
  assert report.comm_error < 0.05


def test_plan_for_another_program_is_refused(tmp_path):
  x = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))
  plan = automap.search(mlp, *x, mesh=mesh((4, 2)))
  with pytest.raises(automap.PlanError, match="different program"):
    automap.verify(plan, lambda a, b, c: mlp(a, b, c) * 2, *x, mesh=mesh((4, 2)))


def test_corrupt_plan_files_are_reported(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(automap.PlanError, match="not valid JSON"):
    automap.Plan.load(bad)
  bad.write_text('{"schema": "something-else"}')
  with pytest.raises(automap.PlanError, match="schema"):
    automap.Plan.load(bad)


@pytest.mark.heavy
def test_explain_lists_layouts_collectives_and_cost():
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu",
                        budget=automap.Budget(episodes=20))
  text = plan.explain()
  assert "step time" in text and "peak memory" in text
  achieved = plan.cost.flops / plan.cost.step_time
  assert f"MFU {achieved / plan.hardware.flops:.1%}" in text
  assert "0/block_0/mlp/wi/kernel" in text
  assert "block_0" in text and "all-" in text


@pytest.mark.heavy
@pytest.mark.parametrize("shape", [(4, 2), (1, 8)])
def test_per_layer_time_and_memory_add_up_to_the_cost(shape):
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh(shape), hardware="cpu",
                        budget=automap.Budget(episodes=20))
  rows, c = plan.layers, plan.cost
  assert [r.name for r in rows][:4] == ["embed", "GPT", "block_0", "block_1"]
  assert sum(r.compute for r in rows) == pytest.approx(c.compute_time, rel=1e-9)
  assert sum(r.comm for r in rows) == pytest.approx(c.comm_time, rel=1e-9)
  # Memory is the peak's make-up: resident buffers and what is alive there.
  assert sum(r.resident + r.temporary for r in rows) == pytest.approx(
      c.peak_memory, rel=1e-9)
  # Repeated blocks cost alike; their optimizer state is charged to them.
  b0, b1 = rows[2], rows[3]
  assert b0.compute == pytest.approx(b1.compute) and b0.resident == b1.resident
  params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(args[0]["block_0"]))
  assert b0.resident >= 3 * params / 8  # params, mu, nu; at most 8-way split


@pytest.mark.slow
def test_yardsticks_are_the_expert_strategies_under_the_same_model():
  step, args, m, plan = planned((4, 2))
  dp = automap.evaluate(step, *args, mesh=m, hardware="cpu", in_shardings=megatron_specs(
      args, data=("data", "model"), model=None))
  assert plan.yardsticks["data parallel"].cost == dp
  megatron = plan.yardsticks["Megatron + data parallel"]
  assert megatron.cost.step_time > plan.cost.step_time
  # `differs` names exactly the arguments laid out otherwise than the plan.
  specs = dict(zip(plan.in_paths, plan.in_specs))
  assert megatron.differs and all(specs[p] != s for p, s in megatron.differs.items())
  assert megatron.differs["0/block_0/mlp/wi/kernel"] == P(None, "model")
  text = plan.explain()
  assert "Megatron + data parallel" in text and "x faster" in text
  assert "communication over data" in text
  assert "per layer" in text and "block_1" in text


@pytest.mark.heavy
def test_explain_reports_memory_against_the_limit_and_plots(tmp_path):
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu",
                        memory_limit=64e6)
  assert plan.memory_limit == 64e6
  assert "of the 61.0 MiB limit" in plan.explain()
  plan.plot(tmp_path / "plan.png")
  assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.heavy
def test_per_layer_collectives_add_up_to_the_cost():
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu",
                        budget=automap.Budget(episodes=20))
  totals: dict = {}
  for _, kind, axes, nbytes, _ in plan.collectives:
    totals[(kind, axes)] = totals.get((kind, axes), 0.0) + nbytes
  assert totals.keys() == plan.cost.comm_bytes.keys()
  for key, nbytes in plan.cost.comm_bytes.items():
    assert totals[key] == pytest.approx(nbytes)


def test_a_plan_reprices_as_searched_inside_scanned_and_rematerialised_layers():
  # Transformer layers scanned with nn.scan and rematerialised: values inside
  # the remat call cannot be constrained, so the plan records the layouts
  # the search priced for them. Re-pricing the plan (as verify does) gives
  # the searched cost, not that of another propagation order (here 10% off).
  import flax.linen as nn
  import optax

  from automap._src.cost.program import Program
  from automap._src.cost.tracker import Tracker
  from automap._src.ir import trace

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      x = x + nn.SelfAttention(num_heads=4, deterministic=True)(nn.LayerNorm()(x))
      return x + nn.Dense(256)(nn.gelu(nn.Dense(1024)(nn.LayerNorm()(x)))), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, tok):
      x = nn.Embed(256, 256)(tok)
      x, _ = nn.scan(nn.remat(Block), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=2)()(x, None)
      return nn.Dense(256)(x)

  model, tx = Model(), optax.adamw(1e-3)
  tok = jax.ShapeDtypeStruct((32, 128), jnp.int32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((32, 128), jnp.int32)))
  params = params["params"]

  def step(params, opt, tok):
    def loss(p):
      logits = model.apply({"params": p}, tok)
      return optax.softmax_cross_entropy_with_integer_labels(logits, tok).mean()
    grads = jax.grad(loss)(params)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt

  args = (params, jax.eval_shape(tx.init, params), tok)
  plan = automap.search(step, *args, mesh=jax.sharding.AbstractMesh((4, 2), ("data", "model")),
                        hardware="tpu-v4", cache=False)
  assert plan.inferred  # the remat call's values
  program = Program.build(trace.trace(step, args), plan.mesh, plan.hardware)
  again = Tracker(program.model, build.state_of(program, plan)).cost()
  assert again.step_time == pytest.approx(plan.cost.step_time, rel=1e-9)
  assert again.comm_bytes == pytest.approx(plan.cost.comm_bytes, rel=1e-9)


def test_results_of_a_sealed_call_are_pinned_where_it_returns_them():
  """relu is a custom-JVP call, bound whole in the rewritten program: what it
  makes inside is left to XLA, but its result is pinned where it returns,
  so a plan that gathers the result before a scatter-add compiles to that
  gather, not to XLA's own choice (a partial scatter, then an all-reduce)."""
  from automap._src.cost.program import Program
  from automap._src.ir import trace
  from automap._src.sharding.mesh import MeshSpec

  def fn(x, w, idx):
    h = jax.nn.relu(x @ w)
    return jnp.zeros((64, 32)).at[idx].add(h)

  args = (jnp.ones((256, 16)), jnp.ones((16, 32)) / 16, jnp.arange(256, dtype=jnp.int32) % 64)
  m = mesh((8,), ("data",))
  program = Program.build(trace.trace(fn, args), MeshSpec.of(m), automap.HARDWARE["cpu"])
  g = program.graph
  (relu,) = [o for o, p in enumerate(g.prims) if p == "max"]
  (h,) = g.results[relu]
  assert g.sealed[h] and g.bound[h]
  state = program.state_from_specs([P("data"), P(), P()])
  assert state[g.operands[relu][0], 0] == 0  # x @ w: edges tiled
  state[h] = -1  # relu's result whole: gathered before the scatter-add
  plan = build.make_plan(program, state, {})
  assert h in plan.constraints
  report = automap.verify(plan, fn, *args, mesh=m)
  assert report.comm_error < 0.05, report.table()
  assert report.max_rel_error < 1e-5


def test_plans_saved_before_hardware_had_a_platform_load_and_price_the_same():
  """Plans once stored XLA's behaviours as hardware flags: such a spec
  loads onto the platform its name or flags describe, keeping a flag that
  differs from it, with no warning."""
  import dataclasses

  from automap._src.cost.compiler import XLA_TPU
  from automap._src.cost.program import Program
  from automap._src.cost.tracker import Tracker
  from automap._src.ir import trace
  from automap._src.sharding.mesh import MeshSpec

  x = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))
  m = mesh((4, 2))
  plan = automap.search(mlp, *x, mesh=m, hardware="cpu")
  d = plan.to_json()
  behaviours = ("reduce_scatter", "reduce_in_f32", "fuses_shared_producers")
  figures = {k: v for k, v in d["hardware"].items() if k not in ("platform", *behaviours)}
  old_cpu = figures | dict(zip(behaviours, (False, True, False)))
  assert automap.Plan.from_json(d | {"hardware": old_cpu}).hardware == automap.HARDWARE["cpu"]
  old_own = figures | {"name": "own"} | dict(zip(behaviours, (False, False, True)))
  loaded = automap.Plan.from_json(d | {"hardware": old_own}).hardware
  assert (loaded.platform, loaded.compiler) == (
      "tpu", dataclasses.replace(XLA_TPU, reduce_scatter=False))
  with pytest.warns(DeprecationWarning):
    written_so = automap.Hardware(**old_own)
  programs = [Program.build(trace.trace(mlp, x), MeshSpec.of(m), hw) for hw in (loaded, written_so)]
  costs = [Tracker(p.model, build.state_of(p, plan)).cost() for p in programs]
  assert costs[0] == costs[1]
  assert automap.Plan.from_json(json.loads(json.dumps(d))).hardware == plan.hardware
