"""What a sharding search is asked for: hints, budget, and the options that bundle them."""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping

import numpy as np
from jax.sharding import PartitionSpec

from automap._src.ir import constraints as constraints_lib


class MemoryLimitError(ValueError):
  """No plan can fit the requested memory limit."""


@dataclasses.dataclass(frozen=True)
class Hints:
  """What the user knows.

  Attributes:
    groups: name-scope patterns (fnmatch, e.g. "block_*") of repeated layers
      that should share one decision.
    fixed: argument-path pattern (fnmatch, e.g. "*/embed/*") -> PartitionSpec
      the plan must keep.
  """

  groups: tuple[str, ...] = ()
  fixed: Mapping[str, PartitionSpec] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    groups = (self.groups,) if isinstance(self.groups, str) else tuple(self.groups)
    for g in groups:
      if not isinstance(g, str) or not g:
        raise TypeError(f"Hints.groups must be non-empty strings, got {g!r}.")
    if not isinstance(self.fixed, Mapping):
      raise TypeError(f"Hints.fixed must be a mapping, got {self.fixed!r}.")
    for k, v in self.fixed.items():
      if not isinstance(k, str) or not isinstance(v, PartitionSpec):
        raise TypeError(
            f"Hints.fixed maps argument-path patterns (str) to PartitionSpec, "
            f"got {k!r}: {v!r}.")
    object.__setattr__(self, "groups", groups)
    # Read-only, so a Hints stays immutable and hashable.
    object.__setattr__(self, "fixed", types.MappingProxyType(dict(self.fixed)))

  def __hash__(self):
    return hash((self.groups, tuple(self.fixed.items())))


@dataclasses.dataclass(frozen=True)
class Budget:
  """How much search to spend: MCTS episodes and wall seconds, whichever
  runs out first, or sooner once the search has converged.

  Attributes:
    episodes: MCTS episodes at most.
    seconds: wall seconds at most.
    progress: show a live display of the best plan so far (None: only when
      stderr is a terminal).
    patience: MCTS ends once this many episodes in a row found no better
      plan (None: it runs the whole budget). Refinement follows either way.
  """

  episodes: int = 200
  seconds: float = 60.0
  progress: bool | None = None
  patience: int | None = None

  def __post_init__(self):
    if (not isinstance(self.episodes, (int, np.integer)) or isinstance(self.episodes, bool)
        or self.episodes <= 0):
      raise ValueError(
          f"Budget.episodes must be a positive integer, got {self.episodes!r}.")
    if (not isinstance(self.seconds, (int, float, np.integer, np.floating))
        or isinstance(self.seconds, bool) or not self.seconds > 0):
      raise ValueError(
          f"Budget.seconds must be a positive number, got {self.seconds!r}.")
    if self.progress not in (None, True, False):
      raise ValueError(f"Budget.progress must be True, False or None, got {self.progress!r}.")
    if self.patience is not None and (
        not isinstance(self.patience, (int, np.integer)) or isinstance(self.patience, bool)
        or self.patience <= 0):
      raise ValueError(
          f"Budget.patience must be a positive integer of episodes or None (run the "
          f"whole budget), got {self.patience!r}.")


SEARCHES = ("mcts", "ilp")
DEVICE = "device"  # memory_limit: the hardware's capacity


def bytes_per_device(memory_limit: float | str | None, hardware) -> float | None:
  """A memory_limit as bytes per device: `hardware.hbm_capacity` for
  "device", None (no limit) for None, else the number given. The one place
  "device" becomes bytes, for the sharding search and the cluster planners."""
  if memory_limit is None:
    return None
  return float(hardware.hbm_capacity if memory_limit == DEVICE else memory_limit)
STARTS = ("search", "your layout")
# What a search checks of its plan beyond its own prices.
VERIFY = ("none", "compile")


class SearchWarning(UserWarning):
  """A search fell short of what was asked and says what it did instead."""


