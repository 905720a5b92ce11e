"""Sharding propagation rules: one einsum-like factor rule per primitive.

A rule names the independent loop dimensions ("factors") of an operation and
says, for every dimension of every operand and result, which factor it
indexes. Tiling a factor over a mesh axis tiles every dimension it indexes,
which is how a decision travels across an operation. A factor that indexes
no result dimension is a *reduction* factor: tiling it leaves each device with
a partial result that a collective must combine. A dimension marked
`UNSHARDABLE` must be whole on every device (a sorted axis, a concatenated
axis, a gathered table's rows), so the operation gathers it first.

The factor notation follows Shardy's `OpShardingRule`. A dimension a
reshape merges from two (or splits into two) indexes both of their factors,
major then minor, as Shardy's compound factors do: axes tiling it fill the
major factor first, and tile the minor one only once the major is whole
(a hidden dim tiled (data, model) split into heads x head width is data on
heads, model on head width). Other merged and split dimensions share only
their major factor, the one whose tiles are contiguous in both layouts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from automap._src.ir import declared
from automap._src.ir.factor_rule import (
  UNSHARDABLE,
  Builder,
  Rule,
  Shape,
  Window,
  replicated_rule,
)


def _elementwise(ins, outs, params) -> Rule:
  b = Builder()
  shape = outs[0]
  factors = [b.new(n) for n in shape]
  operands = []
  for s in ins:
    if s is None:
      operands.append(None)
    elif len(s) == 0:
      operands.append(())
    elif len(s) == len(shape) and all(a in (b, 1) for a, b in zip(s, shape)):
      # Unit dims broadcast implicitly; they have nothing to tile.
      operands.append([f if a == b else UNSHARDABLE
                       for f, a, b in zip(factors, s, shape)])
    else:
      return replicated_rule(ins, outs)
  return b.rule(operands, [factors if tuple(o) == tuple(shape) else
                           [UNSHARDABLE] * len(o) for o in outs])


def _broadcast_in_dim(ins, outs, params) -> Rule:
  b = Builder()
  out = outs[0]
  factors = [b.new(n) for n in out]
  operand = []
  for i, d in enumerate(params["broadcast_dimensions"]):
    operand.append(factors[d] if ins[0][i] == out[d] else UNSHARDABLE)
  return b.rule([operand] + [None] * (len(ins) - 1), [factors])


def _reshape_groups(a: Shape, b: Shape) -> list[tuple[list[int], list[int]]]:
  """Splits two shapes of equal size into runs of dims with equal products."""
  groups, i, j = [], 0, 0
  while i < len(a) or j < len(b):
    gi, gj, pa, pb = [], [], 1, 1
    # Unit dims form groups of their own, so they never steal a factor.
    if i < len(a) and a[i] == 1:
      groups.append(([i], []))
      i += 1
      continue
    if j < len(b) and b[j] == 1:
      groups.append(([], [j]))
      j += 1
      continue
    while True:
      if pa <= pb and i < len(a):
        pa *= a[i]
        gi.append(i)
        i += 1
      elif j < len(b):
        pb *= b[j]
        gj.append(j)
        j += 1
      else:
        break
      if pa == pb:
        break
    groups.append((gi, gj))
  return groups


def _reshape(ins, outs, params) -> Rule:
  if params.get("dimensions") is not None:
    return replicated_rule(ins, outs)
  a, o = ins[0], outs[0]
  b = Builder()
  operand = [UNSHARDABLE] * len(a)
  result = [UNSHARDABLE] * len(o)
  minor = []
  results_from = len(ins)  # the result's member index
  for gi, gj in _reshape_groups(a, o):
    if not gi or not gj:
      continue
    # Only the major dims tile contiguously on both sides.
    f = b.new(math.gcd(a[gi[0]], o[gj[0]]))
    operand[gi[0]] = f
    result[gj[0]] = f
    # One dim split into two, or two merged into one: the second of the two
    # is the one dim's minor factor.
    if f >= 0 and len(gi) == 1 and len(gj) == 2:
      g = b.new(o[gj[1]])
      result[gj[1]] = g
      if g >= 0:
        minor.append((0, gi[0], g))
    elif f >= 0 and len(gi) == 2 and len(gj) == 1:
      g = b.new(a[gi[1]])
      operand[gi[1]] = g
      if g >= 0:
        minor.append((results_from, gj[0], g))
  return b.rule([operand] + [None] * (len(ins) - 1), [result], minor=minor)


def _squeeze(ins, outs, params) -> Rule:
  b = Builder()
  dims = set(d % len(ins[0]) for d in params["dimensions"])
  operand, result = [], []
  for i, n in enumerate(ins[0]):
    if i in dims:
      operand.append(UNSHARDABLE)
    else:
      f = b.new(n)
      operand.append(f)
      result.append(f)
  return b.rule([operand], [result])


def _transpose(ins, outs, params) -> Rule:
  b = Builder()
  operand = [b.new(n) for n in ins[0]]
  return b.rule([operand], [[operand[p] for p in params["permutation"]]])


def _dot_general(ins, outs, params) -> Rule:
  (lc, rc), (lb, rb) = params["dimension_numbers"]
  lhs, rhs = ins
  b = Builder()
  lf = [UNSHARDABLE] * len(lhs)
  rf = [UNSHARDABLE] * len(rhs)
  result = []
  for i, j in zip(lb, rb):
    f = b.new(lhs[i])
    lf[i] = rf[j] = f
    result.append(f)
  for i, j in zip(lc, rc):
    lf[i] = rf[j] = b.new(lhs[i])
  for i in range(len(lhs)):
    if i not in lb and i not in lc:
      lf[i] = b.new(lhs[i])
      result.append(lf[i])
  for j in range(len(rhs)):
    if j not in rb and j not in rc:
      rf[j] = b.new(rhs[j])
      result.append(rf[j])
  return b.rule([lf, rf], [result])


def _conv(ins, outs, params) -> Rule:
  """Convolution: batch and output features tile, input features contract;
  spatial dims stay whole (tiling them needs halo exchanges)."""
  dn = params["dimension_numbers"]
  lhs, rhs = ins
  b = Builder()
  lf = [UNSHARDABLE] * len(lhs)
  rf = [UNSHARDABLE] * len(rhs)
  result = [UNSHARDABLE] * len(outs[0])
  if params.get("batch_group_count", 1) == 1:
    lf[dn.lhs_spec[0]] = result[dn.out_spec[0]] = b.new(lhs[dn.lhs_spec[0]])
  if params.get("feature_group_count", 1) == 1:
    lf[dn.lhs_spec[1]] = rf[dn.rhs_spec[1]] = b.new(lhs[dn.lhs_spec[1]])
    rf[dn.rhs_spec[0]] = result[dn.out_spec[1]] = b.new(rhs[dn.rhs_spec[0]])
  return b.rule([lf, rf], [result])


def _reduce(ins, outs, params) -> Rule:
  """reduce_sum/max/.../argmax: reduced dims are reduction factors (an
  argmax's partial winners are combined by gathering them)."""
  b = Builder()
  axes = set(params["axes"])
  operand, result = [], []
  for i, n in enumerate(ins[0]):
    f = b.new(n)
    operand.append(f)
    if i not in axes:
      result.append(f)
  return b.rule([operand], [result] * len(outs))


def _along_axis(key: str):
  """Ops that need one whole axis (cumulative ops, sort, split...)."""

  def rule(ins, outs, params) -> Rule:
    b = Builder()
    rank = len(outs[0]) if outs[0] else len(ins[0])
    axis = params[key] % rank if rank else 0
    factors = [UNSHARDABLE if i == axis else b.new(n)
               for i, n in enumerate(ins[0])]
    return b.rule([factors if s is not None and len(s) == len(factors) else
                   None if s is None else [UNSHARDABLE] * len(s) for s in ins],
                  [[factors[i] if i != axis else UNSHARDABLE
                    for i in range(len(o))] for o in outs])

  return rule


def _split(ins, outs, params) -> Rule:
  """Pieces of one axis: each reads its range of the operand's through a
  window; the axis tiles by a factor every piece divides."""
  b = Builder()
  a = ins[0]
  axis = params["axis"] % len(a)
  pieces = [o[axis] for o in outs]
  factors = [b.new(math.gcd(n, *pieces) if i == axis else n) for i, n in enumerate(a)]
  windows, start = [], 0
  for r, n in enumerate(pieces):
    windows.append(Window(factors[axis], 0, axis, r, -start, start + n - a[axis]))
    start += n
  return b.rule([factors], [factors] * len(outs), windows)


def _slice(ins, outs, params) -> Rule:
  """A static slice: an untouched dim tiles as it is; a sliced one shares a
  factor with its range of the operand, read through a window."""
  b = Builder()
  a, o = ins[0], outs[0]
  strides = params.get("strides") or (1,) * len(a)
  factors, windows = [], []
  for i, n in enumerate(a):
    if n == o[i]:
      factors.append(b.new(n))
      continue
    f = b.new(math.gcd(n, o[i]))
    start, limit = params["start_indices"][i], params["limit_indices"][i]
    windows.append(Window(f, 0, i, 0, -start, limit - n, strides[i]))
    factors.append(f)
  return b.rule([factors], [factors], windows)


def _stack(ins, outs, params) -> Rule:
  """Operands of one shape stacked along a new dim (`lax.stack`, lowered to
  a concatenation of each broadcast to a unit dim), and its transpose
  `unstack` (a slice and a reshape of each piece): the stacked dim whole,
  the others shared by every piece."""
  b = Builder()
  unstacking = len(outs[0]) < len(ins[0])
  piece = outs[0] if unstacking else ins[0]
  factors = [b.new(n) for n in piece]
  whole = list(factors)
  whole.insert(params["axis"] % (len(piece) + 1), UNSHARDABLE)
  if unstacking:
    return b.rule([whole], [factors] * len(outs))
  return b.rule([factors if s is not None else None for s in ins], [whole])


def _matrices(core: int):
  """Linear algebra on the trailing `core` dims of its first operand (a
  batch of matrices: lu, cholesky, qr, eigh, svd, triangular_solve):
  the leading dims are a batch every operand and result shares, each
  matrix (and its pivots, permutation, eigenvalues) kept whole, as XLA
  partitions them (`HandleCustomCall`/`HandleTriangularSolve`: batch dims
  only)."""

  def rule(ins, outs, params) -> Rule:
    b = Builder()
    batch = tuple(ins[0][:max(len(ins[0]) - core, 0)])
    shapes = [s for s in (*ins, *outs) if s is not None]
    if any(tuple(s[:len(batch)]) != batch or len(s) < len(batch) for s in shapes):
      return replicated_rule(ins, outs)
    factors = [b.new(n) for n in batch]

    def dims(s):
      return None if s is None else factors + [UNSHARDABLE] * (len(s) - len(batch))
    return b.rule([dims(s) for s in ins], [dims(s) for s in outs])

  return rule


def _bitcast_convert_type(ins, outs, params) -> Rule:
  """Same-width bitcasts are elementwise; width changes add or drop a dim."""
  if len(ins[0]) != len(outs[0]):
    return replicated_rule(ins, outs)
  return _elementwise(ins, outs, params)


def _same_where_equal(ins, outs, params) -> Rule:
  """dynamic_slice / dynamic_update_slice / rev: a dim tiles where it is untouched."""
  b = Builder()
  a, o = ins[0], outs[0]
  touched = set(params.get("dimensions", ()))
  factors = [b.new(n) if n == o[i] and i not in touched else UNSHARDABLE
             for i, n in enumerate(a)]
  operands = [factors]
  for s in ins[1:]:
    # dynamic_update_slice's update tiles like the operand; indices are scalars.
    operands.append(None if s is None else factors if len(s) == len(a)
                    and all(s[i] == a[i] for i in range(len(a)) if factors[i] >= 0)
                    else [UNSHARDABLE] * len(s))
  return b.rule(operands, [factors])


def _pad(ins, outs, params) -> Rule:
  """Edge padding reads the operand through a window; interior padding
  (dilation) keeps its dim whole."""
  b = Builder()
  factors, windows = [], []
  for i, (n, (lo, hi, interior), m) in enumerate(zip(ins[0], params["padding_config"],
                                                      outs[0])):
    if (lo, hi, interior) == (0, 0, 0):
      factors.append(b.new(n))
    elif interior:
      factors.append(UNSHARDABLE)
    else:
      factors.append(b.new(math.gcd(n, m)))
      windows.append(Window(factors[-1], 0, i, 0, lo, hi))
  return b.rule([factors, ()], [factors], windows)


def _concatenate(ins, outs, params) -> Rule:
  """Operands tile alike; the concatenated dim by a factor every operand
  divides, which the op moves aside while it computes (`Rule.moved`)."""
  b = Builder()
  d = params["dimension"]
  factors = [b.new(math.gcd(n, *(s[d] for s in ins))) if i == d else b.new(n)
             for i, n in enumerate(outs[0])]
  moved = (factors[d],) if factors[d] >= 0 else ()
  return b.rule([factors] * len(ins), [factors], moved=moved)


def _iota(ins, outs, params) -> Rule:
  b = Builder()
  return b.rule([], [[b.new(n) for n in outs[0]]])


def _random_bits(ins, outs, params) -> Rule:
  """Counter-based bits (`jax_threefry_partitionable`, on by default): each
  element hashes its own index under its key, so any tile computes its own
  elements alone, and a key array's dims lead the result's."""
  b = Builder()
  factors = [b.new(n) for n in outs[0]]
  return b.rule([factors[:len(ins[0])]], [factors])


def _whole_windows(b: Builder, operand, of: list, window_factors: list, window_dims,
                   skipped, indexed, window_size, clipped: bool) -> None:
  """Gives each operand dim a whole window spans one factor with its dim in
  the window array (a gather's result, a scatter's updates): a pass-through
  dim. So is one an index selects in, if indices are clipped: the window
  can only start at 0 (a vmapped lookup indexes every dim). `skipped`:
  operand dims without a window dim; `window_size(i, d)`: the window's
  extent along operand dim i (window dim d)."""
  windowed = [i for i in range(len(operand)) if i not in skipped]
  for i, d in zip(windowed, window_dims):
    if window_size(i, d) == operand[i] and (clipped or i not in indexed):
      of[i] = window_factors[d] = b.new(operand[i])


def _clipped(params) -> bool:
  """Whether out-of-bounds indices are clamped (not filled or dropped)."""
  return "FILL" not in str(params.get("mode", "")).upper()


def _trivially_sliced(b: Builder, operand, of: list, indexed, skipped, batching,
                      window_size) -> None:
  """Gives each operand dim an index selects in with a window of one element
  a factor of its own (XLA's `PartitionGatherTrivialSlicedOperandDimensions`
  and its scatter twin, in `spmd/gather_scatter_handler.cc`): tiled, each
  device looks up (or writes) the rows it holds, indices offset to its
  tile and the others masked. It indexes no dim of the indices or of the
  windows: a gather's result is then partial (an all-reduce combines the
  masked lookups), a scatter's result is tiled like its operand."""
  windowed = [i for i in range(len(operand)) if i not in skipped]
  for i in indexed:
    if i in batching or of[i] != UNSHARDABLE:
      continue
    if i not in windowed or window_size(i, windowed.index(i)) == 1:
      of[i] = b.new(operand[i])


def _index_dims(indices) -> list[int]:
  """The dims of a gather's or scatter's indices that enumerate lookups (all
  but the last, which holds each lookup's coordinates)."""
  return [d for d in range(len(indices)) if d != len(indices) - 1]


def _gather(ins, outs, params) -> Rule:
  """Row lookups (embeddings, take_along_axis).

  Whole slices of the operand and the batch dims of the indices tile; an
  operand batching dim shares the factor of its indices batching dim; a
  dim rows are looked up along tiles with a masked local lookup whose
  partial results are summed (`_trivially_sliced`).
  """
  dn = params["dimension_numbers"]
  operand, indices = ins
  out = outs[0]
  b = Builder()
  of = [UNSHARDABLE] * len(operand)
  inf = [UNSHARDABLE] * len(indices)
  result = [UNSHARDABLE] * len(out)
  _whole_windows(b, operand, of, result, dn.offset_dims,
                 skipped=(*dn.collapsed_slice_dims, *dn.operand_batching_dims),
                 indexed=dn.start_index_map,
                 window_size=lambda i, d: params["slice_sizes"][i], clipped=_clipped(params))
  batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
  batch_in = _index_dims(indices)
  if len(batch_in) == len(batch_out):
    for i, d in zip(batch_in, batch_out):
      inf[i] = result[d] = b.new(indices[i])
  for i, j in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
    if operand[i] == indices[j]:
      of[i] = inf[j]
    else:
      inf[j] = UNSHARDABLE
  _trivially_sliced(b, operand, of, dn.start_index_map,
                    (*dn.collapsed_slice_dims, *dn.operand_batching_dims),
                    dn.operand_batching_dims, lambda i, d: params["slice_sizes"][i])
  return b.rule([of, inf], [result])


def _scatter_add(ins, outs, params) -> Rule:
  """Scatter-add (and -max, -min): rows scattered from tiles of the updates
  combine (a reduction: XLA all-reduces the partial results with the
  scatter's own combiner), except along batching dims, which index the
  result too."""
  return _scatter(ins, outs, params, combinable=True)


def _scatter_replace(ins, outs, params) -> Rule:
  """Scatter (overwrite): only whole windows tile; later writes win, so the
  scattered dims of the updates stay whole."""
  return _scatter(ins, outs, params, combinable=False)


def _scatter(ins, outs, params, combinable: bool) -> Rule:
  dn = params["dimension_numbers"]
  operand, indices, updates = ins
  b = Builder()
  of = [UNSHARDABLE] * len(operand)
  inf = [UNSHARDABLE] * len(indices)
  uf = [UNSHARDABLE] * len(updates)
  _whole_windows(b, operand, of, uf, dn.update_window_dims,
                 skipped=(*dn.inserted_window_dims, *dn.operand_batching_dims),
                 indexed=dn.scatter_dims_to_operand_dims,
                 window_size=lambda i, d: updates[d], clipped=_clipped(params))
  scatter_u = [d for d in range(len(updates)) if d not in dn.update_window_dims]
  scatter_i = _index_dims(indices)
  if combinable and len(scatter_u) == len(scatter_i):
    batching = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
    for i, d in zip(scatter_i, scatter_u):
      f = b.new(indices[i])
      inf[i] = uf[d] = f
      if i in batching:
        if operand[batching[i]] == indices[i]:
          of[batching[i]] = f
        else:
          inf[i] = uf[d] = UNSHARDABLE
  _trivially_sliced(b, operand, of, dn.scatter_dims_to_operand_dims,
                    (*dn.inserted_window_dims, *dn.operand_batching_dims),
                    dn.operand_batching_dims,
                    lambda i, k: updates[dn.update_window_dims[k]])
  return b.rule([of, inf, uf], [of])


def _select_n(ins, outs, params) -> Rule:
  if ins[0] is not None and len(ins[0]) == 0:  # A scalar predicate.
    rule = _elementwise(ins[1:], outs, params)
    return rule._replace(operands=((),) + rule.operands)
  return _elementwise(ins, outs, params)


# Reductions, partitioned in their operand's layout (XLA's HandleReduce);
# those returning an index combine partial winners by gathering them.
ARG_REDUCTIONS = frozenset({"argmax", "argmin"})
REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or",
                        "reduce_prod"}) | ARG_REDUCTIONS

