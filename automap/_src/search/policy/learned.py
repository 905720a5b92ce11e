"""The learned filter: trained weights, their file, and the search's priors.

Weights live in one `.npz`: every parameter under its flattened path, and
`__schema__`, `__width__`, `__rounds__`, `__temperature__`, `__epsilon__`
(the uniform share, calibrated on held-out programs). The package ships one
(`weights.npz`, loaded by default); a missing, unreadable or mismatched file
falls back to uniform priors with a `PolicyWarning`, never an error.
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import warnings
import weakref
import zipfile
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from automap._src.cost.tracker import Tracker
from automap._src.search.actions import Action, ActionSpace
from automap._src.search.policy import decisions as decisions_lib
from automap._src.search.policy import features as features_lib
from automap._src.search.policy.network import Batch, PolicyNet, pad
from automap._src.search.tactics import expert_states
from automap._src.sharding.state import State

DEFAULT_WEIGHTS = os.path.join(os.path.dirname(__file__), "weights.npz")

# Past this many values describing the decisions (one priced step each)
# costs more than the search it saves; the policy steps aside (uniform).
MAX_VALUES = 50_000

# Share of the priors kept uniform where the weights do not say: every
# action stays reachable.
EPSILON = 0.1


class PolicyWarning(UserWarning):
  """The learned policy is unavailable; the search runs with uniform priors."""


def save(path: str, params, width: int, rounds: int, temperature: float = 1.0,
         epsilon: float = EPSILON) -> None:
  """Writes the weights; the same inputs give the same bytes."""
  flat = {"/".join(k): np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()}
  arrays = dict(__schema__=np.array(features_lib.SCHEMA), __width__=np.array(width),
                __rounds__=np.array(rounds), __temperature__=np.array(temperature),
                __epsilon__=np.array(epsilon), **flat)
  # Plain zip entries with fixed timestamps: reproducible byte for byte.
  with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
    for name in sorted(arrays):
      info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
      info.compress_type = zipfile.ZIP_DEFLATED
      buf = io.BytesIO()
      np.lib.format.write_array(buf, np.asarray(arrays[name]), allow_pickle=False)
      z.writestr(info, buf.getvalue())


def load(path: str | os.PathLike | None = None) -> LearnedPolicy | None:
  """The learned filter stored in a weights file.

  Args:
    path: the weights file (default: the shipped weights).

  Returns:
    The `LearnedPolicy`, or None with a `PolicyWarning` saying why the file
    cannot be used (missing, unreadable, or another feature schema): it
    raises nothing, and the search runs with uniform priors.
  """
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
    temperature = float(arrays.pop("__temperature__"))
    epsilon = float(arrays.pop("__epsilon__"))
    params = traverse_util.unflatten_dict({tuple(k.split("/")): jnp.asarray(v)
                                           for k, v in arrays.items()})
    policy = LearnedPolicy(params, width, rounds, temperature, epsilon)
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
  """`mcts.Policy` from trained weights: a learned filter.

  Before a search's first expansion, one forward pass over the program
  scores every decision of its action space (`decisions.describe`); the
  prior at any node is a lookup of those scores over its legal actions:
  softmax(score / T), mixed with `epsilon` uniform, "stop" at its uniform
  share. So no action is ever excluded, progressive widening admits
  actions in score order, and no node runs the network. States are valued
  by the cost model.

  Args:
    params: the network's trained weights (`load` reads them).
    width: the network's hidden width.
    rounds: its message-passing rounds.
    temperature: T of the softmax over scores.
    epsilon: the share of uniform mixed into every prior.
    memory_limit: the search's bytes per device, or None: the decisions are
      described against it (`with_limit`).
  """

  name = "learned"

  def __init__(self, params: Any, width: int, rounds: int, temperature: float = 1.0,
               epsilon: float = EPSILON, memory_limit: float | None = None):
    self.params, self.width, self.rounds = params, width, rounds
    self.temperature, self.epsilon = temperature, epsilon
    self.memory_limit = memory_limit
    self.forwards = 0  # forward passes run: one per program searched
    # Per action space (one per program searched): its decisions, their
    # scores and each action's row, dropped with the space.
    self._spaces: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

  def with_limit(self, memory_limit: float | None) -> LearnedPolicy:
    """The same weights for searches under `memory_limit`."""
    return LearnedPolicy(self.params, self.width, self.rounds, self.temperature,
                         self.epsilon, memory_limit)

  def check(self) -> None:
    """Raises if the parameters do not fit the network."""
    net = PolicyNet(self.width, self.rounds)
    init = jax.eval_shape(net.init, jax.random.key(0), _example_batch())
    want = jax.tree.map(jnp.shape, init["params"])
    got = jax.tree.map(jnp.shape, self.params)
    if want != got:
      raise ValueError("parameter shapes differ from the network's")
    if not self.temperature > 0:
      raise ValueError(f"temperature must be positive, got {self.temperature}")
    if not 0 < self.epsilon <= 1:
      raise ValueError(f"epsilon must be in (0, 1], got {self.epsilon}")

  def forward(self, batch: Batch) -> np.ndarray:
    self.forwards += 1
    return np.asarray(network(self.width, self.rounds)(self.params, batch))

  def _entry(self, space: ActionSpace) -> tuple[decisions_lib.Decisions, np.ndarray, dict]:
    """(decisions, their scores [D], each action's row), computed once."""
    entry = self._spaces.get(space)
    if entry is None:
      dec = decisions_lib.describe(space, self.memory_limit, dp_peak(space))
      logits = distinct(dec, self.forward(batch_of(space, dec))[:len(dec.keys)])
      rows = {a: row for row, acts in enumerate(dec.actions) for a in acts}
      entry = self._spaces[space] = (dec, logits, rows)
    return entry

  def scores(self, space: ActionSpace) -> tuple[decisions_lib.Decisions, np.ndarray]:
    """The program's decisions and their scores [D], computed once."""
    return self._entry(space)[:2]

  def priors(self, space: ActionSpace, state: State,
             actions: Sequence[Action]) -> np.ndarray:
    k = len(actions)
    if k == 0 or not 0 < space.program.graph.num_values <= MAX_VALUES:
      return np.full(k + 1, 1.0 / (k + 1))
    _, logits, rows = self._entry(space)
    z = logits[[rows[a] for a in actions]] / self.temperature
    # "stop" keeps a uniform share: a search that stops learns nothing, and
    # the best plan seen is kept whatever it explores.
    stop = 1.0 / (k + 1)
    p = np.exp(z - z.max())
    p = (1 - stop) * ((1 - self.epsilon) * p / p.sum() + self.epsilon / k)
    return np.append(p, stop)

  def value(self, space: ActionSpace, state: State) -> None:
    return None


def distinct(dec: decisions_lib.Decisions, logits: np.ndarray) -> np.ndarray:
  """[D] the scores with each outcome scored once: of decisions laying out
  the same values the same way from the start, the best scored (the
  space's first among equals) keeps its score and the others drop to the
  least score, so widening admits distinct plans before repeats of one
  (each repeat would cost an episode to find a state already known)."""
  out = np.asarray(logits, np.float64).copy()
  floor = out.min() if len(out) else 0.0
  for o in np.unique(dec.outcome):
    rows = np.flatnonzero(dec.outcome == o)
    if len(rows) > 1:
      keep = rows[np.argmax(out[rows])]
      out[rows[rows != keep]] = floor
  return out


def dp_peak(space: ActionSpace) -> float:
  """Data parallelism's peak bytes per device on `space`'s program."""
  state = expert_states(space.program, space)["data parallel"]
  return float(Tracker(space.program.model, state).peak_memory)


def batch_of(space: ActionSpace, dec: decisions_lib.Decisions) -> Batch:
  """The network's input: the program's classes of values at the start
  state (`features.Featurizer`), with the decisions as its actions."""
  f = features_lib.Featurizer(space)(space.program.initial_state())
  return pad(f._replace(actions=dec.features, action_group=dec.group.astype(np.int32)))


def _example_batch() -> Batch:
  """A one-node graph with one action: the shapes `init` needs."""
  F = features_lib
  f = F.Features(
      nodes=np.zeros((1, F.NODE_FEATURES), np.float32),
      edges=np.zeros((0, F.EDGE_FEATURES), np.float32),
      senders=np.zeros(0, np.int32), receivers=np.zeros(0, np.int32),
      globals=np.zeros(F.GLOBAL_FEATURES, np.float32),
      members=np.zeros((0, 3), np.float32), num_groups=0,
      actions=np.zeros((1, decisions_lib.FEATURES), np.float32),
      action_group=np.full(1, -1, np.int32))
  return pad(f)
