"""Programs beyond transformers: each partitions with exact numerics and the
compiled collectives the cost model predicts."""

import jax
import jax.numpy as jnp
import pytest
from helpers import assert_faithful, graph_network_step, mesh
from jax import lax

KEY = jax.random.key(0)
X = jax.random.normal(KEY, (16, 32))
W = jax.random.normal(jax.random.key(1), (32, 64)) / 6


def cumulative(x, w):
  return jnp.cumsum(jnp.tanh(x @ w), axis=1).sum(0)


def concat_slice_pad(x, w):
  h = x @ w
  both = jnp.concatenate([h, -h], axis=1)[:, 8:72]
  return jnp.pad(both, ((0, 0), (2, 2))) ** 2


def dynamic_window(x, w, i):
  h = jax.nn.gelu(x @ w)
  return lax.dynamic_slice(h, (0, i), (16, 16)) + lax.dynamic_update_slice(
      h, jnp.zeros((16, 8)), (0, i))[:, :16]


def heads(x, w):
  q = (x @ w).reshape(16, 4, 16).transpose(1, 0, 2)  # [heads, tokens, dim]
  scores = jnp.einsum("htd,hsd->hts", q, q) / 4.0
  probs = jax.nn.softmax(scores, axis=-1)
  return jnp.einsum("hts,hsd->thd", probs, q).reshape(16, 64)


def ranking(x, w):
  h = x @ w
  values, _ = lax.top_k(h, 4)
  return jnp.sort(h, axis=1)[:, -4:] - values, jnp.argmax(h, axis=1)


def lookups(x, w, ids):
  table = jnp.tanh(w.T @ x.T)  # [64, 16]
  rows = jnp.take(table, ids, axis=0)
  picked = jnp.take_along_axis(x @ w, ids[:, None] % 64, axis=1)
  updated = (x @ w).at[ids % 16].set(1.0)
  return rows.sum() + picked.sum() + updated.sum()


def nonlinear(x, w):
  h = x @ w
  return jnp.where(h > 0, lax.integer_pow(h, 3), jax.scipy.special.erf(h)) * jax.nn.sigmoid(h)


def training(x, w):
  def loss(w):
    return jnp.mean((jnp.tanh(x @ w) @ w.T - x) ** 2)
  value, g = jax.value_and_grad(loss)(w)
  return w - 0.1 * g, value


PROGRAMS = [
    (cumulative, (X, W)),
    (concat_slice_pad, (X, W)),
    (dynamic_window, (X, W, 3)),
    (heads, (X, W)),
    (ranking, (X, W)),
    (lookups, (X, W, jnp.arange(16) * 3 % 64)),
    (nonlinear, (X, W)),
    (training, (X, W)),
]


@pytest.mark.parametrize("fn,args", PROGRAMS, ids=[f.__name__ for f, _ in PROGRAMS])
@pytest.mark.parametrize("shape", [(4, 2), (2, 2, 2)], ids=["4x2", "2x2x2"])
def test_program_partitions_faithfully(fn, args, shape):
  names = ("data", "model") if len(shape) == 2 else ("x", "y", "z")
  assert_faithful(fn, args, mesh(shape, names))


@pytest.mark.heavy
def test_convolutional_train_step():
  import flax.linen as nn
  import optax

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Conv(16, (3, 3))(x))
      x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x))
      return nn.Dense(10)(x.mean(axis=(1, 2)))

  model, tx = CNN(), optax.sgd(0.1)
  images = jax.random.normal(KEY, (16, 12, 12, 3))
  labels = jnp.arange(16) % 10
  params = model.init(KEY, images)

  def step(params, opt_state, images, labels):
    def loss(p):
      logits = model.apply(p, images)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    value, g = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(g, opt_state)
    return optax.apply_updates(params, updates), opt_state, value

  plan, _ = assert_faithful(step, (params, tx.init(params), images, labels), mesh((4, 2)))
  assert any(s != jax.sharding.PartitionSpec() for s in plan.in_specs)


def test_graph_network_train_step():
  step, args = graph_network_step(16, 64, 32)
  assert_faithful(step, args, mesh((4, 2)), numerics=1e-4)


@pytest.mark.parametrize("kind", ["fori_loop", "reverse", "rematerialised", "no_xs"])
def test_scans_of_every_shape_partition_faithfully(kind):
  w = jax.random.normal(jax.random.key(0), (64, 64)) / 8
  x = jax.random.normal(jax.random.key(1), (32, 64))

  def loss(w, x):
    if kind == "fori_loop":  # static bounds: a scan carrying its counter
      return jax.lax.fori_loop(0, 5, lambda i, h: jnp.tanh(h @ w) + i, x).sum()
    if kind == "reverse":
      c, ys = jax.lax.scan(lambda c, r: (c + jnp.tanh(r @ w), c.sum()),
                           jnp.zeros((64,)), x, reverse=True)
      return c.sum() + ys.sum()
    body = lambda h, _: (jnp.tanh(h @ w), None)  # noqa: E731
    if kind == "rematerialised":
      body = jax.checkpoint(body)
    return jax.lax.scan(body, x, None, length=3)[0].sum()

  assert_faithful(jax.value_and_grad(loss), (w, x), mesh((4, 2)))


def _sgd_step(model, x):
  import optax

  params = model.init(jax.random.key(0), x)
  tx = optax.sgd(1e-2)

  def step(params, opt_state, x):
    loss, g = jax.value_and_grad(lambda p: (model.apply(p, x) ** 2).mean())(params)
    updates, opt_state = tx.update(g, opt_state)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, (params, tx.init(params), x)


@pytest.mark.slow  # the same blocks as the GPT's, over patches: minutes of compile
def test_vision_transformer_train_step():
  import flax.linen as nn

  class ViT(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(64, (4, 4), strides=(4, 4))(x)  # patches
      x = x.reshape(x.shape[0], -1, x.shape[-1])
      for _ in range(2):
        y = nn.LayerNorm()(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(y, y)
        x = x + nn.Dense(64)(nn.gelu(nn.Dense(256)(nn.LayerNorm()(x))))
      return nn.Dense(10)(x.mean(1))

  step, args = _sgd_step(ViT(), jax.random.normal(KEY, (16, 16, 16, 3)))
  assert_faithful(step, args, mesh((4, 2)))


@pytest.mark.heavy
def test_encoder_decoder_with_cross_attention_train_step():
  import flax.linen as nn

  class EncoderDecoder(nn.Module):
    @nn.compact
    def __call__(self, x):
      enc = x
      for _ in range(2):
        enc = enc + nn.SelfAttention(num_heads=4)(nn.LayerNorm()(enc))
      dec = x[:, ::-1]
      for _ in range(2):
        dec = dec + nn.SelfAttention(num_heads=4)(nn.LayerNorm()(dec))
        dec = dec + nn.MultiHeadDotProductAttention(num_heads=4)(nn.LayerNorm()(dec), enc)
        dec = dec + nn.Dense(64)(nn.relu(nn.Dense(128)(dec)))
      return dec

  step, args = _sgd_step(EncoderDecoder(), jax.random.normal(KEY, (8, 16, 64)))
  assert_faithful(step, args, mesh((2, 2, 2), ("data", "model", "seq")))
