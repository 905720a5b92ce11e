"""Hardware specs: the figures the cost model turns FLOPs and bytes into time.

Every figure is per device (chip or GPU) in SI units: FLOP/s, bytes/s, bytes,
seconds. Links: `link_*` is the fast fabric within a node or slice (TPU ICI,
NVLink), `network_*` the slower one across nodes (data-centre network,
InfiniBand). Link bandwidths are one direction of one device's share of a
ring over one mesh axis.
"""

from __future__ import annotations

import dataclasses
import math


class HardwareError(ValueError):
  """An invalid hardware spec or an unknown hardware name."""


@dataclasses.dataclass(frozen=True)
class Hardware:
  """A device and its interconnect.

  name: catalogue name.
  flops: peak dense matmul FLOP/s for 16-bit inputs.
  fp32_flops: peak dense matmul FLOP/s for float32 inputs (default precision).
  hbm_bandwidth: device memory bandwidth, bytes/s.
  hbm_capacity: device memory, bytes.
  link_bandwidth / link_latency: fast fabric, bytes/s per direction and
    seconds per collective step.
  network_bandwidth / network_latency: across nodes, likewise.
  devices_per_node: devices that share the fast fabric.
  reduce_scatter: whether the compiler turns an all-reduce whose result is
    then tiled into a reduce-scatter (XLA does on TPU and GPU, not on CPU).
  reduce_in_f32: whether the compiler all-reduces 16-bit floats in float32,
    moving twice their bytes (XLA:CPU does).
  fuses_shared_producers: whether a reduction's fusion recomputes a fusible
    producer that other ops read too (XLA on TPU and GPU duplicates it).
    XLA:CPU's library reductions absorb only producers no other op reads, so
    such a producer (a layer norm's broadcast scale, shared by the forward
    and backward passes) gets a buffer of its own.
  """

  name: str
  flops: float
  fp32_flops: float
  hbm_bandwidth: float
  hbm_capacity: float
  link_bandwidth: float
  link_latency: float
  network_bandwidth: float
  network_latency: float
  devices_per_node: int
  reduce_scatter: bool = True
  reduce_in_f32: bool = False
  fuses_shared_producers: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      if field.name == "name" or field.type == "bool":  # flags
        continue
      value = getattr(self, field.name)
      # Latencies may be zero (an ideal fabric); nothing else may.
      least_ok = 0.0 if field.name.endswith("latency") else math.ulp(0.0)
      if (not isinstance(value, (int, float)) or isinstance(value, bool)
          or not math.isfinite(value) or value < least_ok):
        raise HardwareError(
            f"Hardware.{field.name} must be a positive finite number, got "
            f"{value!r}. Fix the spec (units: FLOP/s, bytes/s, bytes, s).")

  def matmul_flops(self, itemsize: int) -> float:
    return self.fp32_flops if itemsize >= 4 else self.flops


_G, _T = 1e9, 1e12
_GiB = 2**30

# Sources: Cloud TPU system architecture pages (docs.cloud.google.com/tpu/docs
# /v3, /v4, /v5e, /v5p) for FLOP/s, HBM size and bandwidth; ICI one-way link
# bandwidth per the TPU table of "How to Scale Your Model" (Austin et al.,
# 2025), doubled for the two directions of a torus ring. NVIDIA A100 / H100 /
# H200 SXM datasheets for FLOP/s (dense), HBM and NVLink (600 / 900 GB/s
# bidirectional, so 300 / 450 GB/s one way); InfiniBand HDR 200 Gb/s and NDR
# 400 Gb/s per GPU across nodes. Latencies are typical measured step costs
# (a few microseconds on NVLink/ICI, ~10 us across nodes), order-of-magnitude.
CATALOGUE: dict[str, Hardware] = {
    "tpu-v3": Hardware("tpu-v3", 123 * _T, 123 * _T, 900 * _G, 32 * _GiB,
                       2 * 100 * _G, 5e-6, 12.5 * _G, 1e-5, 1024),
    "tpu-v4": Hardware("tpu-v4", 275 * _T, 275 * _T, 1200 * _G, 32 * _GiB,
                       2 * 45 * _G, 5e-6, 12.5 * _G, 1e-5, 4096),
    "tpu-v5e": Hardware("tpu-v5e", 197 * _T, 197 * _T, 819 * _G, 16 * _GiB,
                        2 * 45 * _G, 5e-6, 12.5 * _G, 1e-5, 256),
    "tpu-v5p": Hardware("tpu-v5p", 459 * _T, 459 * _T, 2765 * _G, 95 * _G,
                        2 * 90 * _G, 5e-6, 12.5 * _G, 1e-5, 8960),
    "a100": Hardware("a100", 312 * _T, 156 * _T, 2039 * _G, 80 * _G,
                     300 * _G, 5e-6, 25 * _G, 1e-5, 8),
    "h100": Hardware("h100", 989 * _T, 494 * _T, 3350 * _G, 80 * _G,
                     450 * _G, 5e-6, 50 * _G, 1e-5, 8),
    "h200": Hardware("h200", 989 * _T, 494 * _T, 4800 * _G, 141 * _G,
                     450 * _G, 5e-6, 50 * _G, 1e-5, 8),
    # A laptop-class CPU "device" (8 simulated devices share its cores and
    # memory): ~100 GFLOP/s of AVX2 per core pair, ~20 GB/s DRAM, copies
    # between simulated devices at memory speed.
    "cpu": Hardware("cpu", 100 * _G, 100 * _G, 20 * _G, 16 * _GiB,
                    10 * _G, 1e-5, 10 * _G, 1e-5, 8, reduce_scatter=False,
                    reduce_in_f32=True, fuses_shared_producers=False),
}


def get_hardware(hardware: str | Hardware) -> Hardware:
  """A catalogue entry by name, or a `Hardware` passed through."""
  if isinstance(hardware, Hardware):
    return hardware
  if isinstance(hardware, str) and hardware.lower() in CATALOGUE:
    return CATALOGUE[hardware.lower()]
  raise HardwareError(
      f"hardware must be a automap.Hardware or one of {sorted(CATALOGUE)}, "
      f"got {hardware!r}.")
