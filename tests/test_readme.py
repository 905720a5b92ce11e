"""The README's quickstart runs as written, the README stays a short front
page, and the documentation site builds with every link checked."""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

TWO_COMMANDS = (
    "```\npip install -e . && automap demo\n```",
    "```\npip install -e '.[test]' && pytest -n 2\n```",
    "`pytest -n 2 -m 'not slow and not heavy'`",
)


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


def test_readme_is_short_and_keeps_the_two_commands():
  text = README.read_text()
  lines = text.count("\n")
  assert lines < 260, f"README.md has {lines} lines; move detail into docs/ and link it."
  section = text[text.index("## Two commands"):text.index("## Quickstart")]
  for command in TWO_COMMANDS:
    assert command in section, f"README's Two commands lost {command!r}"


def test_readme_links_to_files_that_exist():
  targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
  local = [t for t in targets if "://" not in t]
  assert local, "README.md links to no page of docs/"
  missing = [t for t in local if not (ROOT / t).exists()]
  assert not missing, f"README.md links to missing files: {missing}"


# CI builds the site strictly as a step of its own (.ci/run), before the tests.
@pytest.mark.slow
def test_docs_build_strict(tmp_path):
  needed = ("mkdocs", "material", "mkdocstrings", "mkdocs_jupyter")
  absent = [name for name in needed if importlib.util.find_spec(name) is None]
  if absent:
    pytest.skip(f"the docs extra is not installed ({', '.join(absent)} missing): "
                "pip install -e '.[docs]' with jax, flax, optax and numpy held")
  env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
  done = subprocess.run(
      [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-5000:]
  assert (tmp_path / "site" / "examples" / "01_partition_a_training_step" / "index.html").exists()
  assert (tmp_path / "site" / "api" / "automap" / "index.html").exists()
