"""The expert tactics find the weights a model reads, however it reads them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from helpers import mesh
from jax.sharding import PartitionSpec as P

from automap._src.search import driver
from automap._src.search.actions import ActionSpace
from automap._src.sharding.state import spec_of

RNG = np.random.default_rng(0)


def _megatron_specs(fn, *args):
  program = driver.build_program(fn, args, mesh((4, 2)), "tpu-v4")
  space = ActionSpace(program)
  state = program.initial_state()
  space.experts.data_parallel(state, [0])
  space.experts.megatron(state, 1)
  g = program.graph
  return {p: spec_of(state, program.mesh, v, g.rank(v))
          for p, v in zip(program.traced.in_paths, g.inputs)}


def _sgd(loss):
  def step(params, x):
    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  return step


def test_megatron_follows_a_transposed_kernel():
  # HF's Conv1D keeps kernels as (out, in) and reads kernel.T.
  params = {"up": jnp.asarray(RNG.standard_normal((256, 64)), jnp.float32),
            "down": jnp.asarray(RNG.standard_normal((64, 256)), jnp.float32)}
  x = jnp.asarray(RNG.standard_normal((32, 64)), jnp.float32)
  loss = lambda p, x: jnp.mean(jnp.tanh(x @ p["up"].T) @ p["down"].T)  # noqa: E731
  specs = _megatron_specs(_sgd(loss), params, x)
  assert specs["0/up"] == P("model")  # columns: the output features
  assert specs["0/down"] == P(None, "model")  # rows, by propagation
  assert specs["1"] == P("data")


def test_a_tied_output_head_makes_the_embedding_vocab_parallel():
  params = {"embed": jnp.asarray(RNG.standard_normal((512, 64)), jnp.float32),
            "up": jnp.asarray(RNG.standard_normal((64, 256)), jnp.float32),
            "down": jnp.asarray(RNG.standard_normal((256, 64)), jnp.float32)}
  tokens = jnp.asarray(RNG.integers(0, 512, (32, 16)), jnp.int32)

  def loss(p, tokens):
    h = jnp.tanh(p["embed"][tokens] @ p["up"]) @ p["down"]  # a Megatron pair
    logits = h @ p["embed"].T  # the head is the embedding, transposed
    return jax.nn.logsumexp(logits, axis=-1).mean()

  specs = _megatron_specs(_sgd(loss), params, tokens)
  assert specs["0/up"] == P(None, "model") and specs["0/down"] == P("model")
  assert specs["0/embed"] == P("model")  # split by vocabulary, not hidden
