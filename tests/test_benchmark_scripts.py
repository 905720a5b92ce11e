"""Every benchmark script imports: a renamed or removed name in a module the
scripts share breaks them long before anyone reruns the suite."""

import importlib
import pathlib
import sys

import pytest

BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"
OPTIONAL = {"equinox", "haiku", "keras", "transformers", "matplotlib"}


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_benchmark_script_imports(script, monkeypatch):
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  try:
    importlib.import_module(script)
  except ModuleNotFoundError as e:
    if e.name not in OPTIONAL:
      raise
    pytest.skip(f"needs the optional {e.name}")
  finally:
    for name in [n for n, m in sys.modules.items()
                 if getattr(m, "__file__", None) and str(BENCHMARKS) in str(m.__file__)]:
      del sys.modules[name]
