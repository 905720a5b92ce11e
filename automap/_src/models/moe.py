"""Mixture-of-experts layers as libraries write them, and their train step.

Two ways the tokens reach their experts:
- `einsum_dispatch` (GShard, Switch, MaxText's dense path): a one-hot
  dispatch tensor [G, S, X, C] and einsums into and out of the experts'
  capacity slots;
- `sorted_dispatch` (MaxText's sparse path, Megablocks): each group's
  (token, choice) assignments sorted by expert, the tokens gathered into
  slots, the results gathered back and weighted.
Both route top-k per token, give each expert `capacity` slots per group
(tokens past it are dropped), and run the experts as one batched SwiGLU
MLP over [X, G, C, M] (Mixtral's). Shape letters: G groups (batch rows), S
tokens per group, M model width, H expert hidden width, X experts, K
choices per token, C slots per expert and group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

Params = dict[str, jax.Array]


def capacity(tokens: int, experts: int, k: int, factor: float = 1.25) -> int:
  """Slots per expert and group: GShard's capacity factor over an even share.

  Args:
    tokens: tokens in one group.
    experts: X.
    k: experts each token is routed to.
    factor: the capacity factor: slots over an even share of the
      `tokens * k` assignments.

  Returns:
    C, at least 1; assignments past it are dropped.
  """
  return max(1, math.ceil(tokens * k * factor / experts))


def route(x: jax.Array, router: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """x [G, S, M] -> the top-k gate weights [G, S, K] (renormalised, float32)
  and experts [G, S, K] (int32)."""
  probs = jax.nn.softmax(jnp.einsum("gsm,mx->gsx", x, router).astype(jnp.float32))
  weights, experts = jax.lax.top_k(probs, k)
  return weights / weights.sum(-1, keepdims=True), experts


def experts_mlp(p: Params, xe: jax.Array) -> jax.Array:
  """The experts' SwiGLU MLPs on their slots: [X, G, C, M] -> [X, G, C, M]."""
  gate = jnp.einsum("xgcm,xmh->xgch", xe, p["wi_0"])
  up = jnp.einsum("xgcm,xmh->xgch", xe, p["wi_1"])
  return jnp.einsum("xgch,xhm->xgcm", jax.nn.silu(gate) * up, p["wo"])


def einsum_dispatch(p: Params, x: jax.Array, k: int, slots: int) -> jax.Array:
  """The layer by one-hot dispatch and combine tensors: [G, S, M] -> [G, S, M]."""
  g, s, _ = x.shape
  num = p["router"].shape[1]
  weights, chosen = route(x, p["router"], k)
  onehot = jax.nn.one_hot(chosen, num, dtype=jnp.int32)  # [G, S, K, X]
  # Each assignment's slot: how many earlier (token, choice) pairs of its
  # group chose the same expert.
  seen = jnp.cumsum(onehot.reshape(g, s * k, num), axis=1).reshape(onehot.shape) - 1
  slot = jnp.sum(seen * onehot, axis=-1)  # [G, S, K]
  kept = (slot < slots).astype(x.dtype)
  mask = (jax.nn.one_hot(chosen, num, dtype=x.dtype)[..., None]
          * jax.nn.one_hot(slot, slots, dtype=x.dtype)[..., None, :]
          * kept[..., None, None])  # [G, S, K, X, C]
  dispatch = mask.sum(2)  # [G, S, X, C]
  combine = (mask * weights.astype(x.dtype)[..., None, None]).sum(2)
  xe = jnp.einsum("gsxc,gsm->xgcm", dispatch, x)
  return jnp.einsum("gsxc,xgcm->gsm", combine, experts_mlp(p, xe))


