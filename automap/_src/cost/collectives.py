"""Collective time model: rings over one link, and rings axis by axis.

`nbytes` is always a collective's per-device result bytes, the figure
compiled HLO shows: the whole gathered array for an all-gather, one
device's tile for a reduce-scatter, the reduced buffer for an all-reduce,
the exchanged buffer for an all-to-all or collective-permute. Bandwidths
are bytes/s in one direction of one device's share of a ring, latencies
seconds per ring step.
"""

from __future__ import annotations

from collections.abc import Sequence

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "collective-permute")
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, PERMUTE = range(5)


def ring_seconds(kind: int, nbytes: float, n: int, bandwidth: float,
                 latency: float) -> float:
  """Seconds of one collective of `kind` (an index into KINDS) over a ring
  of n devices on one link, `nbytes` its per-device result bytes.

  Each of the n - 1 steps pays `latency` and moves a 1/n share of the
  array; an all-reduce is a reduce-scatter then an all-gather, twice that.
  A collective-permute is priced as an all-gather of its buffer.
  """
  if kind == ALL_REDUCE:
    return 2 * (n - 1) * latency + 2 * (n - 1) / n * nbytes / bandwidth
  if kind == REDUCE_SCATTER:  # the result is one share
    return (n - 1) * latency + (n - 1) * nbytes / bandwidth
  return (n - 1) * latency + (n - 1) / n * nbytes / bandwidth


def staged_seconds(kind: int, nbytes: float, n: int,
                   stages: Sequence[tuple[int, float, float]]) -> float:
  """Seconds of an all-reduce, all-gather or reduce-scatter over several
  mesh axes, run axis by axis in the order of `stages` ((devices,
  bandwidth, latency) per axis, their devices' product n).

  The bucket algorithm of a torus, hierarchical across nodes: each stage
  is one ring over its axis, and the reduce-scatter's input, the gather's
  result and the all-reduce's buffer shrink by that axis's size for the
  next. The bytes on the wire are one flat ring's; the latency steps
  sum(devices - 1) rather than n - 1. `nbytes` as in `ring_seconds`.
  """
  full = nbytes * n if kind == REDUCE_SCATTER else nbytes
  seconds = 0.0
  for size, bandwidth, latency in stages:
    seconds += (size - 1) * latency + (size - 1) / size * full / bandwidth
    full /= size
  return 2 * seconds if kind == ALL_REDUCE else seconds


def levels(n: int, stride: float, crosses: bool, per_node: int,
           fast: tuple[float, float], slow: tuple[float, float]) -> list[tuple[int, float, float]]:
  """(devices, bandwidth, latency) per level of a ring of n devices `stride`
  apart: one level on the node's links (`fast`) where it stays within a
  node; where it `crosses` nodes with several of its devices in each, two:
  within each node, then across in as many rings, each with its share
  (NCCL's rings over multi-NIC nodes, XLA's cross-slice collectives); with
  one device per node, one level on the network (`slow`)."""
  if not crosses:
    return [(n, *fast)]
  within = min(n, int(per_node // stride)) if stride < per_node else 1
  if within > 1 and n % within == 0:
    return [(within, *fast), (n // within, *slow)]
  return [(n, *slow)]


def send_seconds(nbytes: float, bandwidth: float, latency: float) -> float:
  """Seconds to send `nbytes` from one device to another over one link."""
  return nbytes / bandwidth + latency
