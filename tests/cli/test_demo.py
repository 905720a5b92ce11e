"""The demo and the command line stay runnable."""

import io

import pytest
from rich.console import Console

import automap
from automap._src.cli import demo
from automap._src.cli import main as cli
from automap._src.models.gpt import GPTConfig


@pytest.mark.heavy
def test_demo_runs_and_checks_itself():
  out = io.StringIO()
  small = demo.DemoConfig(model=GPTConfig(vocab=128, seq=16, hidden=128, heads=4, layers=2),
                          batch=8, hardware="cpu", seconds=6)
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


MODEL = '''
import jax
import jax.numpy as jnp


def make_step():
  """A two-layer MLP's SGD step, planned from shapes alone."""
  def step(params, x, y):
    def loss(p):
      return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  s = jax.ShapeDtypeStruct
  params = {"w1": s((256, 2048), jnp.float32), "w2": s((2048, 256), jnp.float32)}
  return step, (params, s((64, 256), jnp.float32), s((64, 256), jnp.float32))


def not_a_step():
  return 3
'''


@pytest.fixture
def model_file(tmp_path, monkeypatch):
  (tmp_path / "mymodel.py").write_text(MODEL)
  monkeypatch.chdir(tmp_path)
  monkeypatch.syspath_prepend(str(tmp_path))
  return tmp_path / "mymodel.py"


def test_cli_search_plans_a_users_function_and_saves_it(model_file, tmp_path, capsys):
  assert cli.main(["search", "mymodel:make_step", "--mesh", "4,2", "--seconds", "5",
                   "--out", "plan.json", "--plot", "plan.png"]) == 0
  out = capsys.readouterr().out
  assert "automap plan for mesh (data=4, model=2)" in out
  assert "data parallel" in out  # a training step: the yardsticks are shown
  plan = automap.Plan.load(tmp_path / "plan.json")
  assert plan.mesh.axis_sizes == (4, 2) and "0/w1" in plan.in_paths
  assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"
  # A file path works as well as a module name; --devices picks the mesh.
  assert cli.main(["search", f"{model_file}:make_step", "--devices", "8", "--quiet",
                   "--seconds", "5", "--out", "best.json"]) == 0
  assert automap.Plan.load(tmp_path / "best.json").mesh.num_devices == 8
  assert cli.main(["explain", "plan.json", "--plot", "again.png"]) == 0
  assert "per layer" in capsys.readouterr().out
  assert (tmp_path / "again.png").exists()


@pytest.mark.parametrize("argv, code, message", [
    (["search", "mymodel:not_a_step"], 2, "must return (fn, args)"),
    (["search", "mymodel:missing"], 2, "no callable 'missing'"),
    (["search", "nosuchmodule:make_step"], 2, "cannot import 'nosuchmodule'"),
    (["search", "make_step"], 2, "expected MODULE:FN"),
    (["search", "mymodel:make_step", "--mesh", "4,2", "--axes", "data"], 2, "--axes"),
    (["search", "mymodel:make_step", "--memory-limit", "1KiB"], 1, "lower bound"),
    (["explain", "plan.json", "--plot", "x.png"], 2, "No such file"),
])
def test_cli_reports_bad_arguments_with_exit_codes(model_file, capsys, argv, code, message):
  assert cli.main(argv) == code
  err = capsys.readouterr().err
  assert err.startswith(f"automap {argv[0]}:") and message in err


@pytest.mark.parametrize("argv, message", [
    (["search", "m:f", "--mesh", "4,2,2,2"], "--mesh takes 1 positive sizes"),
    (["search", "m:f", "--memory-limit", "lots"], "--memory-limit takes a positive size"),
    (["search", "m:f", "--mesh", "4,2", "--devices", "8"], "not allowed with"),
    (["bench", "--seconds", "0"], "expected a positive number"),
])
def test_cli_rejects_malformed_options(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_cli_help_lists_every_command(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert all(c in out for c in ("demo", "search", "explain", "bench"))


@pytest.mark.heavy
def test_cli_bench_compares_plans_with_the_experts(capsys):
  assert cli.main(["bench", "--layers", "2", "--hidden", "128", "--heads", "4",
                   "--seq", "16", "--batch", "8", "--meshes", "4,2", "--seconds", "3"]) == 0
  out = capsys.readouterr().out
  assert "vs best expert" in out and "4x2" in out
