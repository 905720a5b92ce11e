"""Accelerator design points: their area and their operators' latency.

The hardware half of PHAZE (Wang et al., ICML 2024): an accelerator is a few
counts and sizes (cores with one systolic array each, vector units, on-chip
buffer, HBM); an operator's latency follows from the rules of
`latency_breakdown`, and a layer's operators are scheduled over the cores in
`scheduling.py`. Units: seconds, bytes, Hz, mm^2.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Mapping, Sequence

import numpy as np

# Issuing an op (descriptors, DMA setup), cycles.
DISPATCH_CYCLES = 300
# A barrier across the cores after a spread op, cycles.
SYNC_CYCLES = 500


class AcceleratorError(ValueError):
  """An invalid accelerator, operator or scheduling problem."""


def is_int(value) -> bool:
  """An integer (numpy's too), not a bool."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
  """A real number (numpy's too), not a bool."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """A parameterised accelerator chip.

  Vector units are spread evenly over the cores (a core may hold a fraction);
  the buffer is on-chip SRAM shared by the cores.

  Attributes:
    tensor_units: cores, each with one systolic array.
    array: the systolic array is array x array MACs (a power of two).
    vector_units: over all cores.
    vector_width: lanes per vector unit, one 16-bit op per lane per cycle.
    buffer: on-chip SRAM, bytes.
    hbm_capacity: bytes.
    hbm_bandwidth: bytes/s.
    clock: Hz.

  Raises:
    AcceleratorError: a count that is not a positive int, a size that is not
      a positive finite number, or an array that is not a power of two.
  """

  tensor_units: int = 8
  array: int = 128
  vector_units: int = 2
  vector_width: int = 128
  buffer: float = 128 * 2**20
  hbm_capacity: float = 32 * 2**30
  hbm_bandwidth: float = 1.2e12
  clock: float = 1.05e9

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "int":
        if not is_int(value) or value < 1:
          raise AcceleratorError(
              f"Accelerator.{field.name} must be a positive int, got {value!r}.")
      elif not is_real(value) or not math.isfinite(value) or value <= 0:
        raise AcceleratorError(
            f"Accelerator.{field.name} must be a positive finite number (units: bytes, "
            f"bytes/s, Hz), got {value!r}.")
    if self.array & (self.array - 1):
      raise AcceleratorError(
          f"Accelerator.array must be a power of two (the systolic array is array x array "
          f"MACs), got {self.array}; try {1 << (self.array.bit_length() - 1)} or "
          f"{1 << self.array.bit_length()}.")

  def area(self, model: AreaModel | None = None) -> float:
    """Die area, mm^2, under `model` (default: AREA, calibrated on TPU_V4_LIKE)."""
    return (model or AREA).area(self)

  @property
  def peak_flops(self) -> float:
    """Dense matmul FLOP/s over every core (a MAC is two FLOPs)."""
    return 2 * self.tensor_units * self.array**2 * self.clock

  @property
  def lanes(self) -> int:
    """Vector lanes over every core."""
    return self.vector_units * self.vector_width


@dataclasses.dataclass(frozen=True)
class AreaModel:
  """Die area as a linear function of the resources, mm^2.

  AREA calibrates it so that TPU_V4_LIKE has BASELINE_AREA with the shares in
  BASELINE_SHARES: tensor units 40%, vector units 5%, SRAM 30%, HBM interface
  (PHYs and controllers) 10%, the rest (interconnect, host interface, control)
  15%. These shares and the total are assumptions, in line with published die
  shots of TPU-class chips, not measurements; pass another model to
  `Accelerator.area` to try others.
  """

  mac: float    # mm^2 per MAC of a systolic array
  lane: float   # mm^2 per vector lane
  sram: float   # mm^2 per byte of buffer
  hbm: float    # mm^2 per byte/s of HBM bandwidth
  fixed: float  # mm^2 whatever the design point

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if not is_real(value) or not math.isfinite(value) or value < 0:
        raise AcceleratorError(
            f"AreaModel.{field.name} must be a finite number >= 0 (mm^2 per unit), "
            f"got {value!r}.")

  @classmethod
  def calibrated(cls, acc: Accelerator, total: float, shares: Mapping[str, float]) -> AreaModel:
    """The model under which `acc` has area `total`, split as `shares` (by field name)."""
    if set(shares) != {f.name for f in dataclasses.fields(cls)} or not math.isclose(
        sum(shares.values()), 1.0):
      raise AcceleratorError(
          f"shares must give each of mac, lane, sram, hbm, fixed a fraction of the area, "
          f"summing to 1; got {shares}.")
    amounts = _resource_amounts(acc)
    return cls(**{name: total * share / amounts[name] for name, share in shares.items()})

  def area(self, acc: Accelerator) -> float:
    amounts = _resource_amounts(acc)
    return sum(getattr(self, name) * amount for name, amount in amounts.items())


def _resource_amounts(acc: Accelerator) -> dict[str, float]:
  """How much of each resource `acc` has, in AreaModel's units."""
  return {"mac": acc.tensor_units * acc.array**2, "lane": acc.lanes,
          "sram": acc.buffer, "hbm": acc.hbm_bandwidth, "fixed": 1.0}


TPU_V4_LIKE = Accelerator()
BASELINE_AREA = 400.0  # mm^2
BASELINE_SHARES: Mapping[str, float] = types.MappingProxyType(
    {"mac": 0.40, "lane": 0.05, "sram": 0.30, "hbm": 0.10, "fixed": 0.15})
AREA = AreaModel.calibrated(TPU_V4_LIKE, BASELINE_AREA, BASELINE_SHARES)
AREA_BUDGET: float = TPU_V4_LIKE.area()


@dataclasses.dataclass(frozen=True)
class Op:
  """One operator of a layer, as the accelerator sees it.

  kind "tensor": `batch` matmuls [m, k] @ [k, n]. kind "vector": `elements`
  element operations (elementwise or reduction). `bytes` is the HBM traffic if
  nothing stays on chip: inputs read once plus outputs written once.
  """

  name: str
  kind: str
  m: int = 1
  n: int = 1
  k: int = 1
  batch: int = 1
  elements: float = 0  # element operations (vector ops)
  bytes: float = 0     # bytes

  def __post_init__(self):
    if self.kind not in ("tensor", "vector"):
      raise AcceleratorError(
          f"Op {self.name!r}: kind must be 'tensor' (a matmul) or 'vector', got {self.kind!r}.")
    for name in ("m", "n", "k", "batch"):
      value = getattr(self, name)
      if not is_int(value) or value < 1:
        raise AcceleratorError(f"Op {self.name!r}: {name} must be a positive int, got {value!r}.")
    for name in ("elements", "bytes"):
      value = getattr(self, name)
      if not is_real(value) or not math.isfinite(value) or value < 0:
        raise AcceleratorError(
            f"Op {self.name!r}: {name} must be a finite number >= 0, got {value!r}.")
    if self.kind == "tensor" and self.elements:
      raise AcceleratorError(
          f"Op {self.name!r}: a tensor op's work is its m, n, k and batch; leave elements 0 "
          f"(got {self.elements!r}) or make it a vector op.")
    if self.kind == "vector" and (self.m, self.n, self.k, self.batch) != (1, 1, 1, 1):
      raise AcceleratorError(
          f"Op {self.name!r}: a vector op's work is its elements; leave m, n, k, batch at 1 "
          f"(got {(self.m, self.n, self.k, self.batch)}) or make it a tensor op.")

  @classmethod
  def matmul(cls, name: str, *, m: int, n: int, k: int, batch: int = 1,
             itemsize: int = 2) -> Op:
    """A tensor op whose bytes are its operands and result at `itemsize` bytes each."""
    return cls(name, "tensor", m=m, n=n, k=k, batch=batch,
               bytes=float(itemsize * batch * (m * k + k * n + m * n)))

  @property
  def flops(self) -> float:
    return 2.0 * self.m * self.n * self.k * self.batch if self.kind == "tensor" else self.elements


@dataclasses.dataclass(frozen=True)
class Latency:
  """An op's latency and its parts, seconds."""

  compute: float
  memory: float
  overhead: float  # dispatch, plus synchronisation when spread

  @property
  def total(self) -> float:
    return max(self.compute, self.memory) + self.overhead


def hbm_traffic(op: Op, buffer: float) -> float:
  """Bytes `op` moves to and from HBM with `buffer` bytes on chip (module docstring)."""
  if op.kind == "vector" or op.bytes == 0:
    return float(op.bytes)
  a, b, c = op.m * op.k, op.k * op.n, op.m * op.n  # elements per instance
  itemsize = op.bytes / (op.batch * (a + b + c))
  if itemsize * (a + b + c) <= buffer or itemsize * min(a, b) <= buffer / 2:
    return float(op.bytes)
  t = max(1, math.isqrt(int(buffer / (3 * itemsize))))
  return itemsize * op.batch * (a * -(-op.n // t) + b * -(-op.m // t) + c)


def latency_breakdown(op: Op, acc: Accelerator, cores: int) -> Latency:
  """`op`'s latency on `cores` of `acc`'s cores, in parts.

  Latency of an op on `cores` of the accelerator's `tensor_units` cores. The op
  owns that share (`cores / tensor_units`) of the vector lanes, the buffer and
  the HBM bandwidth, so single-core ops running side by side never oversubscribe
  the chip.

    - Tensor op, `batch` x [M, K] @ [K, N]: the output is cut into array x array
      tiles, ceil(M / array) * ceil(N / array) * batch of them; a tile streams its
      K rows through the array, plus 2 * array cycles to fill and drain it; the
      cores share the tiles, ceil(tiles / cores) each.
    - Vector op: elements / lanes cycles (one 16-bit op per lane per cycle).
    - Memory: the op's HBM traffic over its share of the bandwidth. A vector op
      streams, so its traffic is its bytes. A tensor op moves its bytes once when
      one instance fits in its share of the buffer, or when its smaller input
      fits in half of it (held resident while the rest streams through the other
      half). Otherwise it is blocked output-stationary, with a t x t block each of
      A, B and C on chip (t = floor(sqrt(buffer / (3 * itemsize)))): A is read
      ceil(N / t) times, B ceil(M / t) times, C written once.
    - latency = max(compute, memory) + DISPATCH_CYCLES, plus SYNC_CYCLES when the
      op spans more than one core.

  Hence at a given core count more vector units, bandwidth or buffer never slow
  an op; more tensor units never slow an op spread over two or more of them (at
  a fixed core count a core is a smaller share of the chip, by design); a larger
  array never slows an op whose M and N are multiples of it and that gives each
  core at least one of its tiles; and spreading never slows the compute part.
  """
  if not isinstance(op, Op):
    raise AcceleratorError(f"op must be an automap Op, got {type(op).__name__}.")
  if not is_int(cores) or not 1 <= cores <= acc.tensor_units:
    raise AcceleratorError(
        f"cores must be an int from 1 (one core) to acc.tensor_units = {acc.tensor_units} "
        f"(spread over all), got {cores!r}.")
  share = cores / acc.tensor_units
  if op.kind == "tensor":
    tiles = -(-op.m // acc.array) * -(-op.n // acc.array) * op.batch
    cycles = -(-tiles // cores) * (op.k + 2 * acc.array)
  else:
    cycles = op.elements / (acc.lanes * share)
  memory = hbm_traffic(op, acc.buffer * share) / (acc.hbm_bandwidth * share)
  overhead = DISPATCH_CYCLES + (SYNC_CYCLES if cores > 1 else 0)
  return Latency(cycles / acc.clock, memory, overhead / acc.clock)


def latency(op: Op, acc: Accelerator, cores: int) -> float:
  """Seconds `op` takes on `cores` cores (1: one core; acc.tensor_units: spread)."""
  return latency_breakdown(op, acc, cores).total


class OpTable:
  """Ops as arrays, priced on one accelerator after another: `latency` for
  all of them at once, by the same rules and in the same arithmetic."""

  def __init__(self, ops: Sequence[Op]):
    ops = list(ops)
    if not all(isinstance(op, Op) for op in ops):
      raise AcceleratorError("OpTable takes automap Ops.")
    col = lambda f, dtype: np.array([f(op) for op in ops], dtype)  # noqa: E731
    self.tensor = col(lambda op: op.kind == "tensor", bool)
    self.m, self.n, self.k, self.batch = (col(lambda op, f=f: getattr(op, f), np.int64)
                                          for f in ("m", "n", "k", "batch"))
    self.elements, self.bytes = col(lambda op: op.elements, float), col(lambda op: op.bytes, float)
    # hbm_traffic's per-instance elements and bytes per element (tensor ops with bytes).
    self.a, self.b, self.c = self.m * self.k, self.k * self.n, self.m * self.n
    self.blocked = self.tensor & (self.bytes > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
      self.itemsize = np.where(self.blocked,
                               self.bytes / (self.batch * (self.a + self.b + self.c)), 0.0)

  def __len__(self) -> int:
    return len(self.tensor)

  def hbm_traffic(self, buffer: float) -> np.ndarray:
    """`hbm_traffic` of every op."""
    a, b, c, itemsize = self.a, self.b, self.c, self.itemsize
    once = ~self.blocked | (itemsize * (a + b + c) <= buffer) | (
        itemsize * np.minimum(a, b) <= buffer / 2)
    out = self.bytes.copy()
    if once.all():
      return out
    i = ~once
    cells = np.floor(buffer / (3 * itemsize[i])).astype(np.int64)
    t = np.floor(np.sqrt(cells)).astype(np.int64)
    t -= t * t > cells  # math.isqrt: floor(sqrt) can round either way
    t += (t + 1) * (t + 1) <= cells
    t = np.maximum(t, 1)
    out[i] = itemsize[i] * self.batch[i] * (a[i] * -(-self.n[i] // t) + b[i] * -(-self.m[i] // t)
                                            + c[i])
    return out

  def latency(self, acc: Accelerator, cores: int) -> np.ndarray:
    """`latency(op, acc, cores)` of every op, seconds."""
    if not is_int(cores) or not 1 <= cores <= acc.tensor_units:
      raise AcceleratorError(
          f"cores must be an int from 1 to acc.tensor_units = {acc.tensor_units}, "
          f"got {cores!r}.")
    share = cores / acc.tensor_units
    tiles = -(-self.m // acc.array) * -(-self.n // acc.array) * self.batch
    cycles = np.where(self.tensor, -(-tiles // cores) * (self.k + 2 * acc.array),
                      self.elements / (acc.lanes * share))
    memory = self.hbm_traffic(acc.buffer * share) / (acc.hbm_bandwidth * share)
    overhead = DISPATCH_CYCLES + (SYNC_CYCLES if cores > 1 else 0)
    return np.maximum(cycles / acc.clock, memory) + overhead / acc.clock


__all__ = ["AREA", "AREA_BUDGET", "Accelerator", "AcceleratorError", "AreaModel", "Latency", "Op",
           "OpTable", "TPU_V4_LIKE", "hbm_traffic", "is_int", "is_real", "latency",
           "latency_breakdown"]
