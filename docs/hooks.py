"""Build hooks of the documentation site (mkdocs.yml names this file).

- The notebooks of `examples/` become pages under `examples/`. mkdocs reads
  pages from `docs/` only, and the notebooks live in `examples/`, where the
  tests run them: each is handed to mkdocs where it lies (no copy, no link
  in the tree), before mkdocs-jupyter renders it without running it.
- Known docstring problems in the library, listed below, are shown but do
  not fail `mkdocs build --strict`, until their docstrings are fixed. Any
  other warning still fails it, and so does an entry no docstring raises
  any more: delete entries as their docstrings are fixed.
"""

import logging
import pathlib
import re

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent

# griffe's messages on the public API's docstrings, without their file and
# line (modules move): none at present.
KNOWN_DOCSTRING_WARNINGS: frozenset[str] = frozenset()

_GRIFFE = re.compile(r"griffe: (?P<where>\S+:\d+): (?P<message>.*)", re.S)
_log = logging.getLogger("mkdocs.hooks")


class _KnownDocstringWarnings(logging.Filter):
  """Turns the known griffe warnings into notes, and records which it saw."""

  def __init__(self):
    super().__init__()
    self.seen = set()

  def filter(self, record):
    found = _GRIFFE.fullmatch(record.getMessage())
    if record.levelno == logging.WARNING and found:
      message = found["message"]
      if message in KNOWN_DOCSTRING_WARNINGS:
        self.seen.add(message)
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = f"known docstring problem, to fix: {record.getMessage()}", ()
    return True


_KNOWN = _KnownDocstringWarnings()


def on_config(config):
  logging.getLogger("mkdocs.plugins.griffe").addFilter(_KNOWN)  # Once: same object.
  return config


def on_pre_build(config):
  _KNOWN.seen.clear()


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the notebooks
def on_files(files, config):
  for notebook in sorted((ROOT / "examples").glob("*.ipynb")):
    files.append(File(f"examples/{notebook.name}", src_dir=str(ROOT),
                      dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls))
  return files


def on_post_build(config):
  for message in sorted(KNOWN_DOCSTRING_WARNINGS - _KNOWN.seen):
    _log.warning("docs/hooks.py: no docstring raises %r any more; delete it from "
                 "KNOWN_DOCSTRING_WARNINGS.", message)
