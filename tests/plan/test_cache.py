"""The plan cache: hits, misses, corruption, concurrency, opting out."""

import json
import logging
import os
import threading

import jax
import numpy as np
import pytest
from helpers import mesh, mlp

import automap
from automap._src.plan import cache as cache_lib


def _program():
  args = (jax.random.normal(jax.random.key(0), (32, 64)),
          jax.random.normal(jax.random.key(1), (64, 128)) / 8,
          jax.random.normal(jax.random.key(2), (128, 64)) / 8)
  return mlp, args


def _partition(folder, **kw):
  return automap.partition(mlp, mesh=mesh((4, 2)), hardware="cpu", cache=folder,
                           budget=automap.Budget(episodes=30), **kw)


def test_each_first_call_logs_where_its_seconds_went(tmp_path, caplog):
  fn, args = _program()
  caplog.set_level(logging.INFO, logger="automap")
  cold = _partition(tmp_path)
  cold(*args)
  cold(*args)  # a signature's second call logs nothing
  _partition(tmp_path)(*args)  # a plan-cache hit
  cold, hit = [r.getMessage() for r in caplog.records if r.name == "automap"]
  assert cold.startswith("automap: mlp on a 4x2 mesh, first call: trace ")
  assert "search " in cold and "compile and first run " in cold and "cache" not in cold
  assert "plan read from the cache" in hit and "search" not in hit
  caplog.clear()
  caplog.set_level(logging.WARNING, logger="automap")
  _partition(tmp_path)(*args)
  assert not caplog.records  # not asked for: no profile, and no wait for the run


def test_a_second_run_loads_the_plan_instead_of_searching(tmp_path):
  fn, args = _program()
  first = _partition(tmp_path)
  expected = first(*args)
  assert "cached" not in first.plan.stats
  assert len(list(tmp_path.glob("*.json"))) == 1
  second = _partition(tmp_path)  # a new process would start here
  np.testing.assert_allclose(second(*args), expected, rtol=1e-6)
  assert second.plan.stats["cached"] is True
  assert second.plan.in_specs == first.plan.in_specs
  assert second.plan.constraints == first.plan.constraints
  assert jax.tree.structure(second.plan.in_shardings) == jax.tree.structure(args)


def test_the_key_changes_with_what_the_plan_depends_on(tmp_path):
  fn, args = _program()
  _partition(tmp_path)(*args)
  _partition(tmp_path, seed=1)(*args)
  _partition(tmp_path, hints=automap.Hints(fixed={"0": jax.sharding.PartitionSpec("data")}))(
      *args)
  automap.partition(mlp, mesh=mesh((2, 4)), hardware="cpu", cache=tmp_path,
                    budget=automap.Budget(episodes=30))(*args)
  assert len(list(tmp_path.glob("*.json"))) == 4


@pytest.mark.parametrize("damage", ["truncated", "not json", "other program", "other version"])
def test_a_damaged_entry_is_reported_once_and_replaced(tmp_path, damage):
  fn, args = _program()
  _partition(tmp_path)(*args)
  (entry,) = tmp_path.glob("*.json")
  text = entry.read_text()
  if damage == "truncated":
    entry.write_text(text[: len(text) // 2])
  elif damage == "not json":
    entry.write_bytes(b"\xff\xfe garbage")
  elif damage == "other program":
    d = json.loads(text)
    d["fingerprint"] = "0" * 16
    entry.write_text(json.dumps(d))
  else:
    d = json.loads(text)
    d["schema"] = "automap.plan/0"
    entry.write_text(json.dumps(d))
  with pytest.warns(cache_lib.PlanCacheWarning, match="ignoring cached plan"):
    again = _partition(tmp_path)
    again(*args)
  assert "cached" not in again.plan.stats
  assert automap.Plan.load(entry).fingerprint == again.plan.fingerprint  # replaced


def test_concurrent_writers_leave_a_whole_file(tmp_path):
  fn, args = _program()
  plan = automap.search(fn, *args, mesh=mesh((4, 2)), budget=automap.Budget(episodes=10))
  store = cache_lib.PlanCache(tmp_path)
  threads = [threading.Thread(target=lambda: [store.store("k", plan) for _ in range(20)])
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert automap.Plan.load(store.path("k")).in_specs == plan.in_specs
  assert [p.name for p in tmp_path.iterdir()] == ["k.json"]


def test_cache_false_writes_nothing_and_bad_values_are_refused(tmp_path, monkeypatch):
  monkeypatch.setenv("AUTOMAP_CACHE_DIR", str(tmp_path))
  fn, args = _program()
  automap.partition(mlp, mesh=mesh((4, 2)), cache=False,
                    budget=automap.Budget(episodes=10))(*args)
  assert not list(tmp_path.iterdir())
  assert cache_lib.default_dir() == tmp_path
  with pytest.raises(TypeError, match="cache must be True, False or a folder path"):
    automap.partition(mlp, mesh=mesh((4, 2)), cache=3)


def test_an_unwritable_cache_is_reported_and_the_plan_still_used(tmp_path):
  blocker = tmp_path / "file"
  blocker.write_text("")
  fn, args = _program()
  with pytest.warns(cache_lib.PlanCacheWarning, match="cannot write the plan cache"):
    out = _partition(os.path.join(blocker, "cache"))(*args)
  np.testing.assert_allclose(out, mlp(*args), rtol=1e-5, atol=1e-5)


def test_search_caches_only_when_asked(tmp_path, monkeypatch):
  monkeypatch.setenv("AUTOMAP_CACHE_DIR", str(tmp_path / "default"))
  fn, args = _program()
  budget = automap.Budget(episodes=20)
  automap.search(fn, *args, mesh=mesh((4, 2)), budget=budget)
  assert not (tmp_path / "default").exists()
  first = automap.search(fn, *args, mesh=mesh((4, 2)), budget=budget, cache=tmp_path)
  again = automap.search(fn, *args, mesh=mesh((4, 2)), budget=budget, cache=tmp_path)
  assert "cached" not in first.stats and again.stats["cached"] is True
  assert again.in_specs == first.in_specs
