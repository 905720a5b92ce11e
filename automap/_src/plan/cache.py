"""The plan cache: searched plans on disk, keyed by everything they depend on.

A key digests the program (its fingerprint: equations, shapes, dtypes,
argument structure), the mesh (axis names and sizes), the hardware spec, the
hints, the search budget, memory limit and seed, and the versions of the plan
schema, automap (and a digest of its source) and JAX. Entries are JSON files written atomically, so
concurrent writers never leave a half-written one; an entry that does not
load or does not fit the program is reported once and searched afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import warnings
from importlib import metadata

import jax

from automap._src.cost.hardware import Hardware
from automap._src.plan.plan import SCHEMA, Plan, PlanError
from automap._src.sharding.mesh import MeshSpec


def _code_digest() -> str:
  """Digest of automap's own source: a plan searched by other code (an
  upgrade, a local edit) is another plan."""
  h = hashlib.sha256()
  root = pathlib.Path(__file__).resolve().parents[1]  # automap/_src
  for path in sorted(root.rglob("*.py")):
    h.update(path.relative_to(root).as_posix().encode())
    h.update(path.read_bytes())
  return h.hexdigest()[:12]


try:
  VERSION = f"{metadata.version('automap')}+{_code_digest()}"
except metadata.PackageNotFoundError:  # Run from a source tree.
  VERSION = f"source+{_code_digest()}"


class PlanCacheWarning(UserWarning):
  """A cached plan could not be used; it is replaced by a fresh search."""


def default_dir() -> pathlib.Path:
  """$AUTOMAP_CACHE_DIR, else $XDG_CACHE_HOME/automap, else ~/.cache/automap."""
  if os.environ.get("AUTOMAP_CACHE_DIR"):
    return pathlib.Path(os.environ["AUTOMAP_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return pathlib.Path(base) / "automap"


def resolve(cache) -> pathlib.Path | None:
  """The folder a `cache=` argument names: True (the default folder), a
  path, or False / None (no cache)."""
  if cache is True:
    return default_dir()
  if cache is False or cache is None:
    return None
  if isinstance(cache, (str, os.PathLike)):
    return pathlib.Path(cache)
  raise TypeError(f"cache must be True, False or a folder path, got {cache!r}.")


def key(fingerprint: str, mesh: MeshSpec, hardware: Hardware, request,
        paths: tuple[str, ...] = (), layout: str = "") -> str:
  """Digest of everything a searched plan depends on (`request`: the
  search's hints, budget, memory limit, seed, backend, policy and what it
  does with the program's constraints; `paths`: the names its arguments and
  results go by, which `names=` may change; `layout`: the digest of the
  layout the arguments state, the "your layout" yardstick's)."""
  hints, budget = request.hints, request.budget
  parts = {
      "schema": SCHEMA, "automap": VERSION, "jax": jax.__version__,
      "program": fingerprint,
      "mesh": [list(mesh.axis_names), list(mesh.axis_sizes)],
      "hardware": dataclasses.asdict(hardware),
      "groups": list(hints.groups),
      "fixed": sorted([k, str(v)] for k, v in hints.fixed.items()),
      "budget": [budget.episodes, budget.seconds, budget.patience],
      "memory_limit": request.memory_limit, "seed": request.seed,
      "search": request.search, "policy": request.policy_id(),
      "constraints": request.constraints, "start": request.start,
      "time_tolerance": request.time_tolerance,
  }
  if request.verify != "none":  # Keys of searches that compile nothing stay as they were.
    parts["verify"] = [request.verify, request.verify_plans]
  if paths:
    parts["paths"] = hashlib.sha256("\0".join(paths).encode()).hexdigest()
  if layout:
    parts["layout"] = layout
  return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


class PlanCache:
  """Plans stored under one folder, one JSON file per key."""

  def __init__(self, folder: pathlib.Path):
    self.folder = folder
    self._reported: set[str] = set()

  def path(self, k: str) -> pathlib.Path:
    return self.folder / f"{k}.json"

  def load(self, k: str, fingerprint: str, mesh: MeshSpec) -> Plan | None:
    """The plan stored under key `k`, if there is a sound one for this
    program and mesh."""
    path = self.path(k)
    if not path.exists():
      return None
    try:
      plan = Plan.load(path)
      if plan.fingerprint != fingerprint or plan.mesh != mesh:
        raise PlanError("it was made for another program or mesh")
    except (PlanError, OSError, UnicodeDecodeError) as e:
      if k not in self._reported:
        self._reported.add(k)
        warnings.warn(f"ignoring cached plan {str(path)!r} ({e}); searching "
                      "again and replacing it.", PlanCacheWarning, stacklevel=4)
      return None
    return plan

  def store(self, k: str, plan: Plan) -> None:
    """Saves `plan` under key `k`; a cache that cannot be written is
    reported once and otherwise ignored (the plan is still used)."""
    try:
      self.folder.mkdir(parents=True, exist_ok=True)
      plan.save(self.path(k))
    except OSError as e:
      if "store" not in self._reported:
        self._reported.add("store")
        warnings.warn(f"cannot write the plan cache in {str(self.folder)!r}: {e}",
                      PlanCacheWarning, stacklevel=4)
