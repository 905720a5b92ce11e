"""Hardware specs: the figures the cost model turns FLOPs and bytes into time.

Every figure is per jax device (a chip, a GPU, or one TensorCore where a chip
shows jax two, as TPU7x's does) in SI units: FLOP/s, bytes/s, bytes, seconds.
Links: `link_*` is the fast fabric within a node or slice (TPU ICI, NVLink),
`network_*` the slower one across nodes (data-centre network, InfiniBand).
Link bandwidths are one direction of one device's share of a ring over one
mesh axis. What the compiler does on the device is its platform's
`Compiler`'s.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from collections.abc import Iterable, Mapping

import jax

from automap._src.cost.calibration import MATMUL_EFFICIENCY
from automap._src.cost.compiler import PLATFORMS, Compiler, compiler_for


class HardwareError(ValueError):
  """An invalid hardware spec or an unknown hardware name."""


# Compiler behaviours a spec once carried itself; now its platform's.
_BEHAVIOURS = ("reduce_scatter", "reduce_in_f32", "fuses_shared_producers")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """A device and its interconnect.

  Attributes:
    name: catalogue name.
    flops: peak dense matmul FLOP/s for 16-bit inputs.
    fp32_flops: peak dense matmul FLOP/s for float32 inputs (default
      precision).
    hbm_bandwidth: device memory bandwidth, bytes/s.
    hbm_capacity: device memory, bytes.
    link_bandwidth: fast fabric, bytes/s per direction.
    link_latency: fast fabric, seconds per collective step.
    network_bandwidth: across nodes, bytes/s per direction.
    network_latency: across nodes, seconds per collective step.
    devices_per_node: devices that share the fast fabric.
    platform: the jax platform that compiles for the device, "tpu", "gpu" or
      "cpu" (`compiler_for` gives its XLA behaviour); None: "tpu" (TPU and
      GPU compile alike as the cost model sees them).
    reduce_scatter: deprecated override of the platform's `Compiler` field
      of that name (None: the platform's); setting it warns.
    reduce_in_f32: likewise.
    fuses_shared_producers: likewise.
    matmul_efficiency: the share of `flops` large matmuls sustain (0 < x <= 1;
      the catalogue's are calibrated, see `calibration.py`).
    matmul_tile: the matrix unit's tile edge: a matmul's contracting and
      output-minor dims are padded to multiples of it (1: no padding).
    host_bandwidth: the link to host memory, bytes/s per direction, which
      state offloaded there crosses (None: no figure; offload is refused).
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
  platform: str | None = None
  reduce_scatter: bool | None = None
  reduce_in_f32: bool | None = None
  fuses_shared_producers: bool | None = None
  matmul_efficiency: float = 1.0
  matmul_tile: int = 1
  host_bandwidth: float | None = None

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name in ("name", "platform", *_BEHAVIOURS) or (
          field.name == "host_bandwidth" and value is None):
        continue
      # Latencies may be zero (an ideal fabric); nothing else may.
      least_ok = 0.0 if field.name.endswith("latency") else math.ulp(0.0)
      if (not isinstance(value, (int, float)) or isinstance(value, bool)
          or not math.isfinite(value) or value < least_ok):
        raise HardwareError(
            f"Hardware.{field.name} must be a positive finite number, got "
            f"{value!r}. Fix the spec (units: FLOP/s, bytes/s, bytes, s).")
    if self.matmul_efficiency > 1:
      raise HardwareError(
          f"Hardware.matmul_efficiency must be a share of peak in (0, 1], got "
          f"{self.matmul_efficiency!r}.")
    if isinstance(self.matmul_tile, bool) or not isinstance(self.matmul_tile, int):
      raise HardwareError(
          f"Hardware.matmul_tile must be a positive int (elements), got {self.matmul_tile!r}.")
    given = [b for b in _BEHAVIOURS if getattr(self, b) is not None]
    if given:
      warnings.warn(
          f"Hardware({', '.join(f'{b}=...' for b in given)}) is deprecated: name the "
          f"platform instead (platform='tpu', 'gpu' or 'cpu'); its Compiler has these "
          f"behaviours, and CostModel takes another as compiler=.",
          DeprecationWarning, stacklevel=3)
    if self.platform is None:
      object.__setattr__(self, "platform", "tpu")
    if not isinstance(self.platform, str) or self.platform.lower() not in PLATFORMS:
      raise HardwareError(
          f"Hardware.platform must be one of {sorted(PLATFORMS)} (the jax platform "
          f"that compiles for the device), got {self.platform!r}.")

  @property
  def compiler(self) -> Compiler:
    """What XLA does on this device: its platform's, with any override."""
    overrides = {b: getattr(self, b) for b in _BEHAVIOURS if getattr(self, b) is not None}
    platform = compiler_for(self.platform)
    return dataclasses.replace(platform, **overrides) if overrides else platform

  def matmul_flops(self, itemsize: int) -> float:
    """Peak matmul FLOP/s for operands of `itemsize` bytes."""
    return self.fp32_flops if itemsize >= 4 else self.flops

  def matmul_rate(self, itemsize: int, contracted: float, minor: float) -> float:
    """FLOP/s a matmul sustains: the peak for its dtype, times
    `matmul_efficiency`, times the useful share of its tiles when the
    `contracted` and output-`minor` dims (elements per device) are padded
    to `matmul_tile`."""
    rate = self.matmul_flops(itemsize) * self.matmul_efficiency
    tile = self.matmul_tile
    if tile > 1:
      for size in (contracted, minor):
        if size > 0:
          rate *= size / (math.ceil(size / tile - 1e-9) * tile)
    return rate

  @classmethod
  def from_json(cls, d: Mapping) -> Hardware:
    """A spec from `dataclasses.asdict` of one; one stored before specs had
    a platform gets its catalogue entry's, or the one whose compiler its
    behaviours match, keeping those that differ as overrides."""
    d = dict(d)
    if "platform" not in d:
      stored = {b: d.pop(b) for b in _BEHAVIOURS if b in d}
      known = CATALOGUE.get(d.get("name"))
      matches = [p for p in PLATFORMS if all(
          getattr(compiler_for(p), b) == v for b, v in stored.items())]
      d["platform"] = known.platform if known else (matches or ["tpu"])[0]
      compiler = compiler_for(d["platform"])
      d.update({b: v for b, v in stored.items() if getattr(compiler, b) != v})
    with warnings.catch_warnings():  # a stored spec is read as it was written
      warnings.simplefilter("ignore", DeprecationWarning)
      return cls(**d)


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
# What the devices of a family share: their platform, link latencies and,
# for TPUs, the data-centre network across slices; the matrix unit's tile
# (a TPU MXU is 128 x 128, v6e's 256 x 256; NVIDIA's matmul performance guide aligns
# dimensions to 64 elements on A100/H100 tensor cores to avoid tile
# quantisation). Sustained matmul efficiency is calibrated (`calibration`).
_TPU = dict(platform="tpu", link_latency=5e-6, network_bandwidth=12.5 * _G,
            network_latency=1e-5, matmul_tile=128)
_GPU = dict(platform="gpu", link_latency=5e-6, network_latency=1e-5, devices_per_node=8,
            matmul_tile=64)

_SPECS: dict[str, Hardware] = {
    "tpu-v3": Hardware(name="tpu-v3", flops=123 * _T, fp32_flops=123 * _T,
                       hbm_bandwidth=900 * _G, hbm_capacity=32 * _GiB,
                       link_bandwidth=2 * 100 * _G, devices_per_node=1024, **_TPU),
    "tpu-v4": Hardware(name="tpu-v4", flops=275 * _T, fp32_flops=275 * _T,
                       hbm_bandwidth=1200 * _G, hbm_capacity=32 * _GiB,
                       link_bandwidth=2 * 45 * _G, devices_per_node=4096, **_TPU),
    "tpu-v5e": Hardware(name="tpu-v5e", flops=197 * _T, fp32_flops=197 * _T,
                        hbm_bandwidth=819 * _G, hbm_capacity=16 * _GiB,
                        link_bandwidth=2 * 45 * _G, devices_per_node=256, **_TPU),
    # 95 GiB of HBM per chip (Cloud TPU's table, docs.cloud.google.com/tpu/docs/
    # tpu7x, which sets v5p beside v6e and TPU7x); XLA:TPU's compile for v5p
    # leaves a program 95.74 GiB ("exceeds available HBM" when it refuses).
    "tpu-v5p": Hardware(name="tpu-v5p", flops=459 * _T, fp32_flops=459 * _T,
                        hbm_bandwidth=2765 * _G, hbm_capacity=95 * _GiB,
                        link_bandwidth=2 * 90 * _G, devices_per_node=8960, **_TPU),
    # Trillium (docs.cloud.google.com/tpu/docs/v6e): 918 TFLOP/s bf16, 32 GiB
    # of HBM at 1638 GB/s, 256 chips a pod (its largest slice), two 256 x 256
    # MXUs. ICI 90 GB/s one way a link per "How to Scale Your Model" (the
    # docs' 800 GB/s both ways over 4 ports is 100), doubled as above.
    # XLA:TPU's own estimate prices the same peak, bandwidth and (less its
    # reserve) memory: tests/cost/test_tpu_hardware.py.
    "tpu-v6e": Hardware(name="tpu-v6e", flops=918 * _T, fp32_flops=918 * _T,
                        hbm_bandwidth=1638 * _G, hbm_capacity=32 * _GiB,
                        link_bandwidth=2 * 90 * _G, devices_per_node=256,
                        **dict(_TPU, matmul_tile=256)),
    # Ironwood, per jax device: a TPU7x chip is two TensorCores that jax sees
    # as two devices, so each gets half of the chip's figures. Per chip
    # (docs.cloud.google.com/tpu/docs/tpu7x; Google's Ironwood announcement,
    # blog.google, April 2025): 2307 TFLOP/s bf16 dense (the 4614 headline is
    # FP8, twice bf16), 192 GiB of HBM at 7.37 TB/s, ICI 1.2 TB/s both ways
    # on a 3D torus, 9216 chips a pod (the largest slice, 16x24x24 in xpk's
    # table). That ICI is v5p's per-chip 1200 GB/s on the same torus, so v5p's
    # per-link figure (2 x 90 GB/s), halved between the chip's two devices.
    # MXU size is not published: the family's tile. XLA:TPU's own estimate
    # agrees on HBM bandwidth and capacity but prices 996 TFLOP/s a device,
    # 86% of this peak (as it prices v5p at 394 of 459).
    "tpu7x": Hardware(name="tpu7x", flops=2307 / 2 * _T, fp32_flops=2307 / 2 * _T,
                      hbm_bandwidth=7370 / 2 * _G, hbm_capacity=192 // 2 * _GiB,
                      link_bandwidth=2 * 90 / 2 * _G, devices_per_node=2 * 9216, **_TPU),
    # Host links: PCIe Gen4 x16 on A100 (NVIDIA's datasheet: 64 GB/s both
    # ways), Gen5 x16 on H100 and H200 (128 GB/s both ways).
    "a100": Hardware(name="a100", flops=312 * _T, fp32_flops=156 * _T,
                     hbm_bandwidth=2039 * _G, hbm_capacity=80 * _G,
                     link_bandwidth=300 * _G, network_bandwidth=25 * _G,
                     host_bandwidth=32 * _G, **_GPU),
    "h100": Hardware(name="h100", flops=989 * _T, fp32_flops=494 * _T,
                     hbm_bandwidth=3350 * _G, hbm_capacity=80 * _G,
                     link_bandwidth=450 * _G, network_bandwidth=50 * _G,
                     host_bandwidth=64 * _G, **_GPU),
    "h200": Hardware(name="h200", flops=989 * _T, fp32_flops=494 * _T,
                     hbm_bandwidth=4800 * _G, hbm_capacity=141 * _G,
                     link_bandwidth=450 * _G, network_bandwidth=50 * _G,
                     host_bandwidth=64 * _G, **_GPU),
    # Blackwell, from NVIDIA's datasheets only (no compiler here checks them).
    # B200 (HGX / DGX B200, for 8 GPUs: 36 PFLOP/s FP16/BF16 and 18 TF32 with
    # 2:4 sparsity, 1440 GB of HBM3e at 64 TB/s): per GPU dense 2.25 PFLOP/s
    # bf16, 1.125 TF32, 180 GB at 8 TB/s. GB200 NVL72 (for 72 GPUs: 360
    # PFLOP/s FP16/BF16 and 180 TF32 sparse, 13.4 TB at 576 TB/s): per GPU
    # dense 2.5 and 1.25, 186 GB at 8 TB/s, all 72 on one NVLink domain.
    # NVLink 5: 1.8 TB/s both ways a GPU; across nodes one 400 Gb/s
    # ConnectX-7 a GPU in DGX B200 and GB200 NVL72 alike. Host links:
    # B200's PCIe Gen5 x16 (64 GB/s a way; Gen6 hosts would double it); a
    # GB200 superchip's NVLink-C2C, 900 GB/s both ways between one Grace and
    # its two GPUs, so 225 GB/s a way for each.
    "b200": Hardware(name="b200", flops=2250 * _T, fp32_flops=1125 * _T,
                     hbm_bandwidth=8000 * _G, hbm_capacity=180 * _G,
                     link_bandwidth=900 * _G, network_bandwidth=50 * _G,
                     host_bandwidth=64 * _G, **_GPU),
    "gb200": Hardware(name="gb200", flops=2500 * _T, fp32_flops=1250 * _T,
                      hbm_bandwidth=8000 * _G, hbm_capacity=186 * _G,
                      link_bandwidth=900 * _G, network_bandwidth=50 * _G,
                      host_bandwidth=900 / 2 / 2 * _G, **dict(_GPU, devices_per_node=72)),
    # A laptop-class CPU "device" (8 simulated devices share its cores and
    # memory): ~100 GFLOP/s of AVX2 per core pair, ~20 GB/s DRAM, copies
    # between simulated devices at memory speed.
    "cpu": Hardware(name="cpu", platform="cpu", flops=100 * _G, fp32_flops=100 * _G,
                    hbm_bandwidth=20 * _G, hbm_capacity=16 * _GiB, link_bandwidth=10 * _G,
                    link_latency=1e-5, network_bandwidth=10 * _G, network_latency=1e-5,
                    devices_per_node=8),
}
CATALOGUE: Mapping[str, Hardware] = types.MappingProxyType({
    name: dataclasses.replace(spec, matmul_efficiency=MATMUL_EFFICIENCY[name])
    for name, spec in _SPECS.items()})


# What prices a plan where neither the caller nor the mesh's devices say.
DEFAULT_HARDWARE = "tpu-v4"


def get_hardware(hardware: str | Hardware | None, mesh=None) -> Hardware:
  """A catalogue entry by name, or a `Hardware` passed through; None: the
  entry of a concrete mesh's devices (`hardware_for_devices`: a TPU slice
  from `automap.tpu_mesh` prices as its chip), else `DEFAULT_HARDWARE`."""
  if hardware is None:
    found = hardware_for_devices(mesh) if isinstance(mesh, jax.sharding.Mesh) else None
    return found if found is not None else CATALOGUE[DEFAULT_HARDWARE]
  if isinstance(hardware, Hardware):
    return hardware
  if isinstance(hardware, str) and hardware.lower() in CATALOGUE:
    return CATALOGUE[hardware.lower()]
  raise HardwareError(
      f"hardware must be a automap.Hardware or one of {sorted(CATALOGUE)}, "
      f"got {hardware!r}.")


# jax's `device_kind` of each catalogue TPU (exact: "TPU v5" is v5p, "TPU v5
# lite" v5e), and the NVIDIA product names a GPU's kind contains, the longer
# first ("GB200" contains "B200").
_TPU_KINDS = {
    "TPU v3": "tpu-v3", "TPU v4": "tpu-v4", "TPU v5 lite": "tpu-v5e", "TPU v5e": "tpu-v5e",
    "TPU v5": "tpu-v5p", "TPU v5p": "tpu-v5p", "TPU v6 lite": "tpu-v6e", "TPU v6e": "tpu-v6e",
    "TPU7x": "tpu7x",
}
_GPU_NAMES = (("GB200", "gb200"), ("B200", "b200"), ("H200", "h200"), ("H100", "h100"),
              ("A100", "a100"))


def _catalogue_name(kind: str) -> str | None:
  if kind in _TPU_KINDS:
    return _TPU_KINDS[kind]
  upper = kind.upper()
  if "NVIDIA" not in upper or "GH200" in upper:
    # GH200 pairs an H100-class GPU with Grace: neither h100's host link nor
    # h200's memory, so no entry describes it.
    return None
  return next((name for product, name in _GPU_NAMES if product in upper), None)


def hardware_for_devices(
    devices: jax.Device | Iterable[jax.Device] | jax.sharding.Mesh) -> Hardware | None:
  """The catalogue entry for the devices a program runs on, read from their
  `device_kind`.

  Real and compile-only devices both name their kind ("TPU v6 lite" for a
  v6e, "TPU7x", "NVIDIA H100 80GB HBM3"), so a mesh built from
  `jax.experimental.topologies` finds its entry as a live one does.

  Args:
    devices: a `jax.Device`, an iterable or array of them, or a
      `jax.sharding.Mesh` (its devices).

  Returns:
    The `automap.HARDWARE` entry all the devices are, or None where they are
    of no catalogued kind (CPU devices, other accelerators), of several kinds,
    or none are given; pass `hardware=` yourself then.
  """
  if isinstance(devices, jax.sharding.Mesh):
    devices = devices.devices
  if hasattr(devices, "device_kind"):
    devices = [devices]
  flat = getattr(devices, "flat", devices)
  names = {_catalogue_name(str(getattr(d, "device_kind", ""))) for d in flat}
  if len(names) != 1 or None in names:
    return None
  return CATALOGUE[names.pop()]


# Per platform, the device attribute naming the group of devices on one
# fast fabric: a TPU job's slice (ICI within, data-centre network across),
# a GPU job's host (one process per node: NVLink within, InfiniBand across).
_GROUPED_BY = {"tpu": "slice_index", "gpu": "process_index"}


def on_mesh(hw: Hardware, mesh) -> Hardware:
  """`hw` with `devices_per_node` read from a concrete mesh's devices: a TPU
  job's slices, a GPU job's hosts, where there are several and each is a
  run of consecutive devices in the mesh's row-major order (the axes that
  cross them outermost, as `mesh_utils.create_hybrid_device_mesh` lays
  them out). An abstract mesh, a job on one slice or host, or devices that
  do not say leave `hw` as it is; groups the mesh interleaves are warned
  of and left so (the cost model reads a node as a run of devices)."""
  attr = _GROUPED_BY.get(hw.platform)
  if attr is None or isinstance(mesh, jax.sharding.AbstractMesh):
    return hw
  devices = getattr(mesh, "devices", None)
  if devices is None or not hasattr(devices, "flat"):
    return hw
  groups = [getattr(d, attr, None) for d in devices.flat]
  if None in groups or len(set(groups)) < 2:
    return hw
  size, count = len(groups) // len(set(groups)), len(set(groups))
  runs = [groups[i:i + size] for i in range(0, len(groups), size)]
  if size * count != len(groups) or any(len(set(r)) != 1 for r in runs):
    warnings.warn(
        f"mesh: its devices' {attr} groups ({count} of them) are not runs of consecutive "
        f"devices in the mesh's order, so the cost model prices nodes of "
        f"devices_per_node={hw.devices_per_node}; put the axes that cross them first "
        "(mesh_utils.create_hybrid_device_mesh does).", stacklevel=3)
    return hw
  return dataclasses.replace(hw, devices_per_node=size)
