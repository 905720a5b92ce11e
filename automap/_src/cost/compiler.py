"""Compiler behaviour: what XLA does to a partitioned program, per backend.

The cost model prices the HLO XLA emits, and XLA's backends emit different
HLO for the same program: these are the differences it prices.

XLA:TPU's pipeline is not public; its compiler (libtpu) compiles here for
compile-only TPU slices, and what follows was read off its compiled HLO
(libtpu 0.0.42.1), each with a test in the TPU tier
(`tests/cost/test_tpu_rules.py`, `tests/run/test_tpu_compiled.py`):
`narrows_dot_operands`, `scatters_every_device` (False), `scatters_first`,
`reassociates_all_reduces`, a reduce-scatter over some of the devices
formed (its all-reduce-scatter fusion) only where the dot's operands come
tiled as its result on every other axis, the gradient all-reduces and the
loss's combined into one tuple all-reduce, collectives in while loops run
each trip, and async collective start / done pairs. Still taken from
XLA:GPU's passes, and marked so where they are stated: which all-gathers
and reduce-scatters its combiners merge and their byte limit,
`holds_combined`, `expensive`, and the latency-hiding schedule's program
order. Its memory-space assignment
places buffers in on-chip memory that its HBM allocation then leaves out
(the same data-parallel step allocates 17 MiB of HBM temporaries on v5p and
none on v6e, its gradients annotated `S(1)`): no field prices that, so on
programs of tens of MiB XLA:TPU allocates less than priced.
"""

from __future__ import annotations

import dataclasses
import types

from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER


