"""Ring collectives over a cluster's links: within a node (or TPU slice) on
the hardware's `link_*`, across nodes on its `network_*`, by the span of
devices a ring joins. Seconds for arrays of `nbytes` in all."""

from __future__ import annotations

from automap._src.cost.collectives import ALL_GATHER, ALL_REDUCE, ring_seconds, send_seconds
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

  def gather(self, nbytes: float, n: int, lo: int, hi: int) -> float:
    """All-gather (or reduce-scatter) of `nbytes` in all over a ring of n
    devices spanning lo..hi: a reduce-scatter's input is the gathered
    array, its steps the same."""
    if n == 1 or nbytes == 0:
      return 0.0
    return ring_seconds(ALL_GATHER, nbytes, n, *self.link(lo, hi))

  def reduce(self, nbytes: float, n: int, lo: int, hi: int) -> float:
    """All-reduce of `nbytes` over a ring of n devices spanning lo..hi."""
    if n == 1 or nbytes == 0:
      return 0.0
    return ring_seconds(ALL_REDUCE, nbytes, n, *self.link(lo, hi))

  def send(self, nbytes: float, a: int, b: int) -> float:
    """Sends `nbytes` from device a to device b."""
    if nbytes == 0:
      return 0.0
    return send_seconds(nbytes, *self.link(min(a, b), max(a, b)))


__all__ = ["Ring"]
