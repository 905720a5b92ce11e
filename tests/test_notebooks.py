"""The example notebooks run top to bottom, so they never rot.

Each notebook runs in a fresh kernel of this interpreter (ipykernel's own
spec, not whatever "python3" kernel the machine has installed), in a
temporary folder, with a plan cache of its own.
"""

import os
import sys
from pathlib import Path

import pytest

nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import AsyncKernelManager  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds


def test_examples_exist():
  assert len(NOTEBOOKS) >= 3, f"no notebooks found in {EXAMPLES}"


def this_interpreters_kernel() -> AsyncKernelManager:
  # No kernel folders: "python3" resolves to the ipykernel installed beside
  # this interpreter, launched with sys.executable.
  specs = KernelSpecManager(kernel_dirs=[])
  km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs)
  assert km.kernel_spec.argv[0] == sys.executable, km.kernel_spec.argv
  return km


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_without_outputs(path):
  nb = nbformat.read(path, as_version=4)
  assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), (
      f"{path.name} is stored with outputs; clear them before committing")


# Each notebook takes a minute or more to run.
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
  nb = nbformat.read(path, as_version=4)
  env = dict(os.environ, AUTOMAP_CACHE_DIR=str(tmp_path / "cache"))
  client = nbclient.NotebookClient(
      nb, km=this_interpreters_kernel(), timeout=CELL_TIMEOUT,
      resources={"metadata": {"path": str(tmp_path)}})
  try:
    # cleanup_kc: shut the kernel down afterwards, though the client does not own it.
    client.execute(env=env, cleanup_kc=True)
  except CellExecutionError as e:
    pytest.fail(f"{path.name} failed:\n{e}", pytrace=False)
