"""The benchmarks run on the public API.

A benchmark does what a user can do through `automap`, `automap.cluster`,
`automap.policy`, `automap.zoo` and `automap.referee`. Only a benchmark
that measures the library's own parts, which no user calls, imports
`automap._src`; each is named in INTERNALS with the reason. None imports
privately a name the public API exports.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from types import ModuleType

import pytest

BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
PUBLIC = ("automap", "automap.cluster", "automap.policy", "automap.referee", "automap.zoo")
# Internal packages whose public face is a module of PUBLIC.
HOMES = {"automap._src.models": "automap.zoo", "automap._src.run.referee": "automap.referee",
         "automap._src.run.compiled": "automap.referee"}

# benchmark: what it measures that the public API does not reach.
INTERNALS = {
    "cluster": "profiles a block per tensor width and places every microbatch size under one "
               "bound (profile.layers, placement.dp.place_any)",
    "experts": "compiles the search's EP+DP tactic as a plan (tactics.expert_states, plan.build)",
    "fidelity": "compiles the search's expert tactics as plans beside automap's "
                "(tactics.expert_states, plan.build)",
    "measured": "prices published runs in their own layouts on the cost model's programs and "
                "layer profiles (cost.program, profile.layers, profile.context)",
    "pod_scale": "prices the search's FSDP, FSDP+TP and EP+DP tactics, and a layout with XLA's "
                 "combiners off (tactics, cost.model)",
    "policy": "runs MCTS under each prior on one program, and the ILP from its plans "
              "(search.mcts, search.policy, search.ilp)",
    "quality": "runs the search drivers and prices the expert tactics on one program "
               "(search.driver, tactics)",
    "scale": "times each stage apart: trace, graph build, full and incremental pricing "
             "(ir.graph, cost.program, cost.tracker)",
    "search": "follows MCTS episode by episode against the best expert (search.mcts, "
              "cost.tracker)",
}


def _private_imports(script: str) -> list[tuple[str, str]]:
  """(module, name) of each `automap._src` import of a script; name "" for
  `import module`."""
  out = []
  for node in ast.walk(ast.parse((BENCHMARKS / f"{script}.py").read_text())):
    if isinstance(node, ast.ImportFrom) and node.module and (
        node.module + ".").startswith("automap._src."):
      out += [(node.module, alias.name) for alias in node.names]
    elif isinstance(node, ast.Import):
      out += [(alias.name, "") for alias in node.names if alias.name.startswith("automap._src")]
  return out


def _imported(module: str, name: str) -> object:
  """What `from module import name` (or `import module`) binds."""
  if name:
    try:
      return importlib.import_module(f"{module}.{name}")
    except ModuleNotFoundError:
      return getattr(importlib.import_module(module), name)
  return importlib.import_module(module)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_imports_internals_only_where_it_says_why(script):
  found = _private_imports(script)
  if script in INTERNALS:
    assert found, (f"benchmarks/{script}.py imports no automap._src any more: delete it "
                   "from INTERNALS.")
  else:
    assert not found, (
        f"benchmarks/{script}.py imports {found}: use the public API (automap, "
        "automap.cluster, automap.policy, automap.zoo, automap.referee), or name the "
        "script in INTERNALS with what it measures that the public API does not reach.")


def test_the_allowlist_names_benchmarks_that_exist():
  assert set(INTERNALS) <= set(SCRIPTS)


@pytest.mark.parametrize("script", sorted(INTERNALS))
def test_no_benchmark_imports_privately_what_the_public_api_exports(script):
  public = {}
  for home in PUBLIC:
    module = importlib.import_module(home)
    for name in module.__all__:
      value = getattr(module, name)
      if isinstance(value, (type, ModuleType)) or callable(value):
        public[id(value)] = f"{home}.{name}"
  for module, name in _private_imports(script):
    where = f"{module}.{name}" if name else module
    home = next((h for prefix, h in HOMES.items() if (where + ".").startswith(prefix + ".")),
                None)
    assert home is None, f"benchmarks/{script}.py imports {where}: use {home}."
    value = _imported(module, name)
    assert id(value) not in public, (
        f"benchmarks/{script}.py imports {where}: use {public.get(id(value))}.")
