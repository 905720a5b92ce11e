"""The README's quickstart runs as written."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _quickstart() -> str:
  text = README.read_text()
  section = text[text.index("## Quickstart"):]
  return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.heavy
def test_quickstart_runs_and_prints_its_plan(tmp_path):
  script = tmp_path / "quickstart.py"
  script.write_text(_quickstart())
  env = dict(os.environ, AUTOMAP_CACHE_DIR=str(tmp_path / "cache"), XLA_FLAGS="")
  done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "automap plan for mesh (data=4, model=2)" in done.stdout
  assert "Megatron + data parallel" in done.stdout
