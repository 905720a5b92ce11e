"""Programs shared by the tests: small enough to compile in seconds."""

from __future__ import annotations

import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from automap._src.models.gpt import GPT, GPTConfig, make_train_step, megatron_specs
from automap._src.models.zoo import SMALL, gpt_step, loss_and_grads

MESHES = [(8, 1), (4, 2), (2, 4), (1, 8)]


def meshes_but(*quick: tuple[int, ...]) -> list:
  """MESHES with all but `quick` left to `pytest -m slow`: end-to-end runs
  take half a minute each, and the one-axis meshes are degenerate cases of
  the two-axis ones."""
  return [s if s in quick else pytest.param(s, marks=pytest.mark.slow) for s in MESHES]


def mesh(shape, names=("data", "model")):
  return jax.make_mesh(shape, names)


def jitted_training(loss, tx, params, batch, steps: int):
  """Losses and parameters after `steps` optimizer steps of the unpartitioned
  jitted step: what a cluster plan's run must reproduce."""
  losses, params, _ = jitted_state(loss, tx, params, batch, steps)
  return losses, params


def jitted_state(loss, tx, params, batch, steps: int):
  """`jitted_training`'s losses and parameters, and the optimizer state."""

  @jax.jit
  def step(params, opt, batch):
    value, grads = jax.value_and_grad(loss)(params, *batch)
    updates, opt = tx.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, value

  opt, losses = tx.init(params), []
  for _ in range(steps):
    params, opt, value = step(params, opt, batch)
    losses.append(float(value))
  return losses, params, opt


def assert_trains_as_jitted(step, loss, tx, params, batch, steps: int = 3, each=None):
  """`steps` optimizer steps of a cluster plan's `step` give the jitted
  step's losses (rtol 1e-5) and parameters (1e-4); `each(state)` is checked
  after `init` and every step. Returns the last state."""
  state, losses = step.init(params), []
  if each is not None:
    each(state)
  for _ in range(steps):
    state, value = step(state, *batch)
    losses.append(float(value))
    if each is not None:
      each(state)
  want_losses, want = jitted_training(loss, tx, params, batch, steps)
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  for got, ref in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-4, rtol=1e-4)
  return state


def stated_run(loss, params, batch, tx, *, global_batch: int, budget, hardware="cpu",
               **config):
  """A split stated as `ClusterConfig(**config)`, priced by `price_cluster`
  and run for three optimizer steps against the jitted step
  (`assert_trains_as_jitted`). Returns (plan, step, state)."""
  from automap import cluster

  plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(**config),
                               global_batch=global_batch, hardware=hardware, budget=budget)
  step = plan.train_step(loss, tx, params, *batch)
  return plan, step, assert_trains_as_jitted(step, loss, tx, params, batch)


def assert_faithful(fn, args, m, numerics: float = 1e-5):
  """Plans fn on mesh m (cpu costs), compiles it, and checks the numerics
  against the unpartitioned function and the collectives against the plan."""
  import automap

  plan = automap.search(fn, *args, mesh=m, hardware="cpu")
  report = automap.verify(plan, fn, *args, mesh=m)
  assert report.max_rel_error < numerics
  assert report.comm_error < 0.05, report.table()
  return plan, report


def assert_stage_compiles_as_priced(program, state, m, args):
  """Compiles the plan of `state` for `program` on mesh `m` and checks its
  collectives, per kind and axes, against the cost model priced for XLA:CPU
  (within 5%); returns the jitted step."""
  from automap._src.cost.compiler import compiler_for
  from automap._src.cost.program import Program
  from automap._src.cost.tracker import Tracker
  from automap._src.plan import build
  from automap._src.run import compiled as hlo
  from automap._src.run.apply import jit_with_plan

  step = jit_with_plan(program.traced, m, build.make_plan(program, state, {}))
  found = hlo.summarize(hlo.collectives(step.lower(*args).compile().as_text(), m))
  cpu = Program.build(program.traced, program.mesh, program.hardware,
                      compiler=compiler_for("cpu"))
  predicted = Tracker(cpu.model, state).cost().comm_bytes
  assert found and set(found) == set(predicted)
  for key, nbytes in predicted.items():
    assert found[key] == pytest.approx(nbytes, rel=0.05), key
  return step


