"""Random training programs for the policy: train steps of MLPs, GPT-style
transformers, convolutional nets, recurrent nets (scanned GRU cells),
MLP-mixers, llama-style decoders (SwiGLU, grouped-query attention, a
scanned stack), recommenders with large embedding tables and U-Nets, with
varied widths and depths, on 8 devices as 1-3 axis meshes,
on varied hardware, with or without a memory limit (a share of data
parallelism's peak).

Whole families are held out for the policy benchmark (`HELD_OUT`): no
sample is an encoder-decoder, a ViT, a mixture of experts or a graph
network (`message_passing` stays for tests, outside the corpus).

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
from automap._src.models.llama import LlamaConfig
from automap._src.models.llama import train_step as llama_train_step

MESHES = ((8, 1), (4, 2), (2, 4), (1, 8), (2, 2, 2))
HARDWARE = ("tpu-v4", "tpu-v5e", "h100", "a100", "cpu")

# name, fn, args, mesh, hardware, memory limit (a share of data
# parallelism's peak; None: no limit)
Sample = tuple[str, Callable, tuple, tuple[int, ...], str, float | None]

# Families the benchmark's rows come from; never sampled here.
HELD_OUT = ("encoder-decoder", "vit", "mixture-of-experts", "graph-network")


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
  depth = int(rng.integers(1, 6))
  widths = [int(rng.choice([128, 256, 512, 1024, 2048])) for _ in range(depth + 1)]
  batch = int(rng.choice([32, 64, 128, 256, 1024]))
  params = [{"w": _sds(a, b), "b": _sds(b)} for a, b in zip(widths, widths[1:])]

  def loss(params, x, y):
    for i, layer in enumerate(params):
      x = x @ layer["w"] + layer["b"]
      x = jax.nn.relu(x) if i < len(params) - 1 else x
    return jnp.mean((x - y) ** 2)

  return f"mlp d{depth}", *_adam_step(loss, params, _sds(batch, widths[0]),
                                      _sds(batch, widths[-1]))


def transformer(rng: np.random.Generator):
  hidden = int(rng.choice([64, 128, 256, 512]))
  config = GPTConfig(vocab=int(rng.choice([128, 256, 512, 2048])),
                     seq=int(rng.choice([16, 32, 64, 128])),
                     hidden=hidden, heads=int(rng.choice([2, 4, 8])),
                     layers=int(rng.integers(1, 5)))
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


def recurrent(rng: np.random.Generator):
  """A GRU language model: embedding, `lax.scan` over time, a head."""
  width, vocab = int(rng.choice([64, 128, 256, 512])), int(rng.choice([128, 512, 2048]))
  seq, batch = int(rng.choice([8, 16, 32])), int(rng.choice([16, 32, 64, 128]))
  params = {"embed": _sds(vocab, width), "wx": _sds(width, 3 * width),
            "wh": _sds(width, 3 * width), "head": _sds(width, vocab)}

  def loss(params, tokens, labels):
    x = params["embed"][tokens]  # [B, T, W]

    def cell(h, x_t):
      zx, zh = x_t @ params["wx"], h @ params["wh"]
      z, r, n = jnp.split(zx, 3, -1)
      hz, hr, hn = jnp.split(zh, 3, -1)
      z, r = jax.nn.sigmoid(z + hz), jax.nn.sigmoid(r + hr)
      h = (1 - z) * jnp.tanh(n + r * hn) + z * h
      return h, h

    _, hs = jax.lax.scan(cell, jnp.zeros((batch, width)), x.swapaxes(0, 1))
    logits = hs.swapaxes(0, 1) @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  tokens = _sds(batch, seq, dtype=jnp.int32)
  return f"gru w{width}", *_adam_step(loss, params, tokens, tokens)


def mixer(rng: np.random.Generator):
  """An MLP-mixer on patch tokens: token-mixing and channel-mixing MLPs."""
  tokens, width = int(rng.choice([16, 64, 256])), int(rng.choice([64, 128, 256, 512]))
  depth, batch = int(rng.integers(1, 5)), int(rng.choice([16, 32, 64]))
  params = [{"t1": _sds(tokens, 2 * tokens), "t2": _sds(2 * tokens, tokens),
             "c1": _sds(width, 4 * width), "c2": _sds(4 * width, width),
             "scale": _sds(width)} for _ in range(depth)]

  def loss(params, x, y):
    for p in params:
      scale = p["scale"][None, None]
      h = x * scale
      x = x + jnp.einsum("bsw,st->btw", jax.nn.gelu(jnp.einsum("btw,ts->bsw", h, p["t1"])),
                         p["t2"])
      x = x + jax.nn.gelu((x * scale) @ p["c1"]) @ p["c2"]
    return jnp.mean((x.mean(1) - y) ** 2)

  return f"mixer {depth}L", *_adam_step(loss, params, _sds(batch, tokens, width),
                                        _sds(batch, width))


def decoder(rng: np.random.Generator):
  """A llama-style decoder (`models/llama.py`): SwiGLU MLPs, grouped-query
  attention, rotary positions, RMSNorm, its layers one remat'd scan."""
  heads = int(rng.choice([4, 8]))
  embed = int(rng.choice([128, 256, 512]))
  config = LlamaConfig(vocab=int(rng.choice([512, 2048, 8192])), embed=embed,
                       mlp=embed * int(rng.choice([2, 3, 4])), heads=heads,
                       kv_heads=int(rng.choice([k for k in (1, 2, 4) if heads % k == 0])),
                       head_dim=embed // heads, layers=int(rng.integers(1, 5)),
                       seq=int(rng.choice([32, 64, 128])), batch=int(rng.choice([8, 16, 32])))
  fn, args = llama_train_step(config, constrained=False, abstract=True)
  return f"decoder {config.layers}L e{embed}", fn, args


