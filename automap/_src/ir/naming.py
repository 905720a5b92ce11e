"""Layer names: the part of an op's name scope that says which layer it is in.

A layer is the first component of an op's name scope once transformations
and a leading model-class name every op shares are stripped
(`transpose(jvp(GPT))/block_1/mlp` -> `block_1`), so its forward and
backward ops count together. Backward ops are those autodiff transposed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

_TRANSFORMS = re.compile(r"^(?:[a-z_]+\(|\))+|\)+")


def layer_of(scope: str, depth: int = 1) -> str:
  """`transpose(jvp(GPT))/block_1/mlp/wi` -> `block_1` (depth 1)."""
  if scope == "(top level)":  # already a layer name
    return scope
  parts = [p for p in (_TRANSFORMS.sub("", s) for s in scope.split("/")) if p]
  # Drop a leading model-class name (GPT, Model, _Private...) that every op
  # shares.
  if len(parts) > 1 and parts[0].lstrip("_")[:1].isupper():
    parts = parts[1:]
  return "/".join(parts[:depth]) or "(top level)"


def is_backward(scope: str) -> bool:
  """Whether an op of this name scope is part of a backward pass: JAX's
  autodiff marks the ops it emits by transposing with `transpose(`."""
  return "transpose(" in scope


UNSCOPED = "(top level)"


def layer_runs(labels: Sequence[str]) -> tuple[list[str], list[int]]:
  """(layers in program order, per item the index of its layer) of items'
  layer labels in program order: an unscoped item (`UNSCOPED`) joins the
  layer before it (the first layer, before any), and a label met again after
  another starts a layer of its own, numbered "#2", "#3" (a tied embedding's
  second use)."""
  last = next((label for label in labels if label != UNSCOPED), UNSCOPED)
  names: list[str] = []
  index: list[int] = []
  seen: dict[str, int] = defaultdict(int)
  previous = None
  for label in labels:
    label = last = last if label == UNSCOPED else label
    if label != previous:
      previous = label
      seen[label] += 1
      names.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    index.append(len(names) - 1)
  return names, index