def compile_as_written(fn, args, m, specs):
  """`jax.jit` of `fn` as written, under `m` (an Auto-axis mesh, so the
  program's constraints resolve), arguments laid out by the PartitionSpec
  pytree `specs`: ({(kind, axes): bytes} of its collectives, its peak
  memory, the compiled program)."""
  from jax.sharding import NamedSharding, PartitionSpec

  from automap._src.run import compiled as hlo

  shardings = jax.tree.map(lambda s: NamedSharding(m, s), specs,
                           is_leaf=lambda s: isinstance(s, PartitionSpec))
  with jax.set_mesh(m):
    compiled = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
  return (hlo.summarize(hlo.collectives(compiled.as_text(), m)),
          hlo.compiled_memory(compiled)[0], compiled)


def graph_network_step(n_nodes: int, n_edges: int, width: int):
  """A jraph GraphNetwork train step (adam): edge and node updates, a loss on
  the nodes. Returns `(step, (params, opt_state, graph))`."""
  from automap._src.models import graph_net

  return graph_net.make_train_step(n_nodes, n_edges, width)


def mlp(x, w1, w2):
  """Two matmuls: the smallest program with a Megatron pattern."""
  return jnp.tanh(x @ w1) @ w2


__all__ = ["MESHES", "SMALL", "GPTConfig", "assert_faithful", "compile_as_written", "gpt_step",
           "graph_network_step", "loss_and_grads", "make_train_step", "megatron_specs",
           "mesh", "mlp"]


def random_input_tilings(graph, seed: int, count: int, axes: int = 2):
  """`count` draws of (argument value, dim, mesh axis), skipping scalars:
  random actions for tests that compare two ways of applying them."""
  rng = np.random.default_rng(seed)
  for _ in range(count):
    v = int(rng.choice(graph.inputs))
    if graph.rank(v) == 0:
      continue
    yield v, int(rng.integers(graph.rank(v))), int(rng.integers(axes))


def saved_dot_outputs(fn, *args) -> list[int]:
  """Bytes of each dot_general output JAX saves as a residual of `fn` (a
  scalar function of `args`) under `jax.checkpoint` with the
  dots-with-no-batch-dims policy, as `print_saved_residuals` lists them."""
  from jax.ad_checkpoint import print_saved_residuals
  remat = jax.checkpoint(fn, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    print_saved_residuals(remat, *args)
  sizes = []
  for line in out.getvalue().splitlines():
    if "output of dot_general" in line:
      dtype, dims = re.match(r"(\w+)\[([\d,]*)\]", line).groups()
      shape = [int(d) for d in dims.split(",") if d]
      itemsize = jnp.dtype({"f32": "float32", "bf16": "bfloat16"}[dtype]).itemsize
      sizes.append(int(np.prod(shape)) * itemsize)
  return sizes


def abstract_gpt_loss(config: GPTConfig, batch: int = 4):
  """`(loss, params, (tokens, targets))` of a GPT with abstract parameters
  (as `init` makes them) and a batch of `batch` sequences: the step the
  cluster planner traces."""
  model = GPT(config)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                             jnp.zeros((1, config.seq), jnp.int32)))["params"]

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

  tokens = jax.ShapeDtypeStruct((batch, config.seq), jnp.int32)
  return loss, params, (tokens, tokens)


@functools.cache
def planned(shape, what="step"):
  """The GPT train step (or its loss and gradients, `what="grads"`) on a
  (data, model) mesh of `shape`, and its plan at the default budget: one
  search per worker, shared by the tests that read it."""
  import automap

  step, args = gpt_step()
  fn, fargs = (step, args) if what == "step" else loss_and_grads(args)
  m = mesh(shape)
  return fn, fargs, m, automap.search(fn, *fargs, mesh=m, hardware="cpu")