def embeddings(rng: np.random.Generator):
  """A recommender (DLRM-like): sparse features looked up in large
  embedding tables, dense features through an MLP, their pairwise dot
  products, a top MLP."""
  tables = int(rng.integers(2, 7))
  dim = int(rng.choice([32, 64, 128]))
  rows = [int(rng.choice([4096, 32768, 131072])) for _ in range(tables)]
  batch, dense = int(rng.choice([128, 512, 2048])), int(rng.choice([13, 64]))
  top = int(rng.choice([256, 512, 1024]))
  params = {"tables": [_sds(r, dim) for r in rows],
            "bottom": {"w1": _sds(dense, top), "w2": _sds(top, dim)},
            "top": {"w1": _sds(dim + (tables + 1) ** 2, top), "w2": _sds(top, 1)}}

  def loss(params, ids, x, y):
    vecs = [t[ids[:, i]] for i, t in enumerate(params["tables"])]  # [B, dim] each
    h = jax.nn.relu(x @ params["bottom"]["w1"]) @ params["bottom"]["w2"]
    z = jnp.stack([h] + vecs, 1)  # [B, T + 1, dim]
    pairs = jnp.einsum("btd,bsd->bts", z, z).reshape(batch, -1)
    out = jax.nn.relu(jnp.concatenate([h, pairs], -1) @ params["top"]["w1"])
    return optax.sigmoid_binary_cross_entropy((out @ params["top"]["w2"])[:, 0], y).mean()

  return f"dlrm {tables}T d{dim}", *_adam_step(
      loss, params, _sds(batch, tables, dtype=jnp.int32), _sds(batch, dense), _sds(batch))


class _UNet(nn.Module):
  channels: tuple[int, ...]

  @nn.compact
  def __call__(self, x):
    skips = []
    for c in self.channels:  # down: convolve, keep, halve
      x = nn.relu(nn.Conv(c, (3, 3))(x))
      skips.append(x)
      x = x.reshape(x.shape[0], x.shape[1] // 2, 2, x.shape[2] // 2, 2, c).mean((2, 4))
    x = nn.relu(nn.Conv(2 * self.channels[-1], (3, 3))(x))
    for c, skip in zip(reversed(self.channels), reversed(skips)):  # up: double, join
      x = jnp.repeat(jnp.repeat(x, 2, 1), 2, 2)
      x = nn.relu(nn.Conv(c, (3, 3))(jnp.concatenate([x, skip], -1)))
    return nn.Conv(3, (1, 1))(x)


def unet(rng: np.random.Generator):
  """A U-Net denoiser: convolutions down, up, and skip connections across."""
  levels = int(rng.integers(1, 4))
  base = int(rng.choice([16, 32, 64]))
  size, batch = int(rng.choice([16, 32])), int(rng.choice([8, 16, 32]))
  model = _UNet(tuple(base * 2 ** i for i in range(levels)))
  x = _sds(batch, size, size, 3)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(x.shape))["params"])

  def loss(params, x, y):
    return jnp.mean((model.apply({"params": params}, x) - y) ** 2)

  return f"unet {levels}L c{base}", *_adam_step(loss, params, x, x)


FAMILIES = (mlp, transformer, convnet, recurrent, mixer, decoder, embeddings, unet)


def sample(rng: np.random.Generator, families=FAMILIES) -> Sample:
  """One random program of `families` on a random 8-device mesh and
  hardware; half under a memory limit of 30-90% of data parallelism's
  peak."""
  family = families[int(rng.integers(len(families)))]
  name, fn, args = family(rng)
  mesh = MESHES[int(rng.integers(len(MESHES)))]
  hw = HARDWARE[int(rng.integers(len(HARDWARE)))]
  limit = float(rng.uniform(0.3, 0.9)) if rng.random() < 0.5 else None
  return name, fn, args, mesh, hw, limit
