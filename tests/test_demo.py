"""The demo and the command line stay runnable."""

import io

import pytest
from rich.console import Console

from automap._src import cli, demo
from automap._src.models.gpt import GPTConfig


def test_demo_runs_and_checks_itself():
  out = io.StringIO()
  small = demo.DemoConfig(model=GPTConfig(vocab=128, seq=16, hidden=128, heads=4, layers=2),
                          batch=8, hardware="cpu", seconds=20)
  result = demo.run(small, Console(file=out, width=120))
  text = out.getvalue()
  assert result["ok"], text
  assert "Megatron + DP" in text and "data parallel" in text
  assert "numerics and collectives check out" in text


def test_cli_rejects_a_bad_mesh(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["demo", "--mesh", "4x2"])
  assert e.value.code == 2
  assert "--mesh takes two sizes" in capsys.readouterr().err


def test_cli_explain_reports_a_missing_file(tmp_path, capsys):
  assert cli.main(["explain", str(tmp_path / "none.json")]) == 2
  assert "automap explain" in capsys.readouterr().err
