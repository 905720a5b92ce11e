"""Random JAX programs for property tests, as data hypothesis can shrink.

A program is a list of steps over a pool of values: each step reads values
already in the pool (by index) and appends one. Shapes are tracked while
drawing, so every drawn program is valid; dims come from a small set that
includes sizes no mesh axis divides. Weights of contractions are fresh
arguments, so a program's arguments are its sources, then its weights.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

DIMS = (1, 2, 3, 4, 6, 8, 12, 16)
MAX_RANK = 4
MAX_SIZE = 4096  # elements per value: keeps one example well under a second

MESHES = ((8,), (4, 2), (2, 4), (2, 2, 2), (1, 8), (2, 1, 4))

UNARY = {
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "logistic": jax.nn.sigmoid,
    "neg": jnp.negative,
    "abs": jnp.abs,
    "square": lambda x: 0.5 * x * x,
    "rsqrt": lambda x: jax.lax.rsqrt(1.0 + x * x),
    "bf16": lambda x: x.astype(jnp.bfloat16).astype(x.dtype),
    "exp": lambda x: jnp.exp(jnp.tanh(x)),
}
BINARY = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply,
          "max": jnp.maximum}
REDUCE = {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}


@dataclasses.dataclass(frozen=True)
class Step:
  kind: str
  operands: tuple[int, ...]  # pool indices
  params: tuple = ()


@dataclasses.dataclass(frozen=True)
class RandomProgram:
  sources: tuple[tuple[int, ...], ...]  # shapes of the arguments the pool starts with
  weights: tuple[tuple[int, ...], ...]  # shapes of the arguments contractions read
  steps: tuple[Step, ...]
  outputs: tuple[int, ...]  # pool indices returned
  grad: bool  # return (loss, grads w.r.t. every argument) instead

  def fn(self, *args):
    pool = list(args[:len(self.sources)])
    weights = iter(args[len(self.sources):])
    for s in self.steps:
      pool.append(_run(s, pool, weights))
    return tuple(pool[i] for i in self.outputs)

  def function(self):
    """The program as a function of its arguments."""
    if not self.grad:
      return self.fn

    def loss(*args):
      # Squares: no cancellation, so float32 rounding stays relative.
      return sum(jnp.sum(jnp.square(jnp.tanh(o))) for o in self.fn(*args))

    return jax.value_and_grad(loss, argnums=tuple(range(len(self.shapes))))

  @property
  def shapes(self) -> tuple[tuple[int, ...], ...]:
    return self.sources + self.weights

  def args(self, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(tuple(s)), jnp.float32)
                 for s in self.shapes)


def _run(s: Step, pool: list, weights) -> jax.Array:
  x = pool[s.operands[0]]
  k, p = s.kind, s.params
  if k == "unary":
    return UNARY[p[0]](x)
  if k == "binary":
    y = pool[s.operands[1]]
    y = jnp.broadcast_to(y, x.shape)  # y's shape is a suffix of x's
    return BINARY[p[0]](x, y)
  if k == "where":
    return jnp.where(x > 0, x, jnp.broadcast_to(pool[s.operands[1]], x.shape))
  if k == "reduce":
    return REDUCE[p[0]](x, axis=p[1])
  if k == "transpose":
    return jnp.transpose(x, p)
  if k in ("split", "merge"):
    return x.reshape(p)
  if k == "dot":
    w = next(weights)
    (contract, batch) = p
    return jax.lax.dot_general(
        x, w, (((contract,), (0,)), (tuple(batch), tuple(range(1, 1 + len(batch))))))
  if k == "concat":
    return jnp.concatenate([x, pool[s.operands[1]]], axis=p[0])
  if k == "slice":
    d, start, stop = p
    return jax.lax.slice_in_dim(x, start, stop, axis=d)
  if k == "pad":
    d, lo, hi = p
    widths = [(0, 0)] * x.ndim
    widths[d] = (lo, hi)
    return jnp.pad(x, widths)
  if k == "cumsum":
    return jnp.cumsum(x, axis=p[0])
  if k == "broadcast":
    return jnp.broadcast_to(x[None], (p[0],) + x.shape)
  if k == "softmax":
    return jax.nn.softmax(x, axis=p[0])
  if k == "iota":
    d = p[0]
    return x + jax.lax.broadcasted_iota(x.dtype, x.shape, d)
  if k == "take":
    d, n = p
    # Data-dependent indices: a gather the partitioner cannot see through.
    idx = jnp.abs(jnp.ravel(x)[:n] * 100).astype(jnp.int32) % x.shape[d]
    return jnp.take(x, idx, axis=d)
  if k == "scan":
    def body(c, xt):
      c = jnp.tanh(c + 0.5 * xt)
      return c, 2.0 * c
    return jax.lax.scan(body, jnp.zeros(x.shape[1:], x.dtype), x)[1]
  if k == "remat":
    # A rematerialised block: bound whole, only its result may be pinned.
    return jax.checkpoint(lambda a: jnp.tanh(a) * 2.0 + a)(x)
  if k == "cond":
    # A predicate no summation order flips: a sum that cancels to zero
    # (x - x.T) sits far from the threshold, not on it.
    return jax.lax.cond(jnp.sum(x) > 0.25 * jnp.sum(jnp.abs(x)), jnp.tanh, jnp.sin, x)
  raise ValueError(f"unknown step kind {k!r}")


KINDS = ("unary", "binary", "where", "reduce", "transpose", "split", "merge",
         "dot", "concat", "slice", "pad", "cumsum", "broadcast", "softmax",
         "iota", "take", "scan", "cond", "remat")


def _shape(draw, rank_min=1):
  rank = draw(st.integers(rank_min, 3))
  return tuple(draw(st.sampled_from(DIMS)) for _ in range(rank))


def _fits(shape) -> bool:
  return len(shape) <= MAX_RANK and math.prod(shape) <= MAX_SIZE


@st.composite
def random_programs(draw, max_steps: int = 8, kinds=KINDS) -> RandomProgram:
  sources = [_shape(draw) for _ in range(draw(st.integers(1, 2)))]
  pool = list(sources)
  weights: list[tuple[int, ...]] = []
  steps: list[Step] = []
  for _ in range(draw(st.integers(1, max_steps))):
    i = draw(st.integers(0, len(pool) - 1))
    x = pool[i]
    kind = draw(st.sampled_from(kinds))
    step, shape, weight = _draw_step(draw, kind, i, x, pool)
    if step is None or not _fits(shape):
      continue
    steps.append(step)
    if weight is not None:
      weights.append(weight)
    pool.append(shape)
  last = len(pool) - 1
  extra = draw(st.lists(st.integers(0, last), max_size=1))
  outputs = tuple(dict.fromkeys([last] + extra))
  return RandomProgram(tuple(sources), tuple(weights), tuple(steps), outputs,
                       grad=draw(st.booleans()))


def _draw_step(draw, kind, i, x, pool):
  """(step, result shape, weight shape or None) of a step of `kind` reading
  pool[i] (shape x); step None when the kind does not apply to x."""
  step, shape = _step(draw, kind, i, x, pool)
  if step is not None and step.kind == "dot":
    d, batch = step.params
    n = shape[-1]
    return step, shape, (x[d],) + tuple(x[b] for b in batch) + (n,)
  return step, shape, None


def _step(draw, kind, i, x, pool):
  r = len(x)
  if kind == "unary":
    return Step(kind, (i,), (draw(st.sampled_from(sorted(UNARY))),)), x
  if kind in ("binary", "where"):
    # A partner whose shape is a suffix of x's (broadcast), else x itself.
    partners = [j for j, y in enumerate(pool) if y == x[len(x) - len(y):]]
    j = draw(st.sampled_from(partners))
    params = (draw(st.sampled_from(sorted(BINARY))),) if kind == "binary" else ()
    return Step(kind, (i, j), params), x
  if r == 0:
    return None, None
  d = draw(st.integers(0, r - 1))
  if kind == "reduce":
    if r < 2:
      return None, None
    return (Step(kind, (i,), (draw(st.sampled_from(sorted(REDUCE))), d)),
            x[:d] + x[d + 1:])
  if kind == "transpose":
    perm = tuple(draw(st.permutations(range(r))))
    return Step(kind, (i,), perm), tuple(x[p] for p in perm)
  if kind == "split":
    factors = [f for f in range(2, x[d]) if x[d] % f == 0]
    if not factors:
      return None, None
    f = draw(st.sampled_from(factors))
    shape = x[:d] + (f, x[d] // f) + x[d + 1:]
    return Step(kind, (i,), shape), shape
  if kind == "merge":
    if r < 2 or d == r - 1:
      return None, None
    shape = x[:d] + (x[d] * x[d + 1],) + x[d + 2:]
    return Step(kind, (i,), shape), shape
  if kind == "dot":
    # Contract dim d against a fresh weight [x[d], *batch, n], batch dims
    # drawn among x's others.
    others = [e for e in range(r) if e != d]
    batch = tuple(draw(st.lists(st.sampled_from(others), unique=True, max_size=1))
                  if others else ())
    n = draw(st.sampled_from(DIMS))
    free = [e for e in range(r) if e != d and e not in batch]
    shape = tuple(x[b] for b in batch) + tuple(x[e] for e in free) + (n,)
    return Step(kind, (i,), (d, batch)), shape
  if kind == "concat":
    partners = [j for j, y in enumerate(pool)
                if len(y) == r and all(y[e] == x[e] for e in range(r) if e != d)]
    j = draw(st.sampled_from(partners))
    shape = x[:d] + (x[d] + pool[j][d],) + x[d + 1:]
    return Step(kind, (i, j), (d,)), shape
  if kind == "slice":
    if x[d] < 2:
      return None, None
    start = draw(st.integers(0, x[d] - 1))
    stop = draw(st.integers(start + 1, x[d]))
    return Step(kind, (i,), (d, start, stop)), x[:d] + (stop - start,) + x[d + 1:]
  if kind == "pad":
    lo, hi = draw(st.integers(0, 3)), draw(st.integers(0, 3))
    return Step(kind, (i,), (d, lo, hi)), x[:d] + (x[d] + lo + hi,) + x[d + 1:]
  if kind in ("cumsum", "softmax", "iota"):
    return Step(kind, (i,), (d,)), x
  if kind == "broadcast":
    n = draw(st.sampled_from(DIMS))
    return Step(kind, (i,), (n,)), (n,) + x
  if kind == "take":
    n = draw(st.integers(1, min(4, math.prod(x))))
    return Step(kind, (i,), (d, n)), x[:d] + (n,) + x[d + 1:]
  if kind in ("scan", "remat"):
    return Step(kind, (i,), ()), x
  if kind == "cond":
    return Step(kind, (i,), ()), x
  raise ValueError(f"unknown step kind {kind!r}")
