"""Layer names: the part of an op's name scope that says which layer it is in.

A layer is the first component of an op's name scope once transformations
and a leading model-class name every op shares are stripped
(`transpose(jvp(GPT))/block_1/mlp` -> `block_1`), so its forward and
backward ops count together. Backward ops are those autodiff transposed.
"""

from __future__ import annotations

import re

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
