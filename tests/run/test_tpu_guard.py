"""verify="compile": a plan held to XLA:TPU's own allocation, the next best
compiled where the first does not fit."""

import jax
import pytest

import automap
from automap import zoo

pytest.importorskip("libtpu", reason="XLA:TPU's compiler (libtpu) is not installed: "
                    "pip install -e '.[tpu]'")
pytestmark = pytest.mark.tpu
BUDGET = automap.Budget(episodes=30, seconds=600)  # episodes decide: the same plans under load


@pytest.mark.heavy
def test_a_plan_over_the_limit_by_xla_tpu_falls_back_to_one_that_fits():
  fn, args = zoo.mlp()
  mesh = automap.tpu_mesh("v5p-16", (4, 2), ("data", "model"))
  plan = automap.search(fn, *args, mesh=mesh, budget=BUDGET, verify="compile")
  assert plan.hardware.name == "tpu-v5p"  # priced as the slice's chip
  first = plan.stats["compiled"]["plans"][0]
  assert plan.stats["compiled"]["fits"] and len(plan.stats["compiled"]["plans"]) == 1
  compiled = automap.check(fn, *args, mesh=mesh, plan=plan).compiled_memory
  assert first["compiled"] == compiled
  if first["compiled"] <= first["predicted_peak"]:
    pytest.skip("XLA:TPU allocates no more than predicted here: no limit between them")
  # A limit the prediction meets and XLA:TPU's allocation does not.
  limit = (first["predicted_peak"] + first["compiled"]) / 2
  try:
    held = automap.search(fn, *args, mesh=mesh, budget=BUDGET, verify="compile",
                          memory_limit=limit, verify_plans=4)
  except automap.MemoryLimitError as e:
    assert "by the compiler's own allocation" in str(e)
    return
  tried = held.stats["compiled"]["plans"]
  assert tried[0]["compiled"] > limit >= tried[-1]["compiled"]
  assert all(t["predicted_peak"] <= limit for t in tried)
  assert automap.check(fn, *args, mesh=mesh, plan=held).compiled_memory <= limit


def test_compiling_needs_a_concrete_mesh():
  fn, args = zoo.mlp(width=128, hidden=256, batch=16)
  with pytest.raises(automap.MeshError, match="concrete mesh"):
    automap.search(fn, *args, mesh=jax.sharding.AbstractMesh((8,), ("data",)),
                   verify="compile")
  with pytest.raises(ValueError, match="verify must be one of"):
    automap.SearchOptions(verify="xla")
  with pytest.raises(ValueError, match="verify_plans must be a positive int"):
    automap.SearchOptions(verify="compile", verify_plans=0)
