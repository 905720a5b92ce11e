"""One placement search's problem: the cluster, its microbatches and the
options resolved against the hardware (`problem`), and how ZeRO's shard
groups tile the data-parallel replicas (`Problem.sharded_over`)."""

from __future__ import annotations

import dataclasses

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.placement.options import PlacementOptions, memory_limit, recompute_modes
from automap._src.cost.hardware import Hardware, get_hardware

SLICE = "slice"  # Problem.shard_group: ZeRO within each slice's replicas


@dataclasses.dataclass(frozen=True)
class Problem:
  """One search: a graph's cluster and microbatches, with the options resolved
  against the hardware."""

  devices: int
  microbatches: int
  memory: float                 # bytes per device
  hw: Hardware
  optimizer: float              # bytes of optimizer state per parameter byte
  zero: tuple[int, ...]         # ZeRO stages to try
  recompute: tuple[str, ...]    # per stage, the modes tried
  widths: tuple[int, ...] | None
  stages: int | None
  gradients: float = 1.0        # bytes of gradient per parameter byte
  overlap: bool = True          # sync and ZeRO collectives beside compute
  virtual_stages: int | None = 1  # None: interleaving searched where legal
  overlap_tensor: bool = False  # tensor-parallel collectives beside the matmuls
  recompute_stated: bool = True  # `recompute` as the options name it (else every mode)
  # Hybrid sharding: ZeRO over groups of this many consecutive replicas,
  # plain data parallelism across the groups (None: over every replica;
  # SLICE: the replicas within one slice or node, as many as divide d).
  shard_group: int | str | None = None
  recompute_share: float = 1.0  # of a stage's layers its recompute mode applies to
  context: int = 1  # devices of a stage its gradients' collectives span too (`cluster/context.py`)
  offload: bool = False  # optimizer state in host memory, crossing `hw.host_bandwidth` each batch

  def sharded_over(self, d: int, zero: int) -> int:
    """Replicas a ZeRO stage shards over (and its collectives span) when
    there are d of them: all d under ZeRO 0, which shards nothing."""
    if self.shard_group is None or not zero:
      return d
    if self.shard_group == SLICE:
      # Groups of whole pipelines that tile a slice, so none straddles two.
      per_pipeline, node = self.devices // d, self.hw.devices_per_node
      g = max(g for g in range(1, d + 1)
              if g == 1 or (not d % g and not node % (g * per_pipeline)))
      return d if g == 1 else g  # one replica a group shards nothing: plain
    return min(self.shard_group, d)

  def hybrid_group(self, d: int, zero: int) -> int | None:
    """The shard group a plan of d replicas under this ZeRO stage records:
    None where ZeRO spans every replica (or shards nothing)."""
    g = self.sharded_over(d, zero)
    return g if g < d else None


def problem(devices, microbatches, hardware, options: PlacementOptions) -> Problem:
  for name, value in (("devices", devices), ("microbatches", microbatches)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise PlacementError(f"{name} must be a positive int, got {value!r}.")
  hw = get_hardware(hardware)
  return Problem(devices, microbatches, memory_limit(options, hw), hw, options.optimizer_state,
                  options.zero, recompute_modes("PlacementOptions", options.recompute),
                  options.widths, options.stages, options.gradient_state, options.overlap,
                  options.virtual_stages, options.overlap_tensor, options.recompute is not None)


__all__ = ["SLICE", "Problem", "problem"]
