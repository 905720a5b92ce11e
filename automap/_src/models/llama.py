"""A MaxText-style llama decoder and its optax training step.

The layout is the user's: parameters carry MaxText's logical axis names
(`nn.with_logical_partitioning`) and activations MaxText's constraints
(`nn.with_logical_constraint`), resolved to a mesh by `RULES`. Used by the
benchmarks to ask whether automap prices a layout written by hand. Shape
letters: B batch, S sequence, E embed, F MLP width, N query heads, K
key/value heads (N = K * G), D head dim, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from automap._src.models import moe


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """The shape of the llama decoder `train_step` builds.

  Attributes:
    vocab: V.
    embed: E, the residual width.
    mlp: F, the SwiGLU MLP's (or each expert's) hidden width.
    heads: N, query heads.
    kv_heads: K, key/value heads; divides N.
    head_dim: D; even (rotary pairs).
    layers: L.
    seq: S, tokens per sequence.
    batch: B, sequences per step.
    dtype: the compute dtype (weights stay float32).
    remat_policy: a name in `jax.checkpoint_policies`, the layers' remat.
    experts: X: a mixture of this many experts in each MLP (Mixtral's);
      0 for dense.
    top_k: experts per token.
    capacity_factor: slots per expert and sequence, over an even share.
    unrolled: the layers as HuggingFace's Flax Llama writes them (one
      `nn.remat`'d module per layer, `layers_0`...), not one `nn.scan`
      over stacked weights.
    fsdp: the mesh axes the weights' embed dim is split over.
    tied: the logits from the token embedding's own table (`Embed.attend`),
      as Gemma and Llama 3.2's small models tie them; else a head of its own.
  """

  vocab: int = 1024
  embed: int = 256
  mlp: int = 512
  heads: int = 8
  kv_heads: int = 4
  head_dim: int = 32
  layers: int = 4
  seq: int = 128
  batch: int = 16
  dtype: Any = jnp.float32
  remat_policy: str = "nothing_saveable"
  experts: int = 0
  top_k: int = 2
  capacity_factor: float = 1.25
  unrolled: bool = False
  fsdp: tuple[str, ...] = ("fsdp",)
  tied: bool = False


# MaxText's rules (base.yml) for the axes this mesh may have, in order of
# precedence; flax skips a rule whose mesh axis the array already uses, so
# k/v's "activation_kv" stays unsharded once its heads take "tensor".
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("activation_batch", ("data", "fsdp", "expert")),
    ("activation_length", None),
    ("activation_embed", None),
    ("activation_heads", "tensor"),
    ("activation_kv_heads", "tensor"),
    ("activation_kv", None),
    ("activation_mlp", "tensor"),
    ("activation_vocab", "tensor"),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("kv", None),
    ("norm", None),
    ("layers", None),
    ("exp", "expert"),
)


def rules_for(mesh, fsdp: tuple[str, ...] = ("fsdp",)) -> tuple[tuple[str, Any], ...]:
  """`RULES` without the mesh axes `mesh` lacks (a Mesh or AbstractMesh),
  the weights' embed dim over the mesh axes `fsdp` (MaxText's "fsdp").

  flax would emit a missing axis into the PartitionSpec; a rule left with
  no axis is dropped, so its logical axis stays unsharded.
  """
  have = set(mesh.axis_names)
  out = []
  for name, axes in RULES:
    if name == "embed":
      axes = fsdp
    if axes is None:
      out.append((name, None))
      continue
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a in have)
    if kept:
      out.append((name, kept[0] if len(kept) == 1 else kept))
  return tuple(out)


class Dense(nn.Module):
  """x's `axis` contracted with a kernel [*x.shape[axis], *features].

  Its own (not flax's DenseGeneral, which boxes the flattened kernel with
  the full-rank names and so fails their constraint under a mesh).
  """

  features: tuple[int, ...]
  axis: tuple[int, ...]  # contracted axes of x
  names: tuple[str, ...]  # logical names of the kernel's axes
  dtype: Any

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    axis = tuple(a % x.ndim for a in self.axis)
    n = len(axis)
    shape = tuple(x.shape[a] for a in axis) + self.features
    init = nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=tuple(range(n)),
        out_axis=tuple(range(n, len(shape))))
    kernel = self.param("kernel", nn.with_logical_partitioning(init, self.names), shape)
    return jax.lax.dot_general(x, kernel.astype(self.dtype),
                               ((axis, tuple(range(n))), ((), ())))


def _dense(features, axis, names: tuple[str, ...], dtype, name: str) -> Dense:
  as_tuple = lambda v: tuple(v) if isinstance(v, tuple) else (v,)
  return Dense(as_tuple(features), as_tuple(axis), names, dtype, name=name)


class RMSNorm(nn.Module):
  dtype: Any
  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)),
                       (x.shape[-1],))
    y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + self.epsilon)
    return (y * scale.reshape((1,) * (x.ndim - 1) + (-1,))).astype(self.dtype)


def rotary(x: jax.Array, max_timescale: float = 10_000.0) -> jax.Array:
  """Rotary embedding of [B, S, heads, D] at positions 0..S-1, halves paired."""
  d = x.shape[-1]
  timescale = max_timescale ** (2 * jnp.arange(d // 2) / d)  # [D/2]
  angle = jnp.arange(x.shape[1])[:, None] / timescale[None]  # [S, D/2]
  sin, cos = jnp.sin(angle)[None, :, None], jnp.cos(angle)[None, :, None]
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin],
                         axis=-1).astype(x.dtype)


class Attention(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, E] -> [B, S, E]
    c = self.config
    # MaxText's names for what its remat policies save or offload.
    q = checkpoint_name(_dense((c.heads, c.head_dim), -1, ("embed", "heads", "kv"), c.dtype,
                               "query")(x), "query_proj")
    k = checkpoint_name(_dense((c.kv_heads, c.head_dim), -1, ("embed", "kv_heads", "kv"),
                               c.dtype, "key")(x), "key_proj")
    v = checkpoint_name(_dense((c.kv_heads, c.head_dim), -1, ("embed", "kv_heads", "kv"),
                               c.dtype, "value")(x), "value_proj")
    q = nn.with_logical_constraint(
        rotary(q), ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    kv_names = ("activation_batch", "activation_length", "activation_kv_heads", "activation_kv")
    k = nn.with_logical_constraint(rotary(k), kv_names)
    v = nn.with_logical_constraint(v, kv_names)
    b, s = x.shape[:2]
    q = q.reshape(b, s, c.kv_heads, c.heads // c.kv_heads, c.head_dim)  # [B, S, K, G, D]
    logits = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(c.head_dim).astype(c.dtype)
    causal = jnp.tril(jnp.ones((s, s), dtype=bool))
    logits = jnp.where(causal, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(c.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, c.heads, c.head_dim)
    out = nn.with_logical_constraint(
        out, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    return checkpoint_name(
        _dense(c.embed, (-2, -1), ("heads", "kv", "embed"), c.dtype, "out")(out), "out_proj")


class MLP(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, E] -> [B, S, E]
    c = self.config
    gate = checkpoint_name(_dense(c.mlp, -1, ("embed", "mlp"), c.dtype, "wi_0")(x), "mlpwi_0")
    up = checkpoint_name(_dense(c.mlp, -1, ("embed", "mlp"), c.dtype, "wi_1")(x), "mlpwi_1")
    h = nn.with_logical_constraint(
        nn.silu(gate) * up, ("activation_batch", "activation_length", "activation_mlp"))
    return checkpoint_name(_dense(c.embed, -1, ("mlp", "embed"), c.dtype, "wo")(h), "mlpwo")


class MoeMLP(nn.Module):
  """Mixtral's sparse MLP as MaxText's dense path computes it: each
  sequence a group, top-k routing, GShard's einsum dispatch into capacity
  slots, SwiGLU experts (`models/moe.py`)."""

  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:  # [B, S, E] -> [B, S, E]
    c = self.config
    init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal",
                                            in_axis=-2, out_axis=-1)
    shapes = {"router": ((c.embed, c.experts), ("embed", None)),
              "wi_0": ((c.experts, c.embed, c.mlp), ("exp", "embed", "mlp")),
              "wi_1": ((c.experts, c.embed, c.mlp), ("exp", "embed", "mlp")),
              "wo": ((c.experts, c.mlp, c.embed), ("exp", "mlp", "embed"))}
    p = {n: self.param(n, nn.with_logical_partitioning(init, names), shape).astype(c.dtype)
         for n, (shape, names) in shapes.items()}
    slots = moe.capacity(x.shape[1], c.experts, c.top_k, c.capacity_factor)
    return moe.einsum_dispatch(p, x, c.top_k, slots)


class DecoderLayer(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, x: jax.Array, _) -> tuple[jax.Array, None]:
    c = self.config
    x = checkpoint_name(x, "decoder_layer_input")
    x = x + Attention(c, name="self_attention")(RMSNorm(c.dtype, name="pre_attention_norm")(x))
    mlp = MoeMLP(c, name="moe") if c.experts else MLP(c, name="mlp")
    x = x + mlp(RMSNorm(c.dtype, name="post_attention_norm")(x))
    x = nn.with_logical_constraint(
        x, ("activation_batch", "activation_length", "activation_embed"))
    return x, None


class Decoder(nn.Module):
  config: LlamaConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:  # [B, S] int -> [B, S, V]
    c = self.config
    embed_init = nn.with_logical_partitioning(nn.initializers.normal(1.0), ("vocab", "embed"))
    embedder = nn.Embed(c.vocab, c.embed, dtype=c.dtype, embedding_init=embed_init,
                        name="token_embedder")
    x = embedder(tokens)
    x = nn.with_logical_constraint(
        x, ("activation_batch", "activation_length", "activation_embed"))
    policy = getattr(jax.checkpoint_policies, c.remat_policy)
    if c.unrolled:  # flax's default prevent_cse, as HuggingFace's layers take it
      layer = nn.remat(DecoderLayer, policy=policy)
      for i in range(c.layers):
        x, _ = layer(c, name=f"layers_{i}")(x, None)
    else:
      x, _ = nn.scan(nn.remat(DecoderLayer, prevent_cse=False, policy=policy),
                     variable_axes={"params": 0}, split_rngs={"params": True},
                     length=c.layers, metadata_params={nn.PARTITION_NAME: "layers"})(
                         c, name="layers")(x, None)
    x = RMSNorm(c.dtype, name="decoder_norm")(x)
    if c.tied:
      logits = embedder.attend(x)
    else:
      logits = _dense(c.vocab, -1, ("embed", "vocab"), c.dtype, "logits_dense")(x)
    return nn.with_logical_constraint(
        logits, ("activation_batch", "activation_length", "activation_vocab"))


def _optimizer() -> optax.GradientTransformation:
  return optax.adamw(1e-3, weight_decay=0.1)


def train_step(config: LlamaConfig, seed: int = 0, constrained: bool = True,
               abstract: bool = False) -> tuple[Callable, tuple]:
  """An AdamW train step of a MaxText-style llama decoder, its layout the
  user's: logical axis names on the weights, constraints on the activations.

  The constraints bind to the mesh the caller traces under (`with
  jax.set_mesh(mesh): jax.jit(step_fn)...`, Auto axis types); with none in
  context they are no-ops.

  Args:
    config: the decoder's shape.
    seed: of the initial weights and the tokens.
    constrained: the activations' constraints resolved by MaxText's rules;
      False: none (the same step without a layout of its own).
    abstract: arguments as `jax.ShapeDtypeStruct`s (any size: nothing is
      allocated), else small concrete arrays.

  Returns:
    `(step_fn, (params, opt_state, batch))`: `step_fn(params, opt_state,
    batch) -> (params, opt_state, loss)` on plain arrays; batch is
    {"inputs", "targets"}, [B, S] int32, targets the next tokens.

  Raises:
    AttributeError: `config.remat_policy` names nothing in
      `jax.checkpoint_policies`.
    TypeError: `config.kv_heads` does not divide `config.heads`.
  """
  model, optimizer = Decoder(config), _optimizer()
  k_init, k_data = jax.random.split(jax.random.key(seed))
  if abstract:
    tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens}
    params = nn.meta.unbox(jax.eval_shape(lambda t: model.init(k_init, t), tokens)["params"])
  else:
    tokens = jax.random.randint(k_data, (config.batch, config.seq + 1), 0, config.vocab)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = nn.meta.unbox(jax.jit(model.init)(k_init, batch["inputs"])["params"])

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"]).mean()

  def step_fn(params, opt_state, batch):
    rules = rules_for(jax.sharding.get_abstract_mesh(), config.fsdp) if constrained else ()
    with nn.logical_axis_rules(rules):
      loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state = jax.eval_shape(optimizer.init, params) if abstract else optimizer.init(params)
  return step_fn, (params, opt_state, batch)


def param_specs(config: LlamaConfig, mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh,
                ) -> tuple[Any, Any, P]:
  """The layout the decoder is written with: its logical names resolved on
  `mesh` by MaxText's rules.

  Args:
    config: the decoder's shape.
    mesh: the mesh; rules naming axes it lacks are dropped.

  Returns:
    PartitionSpecs `(params, opt_state, batch)`: the parameters' pytree,
    Adam's state (moments laid out as the parameters, its step count
    replicated), and one spec for each [B, S] batch array.

  Raises:
    AttributeError: `config.remat_policy` names nothing in
      `jax.checkpoint_policies`.
    TypeError: `config.kv_heads` does not divide `config.heads`.
  """
  model, rules = Decoder(config), rules_for(mesh, config.fsdp)
  tokens = jax.ShapeDtypeStruct((config.batch, config.seq), jnp.int32)
  boxed = jax.eval_shape(lambda t: model.init(jax.random.key(0), t), tokens)["params"]
  is_spec = lambda x: isinstance(x, P)
  params = jax.tree.map(lambda s: nn.logical_to_mesh_axes(s, rules),
                        nn.get_partition_spec(boxed), is_leaf=is_spec)
  optimizer = _optimizer()
  state = jax.eval_shape(optimizer.init, nn.meta.unbox(boxed))
  opt = optax.tree_map_params(optimizer, lambda _, spec: spec, state, params,
                              transform_non_params=lambda _: P(), is_leaf=is_spec)
  return params, opt, nn.logical_to_mesh_axes(("activation_batch", None), rules)
