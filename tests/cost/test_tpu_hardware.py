"""The TPU catalogue against XLA:TPU's own estimate: libtpu compiles for
compile-only v6e and TPU7x topologies here, and the peak FLOP/s, HBM
bandwidth and HBM size its cost analysis implies for one device are set
beside each entry's published figures.

What it implies, per jax device (libtpu 0.0.42.1): v6e 918 TFLOP/s, 1638 GB/s,
31.25 GiB usable of 32; TPU7x 996 TFLOP/s, 3686 GB/s, 94.75 GiB usable of 96.
All agree with the catalogue but TPU7x's FLOP/s: XLA:TPU prices 86% of the
published 2307 / 2 TFLOP/s a TensorCore (as it prices v5p at 394 of 459), so
that is not asserted here.
"""

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import automap

_NO_LIBTPU = "XLA:TPU's compiler (libtpu) is not installed: pip install -e '.[tpu]'"
# Published peaks are rounded (1638 GB/s, 7.37 TB/s); XLA:TPU's differ from
# them by under 0.1%.
_RTOL = 0.01


def _devices(topology: str) -> list:
  """Compile-only devices of a TPU topology, e.g. "v6e:2x4"."""
  pytest.importorskip("libtpu", reason=_NO_LIBTPU)
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  return topologies.get_topology_desc(
      platform="tpu", topology_name=topology, chip_config_name="default",
      num_slices=1).devices


def _compile_on(device, fn, *shapes):
  """`fn` compiled for one device, its arguments of `shapes` (shape, dtype)."""
  sharding = NamedSharding(Mesh(np.array([device]), ("x",)), P())
  args = [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in shapes]
  return jax.jit(fn).lower(*args).compile()


def _implied_rate(compiled, measure: str) -> float:
  """`measure` ("flops" or "bytes accessed") over XLA:TPU's own time
  estimate, per second."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost[measure] / cost["optimal_seconds"]


def _peak_flops(device) -> float:
  # Large enough that XLA:TPU prices it at the matrix units' peak, not HBM.
  n = 8192
  compiled = _compile_on(device, lambda a, b: a @ b, ((n, n), jnp.bfloat16),
                         ((n, n), jnp.bfloat16))
  return _implied_rate(compiled, "flops")


def _hbm_bandwidth(device) -> float:
  compiled = _compile_on(device, lambda a: a * 2, ((2**24,), jnp.float32))
  return _implied_rate(compiled, "bytes accessed")


def _usable_hbm(device) -> float:
  """The HBM, bytes, XLA:TPU says a program may use: read off the error of
  one that does not fit."""
  too_big = (2**40 // 4,)  # 1 TiB of float32
  with pytest.raises(jax.errors.JaxRuntimeError, match="available HBM") as error:
    _compile_on(device, lambda a: a * 2, (too_big, jnp.float32))
  found = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(error.value))
  assert found, f"XLA:TPU's out-of-memory message changed: {error.value}"
  return float(found.group(1)) * 2**30


@pytest.mark.tpu
def test_v6e_entry_is_what_xla_tpu_prices():
  device = _devices("v6e:2x4")[0]
  hw = automap.HARDWARE["tpu-v6e"]
  assert _peak_flops(device) == pytest.approx(hw.flops, rel=_RTOL)
  assert _hbm_bandwidth(device) == pytest.approx(hw.hbm_bandwidth, rel=_RTOL)


@pytest.mark.tpu
def test_tpu7x_entry_is_per_tensorcore():
  """Two jax devices a TPU7x chip, and the entry's HBM bandwidth is one
  TensorCore's: half the chip's 7.37 TB/s, as XLA:TPU prices it."""
  devices = _devices("tpu7x:2x2x1")
  assert len(devices) == 2 * 4
  assert _hbm_bandwidth(devices[0]) == pytest.approx(
      automap.HARDWARE["tpu7x"].hbm_bandwidth, rel=_RTOL)


@pytest.mark.tpu
@pytest.mark.parametrize("topology, name", [("v6e:2x4", "tpu-v6e"), ("tpu7x:2x2x1", "tpu7x")])
def test_hbm_capacity_holds_what_xla_tpu_lets_a_program_use(topology, name):
  """The entry is the device's HBM; XLA:TPU lets a program use all of it
  but a runtime reserve of under 3%."""
  usable = _usable_hbm(_devices(topology)[0])
  capacity = automap.HARDWARE[name].hbm_capacity
  assert 0.97 * capacity <= usable <= capacity


@pytest.mark.tpu
@pytest.mark.parametrize("topology, name", [
    ("v4:2x2x1", "tpu-v4"),
    ("v5e:2x2", "tpu-v5e"),
    ("v5p:2x2x1", "tpu-v5p"),
    ("v6e:2x4", "tpu-v6e"),
    ("tpu7x:2x2x1", "tpu7x"),
])
def test_hardware_for_compile_only_tpu_devices(topology, name):
  devices = _devices(topology)
  assert automap.hardware_for_devices(devices) is automap.HARDWARE[name]
  assert automap.hardware_for_devices(devices[0]) is automap.HARDWARE[name]
  mesh = Mesh(np.array(devices).reshape(2, -1), ("data", "model"))
  assert automap.hardware_for_devices(mesh) is automap.HARDWARE[name]


@pytest.mark.parametrize("kind, name", [
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA H200", "h200"),
    ("NVIDIA B200", "b200"),
    ("NVIDIA GB200", "gb200"),
    ("TPU v3", "tpu-v3"),
    ("TPU v5p", "tpu-v5p"),
    ("TPU v6e", "tpu-v6e"),
    ("NVIDIA GH200 480GB", None),
    ("NVIDIA L4", None),
    ("TPU v4 lite", None),
])
def test_hardware_for_device_kinds(kind, name):
  device = types.SimpleNamespace(device_kind=kind)
  assert automap.hardware_for_devices([device]) is (automap.HARDWARE[name] if name else None)


def test_hardware_for_cpu_mixed_or_no_devices_is_none(devices):
  assert automap.hardware_for_devices(devices) is None
  h100, b200 = (types.SimpleNamespace(device_kind=f"NVIDIA {k}") for k in ("H100", "B200"))
  assert automap.hardware_for_devices([h100, b200]) is None
  assert automap.hardware_for_devices([]) is None