def sorted_dispatch(p: Params, x: jax.Array, k: int, slots: int) -> jax.Array:
  """The layer by sorting each group's assignments by expert and gathering:
  [G, S, M] -> [G, S, M]."""
  g, s, m = x.shape
  num = p["router"].shape[1]
  weights, chosen = route(x, p["router"], k)

  def dispatch(x, chosen):  # one group: [S, M], [S, K] -> [X, C, M], slot of each
    flat = chosen.reshape(-1)  # [S*K]
    order = jnp.argsort(flat, stable=True)  # assignments grouped by expert
    counts = jnp.bincount(flat, length=num)
    starts = jnp.cumsum(counts) - counts
    at = starts[:, None] + jnp.arange(slots)[None]  # [X, C] place in `order`
    filled = jnp.arange(slots)[None] < counts[:, None]
    token = order[jnp.minimum(at, s * k - 1)] // k
    xe = jnp.where(filled[..., None], x[token], 0)
    slot = jnp.argsort(order) - starts[flat]  # [S*K] each assignment's slot
    return xe, slot

  xe, slot = jax.vmap(dispatch)(x, chosen)  # [G, X, C, M], [G, S*K]
  ye = experts_mlp(p, xe.transpose(1, 0, 2, 3)).transpose(1, 0, 2, 3)
  flat = chosen.reshape(g, s * k)
  kept = slot < slots
  back = jax.vmap(lambda ye, e, c: ye[e, c])(ye, flat, jnp.minimum(slot, slots - 1))
  scale = (kept.reshape(g, s, k) * weights).astype(x.dtype)[..., None]
  return (back.reshape(g, s, k, m) * scale).sum(2)


DISPATCH: dict[str, Callable] = {"einsum": einsum_dispatch, "sorted": sorted_dispatch}


def init(experts: int, width: int, hidden: int, dtype=jnp.float32, seed: int = 0,
         abstract: bool = False) -> Params:
  """A layer's parameters: router [M, X], wi_0 and wi_1 [X, M, H], wo [X, H, M]."""
  shapes = {"router": (width, experts), "wi_0": (experts, width, hidden),
            "wi_1": (experts, width, hidden), "wo": (experts, hidden, width)}
  if abstract:
    return {n: jax.ShapeDtypeStruct(s, dtype) for n, s in shapes.items()}
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {n: (jax.random.normal(key, s) / math.sqrt(s[-2])).astype(dtype)
          for key, (n, s) in zip(keys, shapes.items())}


def make_train_step(dispatch: str = "einsum", experts: int = 8, width: int = 256,
                    hidden: int = 512, groups: int = 16, group_size: int = 64, k: int = 2,
                    capacity_factor: float = 1.25, layers: int = 1, dtype: Any = jnp.float32,
                    abstract: bool = False, seed: int = 0) -> tuple[Callable, tuple]:
  """An AdamW step of residual mixture-of-experts layers as libraries write
  them: top-k routing per group, capacity slots, SwiGLU experts.

  Args:
    dispatch: "einsum" (GShard's one-hot dispatch and combine) or "sorted"
      (each group's assignments sorted by expert and gathered).
    experts: X.
    width: M, the model width.
    hidden: H, each expert's hidden width.
    groups: G, groups (batch rows) per step.
    group_size: S, tokens per group.
    k: experts each token is routed to.
    capacity_factor: slots per expert and group over an even share.
    layers: MoE layers, each added to its input.
    dtype: of the parameters and data.
    abstract: arguments as `jax.ShapeDtypeStruct`s, else concrete.
    seed: of the parameters (layer i from seed + i) and the data.

  Returns:
    `(step, (params, opt_state, x, y))`: `step(params, opt_state, x, y) ->
    (params, opt_state, loss)` regresses y from x, both [G, S, M].

  Raises:
    ValueError: `dispatch` is neither "einsum" nor "sorted".
  """
  if dispatch not in DISPATCH:
    raise ValueError(f"make_train_step: dispatch must be one of {sorted(DISPATCH)}, "
                     f"got {dispatch!r}.")
  layer, slots = DISPATCH[dispatch], capacity(group_size, experts, k, capacity_factor)
  params = [init(experts, width, hidden, dtype, seed + i, abstract) for i in range(layers)]
  opt = optax.adamw(1e-3)

  def loss(params, x, y):
    for p in params:
      x = x + layer(p, x, k, slots)
    return jnp.mean(jnp.square(x - y).astype(jnp.float32))

  def step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss)(params, x, y)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  shape = (groups, group_size, width)
  if abstract:
    data = jax.ShapeDtypeStruct(shape, dtype)
    return step, (params, jax.eval_shape(opt.init, params), data, data)
  kx, ky = jax.random.split(jax.random.key(seed + 1000))
  x, y = (jax.random.normal(key, shape).astype(dtype) for key in (kx, ky))
  return step, (params, opt.init(params), x, y)


__all__ = ["DISPATCH", "capacity", "einsum_dispatch", "experts_mlp", "init",
           "make_train_step", "route", "sorted_dispatch"]
