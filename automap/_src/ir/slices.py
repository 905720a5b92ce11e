"""Slices XLA's simplifier folds before partitioning: a slice within one
operand of a concatenate reads that operand alone; a slice of a pad that
selects only padding is a constant."""

from __future__ import annotations


def within_one_operand(dimension: int, operands: list, shapes: list, params):
  """(operand, its shape, the slice's params on it) when a slice of a
  concatenate's result selects elements of one operand only, else None."""
  strides = params["strides"] or (1,) * len(shapes[0])
  start = params["start_indices"][dimension]
  last = _last_selected(start, params["limit_indices"][dimension], strides[dimension])
  if last is None:
    return None
  offset = 0
  for operand, shape in zip(operands, shapes):
    if offset <= start and last < offset + shape[dimension]:
      shift = [offset if d == dimension else 0 for d in range(len(shape))]
      moved = dict(params,
                   start_indices=tuple(i - s for i, s in zip(params["start_indices"], shift)),
                   limit_indices=tuple(i - s for i, s in zip(params["limit_indices"], shift)))
      return operand, shape, moved
    offset += shape[dimension]
  return None


def reads_padding_only(config, shape, params) -> bool:
  """Whether a slice of a pad's result selects only padding along some dim
  (no interior padding there), so that it is a constant."""
  strides = params["strides"] or (1,) * len(shape)
  for (lo, _, interior), n, start, limit, step in zip(
      config, shape, params["start_indices"], params["limit_indices"], strides):
    last = _last_selected(start, limit, step)
    if interior or last is None:
      continue
    if last < lo or start >= lo + n:
      return True
  return False


def _last_selected(start: int, limit: int, stride: int) -> int | None:
  """The last index a strided slice [start, limit) selects; None if none."""
  return None if start >= limit else start + (limit - 1 - start) // stride * stride


__all__ = ["reads_padding_only", "within_one_operand"]
