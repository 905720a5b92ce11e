"""The layout of the package: data flows down the pipeline, never back."""

from __future__ import annotations

import ast
import pathlib

import automap

ROOT = pathlib.Path(automap.__file__).resolve().parent
# The packages (and the two front-door modules) under automap/_src/, in
# pipeline order: a module imports only from its own package or those before it.
ORDER = ("models", "ir", "sharding", "cost", "search", "plan", "run", "api", "partitioned",
         "cluster", "cli")
# The cluster planner's sub-packages, likewise; the modules at cluster/'s top
# (`cluster_plan`) come after them all, but for the pieces every sub-package
# shares (its error, saving to JSON), which come before them all.
CLUSTER = ("profile", "schedule", "placement", "execute", "accelerator")
CLUSTER_SHARED = ("errors", "json_file")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for path in ROOT.rglob("*.py"):
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def _imports(modules: dict[str, pathlib.Path]) -> dict[str, set[tuple[str, str]]]:
  """module -> {(imported module, imported name)} within automap."""
  out = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("automap"):
        for alias in node.names:
          sub = f"{node.module}.{alias.name}"
          found.add((sub, "") if sub in modules else (node.module, alias.name))
    out[name] = found
  return out


def _package(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if len(parts) > 2 and parts[1] == "_src" and parts[2] in ORDER else None


def test_no_import_runs_back_up_the_pipeline():
  modules = _modules()
  back = [(a, b) for a, found in _imports(modules).items() for b, _ in found
          if _package(a) and _package(b) and ORDER.index(_package(b)) > ORDER.index(_package(a))]
  assert not back


def _cluster_rank(module: str) -> int | None:
  """Where `module` sits in the cluster planner's order: -1 for the shared
  pieces, its sub-package's index, len(CLUSTER) for cluster/'s other top
  modules, None outside cluster/."""
  parts = module.split(".")
  if parts[:3] != ["automap", "_src", "cluster"] or len(parts) < 4:
    return None
  if parts[3] in CLUSTER_SHARED:
    return -1
  return CLUSTER.index(parts[3]) if parts[3] in CLUSTER else len(CLUSTER)


def test_the_cluster_planner_runs_profile_to_accelerator():
  modules = _modules()
  assert {m.split(".")[3] for m in modules if _cluster_rank(m) is not None
          and 0 <= _cluster_rank(m) < len(CLUSTER)} == set(CLUSTER)
  assert {m.split(".")[3] for m in modules if _cluster_rank(m) == -1} == set(CLUSTER_SHARED)
  back = [(a, b) for a, found in _imports(modules).items() for b, _ in found
          if _cluster_rank(a) is not None and _cluster_rank(b) is not None
          and _cluster_rank(b) > _cluster_rank(a)]
  assert not back


def test_the_import_graph_has_no_cycles():
  modules = _modules()
  edges = {a: {b for b, _ in found if b in modules and b != a}
           for a, found in _imports(modules).items()}
  state: dict[str, int] = {}

  def cycle_from(m: str, path: list[str]) -> list[str] | None:
    state[m] = 1
    for n in sorted(edges[m]):
      if state.get(n) == 1:
        return path + [m, n]
      if n not in state and (found := cycle_from(n, path + [m])):
        return found
    state[m] = 2
    return None

  for m in sorted(modules):
    if m not in state:
      assert cycle_from(m, []) is None


def _private(name: str) -> bool:
  return name.startswith("_") and not name.startswith("__")


def test_no_module_reaches_into_another_modules_private_names():
  """Neither `from m import _x` nor `m._x` on a module of automap."""
  modules = _modules()
  reached = [(a, b, n) for a, found in _imports(modules).items() for b, n in found if _private(n)]
  for name, path in modules.items():
    tree = ast.parse(path.read_text())
    aliases = {alias.asname or alias.name for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and node.module and
               node.module.startswith("automap") for alias in node.names
               if f"{node.module}.{alias.name}" in modules}
    reached += [(name, node.value.id, node.attr) for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and _private(node.attr)]
  assert not reached


def test_the_planner_is_the_one_caller_of_the_search_driver():
  """trace -> Program -> search -> Plan has one owner: `plan/planner.py`."""
  callers = set()
  for name, path in _modules().items():
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id == "driver" and node.attr.startswith("run")):
        callers.add(name)
      if (isinstance(node, ast.ImportFrom) and node.module == "automap._src.search.driver"
          and any(alias.name.startswith("run") for alias in node.names)):
        callers.add(name)
  assert callers == {"automap._src.plan.planner"}


def _definitions():
  """(module, qualified name, kind, lines) of every class and function."""
  def visit(module, node, prefix):
    for child in ast.iter_child_nodes(node):
      if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        kind = "class" if isinstance(child, ast.ClassDef) else "function"
        qualified = f"{prefix}{child.name}"
        yield module, qualified, kind, child.end_lineno - child.lineno + 1
        yield from visit(module, child, qualified + ".")

  for name, path in _modules().items():
    yield from visit(name, ast.parse(path.read_text()), "")


def test_classes_and_functions_hold_one_concept():
  """No class over 400 lines, no function over 100 (docstrings included)."""
  limits = {"class": 400, "function": 100}
  long = [(module, name, n) for module, name, kind, n in _definitions() if n > limits[kind]]
  assert not long


def test_modules_stay_short():
  """One concept a module: none over 600 lines."""
  long = {name: n for name, path in _modules().items()
          if (n := len(path.read_text().splitlines())) > 600}
  assert not long
