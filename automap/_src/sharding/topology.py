"""Compile-only TPU meshes, by the slice names Cloud TPU uses.

XLA:TPU's compiler (libtpu) compiles ahead of time for a named TPU topology
on a machine with no TPU (`jax.experimental.topologies`): the devices it
gives cannot run a program, but `jax.jit(...).lower(...).compile()` on a
mesh of them returns XLA:TPU's own HLO, buffers and cost estimate.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import types
from collections.abc import Sequence

import jax
import numpy as np

from automap._src.sharding.mesh import MeshError


class TopologyError(MeshError):
  """An unknown TPU slice name, a mesh shape that does not fit the slice, or
  XLA:TPU's compiler (libtpu) missing."""


@dataclasses.dataclass(frozen=True)
class Generation:
  """A TPU generation as Cloud TPU names its slices and libtpu compiles them.

  Attributes:
    name: the prefix of Cloud TPU's accelerator types ("v5p" in "v5p-256").
    counts: what the number in a slice name counts: "cores" (TensorCores:
      v4 and v5p, two per chip) or "chips" (v5e, v6e, TPU7x).
    torus_dims: 3 for a 3-D torus (v4, v5p, TPU7x), 2 for v5e and v6e.
    chip_config: libtpu's chip configuration: "megacore" joins a chip's two
      TensorCores into one jax device; "default" gives each its own.
    devices_per_chip: jax devices per chip under that configuration.
    hardware: the `automap.HARDWARE` entry that prices its devices.
    max_chips: the chips of its largest slice (a pod).
    aliases: other prefixes Cloud TPU uses for it.
  """

  name: str
  counts: str
  torus_dims: int
  chip_config: str
  devices_per_chip: int
  hardware: str
  max_chips: int
  aliases: tuple[str, ...] = ()


GENERATIONS = types.MappingProxyType({g.name: g for g in (
    Generation("v4", "cores", 3, "megacore", 1, "tpu-v4", 4096),
    Generation("v5p", "cores", 3, "megacore", 1, "tpu-v5p", 8960),
    Generation("v5e", "chips", 2, "default", 1, "tpu-v5e", 256, aliases=("v5litepod",)),
    Generation("v6e", "chips", 2, "default", 1, "tpu-v6e", 256),
    Generation("tpu7x", "chips", 3, "default", 2, "tpu7x", 9216),
)})
_BY_PREFIX = types.MappingProxyType(
    {p: g for g in GENERATIONS.values() for p in (g.name, *g.aliases)})
# Slice names as Cloud TPU writes them ("v5p-256"), or libtpu's topology
# form ("v5p:4x4x8"), which names any shape the pod admits.
_NAME = re.compile(r"^(?P<gen>[a-z0-9]+)-(?P<count>[0-9]+)$")
_TOPOLOGY = re.compile(r"^(?P<gen>[a-z0-9]+):(?P<shape>[0-9]+(?:x[0-9]+){1,2})$")
_GPU_WORDS = ("a100", "h100", "h200", "b200", "gb200", "gpu", "cuda", "rocm", "mi300")


@dataclasses.dataclass(frozen=True)
class TpuSlice:
  """One TPU slice (or several alike), resolved from its name.

  Attributes:
    name: the name as given.
    generation: its `Generation`.
    topology: chips along each torus axis, e.g. (4, 4, 8).
    slices: how many such slices, joined over the data-centre network.
  """

  name: str
  generation: Generation
  topology: tuple[int, ...]
  slices: int = 1

  @property
  def chips(self) -> int:
    """Chips in all slices."""
    return math.prod(self.topology) * self.slices

  @property
  def num_devices(self) -> int:
    """jax devices in all slices (TPU7x has two per chip)."""
    return self.chips * self.generation.devices_per_chip

  @property
  def hardware(self) -> str:
    """The `automap.HARDWARE` name of its devices."""
    return self.generation.hardware

  def __str__(self) -> str:
    shape = "x".join(map(str, self.topology))
    many = f" x {self.slices} slices" if self.slices > 1 else ""
    return (f"{self.name}: {self.generation.name} {shape}{many}, {self.chips} chips, "
            f"{self.num_devices} devices")


def _default_topology(chips: int, dims: int) -> tuple[int, ...]:
  """Cloud TPU's default shape of a slice of `chips` (a power of two): from
  one host's 2x2 (x1), the shortest torus axis doubled, the last among
  equals (v5p-8 2x2x1, -16 2x2x2, -32 2x2x4, -64 2x4x4, -128 4x4x4, -256
  4x4x8; v6e-4 2x2, -8 2x4, -16 4x4, -256 16x16); a slice under a host's
  chips lies along the first axes."""
  if chips < 4:
    return tuple([chips] + [1] * (dims - 1)) if dims == 3 else (1, chips)
  shape = [2, 2] + [1] * (dims - 2)
  while math.prod(shape) < chips:
    shortest = min(shape)
    i = max(j for j, s in enumerate(shape) if s == shortest)
    shape[i] *= 2
  return tuple(shape)


