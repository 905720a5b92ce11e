"""Build hooks of the documentation site (mkdocs.yml names this file).

The notebooks of `examples/` become pages under `examples/`. mkdocs reads
pages from `docs/` only, and the notebooks live in `examples/`, where the
tests run them: each is handed to mkdocs where it lies (no copy, no link in
the tree), before mkdocs-jupyter renders it without running it.
"""

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).resolve().parent.parent


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the notebooks
def on_files(files, config):
  for notebook in sorted((ROOT / "examples").glob("*.ipynb")):
    files.append(File(f"examples/{notebook.name}", src_dir=str(ROOT),
                      dest_dir=config.site_dir, use_directory_urls=config.use_directory_urls))
  return files