@dataclasses.dataclass(frozen=True)
class Compiler:
  """The XLA backend behaviours the cost model depends on.

  name: the backend, e.g. "xla:tpu".
  reduce_scatter: whether an all-reduce whose result is then sliced to each
    device's tile becomes a reduce-scatter (XLA:TPU and XLA:GPU form them,
    the latter in its ReduceScatterCreator pass; XLA:CPU does not, so the
    whole partial result is all-reduced, then sliced).
  scatters_every_device: whether a reduce-scatter over every device of the
    program is formed too. XLA:TPU forms its reduce-scatter (an all-reduce
    and a dynamic-slice in one "all-reduce-scatter" fusion) over a group of
    some of the devices only: over all of them it all-reduces the whole
    partial result and each device slices its tile, as its compiled HLO
    shows for an FSDP gradient over 8 of 8 and 16 of 16 v5p chips (one
    all-reduce of the whole gradient, combined with the loss's), where
    over 4 of 8, 8 of 16 or 64 of 256 it forms the fusion. XLA:GPU is
    taken to form both (its `ReduceScatterCreator` matches any group).
  scatters_first: whether a partial result summed over more axes than its
    result is tiled on is reduce-scattered over the tiling axes first and
    the tile then all-reduced over the rest (XLA:TPU's compiled HLO: a
    gradient partial over (data, model) and tiled over data is a
    reduce-scatter over data and an all-reduce of the quarter over
    model); else the whole partial result is all-reduced over the rest,
    then scattered, as the partitioner emits it.
  narrows_dot_operands: whether a float32 dot at the default precision is
    computed with bfloat16 operands, converted before any collective that
    reshards them (XLA:TPU: the matrix units' one-pass bfloat16 is what
    DEFAULT means there, and its compiled HLO converts an FSDP weight and
    a gathered activation to bfloat16 before their all-gathers, which then
    move and hold half the bytes). XLA:GPU and XLA:CPU keep float32.
  reassociates_all_reduces: whether a sum of two values all-reduced over
    the same axes is one all-reduce of their sum (`AllReduceReassociate`,
    `reassociate.py`): in XLA:GPU's collective optimizations
    (`gpu_compiler.cc`) and in XLA:TPU's compiled HLO; not in XLA:CPU's
    pipeline, which all-reduces each.
  reduce_in_f32: whether 16-bit float all-reduces run in float32, moving
    twice their bytes (XLA:CPU does: its float normalization widens them).
  fuses_shared_producers: whether a reduction's fusion recomputes a fusible
    producer that other ops read too (XLA's instruction fusion on TPU and
    GPU duplicates it). XLA:CPU's library reductions absorb only producers
    no other op reads, so such a producer (a layer norm's broadcast scale,
    shared by the forward and backward passes) gets a buffer of its own.
  combines: the collective kinds (indices into `collectives.KINDS`) whose
    mutually independent instances XLA merges into one tuple collective.
    XLA:CPU runs only an all-reduce combiner (`CpuAllReduceCombiner` in
    `cpu_compiler.cc`); XLA:GPU combines all-gathers and reduce-scatters
    too (`gpu_compiler.cc`); XLA:TPU's pipeline is not public and is taken
    to do as XLA:GPU does. No backend combines collective-permutes.
  combine_bytes, combine_count: the most result bytes and collectives one
    combined collective takes (XLA:CPU: no byte limit, 256; XLA:GPU: 30 MiB,
    `kDefaultAllReduceCombineThreshold` and its all-gather and
    reduce-scatter twins in `collective_utils.h`, and 256). The combiners
    (`CombineInstructionsByKey`) walk the program in order and close a group
    at either limit, so a late reduction's input is held until its group's
    collective (`Tracker.windows`): on XLA:CPU every gradient until the last
    is made; on XLA:GPU windows of 30 MiB of results, which for a
    reduce-scatter over n devices hold n times that of unreduced gradients.
  holds_combined: whether a combined group's inputs are priced held until
    its collective, as the public combiners above hold them. XLA:TPU's
    pipeline is not public, nor whether its combiners or its async
    collective fusion hold an unrolled stack's gradients: each late
    reduction is priced reduced as it is made, the bound its scanned twin
    (reduced inside the loop) reaches.
  expensive: the elementwise primitives XLA's fusion never duplicates: one
    whose computation several fusions read is stored once, not recomputed
    in each (`InstructionFusion::IsExpensive`, which XLA:CPU's fusion uses
    as is and XLA:TPU is taken to; `GpuInstructionFusion::IsExpensive`
    deems f32/f16 exp, divide, sqrt and rsqrt cheap, and those dtypes are
    what XLA:GPU computes them in; its priority fusion, which weighs
    duplication by its cost model, is taken to agree). Checked on XLA:CPU.
    A division by a constant is cheap on every backend
    (`analysis._expensive`).
  async_collectives: whether collectives run as start / done pairs that the
    latency-hiding scheduler overlaps with independent compute (XLA:GPU's
    `AsyncCollectiveCreator` and `LatencyHidingScheduler` in
    `gpu_compiler.cc`; XLA:TPU taken to do the same); XLA:CPU runs them in
    place.
  major_collective_dims: whether an all-gather runs only along its array's
    most major dim (XLA:GPU's layout assignment moves the gathered dim
    major, `GpuLayoutAssignment::AddBackendConstraints`; XLA:CPU compiles
    the same): gathered along another dim of more than one element, the
    tile is copied into that layout first and the result back after, each
    copy fused into a loop-fused producer or reader where there is one.
  tuple_all_to_all: whether an all-to-all runs as slices of its operand,
    one buffer each, a tuple all-to-all of them, and a concatenation of
    what arrives (`AllToAllDecomposer`, in XLA:CPU's and XLA:GPU's
    pipelines), the slices and the concatenation fused into a loop-fused
    producer or reader where there is one. XLA:TPU's pipeline is not
    public; it is taken to run both collectives in place.
  breadth_first: whether the entry computation is scheduled breadth-first,
    each op as soon as its operands are made (XLA:CPU's default
    `BFScheduler`, `CpuCompiler::CreateHloSchedule`; Kahn's order with a
    FIFO queue, no memory model), so buffers live by that order
    (`analysis.breadth_first_positions`): a resharded copy is made right
    after what it copies (every FSDP weight's gather at the program's
    start), and a remat'd layer's recomputation runs beside the forward
    pass, its results held until the layer's backward reads them. XLA:GPU
    schedules from the least-peak of its memory schedulers
    (`DefaultMemoryScheduler`) with the latency-hiding scheduler on top,
    which tracks memory pressure against the device's memory and keeps a
    buffer from its collective's start to its last reader
    (`gpu_hlo_schedule.cc`, `latency_hiding_scheduler.cc`); XLA:TPU is
    taken to do the same. Both are priced in program order: a copy made
    where it is first read and freed after its last, a remat'd layer
    recomputed just before its backward (its optimization barrier stays
    until after scheduling on XLA:GPU, `RunPostSchedulingPipelines`).
  """

  name: str
  reduce_scatter: bool
  reduce_in_f32: bool
  fuses_shared_producers: bool
  scatters_every_device: bool = True
  scatters_first: bool = False
  narrows_dot_operands: bool = False
  reassociates_all_reduces: bool = False
  combines: frozenset[int] = frozenset({ALL_REDUCE})
  combine_bytes: float = float("inf")
  combine_count: int = 256
  async_collectives: bool = False
  expensive: frozenset[str] = frozenset()
  major_collective_dims: bool = False
  tuple_all_to_all: bool = False
  breadth_first: bool = False
  holds_combined: bool = True