def _known_names() -> str:
  return ", ".join(
      f"{g.name}-N (N {g.counts}, up to {g.max_chips * (2 if g.counts == 'cores' else 1)})"
      for g in GENERATIONS.values())


def parse_slice(name: str, slices: int = 1) -> TpuSlice:
  """A TPU slice from its name.

  Args:
    name: Cloud TPU's accelerator type, "<generation>-<N>": v4 and v5p count
      TensorCores (two per chip: "v5p-256" is 128 chips), v5e ("v5e-16" or
      "v5litepod-16"), v6e and TPU7x count chips ("v6e-256" is 256 chips).
      N a power of two takes Cloud TPU's default shape for it; any other
      shape the pod admits is named in libtpu's form, "v5p:4x4x12" or
      "tpu7x:2x2x1".
    slices: how many such slices (multislice), joined over the data-centre
      network.

  Returns:
    The `TpuSlice`.

  Raises:
    automap.MeshError (a `TopologyError`): an unknown or malformed name, a
      GPU's name, or a slice larger than its generation's pod.
  """
  if not isinstance(name, str):
    raise TopologyError(f"topology must be a TPU slice name such as 'v5p-256', "
                        f"got {type(name).__name__}.")
  if isinstance(slices, bool) or not isinstance(slices, (int, np.integer)) or slices < 1:
    raise TopologyError(f"slices must be a positive int, got {slices!r}.")
  text = name.strip().lower()
  if any(text.startswith(w) for w in _GPU_WORDS):
    raise TopologyError(
        f"topology {name!r} names a GPU: compile-only meshes exist for TPUs, whose "
        "compiler (libtpu) runs on any machine; XLA:GPU compiles only where a GPU is. "
        f"Name a TPU slice: {_known_names()}.")
  by_name, by_shape = _NAME.match(text), _TOPOLOGY.match(text)
  match = by_name or by_shape
  generation = _BY_PREFIX.get(match.group("gen")) if match else None
  if generation is None:
    raise TopologyError(f"unknown TPU slice {name!r}; expected one of {_known_names()}, "
                        "or libtpu's form such as 'v5p:4x4x8'.")
  if by_shape:
    topology = tuple(int(s) for s in by_shape.group("shape").split("x"))
    if len(topology) != generation.torus_dims or min(topology) < 1:
      raise TopologyError(
          f"topology {name!r}: {generation.name} slices are {generation.torus_dims}-D "
          f"tori, e.g. '{generation.name}:{'x'.join(['2'] * generation.torus_dims)}'.")
  else:
    count = int(by_name.group("count"))
    per_chip = 2 if generation.counts == "cores" else 1
    chips, left = divmod(count, per_chip)
    if left or chips < 1 or chips & (chips - 1):
      raise TopologyError(
          f"topology {name!r}: {generation.name}-N counts {generation.counts}, and N "
          f"must be {per_chip} times a power of two for Cloud TPU's default shape; name "
          f"any other shape in libtpu's form, e.g. '{generation.name}:"
          f"{'x'.join(['4'] * generation.torus_dims)}'.")
    topology = _default_topology(chips, generation.torus_dims)
  if math.prod(topology) > generation.max_chips:
    raise TopologyError(f"topology {name!r}: {math.prod(topology)} chips, more than a "
                        f"{generation.name} pod's {generation.max_chips}.")
  return TpuSlice(name, generation, topology, int(slices))


def tpu_devices(tpu: TpuSlice) -> list:
  """The compile-only devices of a slice, from libtpu.

  Raises:
    automap.MeshError (a `TopologyError`): libtpu is not installed, or it
      refuses the topology.
  """
  if importlib.util.find_spec("libtpu") is None:
    raise TopologyError(
        "XLA:TPU's compiler (libtpu) is not installed, so no TPU topology can be "
        f"compiled for here. Install it at the jax version held: "
        f"pip install 'automap[tpu]' (or pip install 'jax[tpu]=={jax.__version__}').")
  # libtpu takes a lockfile per process; compile-only use needs no exclusive hold,
  # and test workers or a second notebook would otherwise fail to load it.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies

  shape = tpu.topology + (1,) * (3 - len(tpu.topology))
  # A host holds up to 2x2x1 chips; a smaller slice is one host.
  host = tuple(min(s, b) for s, b in zip(shape, (2, 2, 1)))
  try:
    description = topologies.get_topology_desc(
        platform="tpu", topology_name=f"{tpu.generation.name}:"
        + "x".join(map(str, tpu.topology)), chip_config_name=tpu.generation.chip_config,
        chips_per_host_bounds=host, num_slices=tpu.slices)
  except Exception as e:  # libtpu's own refusal, stated as it gave it.
    raise TopologyError(f"libtpu refuses topology {tpu}: {str(e).splitlines()[0]}") from e
  return list(description.devices)