ELEMENTWISE = frozenset("""
abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clz
conj convert_element_type copy cos cosh digamma div eq erf erf_inv erfc
exp exp2 expm1 floor ge gt igamma imag integer_pow is_finite le lgamma log
log1p logistic lt max min mul ne neg nextafter not or polygamma population_count
pow real reduce_precision rem round rsqrt shift_left shift_right_arithmetic
shift_right_logical sign sin sinh sqrt square stop_gradient sub tan tanh
xor bessel_i0e bessel_i1e regularized_incomplete_beta igammac
random_gamma_grad zeta optimization_barrier name
""".split())

_RULES: dict[str, Callable[[Any, Any, dict], Rule]] = {
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "squeeze": _squeeze,
    "transpose": _transpose,
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    **{prim: _reduce for prim in sorted(REDUCTIONS)},
    "cumsum": _along_axis("axis"),
    "cumprod": _along_axis("axis"),
    "cummax": _along_axis("axis"),
    "cummin": _along_axis("axis"),
    "cumlogsumexp": _along_axis("axis"),
    "split": _split,
    "sort": _along_axis("dimension"),
    "slice": _slice,
    "dynamic_slice": _same_where_equal,
    "dynamic_update_slice": _same_where_equal,
    "rev": _same_where_equal,
    "pad": _pad,
    "concatenate": _concatenate,
    "iota": _iota,
    "empty2": _iota,  # an uninitialised array (AD's zeros in cond branches)
    "random_bits": _random_bits,
    "gather": _gather,
    "scatter-add": _scatter_add,
    "scatter_add": _scatter_add,
    "scatter-max": _scatter_add,
    "scatter-min": _scatter_add,
    "scatter": _scatter_replace,
    "bitcast_convert_type": _bitcast_convert_type,
    "select_n": _select_n,
    "clamp": _elementwise,
    **{prim: _matrices(2) for prim in ("lu", "cholesky", "qr", "householder_product", "eigh",
                                       "eig", "svd", "triangular_solve", "tridiagonal_solve",
                                       "schur", "hessenberg")},
    "lu_pivots_to_permutation": _matrices(1),
    "stack": _stack,
    "unstack": _stack,
}