@dataclasses.dataclass(frozen=True)
class SearchOptions:
  """How a sharding search runs: one value to reuse across `automap.search`,
  `automap.partition` and saved configurations. Each field is also a
  keyword of those functions.

  Attributes:
    hints: what the user knows (`Hints`: layer groups, pinned layouts).
    budget: MCTS episodes and wall seconds (`Budget`).
    memory_limit: bytes per device a plan may use; "device" for the
      hardware's memory capacity; None for no limit.
    time_tolerance: among plans within this fraction of the fastest step time
      found, the plan is the one of least peak memory (0: the fastest; the
      time/memory front the search saw is in the plan's stats and explain).
    seed: the search's random seed (same inputs and seed, same plan).
    search: the backend, "mcts" (tree search over layer-group tilings and
      tactics, then refinement) or "ilp" (the exact per-op integer program).
    policy: MCTS's priors: "learned" (default: the shipped filter scores
      every decision once per search, and each node's prior is a lookup of
      those scores), "uniform", "lookahead" (each action's change in the
      priced step time and memory excess, at the root and its children), or
      the path of a weights file (stored as an absolute path).
    constraints: what to do with the program's own layout constraints
      (`with_sharding_constraint`, flax logical constraints): "keep" them as
      decisions the plan must respect, as `jax.jit` compiles them (default);
      "hints": search without them, then also refine the program's own layout
      and keep the better plan, so they may be undone; "ignore": plan and
      compile the program as if it had none.
    start: "search" (default), or "your layout": also refine the layout the
      program and its arguments state (`layout=`, flax metadata, arrays'
      shardings) and keep the better plan, never worse than that layout.
    verify: "none" (default), or "compile": compile the chosen plan for the
      concrete mesh (a TPU slice from `automap.tpu_mesh` compiles with
      XLA:TPU on any machine) and, where the compiler's allocation is over
      the memory limit the prediction met (or it refuses the program for
      memory), compile the next best plan the search saw, up to
      `verify_plans` plans; the plan's `stats["compiled"]` records what the
      compiler said. Each compile costs what `jax.jit(...).compile()` of the
      step does (seconds for a small step; a minute for an 8B model on 256
      chips). Needs a concrete mesh.
    verify_plans: the most plans "compile" compiles (a positive int).
  """

  hints: Hints | None = None
  budget: Budget | None = None
  memory_limit: float | str | None = "device"
  seed: int = 0
  search: str = "mcts"
  policy: str | os.PathLike = "learned"
  constraints: str = constraints_lib.KEEP
  start: str = "search"
  time_tolerance: float = 0.01
  verify: str = "none"
  verify_plans: int = 3

  def __post_init__(self):
    hints = self.hints if self.hints is not None else Hints()
    if not isinstance(hints, Hints):
      raise TypeError(f"hints must be an automap.Hints, got {hints!r}.")
    budget = self.budget if self.budget is not None else Budget()
    if not isinstance(budget, Budget):
      raise TypeError(f"budget must be an automap.Budget, got {budget!r}.")
    constraints_lib.check_mode(self.constraints, "SearchOptions")
    if self.search not in SEARCHES:
      raise ValueError(
          f"search must be one of {SEARCHES}, got {self.search!r}: 'mcts' (tree "
          "search over layer-group tilings and tactics) or 'ilp' (Alpa's "
          "per-op integer program, solved by CP-SAT within the budget's seconds).")
    if self.start not in STARTS:
      raise ValueError(
          f"start must be one of {STARTS}, got {self.start!r}: 'search' (search "
          "alone) or 'your layout' (also refine the layout the arguments and "
          "program state, keeping the better plan).")
    seed = self.seed
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
      raise TypeError(f"seed must be a non-negative integer, got {seed!r}.")
    limit = self.memory_limit
    if limit is not None and limit != DEVICE and (
        not isinstance(limit, (int, float, np.integer, np.floating)) or isinstance(limit, bool)):
      raise TypeError(
          f"memory_limit must be a number of bytes per device, 'device' (the "
          f"hardware's capacity) or None for no limit, got {limit!r}.")
    tol = self.time_tolerance
    if (not isinstance(tol, (int, float, np.integer, np.floating)) or isinstance(tol, bool)
        or not 0 <= tol < 1):
      raise ValueError(
          f"time_tolerance must be a fraction in [0, 1) of the best step time within "
          f"which the plan of least peak memory is chosen (0: the fastest), got {tol!r}.")
    if self.verify not in VERIFY:
      raise ValueError(
          f"verify must be one of {VERIFY}, got {self.verify!r}: 'none', or 'compile' "
          "(compile the plan for the mesh and fall back to the next best where the "
          "compiler's allocation is over the memory limit).")
    plans = self.verify_plans
    if not isinstance(plans, (int, np.integer)) or isinstance(plans, bool) or plans < 1:
      raise ValueError(f"verify_plans must be a positive int (the most plans compiled), "
                       f"got {plans!r}.")
    policy = os.fspath(self.policy) if isinstance(self.policy, os.PathLike) else self.policy
    if not isinstance(policy, str) or not policy:
      raise TypeError(
          f"policy must be 'uniform' (no learned priors), 'lookahead' (the cost "
          f"model's one step ahead), 'learned' (the shipped weights) or the path of a "
          f"weights file, got {policy!r}.")
    if policy not in ("learned", "uniform", "lookahead"):
      policy = os.path.abspath(policy)
    for name, value in (("hints", hints), ("budget", budget), ("seed", int(seed)),
                        ("policy", policy)):
      object.__setattr__(self, name, value)

  def resolved(self, hardware) -> SearchOptions:
    """These options with memory_limit="device" as `hardware`'s capacity."""
    if self.memory_limit != DEVICE:
      return self
    return dataclasses.replace(self, memory_limit=bytes_per_device(self.memory_limit, hardware))

  def policy_id(self) -> str:
    """What the policy's priors depend on: none, or its weights' digest."""
    if self.policy in ("uniform", "lookahead"):
      return self.policy
    from automap._src.search.policy import learned

    return learned.digest(None if self.policy == "learned" else self.policy)