def _dcn_split(shape: tuple[int, ...], slices: int, name: str) -> tuple[int, ...]:
  """How many slices each mesh axis crosses: the slices spread over the
  leading axes (the data-centre network outermost, as MaxText's
  `dcn_*_parallelism` lays them), each axis taking what divides it."""
  left, dcn = slices, []
  for size in shape:
    take = math.gcd(left, size)
    dcn.append(take)
    left //= take
  if left != 1:
    raise TopologyError(
        f"mesh shape {shape} cannot span {slices} slices of {name}: the leading axes "
        f"must hold the slice count as a factor (e.g. a first axis of {slices}).")
  return tuple(dcn)


def compile_only(mesh) -> bool:
  """Whether a concrete mesh's devices are compile-only (a topology from
  libtpu, `tpu_mesh`): devices this process's runtime does not hold, which
  can compile a program but never run one. An abstract mesh is not."""
  devices = getattr(mesh, "devices", None)
  if devices is None or not hasattr(devices, "flat"):
    return False
  try:
    runtime = set(jax.devices(devices.flat[0].platform))
  except RuntimeError:  # No runtime backend of that platform here at all.
    return True
  return any(d not in runtime for d in devices.flat)


def tpu_mesh(topology: str, axis_shape: Sequence[int] | None = None,
             axis_names: Sequence[str] | None = None, *, slices: int = 1
             ) -> jax.sharding.Mesh:
  """A compile-only mesh of a named TPU slice, for planning and compiling
  with XLA:TPU on any machine (it cannot run a program).

  The devices are laid out for the torus as `jax.experimental.mesh_utils`
  lays out real ones (`create_device_mesh`, or `create_hybrid_device_mesh`
  over several slices, the slices spread over the leading axes). Pass it
  wherever a mesh goes: `automap.search`, `evaluate`, `verify`,
  `partition` (plans and compiles; `.lower(...).compile()`), and the
  cluster planner.

  Args:
    topology: the slice as Cloud TPU names it: "v5p-256" and "v4-128" count
      TensorCores (two per chip: 128 and 64 chips, one jax device each);
      "v5e-16" (or "v5litepod-16"), "v6e-256" and "tpu7x-64" count chips
      (TPU7x has two devices per chip). Any shape the pod admits in libtpu's
      form, e.g. "v5p:4x4x12" or "tpu7x:2x2x1".
    axis_shape: the mesh's shape, its product the slices' device count
      (default: one axis of them all).
    axis_names: one name per axis (default: "data" for one axis, else
      "data", "fsdp", "tensor" in that order, as many as `axis_shape` has).
    slices: how many such slices (multislice), over the data-centre network;
      each device's `slice_index` says which, and automap prices the axes
      that cross slices on the data-centre network.

  Returns:
    A `jax.sharding.Mesh` of compile-only TPU devices.

  Raises:
    automap.MeshError (a `TopologyError`): libtpu is not installed (the
      message says how to install it), an unknown slice name (the message
      lists them), a GPU's name, or an `axis_shape` whose product is not the
      slices' device count or whose leading axes cannot hold `slices`.
  """
  tpu = parse_slice(topology, slices)
  if axis_shape is None:
    axis_shape = (tpu.num_devices,)
  shape = tuple(axis_shape)
  if (not shape or any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 1
                       for s in shape)):
    raise TopologyError(f"axis_shape must be positive ints, got {axis_shape!r}.")
  if axis_names is None:
    axis_names = ("data",) if len(shape) == 1 else ("data", "fsdp", "tensor", "expert")[
        :len(shape)]
  names = tuple(axis_names)
  if len(names) != len(shape) or len(set(names)) != len(names):
    raise TopologyError(f"axis_names must be {len(shape)} distinct names for axis_shape "
                        f"{shape}, got {axis_names!r}.")
  if math.prod(shape) != tpu.num_devices:
    raise TopologyError(
        f"axis_shape {shape} holds {math.prod(shape)} devices, but {tpu} has "
        f"{tpu.num_devices}: give a shape whose product is {tpu.num_devices}.")
  devices = tpu_devices(tpu)
  from jax.experimental import mesh_utils

  try:
    if tpu.slices == 1:
      laid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
      dcn = _dcn_split(shape, tpu.slices, topology)
      ici = tuple(s // d for s, d in zip(shape, dcn))
      laid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices,
                                                  allow_split_physical_axes=True)
  except TopologyError:
    raise
  except (ValueError, NotImplementedError, AssertionError) as e:
    raise TopologyError(f"axis_shape {shape} does not lay out on {tpu}: {e}") from e
  return jax.sharding.Mesh(laid, names)


__all__ = ["GENERATIONS", "Generation", "TopologyError", "TpuSlice", "compile_only",
           "parse_slice",
           "tpu_devices", "tpu_mesh"]
