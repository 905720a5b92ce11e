"""Saving a plan to a JSON file and loading it back."""

from __future__ import annotations

import json
import os


class JsonFile:
  """`save(path)` / `load(path)` for a type with `to_json` / `from_json`."""

  def save(self, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
      json.dump(self.to_json(), f, indent=1, sort_keys=True)

  @classmethod
  def load(cls, path: str | os.PathLike):
    with open(path) as f:
      return cls.from_json(json.load(f))


__all__ = ["JsonFile"]