def has_rule(primitive: str) -> bool:
  return primitive in _RULES or primitive in ELEMENTWISE or declared.declared(primitive)


def rule_for(primitive: str, in_shapes: Sequence[Shape | None],
             out_shapes: Sequence[Shape], params: dict) -> Rule:
  """The factor rule of one equation; `replicated_rule` if we have none. A
  rule the user declared (`declared.declare`) wins, and a RuleError names
  an equation it does not fit."""
  if declared.declared(primitive):
    return declared.rule_of(primitive, list(in_shapes), list(out_shapes))
  fn = _RULES.get(primitive)
  if fn is None and primitive in ELEMENTWISE:
    fn = _elementwise
  if fn is None or not out_shapes:
    return replicated_rule(in_shapes, out_shapes)
  try:
    rule = fn(list(in_shapes), list(out_shapes), params)
  except (KeyError, IndexError, TypeError, AttributeError, ValueError):
    # Parameters of an unfamiliar form: whole arrays are always correct.
    return replicated_rule(in_shapes, out_shapes)
  _check(rule, in_shapes, out_shapes)
  return rule


def _check(rule: Rule, in_shapes, out_shapes) -> None:
  for dims, shape in zip(rule.operands + rule.results,
                         list(in_shapes) + list(out_shapes)):
    if dims is not None and shape is not None and len(dims) != len(shape):
      raise AssertionError(f"rule rank {len(dims)} != shape {shape}")


def flops(primitive: str, in_shapes: Sequence[Shape | None],
          out_shapes: Sequence[Shape], params: dict) -> float:
  """Floating point operations of one equation (multiply-add = 2)."""
  out = sum(int(np.prod(s)) for s in out_shapes)
  if primitive == "dot_general":
    (lc, _), _ = params["dimension_numbers"]
    k = int(np.prod([in_shapes[0][i] for i in lc])) if lc else 1
    return 2.0 * out * k
  if primitive == "conv_general_dilated":
    rhs_spec = params["dimension_numbers"].rhs_spec
    window = int(np.prod([in_shapes[1][i] for i in rhs_spec[1:]]))  # in x spatial
    return 2.0 * out * window
  if primitive.startswith("reduce_") or primitive in ("argmax", "argmin"):
    return float(int(np.prod(in_shapes[0])))
  if primitive in ("scatter-add", "scatter_add", "scatter-max", "scatter-min"):
    return float(int(np.prod(in_shapes[2])))
  if primitive in _RULES and primitive not in ("cumsum", "cumlogsumexp",
                                              "cumprod", "cummax", "cummin",
                                              "sort"):
    return 0.0  # Data movement, counted as bytes not FLOPs.
  return float(out)
