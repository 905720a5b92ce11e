"""Layer names: the part of an op's name scope that says which layer it is in.

A layer is the first component of an op's name scope once transformations
and a leading model-class name every op shares are stripped
(`transpose(jvp(GPT))/block_1/mlp` -> `block_1`), so its forward and
backward ops count together; where the repeated layers sit deeper, under
scopes that only hold them (HuggingFace's `transformer/h/0`), the cluster
planner names layers below those `containers`. Backward ops are those
autodiff transposed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence

TRANSFORMS = re.compile(r"^(?:[a-z_]+\(|\))+|\)+")
UNSCOPED = "(top level)"


def _parts(scope: str) -> list[str]:
  """Scope components, transformations stripped, a leading model-class name
  (GPT, Model, _Private...) every op shares dropped."""
  parts = [p for p in (TRANSFORMS.sub("", s) for s in scope.split("/")) if p]
  if len(parts) > 1 and parts[0].lstrip("_")[:1].isupper():
    parts = parts[1:]
  return parts


def layer_of(scope: str, depth: int = 1, containers: frozenset[str] = frozenset()) -> str:
  """`transpose(jvp(GPT))/block_1/mlp/wi` -> `block_1` (depth 1). A scope
  under `containers` (see `containers`) descends past them:
  `transformer/h/3/attn` -> `transformer/h/3`; an op in a container itself
  is `UNSCOPED` (it joins the layer before)."""
  if scope == UNSCOPED:  # already a layer name
    return scope
  parts = _parts(scope)
  k = depth
  while k <= len(parts) and "/".join(parts[:k]) in containers:
    k += 1
  if k > len(parts) and parts and k > depth:
    return UNSCOPED
  return "/".join(parts[:k]) or UNSCOPED


_STEM = re.compile(r"[_-]?\d+$")


def containers(scopes: Sequence[str]) -> frozenset[str]:
  """The scopes that hold a model's repeated layers rather than being one:
  HuggingFace's `transformer/h` (its blocks `0`, `1`, ...) and
  `transformer` above it, BART's `model/encoder/layers`. A scope is a
  container when some scope below it has two or more children of one stem
  (`0`, `1`; `block_0`, `block_1`; haiku's `block`, `block_1`), unless it
  is itself one of a repeated set at least as large (a block's own numbered
  sublayers stay inside it; two towers of six blocks hold their blocks).
  Layers are then named one level below each container (`layer_of(...,
  containers=)`); a model whose layers are its top-level scopes (`embed`,
  `block_0`, ..., `ln_f`) has none."""
  children: dict[str, set[str]] = defaultdict(set)
  for scope in set(scopes):
    parts = _parts(scope)
    for k in range(len(parts)):
      children["/".join(parts[:k])].add(parts[k])

  def repeated(names: set[str]) -> dict[str, int]:
    """Members of repeated sets among siblings, each with its set's size."""
    stems: dict[str, list[str]] = defaultdict(list)
    for name in names:
      if _STEM.search(name):
        stems[_STEM.sub("", name)].append(name)
    for name in names:  # haiku's and keras' first of a set: `block`, then `block_1`
      if name in stems:
        stems[name].append(name)
    return {n: len(group) for group in stems.values() if len(group) > 1 for n in group}

  sets_under = {parent: repeated(names) for parent, names in children.items()}
  members = {f"{parent}/{n}" if parent else n: size
             for parent, sets in sets_under.items() for n, size in sets.items()}
  found: set[str] = set()
  for holder, sets in sets_under.items():
    if not holder or not sets:
      continue
    parts = holder.split("/")
    prefixes = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
    # Repeats inside a repeated member (a block's Dense_0, Dense_1) stay in
    # it, unless they repeat more often (two towers of six blocks each).
    if not any(members.get(p, 0) >= max(sets.values()) for p in prefixes):
      found.update(prefixes)
  return frozenset(found)


def is_backward(scope: str) -> bool:
  """Whether an op of this name scope is part of a backward pass: JAX's
  autodiff marks the ops it emits by transposing with `transpose(`."""
  return "transpose(" in scope


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
