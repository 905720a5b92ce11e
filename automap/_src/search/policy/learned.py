"""The learned policy: trained weights, their file, and the search's priors.

Weights live in one `.npz`: every parameter under its flattened path, and
`__schema__`, `__width__`, `__rounds__`. The package ships one
(`weights.npz`, loaded by default); a missing, unreadable or mismatched file
falls back to uniform priors with a `PolicyWarning`, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
import weakref
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from automap._src.search.actions import Action, ActionSpace
from automap._src.search.policy import features as features_lib
from automap._src.search.policy.network import Batch, PolicyNet, pad
from automap._src.sharding.state import State

DEFAULT_WEIGHTS = os.path.join(os.path.dirname(__file__), "weights.npz")

# Past this many values a forward pass per expansion costs more than the
# search it saves; the policy steps aside (uniform priors).
MAX_VALUES = 50_000

# Share of the priors kept uniform: every action stays reachable.
_FLOOR = 0.25


class PolicyWarning(UserWarning):
  """The learned policy is unavailable; the search runs with uniform priors."""


def save(path: str, params, width: int, rounds: int) -> None:
  flat = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}
  np.savez_compressed(path, __schema__=np.array(features_lib.SCHEMA),
                      __width__=np.array(width), __rounds__=np.array(rounds), **flat)


def load(path: str | None = None) -> LearnedPolicy | None:
  """The policy in `path` (default: the shipped weights), or None with a
  `PolicyWarning` saying why it cannot be used."""
  path = DEFAULT_WEIGHTS if path is None else os.fspath(path)
  try:
    with np.load(path, allow_pickle=False) as data:
      arrays = {k: data[k] for k in data.files}
  except FileNotFoundError:
    warnings.warn(PolicyWarning(
        f"no policy weights at {path!r}; searching with uniform priors. Train "
        "them with `python -m automap.policy.train`."), stacklevel=2)
    return None
  except Exception as e:  # a corrupt or foreign file: never fatal
    warnings.warn(PolicyWarning(
        f"policy weights {path!r} are unreadable ({type(e).__name__}: {e}); "
        "searching with uniform priors."), stacklevel=2)
    return None
  schema = str(arrays.pop("__schema__", "none"))
  if schema != features_lib.SCHEMA:
    warnings.warn(PolicyWarning(
        f"policy weights {path!r} were trained on features {schema!r}, this "
        f"automap computes {features_lib.SCHEMA!r}; searching with uniform "
        "priors. Retrain with `python -m automap.policy.train`."), stacklevel=2)
    return None
  try:
    width, rounds = int(arrays.pop("__width__")), int(arrays.pop("__rounds__"))
    params = traverse_util.unflatten_dict({tuple(k.split("/")): jnp.asarray(v)
                                           for k, v in arrays.items()})
    policy = LearnedPolicy(params, width, rounds)
    policy.check()
  except Exception as e:
    warnings.warn(PolicyWarning(
        f"policy weights {path!r} do not fit the network ({type(e).__name__}: "
        f"{e}); searching with uniform priors."), stacklevel=2)
    return None
  return policy


def _read(path: str) -> bytes | None:
  try:
    with open(path, "rb") as f:
      return f.read()
  except OSError:
    return None


def digest(path: str | None = None) -> str:
  """The features schema and a digest of the weights file (or "missing"):
  what a plan searched with these weights depends on."""
  data = _read(DEFAULT_WEIGHTS if path is None else path)
  if data is None:
    return "missing"
  return f"{features_lib.SCHEMA}:{hashlib.sha256(data).hexdigest()[:16]}"


@functools.lru_cache(maxsize=8)
def _load_version(path: str, version: str) -> LearnedPolicy | None:
  """`load(path)` for one version of its contents (`digest`), so a
  rewritten file is loaded anew."""
  return load(path)


def cached(path: str | None = None) -> LearnedPolicy | None:
  """`load`, once per weights file contents (path and `digest`)."""
  path = DEFAULT_WEIGHTS if path is None else path
  return _load_version(path, digest(path))


@functools.cache
def network(width: int, rounds: int):
  """The network's jitted apply(params, batch), one per architecture (a
  cache keyed by everything the network depends on)."""
  net = PolicyNet(width, rounds)
  return jax.jit(lambda params, batch: net.apply({"params": params}, batch))


class LearnedPolicy:
  """`mcts.Policy` from trained weights: priors from the network's ranking
  of the actions (interleaved with the space's order, floored by a uniform
  share), states valued by the cost model (exact and cheap; the network's
  value head serves training and diagnostics)."""

  def __init__(self, params, width: int, rounds: int):
    self.params, self.width, self.rounds = params, width, rounds
    # One featurizer per action space (built once per program searched),
    # dropped with the space.
    self._featurizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def check(self) -> None:
    """Raises if the parameters do not fit the network."""
    init = PolicyNet(self.width, self.rounds).init(jax.random.key(0), _example_batch())
    want = jax.tree.map(jnp.shape, init["params"])
    got = jax.tree.map(jnp.shape, self.params)
    if want != got:
      raise ValueError("parameter shapes differ from the network's")

  def forward(self, batch: Batch) -> tuple[np.ndarray, float]:
    logits, value = network(self.width, self.rounds)(self.params, batch)
    return np.asarray(logits), float(value)

  def featurizer(self, space: ActionSpace) -> features_lib.Featurizer:
    featurizer = self._featurizers.get(space)
    if featurizer is None:
      featurizer = self._featurizers[space] = features_lib.Featurizer(space)
    return featurizer

  def priors(self, space: ActionSpace, state: State,
             actions: Sequence[Action]) -> np.ndarray:
    uniform = np.full(len(actions) + 1, 1.0 / (len(actions) + 1))
    if space.program.graph.num_values > MAX_VALUES:
      return uniform
    f = self.featurizer(space)(state, list(actions))
    logits, _ = self.forward(pad(f))
    k = len(actions)
    # The network's ranking interleaved with the space's own (tactics, then
    # the largest groups): widening admits the network's first choice,
    # then the space's, and so on, so no action waits more than twice as
    # long as it would with uniform priors.
    ranked = np.argsort(-logits[:k], kind="stable")
    rank = np.full(k, -1)
    place = 0
    for i in range(k):
      for a in (ranked[i], i):
        if rank[a] < 0:
          rank[a], place = place, place + 1
    p = 1.0 / (1.0 + rank)
    # Stopping gets a uniform share: a search that stops learns nothing,
    # and the best plan seen is kept whatever it explores.
    p = np.append(p / p.sum() * (1 - uniform[-1]), uniform[-1])
    return (1 - _FLOOR) * p + _FLOOR * uniform

  def value(self, space: ActionSpace, state: State) -> None:
    return None


def _example_batch() -> Batch:
  """A one-node graph with one action: the shapes `init` needs."""
  F = features_lib
  f = F.Features(
      nodes=np.zeros((1, F.NODE_FEATURES), np.float32),
      edges=np.zeros((0, F.EDGE_FEATURES), np.float32),
      senders=np.zeros(0, np.int32), receivers=np.zeros(0, np.int32),
      globals=np.zeros(F.GLOBAL_FEATURES, np.float32),
      members=np.zeros((0, 2), np.int32), num_groups=0,
      actions=np.zeros((1, F.ACTION_FEATURES), np.float32),
      action_group=np.full(1, -1, np.int32))
  return pad(f)
