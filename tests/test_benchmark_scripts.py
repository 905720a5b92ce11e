"""Every benchmark script imports: a renamed or removed name in a module the
scripts share breaks them long before anyone reruns the suite."""

import importlib
import pathlib
import sys
import types
import warnings

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



@pytest.mark.tpu
@pytest.mark.slow
def test_the_tpu_table_keeps_each_row_once_and_renders_it(tmp_path, monkeypatch):
  pytest.importorskip("libtpu", reason="XLA:TPU's compiler (libtpu) is not installed")
  monkeypatch.syspath_prepend(str(BENCHMARKS))
  import tpu

  fn, args = tpu.zoo.mlp(width=256, hidden=512, batch=16)
  step = types.SimpleNamespace(fn=fn, args=args, names=None)
  mesh = tpu.automap.tpu_mesh("v5p-16", (8,), ("data",))
  base = dict(part="small", program="mlp", topology="v5p-16", mesh=[8], axes=["data"])
  out = tmp_path / "rows.jsonl"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", tpu.automap.SearchWarning)
    tpu.measure_layouts(tpu.Rows(str(out)), base, step, mesh, "tpu-v5p", seconds=1)
    written = tpu.read_rows([out])
    # A rerun measures nothing twice: an interrupted run keeps its rows.
    tpu.measure_layouts(tpu.Rows(str(out)), base, step, mesh, "tpu-v5p", seconds=1)
  assert len(tpu.read_rows([out])) == len(written)
  assert {"automap", "data parallel", "FSDP"} <= {r["layout"] for r in written}
  assert all(r["compiled_memory"] > 0 and r["optimal_seconds"] > 0 for r in written)
  lines = tpu.table(written) + tpu.summary(written)
  assert len(lines) == 2 + len(written) + 2
  assert lines[-1].startswith(f"- small, v5p-16, hand-written ({len(written) - 1} rows)")