def public_name(cls: type) -> str:
  """Where users reach an options class: `automap.cluster.X` for cluster
  planning's, `automap.X` for the rest."""
  home = "automap.cluster" if cls.__module__.startswith("automap._src.cluster") else "automap"
  return f"{home}.{cls.__name__}"


def with_keywords(cls: type, options, keywords: dict, function: str):
  """`options` (a `cls`, or None for its defaults) with a planner's keyword
  arguments folded in, each naming a field of `cls`. With options= given,
  any such keyword is an error: the field would be given twice."""
  fields = [f.name for f in dataclasses.fields(cls)]
  unknown = [k for k in keywords if k not in fields]
  if unknown:
    raise TypeError(
        f"{function}() got an unexpected keyword argument {unknown[0]!r}; its options "
        f"(keywords, or fields of {public_name(cls)}) are {', '.join(fields)}.")
  if options is None:
    return cls(**keywords)
  if not isinstance(options, cls):
    raise TypeError(
        f"{function}(): options must be an {public_name(cls)}, got "
        f"{type(options).__name__}; build one with {public_name(cls)}(...).")
  if keywords:
    names = ", ".join(f"{k}=" for k in keywords)
    raise TypeError(
        f"{function}() got {names} as keyword(s) and options= too; give each option one way: "
        f"options=dataclasses.replace(options, {next(iter(keywords))}=...), or no options=.")
  return options


__all__ = ["DEVICE", "SEARCHES", "Budget", "Hints", "MemoryLimitError", "SearchOptions",
           "SearchWarning", "bytes_per_device", "with_keywords"]
