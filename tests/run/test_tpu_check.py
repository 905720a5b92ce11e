"""`automap.check` and `automap check`: does a step fit a TPU slice, by
XLA:TPU's own compile on this machine."""

import textwrap

import jax
import pytest
from jax.sharding import PartitionSpec as P

import automap
from automap import zoo
from automap._src.cli.main import main

pytest.importorskip("libtpu", reason="XLA:TPU's compiler (libtpu) is not installed: "
                    "pip install -e '.[tpu]'")
pytestmark = pytest.mark.tpu
_GiB = 2**30


def _fsdp(args):
  return jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), args)


@pytest.mark.heavy
def test_a_hand_written_layout_fits_and_reads_as_compiled():
  fn, args = zoo.mlp(width=1024, hidden=4096, batch=64)
  mesh = automap.tpu_mesh("v5p-16", (8,), ("data",))
  result = automap.check(fn, *args, mesh=mesh, in_shardings=_fsdp(args))
  assert result.fits and result.refusal is None and result.layout == "your layout"
  assert result.hardware.name == "tpu-v5p"
  assert result.capacity == automap.HARDWARE["tpu-v5p"].hbm_capacity
  report = result.report
  # Every weight is a gathered f32 matrix: XLA:TPU gathers them as bf16.
  gathers = [c for c in report.collectives if c.kind == "all-gather" and c.nbytes >= 2**20]
  assert gathers and all(c.converted_from == "f32" for c in gathers)
  assert report.compiled_memory < 0.01 * result.capacity
  assert report.compiled_seconds > 0
  assert "fits: yes" in result.table() and "8 TPU v5 devices (data=8)" in result.table()


def test_a_step_too_large_is_refused_with_the_compilers_own_figures():
  fn, args = zoo.mlp(width=16384, hidden=65536, batch=64)  # 4 GiB matrices, f32 Adam
  mesh = automap.tpu_mesh("v5e-4", (4,), ("data",))
  result = automap.check(fn, *args, mesh=mesh, in_shardings=_fsdp(args))
  assert not result.fits and result.report is None
  assert "HBM" in result.refusal
  # What XLA:TPU leaves for the program on a 16 GiB v5e, stated in its message.
  assert 15 * _GiB < result.capacity < 16 * _GiB
  assert result.predicted.peak_memory > result.capacity
  assert "fits: NO" in result.table()


@pytest.mark.slow
def test_check_refuses_what_it_cannot_compile():
  fn, args = zoo.mlp(width=256, hidden=512, batch=16)
  with pytest.raises(automap.MeshError, match="concrete"):
    automap.check(fn, *args, mesh=jax.sharding.AbstractMesh((8,), ("data",)))
  mesh = automap.tpu_mesh("v5p-16", (8,), ("data",))
  plan = automap.search(fn, *args, mesh=mesh, hardware="tpu-v5p",
                        budget=automap.Budget(episodes=5, seconds=5))
  with pytest.raises(TypeError, match="not both"):
    automap.check(fn, *args, mesh=mesh, plan=plan, in_shardings=P())
  with pytest.raises(automap.MeshError, match="differs from the plan"):
    automap.check(fn, *args, mesh=automap.tpu_mesh("v5p-16", (4, 2)), plan=plan)


@pytest.fixture
def step_module(tmp_path, monkeypatch):
  (tmp_path / "tpu_step.py").write_text(textwrap.dedent("""\
      import jax
      from jax.sharding import PartitionSpec as P
      from automap import zoo

      def make_step():
        return zoo.mlp(width=1024, hidden=4096, batch=64)

      def fsdp():
        return jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), make_step()[1])

      def huge():
        return zoo.mlp(width=16384, hidden=65536, batch=64)
      """))
  monkeypatch.chdir(tmp_path)
  return tmp_path


@pytest.mark.heavy
def test_the_command_answers_fits_or_not(step_module, capsys):
  assert main(["check", "tpu_step:make_step", "--topology", "v5p-16", "--mesh", "8",
               "--layout", "tpu_step:fsdp"]) == 0
  out = capsys.readouterr().out
  assert "v5p-16: v5p 2x2x2, 8 chips, 8 devices" in out and "fits: yes" in out
  assert "all-gather" in out and "XLA estimate" in out
  assert main(["check", "tpu_step:huge", "--topology", "v5e-4", "--mesh", "4",
               "--layout", "tpu_step:fsdp"]) == 1
  assert "fits: NO" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--topology", "v9-8"], "unknown TPU slice"),
    (["--topology", "h100-8"], "names a GPU"),
    (["--topology", "v5p-16", "--mesh", "3,3", "--layout", "tpu_step:fsdp"], "holds 9"),
    (["--topology", "v5p-16", "--mesh", "4,2", "--axes", "a"], "--axes must give 2"),
])
def test_the_command_names_bad_input(step_module, capsys, argv, message):
  assert main(["check", "tpu_step:make_step", *argv]) == 2
  assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_plans_saves_and_rechecks_a_plan(step_module, capsys):
  assert main(["check", "tpu_step:make_step", "--topology", "v5p-16", "--mesh", "4,2",
               "--seconds", "5", "--out", "plan.json"]) == 0
  first = capsys.readouterr().out
  assert "automap's plan on 8 TPU v5 devices (data=4 x model=2)" in first
  assert main(["check", "tpu_step:make_step", "--topology", "v5p-16",
               "--plan", "plan.json"]) == 0
  assert "fits: yes" in capsys.readouterr().out


def test_python_numbers_among_the_arguments_compile_for_a_slice():
  """A trainer's step counter as a Python int: its dtype is read by
  promotion, never by making an array on the compile-only mesh."""
  mesh = automap.tpu_mesh("v5p-16", (8,), ("data",))

  def step(w, count):
    return w * 0.5, count + 1

  result = automap.check(step, jax.ShapeDtypeStruct((1024, 128), "float32"), 0, mesh=mesh,
                         in_shardings=(P("data"), P()))
  assert result.fits and result.report.compiled_memory >= 2 * 1024 * 128 * 4 // 8
