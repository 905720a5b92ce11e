"""Plans as data: JSON round trip, explain, fingerprints."""

import json

import jax.numpy as jnp
import pytest
from helpers import gpt_step, mesh, mlp

import automap


def test_plan_round_trips_through_json(tmp_path):
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu")
  path = tmp_path / "plan.json"
  plan.save(path)
  loaded = automap.Plan.load(path)
  assert loaded == plan
  assert loaded.to_json() == json.loads(path.read_text())
  # A loaded plan carries no pytree structure: its specs come keyed by path.
  assert loaded.in_shardings["0/block_0/mlp/wi/kernel"] == plan.in_specs[
      plan.in_paths.index("0/block_0/mlp/wi/kernel")]
  # And it verifies against the program it was made for.
  report = automap.verify(loaded, step, *args, mesh=mesh((4, 2)))
  assert report.comm_error < 0.05


def test_plan_for_another_program_is_refused(tmp_path):
  x = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))
  plan = automap.search(mlp, *x, mesh=mesh((4, 2)))
  with pytest.raises(automap.PlanError, match="different program"):
    automap.verify(plan, lambda a, b, c: mlp(a, b, c) * 2, *x, mesh=mesh((4, 2)))


def test_corrupt_plan_files_are_reported(tmp_path):
  bad = tmp_path / "bad.json"
  bad.write_text("{not json")
  with pytest.raises(automap.PlanError, match="not valid JSON"):
    automap.Plan.load(bad)
  bad.write_text('{"schema": "something-else"}')
  with pytest.raises(automap.PlanError, match="schema"):
    automap.Plan.load(bad)


def test_explain_lists_layouts_collectives_and_cost():
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu")
  text = plan.explain()
  assert "step time" in text and "peak memory" in text
  assert "0/block_0/mlp/wi/kernel" in text
  assert "block_0" in text and "all-" in text


def test_per_layer_collectives_add_up_to_the_cost():
  step, args = gpt_step()
  plan = automap.search(step, *args, mesh=mesh((4, 2)), hardware="cpu")
  totals: dict = {}
  for _, kind, axes, nbytes, _ in plan.collectives:
    totals[(kind, axes)] = totals.get((kind, axes), 0.0) + nbytes
  assert totals.keys() == plan.cost.comm_bytes.keys()
  for key, nbytes in plan.cost.comm_bytes.items():
    assert totals[key] == pytest.approx(nbytes)
