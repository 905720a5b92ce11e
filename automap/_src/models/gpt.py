"""A GPT-style flax transformer and its optax training step.

Used by the demo, the tests and the benchmarks as the reference program whose
expert sharding (Megatron) is known. Shape letters: B batch, S sequence,
H hidden, N heads, D head dim (H = N * D), K key/value heads (N = K * G),
F MLP width (4H unless given), V vocabulary. The defaults are GPT-2's block;
`mlp`, `gated`, `kv_heads` and `tied` give the llama family's (SwiGLU,
grouped-query attention, an untied output head).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class GPTConfig:
  """The shape of a `GPT`; the defaults are a small 2-layer GPT-2.

  Attributes:
    vocab: V, token ids 0..V-1.
    seq: S, the longest sequence (learned positions).
    hidden: H, the residual width.
    heads: N, query heads.
    layers: blocks.
    mlp_ratio: F = mlp_ratio * H where `mlp` is 0.
    dtype: the dense layers' compute dtype (parameters stay float32).
    scan_layers: the blocks as one `nn.scan` over stacked parameters.
    mlp: F; 0: mlp_ratio * hidden.
    gated: SwiGLU: silu(x W_gate) * (x W_up), then W_out.
    kv_heads: K; 0: heads (multi-head attention).
    tied: the output head reads the embedding table.
    head_size: D; 0: hidden // heads (heads * D need not be hidden).
    parallel: attention and MLP read one norm, summed (GPT-J, PaLM).
    fused_kernels: each layer norm and the GELU keep only their inputs for
      the backward, which recomputes the rest, as Megatron-LM's fused
      kernels do (Apex's fused layer norm saves its input and row
      statistics, the fused bias-GELU its input, the fused causal softmax
      applies its mask inside the kernel): `jax.checkpoint` around the norms
      and the GELU, the mask added to the scores. Without it JAX keeps the
      GELU's tanh and products, the norm's float32 centred input and the
      mask broadcast to the scores' shape as residuals too.
  """

  vocab: int = 256
  seq: int = 32
  hidden: int = 64
  heads: int = 4
  layers: int = 2
  mlp_ratio: int = 4
  dtype: Any = jnp.float32
  scan_layers: bool = False
  mlp: int = 0
  gated: bool = False
  kv_heads: int = 0
  tied: bool = True
  head_size: int = 0
  parallel: bool = False
  fused_kernels: bool = False

  @property
  def head_dim(self) -> int:
    """D: `head_size`, else hidden // heads."""
    return self.head_size or self.hidden // self.heads

  @property
  def mlp_width(self) -> int:
    """F: `mlp`, else mlp_ratio * hidden."""
    return self.mlp or self.mlp_ratio * self.hidden


class Attention(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, H] -> [B, S, H]
    c = self.config
    proj = lambda name, heads: nn.DenseGeneral(  # noqa: E731
        (heads, c.head_dim), use_bias=False, dtype=c.dtype, name=name)
    kv = c.kv_heads or c.heads
    q = proj("query", c.heads)(x)  # [B, S, N, D]
    k, v = proj("key", kv)(x), proj("value", kv)(x)  # [B, S, K, D]
    if kv != c.heads:  # each key/value head serves G query heads
      k, v = (jnp.repeat(a, c.heads // kv, axis=2) for a in (k, v))
    logits = jnp.einsum("bqnd,bknd->bnqk", q, k) / jnp.sqrt(c.head_dim)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), dtype=bool))
    if c.fused_kernels:  # the mask added inside the softmax's kernel: nothing kept
      mask = jnp.where(causal, 0, jnp.finfo(logits.dtype).min).astype(logits.dtype)
      logits = logits + mask[None, None]
    else:
      logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bnqk,bknd->bqnd", probs, v)  # [B, S, N, D]
    return nn.DenseGeneral(c.hidden, axis=(-2, -1), use_bias=False,
                           dtype=c.dtype, name="out")(out)