# jax primitives `InstructionFusion::IsExpensive` deems expensive (those the
# compiler expands into expensive HLO: erfc and erf_inv into exp and log).
_EXPENSIVE = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "logistic", "erf", "erfc", "erf_inv",
    "tanh", "sqrt", "rsqrt", "cbrt", "pow", "atan2", "div", "rem", "lgamma",
    "digamma", "igamma", "igammac", "sinh", "cosh", "asinh", "acosh", "atanh"})
_GATHERS_AND_REDUCTIONS = frozenset({ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER})
_GPU_COMBINE_BYTES = 30 * 2**20
XLA_TPU = Compiler("xla:tpu", reduce_scatter=True, reduce_in_f32=False,
                   fuses_shared_producers=True, scatters_every_device=False,
                   scatters_first=True, narrows_dot_operands=True,
                   reassociates_all_reduces=True, combines=_GATHERS_AND_REDUCTIONS,
                   combine_bytes=_GPU_COMBINE_BYTES, async_collectives=True,
                   expensive=_EXPENSIVE, holds_combined=False)
XLA_GPU = Compiler("xla:gpu", reduce_scatter=True, reduce_in_f32=False,
                   fuses_shared_producers=True, reassociates_all_reduces=True,
                   combines=_GATHERS_AND_REDUCTIONS,
                   combine_bytes=_GPU_COMBINE_BYTES, async_collectives=True,
                   expensive=_EXPENSIVE - {"exp", "exp2", "div", "sqrt", "rsqrt"},
                   major_collective_dims=True, tuple_all_to_all=True)
XLA_CPU = Compiler("xla:cpu", reduce_scatter=False, reduce_in_f32=True,
                   fuses_shared_producers=False, combines=frozenset({ALL_REDUCE}),
                   expensive=_EXPENSIVE, major_collective_dims=True, tuple_all_to_all=True,
                   breadth_first=True)

# Platform names as jax reports them (`Device.platform`), and the GPU
# vendors' names for the one XLA:GPU backend.
_BY_PLATFORM = types.MappingProxyType({
    "tpu": XLA_TPU, "gpu": XLA_GPU, "cuda": XLA_GPU, "rocm": XLA_GPU, "cpu": XLA_CPU})
PLATFORMS = tuple(_BY_PLATFORM)


def compiler_for(platform: str) -> Compiler:
  """XLA's backend for a platform: "tpu", "gpu" (or "cuda", "rocm"), "cpu"."""
  if isinstance(platform, str) and platform.lower() in _BY_PLATFORM:
    return _BY_PLATFORM[platform.lower()]
  raise ValueError(
      f"platform must be one of {sorted(_BY_PLATFORM)} (as jax's "
      f"Device.platform names it), got {platform!r}.")
