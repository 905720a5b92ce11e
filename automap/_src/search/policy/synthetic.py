"""Random training programs for the policy: train steps of MLPs,
transformers, convolutional nets and message-passing GNNs with varied
widths and depths, on varied meshes and hardware.

All are abstract (`jax.ShapeDtypeStruct` arguments): tracing is enough.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap._src.models.gpt import GPTConfig
from automap._src.models.gpt import make_train_step as gpt_train_step

MESHES = ((8, 1), (4, 2), (2, 4), (1, 8), (2, 2, 2))
HARDWARE = ("tpu-v4", "tpu-v5e", "h100", "a100", "cpu")

Sample = tuple[str, Callable, tuple, tuple[int, ...], str]  # name, fn, args, mesh, hw


def _adam_step(loss: Callable, params, *data) -> tuple[Callable, tuple]:
  optimizer = optax.adam(1e-3)

  def step(params, opt_state, *data):
    value, grads = jax.value_and_grad(loss)(params, *data)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, (params, jax.eval_shape(optimizer.init, params)) + data


def _sds(*shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def mlp(rng: np.random.Generator):
  depth = int(rng.integers(1, 5))
  widths = [int(rng.choice([128, 256, 512, 1024])) for _ in range(depth + 1)]
  batch = int(rng.choice([32, 64, 128, 256]))
  params = [{"w": _sds(a, b), "b": _sds(b)} for a, b in zip(widths, widths[1:])]

  def loss(params, x, y):
    for i, layer in enumerate(params):
      x = x @ layer["w"] + layer["b"]
      x = jax.nn.relu(x) if i < len(params) - 1 else x
    return jnp.mean((x - y) ** 2)

  return f"mlp d{depth}", *_adam_step(loss, params, _sds(batch, widths[0]),
                                      _sds(batch, widths[-1]))


def transformer(rng: np.random.Generator):
  hidden = int(rng.choice([64, 128, 256]))
  config = GPTConfig(vocab=int(rng.choice([128, 256, 512])), seq=int(rng.choice([16, 32, 64])),
                     hidden=hidden, heads=int(rng.choice([2, 4, 8])),
                     layers=int(rng.integers(1, 4)))
  fn, args = gpt_train_step(config, batch=int(rng.choice([8, 16, 32])), abstract=True)
  return f"gpt {config.layers}L h{hidden}", fn, args


class _ConvNet(nn.Module):
  channels: tuple[int, ...]
  classes: int

  @nn.compact
  def __call__(self, x):
    for c in self.channels:
      x = nn.relu(nn.Conv(c, (3, 3), strides=(2, 2))(x))
    return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def convnet(rng: np.random.Generator):
  channels = tuple(int(rng.choice([16, 32, 64])) for _ in range(int(rng.integers(1, 4))))
  size, batch = int(rng.choice([16, 32])), int(rng.choice([16, 32, 64]))
  model = _ConvNet(channels, 16)
  x = _sds(batch, size, size, 3)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape))["params"])

  def loss(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  return f"conv {len(channels)}L", *_adam_step(loss, params, x, _sds(batch, 16))


def message_passing(rng: np.random.Generator):
  """A GNN written with segment sums (not jraph): node and edge MLPs."""
  nodes = int(rng.choice([256, 512, 1024, 2048]))
  edges, width = nodes * int(rng.choice([2, 4, 8])), int(rng.choice([32, 64, 128]))
  rounds = int(rng.integers(1, 4))
  params = [{"msg": _sds(2 * width, width), "upd": _sds(2 * width, width)}
            for _ in range(rounds)]

  def loss(params, h, senders, receivers, target):
    for p in params:
      m = jax.nn.relu(jnp.concatenate([h[senders], h[receivers]], -1) @ p["msg"])
      agg = jax.ops.segment_sum(m, receivers, num_segments=nodes)
      h = jnp.tanh(jnp.concatenate([h, agg], -1) @ p["upd"])
    return jnp.mean((h - target) ** 2)

  index = _sds(edges, dtype=jnp.int32)
  return f"mp {rounds}R n{nodes}", *_adam_step(
      loss, params, _sds(nodes, width), index, index, _sds(nodes, width))


FAMILIES = (mlp, transformer, convnet, message_passing)


def sample(rng: np.random.Generator) -> Sample:
  """One random program on a random 8-device mesh and hardware."""
  family = FAMILIES[int(rng.integers(len(FAMILIES)))]
  name, fn, args = family(rng)
  mesh = MESHES[int(rng.integers(len(MESHES)))]
  return name, fn, args, mesh, HARDWARE[int(rng.integers(len(HARDWARE)))]