class MLP(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    h = nn.Dense(c.mlp_width, dtype=c.dtype, name="wi")(x)  # [B, S, F]
    if c.gated:
      gate = nn.Dense(c.mlp_width, use_bias=False, dtype=c.dtype, name="wg")(x)
      return nn.Dense(c.hidden, dtype=c.dtype, name="wo")(nn.silu(gate) * h)
    gelu = jax.checkpoint(nn.gelu) if c.fused_kernels else nn.gelu
    return nn.Dense(c.hidden, dtype=c.dtype, name="wo")(gelu(h))


def _norm(config: GPTConfig, name: str) -> nn.Module:
  """A layer norm, rematerialised where `config.fused_kernels`."""
  return (nn.remat(nn.LayerNorm) if config.fused_kernels else nn.LayerNorm)(name=name)


class Block(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.config
    if c.parallel:
      y = _norm(c, "ln1")(x)
      return x + Attention(c, name="attn")(y) + MLP(c, name="mlp")(y)
    x = x + Attention(c, name="attn")(_norm(c, "ln1")(x))
    return x + MLP(c, name="mlp")(_norm(c, "ln2")(x))


class _ScannedBlock(nn.Module):
  config: GPTConfig

  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    return Block(self.config, name="block")(x), None


class GPT(nn.Module):
  """A GPT-style decoder: token and learned position embeddings, `layers`
  pre-norm blocks (causal attention, then the MLP, or both on one norm:
  `parallel`), a final LayerNorm and the output head. Called on tokens
  [B, S] int32, it gives logits [B, S, V].

  Attributes:
    config: its shape.
  """

  config: GPTConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, S] -> [B, S, V]
    c = self.config
    embed = nn.Embed(c.vocab, c.hidden, name="embed")
    pos = self.param("pos", nn.initializers.normal(0.02), (c.seq, c.hidden))
    x = embed(tokens) + pos[None, : tokens.shape[1]]
    if c.scan_layers:
      blocks = nn.scan(_ScannedBlock, variable_axes={"params": 0},
                       split_rngs={"params": True}, length=c.layers)
      x, _ = blocks(c, name="blocks")(x, None)
    else:
      for i in range(c.layers):
        x = Block(c, name=f"block_{i}")(x)
    x = _norm(c, "ln_f")(x)
    if c.tied:
      return embed.attend(x)
    return nn.Dense(c.vocab, use_bias=False, dtype=c.dtype, name="head")(x)


def make_train_step(
    config: GPTConfig, batch: int, learning_rate: float = 1e-3,
    abstract: bool = False,
) -> tuple[Callable, tuple]:
  """An Adam train step of a `GPT` on next-token cross-entropy.

  Args:
    config: the model's shape.
    batch: B, sequences per step.
    learning_rate: Adam's.
    abstract: arguments as `jax.ShapeDtypeStruct`s (nothing materialised,
      any size), else concrete (random tokens, initialised parameters).

  Returns:
    `(train_step, (params, opt_state, batch))`: `train_step(params,
    opt_state, batch) -> (params, opt_state, loss)`, batch a dict of
    "inputs" and "targets", [B, S] int32 each.
  """
  model = GPT(config)
  optimizer = optax.adam(learning_rate)

  def init():
    tokens = jax.random.randint(
        jax.random.key(1), (batch, config.seq + 1), 0, config.vocab)
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return params, optimizer.init(params), data

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]).mean()

  def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # One compile of the whole init, not one per op dispatched eagerly.
  return train_step, jax.eval_shape(init) if abstract else jax.jit(init)()


def megatron_specs(args: Any, data: str | tuple[str, ...] | None = "data",
                   model: str | None = "model") -> Any:
  """The expert layout of a GPT train step's arguments.

  Megatron tensor parallelism over `model`: query/key/value and the MLP's
  first layer split by columns (heads, hidden units), attention output and
  the MLP's second layer by rows; the batch over `data`. Adam's moments follow
  their parameters.

  Args:
    args: `(params, opt_state, batch)` of the GPT train step (arrays or
      ShapeDtypeStructs).
    data: the mesh axis (or axes) the batch is split over; None: pure
      Megatron.
    model: the mesh axis of the tensor parallelism; None: pure data
      parallelism.

  Returns:
    A PartitionSpec per leaf of `args`, in its structure, as `jax.jit`'s
    in_shardings and `automap.evaluate` take them.
  """
  from jax.sharding import PartitionSpec as P

  def param_spec(path: str, ndim: int):
    if model is None:
      return P()
    leaf = path.split("/")
    if leaf[-1] == "kernel" and leaf[-2] in ("query", "key", "value"):
      return P(None, model, None)
    if leaf[-1] == "kernel" and leaf[-2] == "out":
      return P(model, None, None)
    if leaf[-2:] == ["wi", "kernel"]:
      return P(None, model)
    if leaf[-2:] == ["wi", "bias"]:
      return P(model)
    if leaf[-2:] == ["wo", "kernel"]:
      return P(model, None)
    return P()

  def spec(path, x):
    p = jax.tree_util.keystr(path, simple=True, separator="/")
    if p.startswith("2/"):  # the batch
      return P(data)
    if "/blocks/" in p and x.ndim:  # stacked by nn.scan: the layer dim first
      return P(None, *param_spec(p, x.ndim - 1))
    return param_spec(p, x.ndim) if x.ndim else P()

  return jax.tree_util.tree_map_with_path(spec, args)
