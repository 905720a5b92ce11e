"""Reading collectives back from compiled HLO text."""

import jax
from helpers import mesh

import automap
from automap._src.run import compiled as hlo
from automap._src.run import verify

M = mesh((4, 2))


def parse(line):
  (c,) = hlo.collectives(line, M)
  return c


def test_explicit_replica_groups():
  c = parse("%ar = f32[2,32,64]{2,1,0} all-reduce(%x), channel_id=1, "
            "replica_groups={{0,1},{2,3},{4,5},{6,7}}, to_apply=%add")
  assert (c.kind, c.nbytes, c.axes) == ("all-reduce", 2 * 32 * 64 * 4, ("model",))


def test_iota_replica_groups():
  c = parse("%ag = bf16[128,64]{1,0} all-gather(%x), replica_groups=[2,4]<=[4,2]T(1,0), "
            "dimensions={0}")
  assert (c.kind, c.nbytes, c.axes) == ("all-gather", 128 * 64 * 2, ("data",))


def test_mesh_form_replica_groups_with_and_without_device_ids():
  c = parse("%ar = f32[8]{0} all-reduce(%x), replica_groups=mesh['axis_0'=4,'axis_1'=2] "
            "{'axis_0'}, to_apply=%add")
  assert c.axes == ("data",)
  c = parse("%ar = f32[8]{0} all-reduce(%x), replica_groups=mesh['axis_0'=1,'axis_1'=1,"
            "'axis_2'=2,'axis_3'=4], device_ids=([4,2]T(1,0)) {'axis_2'}, to_apply=%add")
  assert c.axes == ("model",)


def test_tuple_results_add_up():
  c = parse("%ar = (f32[4,64]{1,0}, f32[64]{0}, /*index=2*/f32[2]{0}) all-reduce(%a, %b, %c), "
            "replica_groups={{0,2,4,6},{1,3,5,7}}, to_apply=%add")
  assert c.nbytes == (4 * 64 + 64 + 2) * 4 and c.axes == ("data",)


def test_compiled_program_round_trip():
  f = jax.jit(lambda x: x.sum(0), in_shardings=jax.sharding.NamedSharding(
      M, jax.sharding.PartitionSpec("data")))
  text = f.lower(jax.numpy.ones((8, 4))).compile().as_text()
  found = hlo.collectives(text, M)
  assert [c.axes for c in found] == [("data",)]


def test_numerics_tolerate_rounding_noise_but_not_small_real_errors():
  import numpy as np

  ones = np.ones((4, 4), np.float32)
  noise = np.full((4,), 3e-11, np.float32)  # a gradient that is zero exactly
  _, rel = verify.compare_numerics({"w": ones, "b": noise}, {"w": ones, "b": -noise})
  assert rel < 1e-5
  small = np.full((4,), 1e-3, np.float32)
  _, rel = verify.compare_numerics({"w": ones, "b": small}, {"w": ones, "b": 2 * small})
  assert rel == 1.0
  _, rel = verify.compare_numerics({"i": np.arange(3)}, {"i": np.arange(3) + 1})
  assert rel == float("inf")


def test_the_report_names_the_leaf_with_the_largest_error():
  import numpy as np

  expected = {"params": {"w": np.ones((4, 4), np.float32), "b": np.full(4, 1e-3, np.float32)}}
  actual = {"params": {"w": np.ones((4, 4), np.float32), "b": np.full(4, 2e-3, np.float32)}}
  errors = {name: rel for name, _, rel in verify.leaf_errors(expected, actual)}
  assert errors == {"['params']['b']": 1.0, "['params']['w']": 0.0}
  double = lambda x: {"y": 2 * x}  # noqa: E731
  x = np.ones((8, 4), np.float32)
  report = automap.verify(automap.search(double, x, mesh=M, hardware="cpu"), double, x, mesh=M)
  assert report.worst_leaf == "['y']" and report.max_rel_error == 0.0


def test_the_report_compares_memory_traffic_with_xlas_bytes_accessed():
  import numpy as np

  scale = lambda x: {"y": jax.numpy.tanh(2 * x) + 1}  # noqa: E731  (one fusion)
  x = np.ones((64, 32), np.float32)
  report = automap.verify(automap.search(scale, x, mesh=M, hardware="cpu"), scale, x, mesh=M)
  # Split over every device, nothing moved: each reads its tile of x and
  # writes its tile of y.
  assert report.predicted.comm_bytes == {}
  assert report.compiled_traffic == report.predicted.memory_traffic == 2 * x.nbytes / 8
  assert report.traffic_error == 0.0
  assert "memory traffic" in report.table()


def test_numerics_catch_nans_and_compare_bfloat16_as_floats():
  import jax.numpy as jnp
  import numpy as np

  x = np.ones(4, np.float32)
  _, rel = verify.compare_numerics(x, np.array([1, 1, np.nan, 1], np.float32))
  assert rel == float("inf")
  _, rel = verify.compare_numerics(np.full(2, np.nan), np.full(2, np.nan))
  assert rel == 0.0
  b = jnp.ones(4, jnp.bfloat16)
  _, rel = verify.compare_numerics(b, b * jnp.bfloat16(1.0078125))  # 1 ulp
  assert 0 < rel < 0.01
