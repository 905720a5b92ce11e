"""The program zoo: train steps of several model families, shared by the
tests and the benchmarks, and public as `automap.zoo`.

`mlp`, `gpt`, `encoder_decoder`, `vit`, `moe`, `moe_layers`, `graph_network`
and `ssm` return `(step, args)` with `args` as `jax.ShapeDtypeStruct`s
(parameters from `jax.eval_shape` of the initialiser), so nothing is
materialised and any size can be planned; `materialize` makes concrete
arguments for them. `gpt_step` (concrete, `SMALL` by default),
`loss_and_grads`, and `gpt_loss` and `encoder_decoder_loss` (losses as a
cluster plan takes them) are small enough to compile in seconds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from automap._src.models import graph_net, llama
from automap._src.models import moe as moe_lib
from automap._src.models.gpt import GPT, GPTConfig, make_train_step

SMALL = GPTConfig(vocab=128, seq=16, hidden=128, heads=4, layers=2)


# A builder of the zoo: no arguments, `(step, args)` back.
Builder = Callable[[], tuple[Callable, tuple]]


@functools.cache
def gpt_step(config: GPTConfig = SMALL, batch: int = 8) -> tuple[Callable, tuple]:
  """A concrete GPT train step, built once per (config, batch).

  Args:
    config: the model's shape; by default 2 layers, hidden 128, 4 heads,
      sequence 16, vocabulary 128.
    batch: sequences per step.

  Returns:
    `(step, (params, opt_state, batch))`, as `gpt_train_step` returns them.
  """
  return make_train_step(config, batch=batch)


def loss_and_grads(step_args: tuple, config: GPTConfig = SMALL) -> tuple[Callable, tuple]:
  """A (loss, grads) function of the GPT, for gradient numerics.

  Args:
    step_args: `(params, opt_state, batch)` of `gpt_step(config)`.
    config: the model's shape, as `step_args` were made for.

  Returns:
    `(fn, (params, batch))`: `fn(params, batch) -> (loss, grads)`.
  """
  model = GPT(config)

  def fn(params, batch):
    def loss(p):
      logits = model.apply({"params": p}, batch["inputs"])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, batch["targets"]).mean()
    return jax.value_and_grad(loss)(params)

  params, _, batch = step_args
  return fn, (params, batch)



def gpt_loss(config: GPTConfig = SMALL, batch: int = 8) -> tuple[Callable, Any, tuple]:
  """The GPT's loss on concrete arguments, as `automap.cluster.plan_cluster`
  and `ClusterPlan.train_step` take a loss.

  Args:
    config: the model's shape.
    batch: sequences per step.

  Returns:
    `(loss, params, (batch,))`: `loss(params, batch)` is the mean
    next-token cross-entropy; batch a dict of "inputs" and "targets".
  """
  model = GPT(config)
  _, (params, _, data) = make_train_step(config, batch)

  def loss(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  return loss, params, (data,)


def llama_loss(config: llama.LlamaConfig) -> tuple[Callable, Any, tuple]:
  """The MaxText-style llama's loss on concrete arguments (its layers one
  `nn.scan` over stacked weights unless `config.unrolled`), as
  `automap.cluster.plan_cluster` and `ClusterPlan.train_step` take a loss.

  Args:
    config: the decoder's shape (`config.batch` sequences).

  Returns:
    `(loss, params, (inputs, targets))`: `loss(params, inputs, targets)` is
    the mean next-token cross-entropy; inputs and targets [B, S] int32.
  """
  model = llama.Decoder(config)
  _, (params, _, data) = llama.train_step(config)

  def loss(params, inputs, targets):
    logits = model.apply({"params": params}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets).mean()

  return loss, params, (data["inputs"], data["targets"])


def encoder_decoder_loss(layers: int = 4, width: int = 128, vocab: int = 256, seq: int = 32,
                         batch: int = 32, heads: int = 4) -> tuple[Callable, Any, tuple]:
  """A T5-style encoder-decoder's loss on concrete arguments, as
  `automap.cluster.plan_cluster` takes a loss: a pipeline cuts between its
  blocks (`enc_<i>`, `dec_<i>`), and every decoder block attends to the
  encoder's output, so each stage of the decoder takes it too.

  Args:
    layers: blocks of the encoder, and of the decoder (pre-norm
      attention, then a 4x ReLU MLP; the decoder's with cross-attention
      between).
    width: the residual width.
    vocab: token ids 0..vocab-1; the head reads the shared embedding.
    seq: tokens per sequence, source and target.
    batch: sequence pairs per step.
    heads: attention heads.

  Returns:
    `(loss, params, (src, tgt))`: `loss(params, src, tgt)` is the target's
    mean cross-entropy; src and tgt [batch, seq] int32.

  Raises:
    AssertionError: `heads` does not divide `width` (flax's attention
      checks it).
  """
  import flax.linen as nn

  def feed_forward(x):  # inside a block's compact call: its submodules
    return x + nn.Dense(x.shape[-1])(nn.relu(nn.Dense(4 * x.shape[-1])(nn.RMSNorm()(x))))

  class EncoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
      return feed_forward(x + nn.SelfAttention(num_heads=heads)(nn.RMSNorm()(x)))

  class DecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, x, memory):
      x = x + nn.SelfAttention(num_heads=heads)(nn.RMSNorm()(x))
      cross = nn.MultiHeadDotProductAttention(num_heads=heads)
      return feed_forward(x + cross(nn.RMSNorm()(x), memory))

  class EncoderDecoder(nn.Module):
    @nn.compact
    def __call__(self, src, tgt):
      embed = nn.Embed(vocab, width, name="embed")
      enc = embed(src)
      for i in range(layers):
        enc = EncoderBlock(name=f"enc_{i}")(enc)
      dec = embed(tgt)
      for i in range(layers):
        dec = DecoderBlock(name=f"dec_{i}")(dec, enc)
      return embed.attend(nn.RMSNorm(name="norm")(dec))

  model = EncoderDecoder()
  src = jax.random.randint(jax.random.key(1), (batch, seq), 0, vocab)
  tgt = jax.random.randint(jax.random.key(2), (batch, seq), 0, vocab)
  params = jax.jit(model.init)(jax.random.key(0), src, tgt)

  def loss(params, src, tgt):
    logits = model.apply(params, src, tgt)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  return loss, params, (src, tgt)


def _adam_step(loss, params, *data):
  """A train step `(params, opt_state, *data) -> (params, opt_state, loss)`."""
  tx = optax.adam(1e-3)

  def step(params, opt_state, *data):
    value, grads = jax.value_and_grad(loss)(params, *data)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return step, (params, jax.eval_shape(tx.init, params), *data)


def _abstract(init, *args):
  return jax.eval_shape(init, *args)


def mlp(width: int = 1024, hidden: int = 4096, batch: int = 64) -> tuple[Callable, tuple]:
  """A 2-matmul MLP regression train step (gelu, mean square error, Adam).

  Args:
    width: input and output width.
    hidden: hidden width.
    batch: rows per step.

  Returns:
    `(step, (params, opt_state, x, y))`, arguments abstract.
  """
  f32 = jnp.float32
  params = {"w1": jax.ShapeDtypeStruct((width, hidden), f32),
            "w2": jax.ShapeDtypeStruct((hidden, width), f32)}

  def loss(params, x, y):
    return jnp.mean((jax.nn.gelu(x @ params["w1"]) @ params["w2"] - y) ** 2)

  data = jax.ShapeDtypeStruct((batch, width), f32)
  return _adam_step(loss, params, data, data)


def gpt(layers: int, hidden: int = 512) -> tuple[Callable, tuple]:
  """A GPT train step at benchmark size: vocabulary 512, sequence 128, 8
  heads, batch 32.

  Args:
    layers: blocks.
    hidden: the residual width.

  Returns:
    `(step, (params, opt_state, batch))`, arguments abstract.
  """
  config = GPTConfig(vocab=512, seq=128, hidden=hidden, heads=8, layers=layers)
  return make_train_step(config, batch=32, abstract=True)


def encoder_decoder(layers: int = 2, width: int = 512, seq: int = 64,
                    batch: int = 16) -> tuple[Callable, tuple]:
  """A T5-style train step: an encoder, and a decoder with self- and
  cross-attention, sharing one embedding (vocabulary 1024, 8 heads).

  Args:
    layers: blocks of the encoder, and of the decoder.
    width: the residual width.
    seq: tokens per sequence, source and target.
    batch: sequence pairs per step.

  Returns:
    `(step, (params, opt_state, src, tgt))`, arguments abstract.

  Raises:
    AssertionError: 8 does not divide `width` (flax's attention checks it).
  """
  import flax.linen as nn

  class Block(nn.Module):
    cross: bool

    @nn.compact
    def __call__(self, x, memory=None):
      x = x + nn.SelfAttention(num_heads=8)(nn.RMSNorm()(x))
      if self.cross:
        x = x + nn.MultiHeadDotProductAttention(num_heads=8)(nn.RMSNorm()(x), memory)
      h = nn.Dense(4 * width, use_bias=False)(nn.RMSNorm()(x))
      return x + nn.Dense(width, use_bias=False)(nn.relu(h))

  class EncoderDecoder(nn.Module):
    @nn.compact
    def __call__(self, src, tgt):
      embed = nn.Embed(1024, width)
      enc = embed(src)
      for _ in range(layers):
        enc = Block(cross=False)(enc)
      dec = embed(tgt)
      for _ in range(layers):
        dec = Block(cross=True)(dec, enc)
      return embed.attend(nn.RMSNorm()(dec))

  model = EncoderDecoder()
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  params = _abstract(lambda s, t: model.init(jax.random.key(0), s, t), tokens, tokens)

  def loss(params, src, tgt):
    logits = model.apply(params, src, tgt)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

  return _adam_step(loss, params, tokens, tokens)


def vit(layers: int = 4, width: int = 384, batch: int = 32) -> tuple[Callable, tuple]:
  """A vision transformer train step on 64x64 images, 8x8 patches, 10 classes.

  Args:
    layers: blocks.
    width: the residual width (6 heads).
    batch: images per step.

  Returns:
    `(step, (params, opt_state, images, labels))`, arguments abstract.

  Raises:
    AssertionError: 6 does not divide `width` (flax's attention checks it).
  """
  import flax.linen as nn

  class ViT(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Conv(width, (8, 8), strides=(8, 8))(x)
      x = x.reshape(x.shape[0], -1, width)
      for _ in range(layers):
        x = x + nn.MultiHeadDotProductAttention(num_heads=6)(nn.LayerNorm()(x),
                                                            nn.LayerNorm()(x))
        x = x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))
      return nn.Dense(10)(x.mean(1))

  model = ViT()
  images = jax.ShapeDtypeStruct((batch, 64, 64, 3), jnp.float32)
  labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
  params = _abstract(lambda x: model.init(jax.random.key(0), x), images)

  def loss(params, images, labels):
    logits = model.apply(params, images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  return _adam_step(loss, params, images, labels)


def moe(experts: int = 8, width: int = 512, hidden: int = 2048, tokens: int = 2048,
        capacity: int = 512) -> tuple[Callable, tuple]:
  """A top-1 mixture-of-experts MLP layer's train step (Switch-style dense
  dispatch, ungrouped): a router, one-hot dispatch into per-expert capacity
  slots, expert MLPs batched over experts, and the weighted combine.

  Args:
    experts: X.
    width: the model width.
    hidden: each expert's hidden width.
    tokens: tokens per step.
    capacity: slots per expert; tokens past it are dropped.

  Returns:
    `(step, (params, opt_state, x, y))`, arguments abstract.
  """
  f32 = jnp.float32
  params = {"router": jax.ShapeDtypeStruct((width, experts), f32),
            "wi": jax.ShapeDtypeStruct((experts, width, hidden), f32),
            "wo": jax.ShapeDtypeStruct((experts, hidden, width), f32)}

  def loss(params, x, y):
    probs = jax.nn.softmax(x @ params["router"])  # [T, E]
    expert = jnp.argmax(probs, axis=-1)
    onehot = jax.nn.one_hot(expert, experts, dtype=f32)  # [T, E]
    slot = (jnp.cumsum(onehot, axis=0) - 1) * onehot  # position in its expert
    dispatch = onehot[:, :, None] * jax.nn.one_hot(slot, capacity, dtype=f32)  # [T, E, C]
    inputs = jnp.einsum("tec,tm->ecm", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("ecm,emh->ech", inputs, params["wi"]))
    outputs = jnp.einsum("ech,ehm->ecm", h, params["wo"])
    gate = (probs * onehot).sum(-1, keepdims=True)
    out = gate * jnp.einsum("tec,ecm->tm", dispatch, outputs)
    return jnp.mean((out - y) ** 2)

  data = jax.ShapeDtypeStruct((tokens, width), f32)
  return _adam_step(loss, params, data, data)


def moe_layers(dispatch: str = "einsum", experts: int = 8, width: int = 512,
               hidden: int = 1024, groups: int = 16, group_size: int = 128,
               layers: int = 2) -> tuple[Callable, tuple]:
  """Mixture-of-experts layers as libraries write them, abstract: top-2
  routing, GShard's einsum dispatch or a sort-and-gather one
  (`moe_train_step` with its other defaults).

  Args:
    dispatch: "einsum" or "sorted".
    experts: X.
    width: the model width.
    hidden: each expert's hidden width.
    groups: groups per step.
    group_size: tokens per group.
    layers: MoE layers.

  Returns:
    `(step, (params, opt_state, x, y))`, arguments abstract.

  Raises:
    ValueError: `dispatch` is neither "einsum" nor "sorted".
  """
  return moe_lib.make_train_step(dispatch, experts=experts, width=width, hidden=hidden,
                                 groups=groups, group_size=group_size, layers=layers,
                                 abstract=True)


def graph_network(nodes: int = 4096, edges: int = 16384,
                  width: int = 128) -> tuple[Callable, tuple]:
  """A jraph GraphNetwork train step: edge and node updates (gathers by
  sender and receiver, scatter-adds into nodes), a loss on the nodes.

  Args:
    nodes: N.
    edges: E.
    width: W, every feature's width.

  Returns:
    `(step, (params, opt_state, graph))`, arguments abstract.
  """
  return graph_net.make_train_step(nodes, edges, width, abstract=True)


def ssm(layers: int = 2, width: int = 256, state: int = 16, expand: int = 2,
        vocab: int = 1024, seq: int = 64, batch: int = 16) -> tuple[Callable, tuple]:
  """A state-space language model's train step (S4D-style diagonal
  recurrences, gated as Mamba gates them): per layer, the input projected
  to `expand` x width channels and a gate; each channel runs `state`
  decaying modes over time (`lax.scan`); their readout, gated, projected
  back.

  Args:
    layers: mixing layers.
    width: the residual width.
    state: decaying modes per channel.
    expand: channels per unit of width.
    vocab: token ids 0..vocab-1.
    seq: tokens per sequence.
    batch: sequences per step.

  Returns:
    `(step, (params, opt_state, tokens, targets))`, arguments abstract.
  """
  f32, inner = jnp.float32, expand * width
  sds = lambda *shape: jax.ShapeDtypeStruct(shape, f32)  # noqa: E731
  params = {"embed": sds(vocab, width), "head": sds(width, vocab),
            "layers": [{"norm": sds(width), "w_in": sds(width, inner),
                        "w_gate": sds(width, inner), "log_decay": sds(inner, state),
                        "b": sds(inner, state), "c": sds(inner, state),
                        "w_out": sds(inner, width)} for _ in range(layers)]}

  def mix(p, x):  # [B, T, W] -> [B, T, W]
    h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p["norm"]
    u, gate = h @ p["w_in"], jax.nn.silu(h @ p["w_gate"])  # [B, T, I]
    decay = jnp.exp(-jnp.exp(p["log_decay"]))  # [I, N]

    def step(carry, u_t):  # carry [B, I, N], u_t [B, I]
      carry = decay * carry + u_t[..., None] * p["b"]
      return carry, (carry * p["c"]).sum(-1)

    _, y = jax.lax.scan(step, jnp.zeros((batch, inner, state), f32), u.swapaxes(0, 1))
    return x + (y.swapaxes(0, 1) * gate) @ p["w_out"]

  def loss(params, tokens, targets):
    x = params["embed"][tokens]
    for p in params["layers"]:
      x = mix(p, x)
    logits = x @ params["head"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return _adam_step(loss, params, tokens, tokens)


def catalogue(quick: bool = False) -> dict[str, Builder]:
  """The programs of the plan-quality benchmark, at its sizes.

  Args:
    quick: four programs instead of eleven.

  Returns:
    {name: builder}; each builder returns `(step, args)`, arguments abstract.
  """
  out = {"MLP 1024x4096": mlp, "GPT 2L h512": lambda: gpt(2), "ViT 4L w384": vit,
         "MoE 8x2048": moe}
  if quick:
    return out
  return {"MLP 1024x4096": mlp, "GPT 2L h512": lambda: gpt(2), "GPT 12L h512": lambda: gpt(12),
          "GPT 24L h512": lambda: gpt(24), "GPT 2L h1024": lambda: gpt(2, 1024),
          "T5 2+2L w512": encoder_decoder, "ViT 4L w384": vit, "MoE 8x2048": moe,
          "MoE einsum 2L 8x1024": moe_layers,
          "MoE sorted 2L 8x1024": lambda: moe_layers("sorted"),
          "GraphNetwork 4k nodes": graph_network}


def small() -> dict[str, Builder]:
  """Programs of four families small enough to compile and run on a host's
  CPU in seconds: T5-style, ViT, a Switch MoE layer, a GraphNetwork.

  Returns:
    {name: builder}; each builder returns `(step, args)`, arguments abstract
    (`materialize` makes them concrete).
  """
  return {"T5 1+1L w64": lambda: encoder_decoder(layers=1, width=64, seq=16, batch=8),
          "ViT 2L w64": lambda: vit(layers=2, width=96, batch=8),
          "MoE 4x128": lambda: moe(experts=4, width=64, hidden=128, tokens=128, capacity=32),
          "GraphNetwork 256 nodes": lambda: graph_network(nodes=256, edges=1024, width=32)}


def materialize(args: Any, seed: int = 0) -> Any:
  """Concrete arrays for abstract arguments: small normal floats, zero
  integers (valid token ids and indices).

  Args:
    args: a pytree of `jax.ShapeDtypeStruct`s.
    seed: of the random floats.

  Returns:
    The same pytree of arrays.

  Raises:
    AttributeError: a leaf has no shape or dtype.
  """
  leaves, tree = jax.tree.flatten(args)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  out = [0.05 * jax.random.normal(k, a.shape, a.dtype)
         if jnp.issubdtype(a.dtype, jnp.floating) else jnp.zeros(a.shape, a.dtype)
         for k, a in zip(keys, leaves)]
  return jax.tree.unflatten(tree, out)
