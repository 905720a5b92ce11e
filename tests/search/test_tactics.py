"""The expert tactics lay a model out as its practitioners would."""

import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap
from automap._src.cost.hardware import get_hardware
from automap._src.cost.tracker import Tracker
from automap._src.plan import planner
from automap._src.search import tactics
from automap._src.search.actions import ActionSpace
from automap._src.sharding.state import spec_of

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def gated_step(p, x):
  """A gated unit whose two gates share one fused weight [in, gate, hidden],
  taken apart by index (Griffin's and GLU layers' way)."""
  def loss(p):
    g = jnp.einsum("bd,dgh->bgh", x, p["gate"])
    return jnp.mean((jax.nn.sigmoid(g[:, 0]) * jnp.tanh(g[:, 1]) @ p["out"]) ** 2)
  return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(loss)(p))


def test_megatron_splits_a_fused_weights_hidden_units_not_its_gates():
  p = {"gate": jnp.ones((64, 2, 128)) / 64, "out": jnp.ones((128, 64)) / 128}
  x = jnp.ones((32, 64))
  program = planner.build_program(gated_step, (p, x), MESH, get_hardware("tpu-v4"))
  g = program.graph
  state = tactics.expert_states(program, ActionSpace(program))["Megatron+DP"]
  specs = {g.names[v]: spec_of(state, program.mesh, v, g.rank(v)) for v in g.inputs}
  # Column-parallel over the hidden units, row-parallel after: one reduction.
  assert specs["0/gate"] == P(None, None, "model") and specs["0/out"] == P("model")
  layout = ({"gate": specs["0/gate"], "out": specs["0/out"]}, specs["1"])
  cost = automap.evaluate(gated_step, p, x, mesh=MESH, in_shardings=layout, hardware="cpu")
  compiled, _, _ = compile_as_written(gated_step, (p, x), MESH, layout)
  assert cost.comm_bytes == pytest.approx(compiled, rel=0.05)


def adam_step(p, o, x):
  """A 4-layer MLP stepped by Adam: parameters and moments dominate memory."""
  def loss(p):
    h = x
    for w in p:
      h = jnp.tanh(h @ w)
    return jnp.mean(h ** 2)
  tx = optax.adam(1e-3)
  updates, o = tx.update(jax.grad(loss)(p), o, p)
  return optax.apply_updates(p, updates), o


def test_a_search_short_of_the_memory_limit_falls_back_on_the_experts():
  """One episode of search cannot reach a plan within a limit only sharding
  every argument meets; the search returns FSDP's plan rather than fail."""
  p = [jnp.ones((512, 512)) / 512 for _ in range(4)]
  o = optax.adam(1e-3).init(p)
  x = jnp.ones((64, 512))
  program = planner.build_program(adam_step, (p, o, x), MESH, get_hardware("tpu-v4"))
  fsdp = tactics.expert_states(program, ActionSpace(program))["FSDP"]
  limit = Tracker(program.model, fsdp).peak_memory * 1.01
  dp = tactics.expert_states(program, ActionSpace(program))["data parallel"]
  assert Tracker(program.model, dp).peak_memory > 2 * limit
  plan = automap.search(adam_step, p, o, x, mesh=MESH, hardware="tpu-v4", memory_limit=limit,
                        budget=automap.Budget(episodes=1))
  assert plan.cost.peak_memory <= limit


def small_gpt():
  from automap._src.models.gpt import GPTConfig, make_train_step
  return make_train_step(GPTConfig(vocab=512, seq=128, hidden=256, heads=4, layers=2),
                         batch=16, abstract=True)


def test_fsdp_beside_tensor_parallelism_splits_what_megatron_leaves():
  """FSDP+TP, MaxText's layout: Megatron's columns and rows on the last
  axis (the embedding table by vocabulary), FSDP on the other taking each
  weight's other dimension (the embedding), Adam's moments as their
  parameters."""
  step, args = small_gpt()
  program = planner.build_program(step, args, MESH, get_hardware("tpu-v4"))
  state = tactics.expert_states(program, ActionSpace(program))["FSDP+TP"]
  g = program.graph
  specs = {p: spec_of(state, program.mesh, v, g.rank(v))
           for p, v in zip(program.traced.in_paths, g.inputs)}
  assert specs["0/block_0/mlp/wi/kernel"] == P("data", "model")
  assert specs["0/block_0/mlp/wo/kernel"] == P("model", "data")
  assert specs["1/0/mu/block_0/mlp/wi/kernel"] == P("data", "model")
  # The embedding table by its vocabulary rows, Megatron's parallel lookup.
  assert specs["0/embed/embedding"] == P("model", "data")


def test_a_short_search_never_returns_worse_than_an_expert():
  """One episode of MCTS finds less than plain data parallelism on this
  step; the search keeps the expert's plan, and says so."""
  step, args = small_gpt()
  program = planner.build_program(step, args, MESH, get_hardware("tpu-v4"))
  experts = {name: Tracker(program.model, state).cost().step_time
             for name, state in tactics.expert_states(program, ActionSpace(program)).items()}
  plan = automap.search(step, *args, mesh=MESH, hardware="tpu-v4",
                        budget=automap.Budget(episodes=1))
  assert plan.cost.step_time <= min(experts.values()) * 1.01
  assert plan.stats["kept"].startswith("expert: ")


def test_a_limit_below_the_saved_activations_says_to_rematerialise():
  """When the backward starts, every activation it reads is resident: a
  bound no layout beats, which the error names with the remedy."""
  step, args = small_gpt()
  program = planner.build_program(step, args, MESH, get_hardware("tpu-v4"))
  saved = program.saved_lower_bound()
  assert saved > program.memory_lower_bound()
  for name, state in tactics.expert_states(program, ActionSpace(program)).items():
    assert Tracker(program.model, state).peak_memory >= saved, name
  with pytest.raises(automap.MemoryLimitError, match="rematerialise them"):
    automap.search(step, *args, mesh=MESH, hardware="tpu-v4", memory_limit=saved * 0.95,
                   budget=automap.Budget(episodes=2))
