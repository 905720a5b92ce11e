"""Ring collectives over a cluster's links: within a node (or TPU slice) on
the hardware's `link_*`, across nodes on its `network_*`, by the span of
devices a ring joins. Seconds for arrays of `nbytes` in all.

A group with several members in each node it spans runs as two levels:
within each node over the fast links, then across nodes in as many rings
as the group has members per node, each with its own share of the array
(`collectives.staged_seconds`). This is what makes FSDP over many nodes
affordable: NCCL's rings over multi-NIC nodes cross each node boundary on
every member's own NIC, and XLA's cross-slice collectives reduce or gather
within the slice before the data-centre network. A group of one member
per node (data parallelism beside tensor parallelism) is one ring on the
network.
"""

from __future__ import annotations

from automap._src.cost.collectives import (
  ALL_GATHER,
  ALL_REDUCE,
  levels,
  ring_seconds,
  send_seconds,
  staged_seconds,
)
from automap._src.cost.hardware import Hardware


class Ring:
  """Ring collectives over a set of devices on the hardware's links
  (`collectives`), for arrays of `nbytes` in all."""

  def __init__(self, hw: Hardware):
    self.hw = hw

  def link(self, lo: int, hi: int) -> tuple[float, float]:
    """(bandwidth, latency) of the link joining devices lo..hi."""
    node = self.hw.devices_per_node
    if lo // node == hi // node:
      return self.hw.link_bandwidth, self.hw.link_latency
    return self.hw.network_bandwidth, self.hw.network_latency

  def levels(self, n: int, lo: int, hi: int) -> list[tuple[int, float, float]]:
    """(devices, bandwidth, latency) per level of a ring of n devices spread
    evenly over lo..hi (`collectives.levels`)."""
    hw, node = self.hw, self.hw.devices_per_node
    stride = (hi - lo) / (n - 1) if n > 1 else 1.0
    return levels(n, stride, lo // node != hi // node, node,
                  (hw.link_bandwidth, hw.link_latency), (hw.network_bandwidth, hw.network_latency))

  def _seconds(self, kind: int, nbytes: float, n: int, lo: int, hi: int) -> float:
    if n == 1 or nbytes == 0:
      return 0.0
    levels = self.levels(n, lo, hi)
    if len(levels) == 1:
      return ring_seconds(kind, nbytes, n, *levels[0][1:])
    return staged_seconds(kind, nbytes, n, levels)

  def gather(self, nbytes: float, n: int, lo: int, hi: int) -> float:
    """All-gather (or reduce-scatter) of `nbytes` in all over a ring of n
    devices spanning lo..hi: a reduce-scatter's input is the gathered
    array, its steps the same."""
    return self._seconds(ALL_GATHER, nbytes, n, lo, hi)

  def reduce(self, nbytes: float, n: int, lo: int, hi: int) -> float:
    """All-reduce of `nbytes` over a ring of n devices spanning lo..hi."""
    return self._seconds(ALL_REDUCE, nbytes, n, lo, hi)

  def send(self, nbytes: float, a: int, b: int) -> float:
    """Sends `nbytes` from device a to device b."""
    if nbytes == 0:
      return 0.0
    return send_seconds(nbytes, *self.link(min(a, b), max(a, b)))


__all__ = ["Ring"]
