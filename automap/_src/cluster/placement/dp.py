"""Device placement: pipeline stages x tensor x data parallelism over a layer graph.

The placement half of PHAZE. A plan splits the graph into pipeline stages
(each prefix of stages a downset), runs stage i on its own tensor-parallel
width, replicates the pipeline d ways and, per stage, stashes or recomputes.
Under 1F1B (PipeDream-Flush) a batch of m microbatches over S stages takes
(m + S - 1) * max_i T_i + max_i Y_i seconds, T_i a stage's time per
microbatch (`stage_costs`) and Y_i its exposed data-parallel sync; the
interleaved schedule (v chunks a stage) takes (m + (S - 1) / v) * max_i T_i
+ max_i Y_i (`uniform`). The search is exact: a dynamic program over
(downset still to place, stages after it) keeping per state the Pareto
front of (devices used, max T, max Y), inside a loop over the data-parallel
degree and ZeRO stage, pruned by bounds on what a partial plan can reach
(`StageCosts.packed_work`). Devices are numbered pipeline-major, so a
group's link level follows from where its devices sit.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re
from collections.abc import Sequence
from typing import Any

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.placement import stage_costs
from automap._src.cluster.placement.options import PlacementOptions
from automap._src.cluster.placement.placed import Placement
from automap._src.cluster.placement.stage_costs import Problem, StageCosts
from automap._src.cluster.profile.layer_graph import LayerGraph
from automap._src.cluster.schedule import schedules
from automap._src.cost.hardware import Hardware
from automap._src.search.request import with_keywords

# Downsets enumerated at most; wider graphs should be coarsened into layer groups.
MAX_DOWNSETS = 4096


def _downsets(graph: LayerGraph) -> list[int]:
  """Every downset of the graph as a bitmask over layer indices (empty first)."""
  index = {layer.name: i for i, layer in enumerate(graph.layers)}
  preds = [0] * len(graph.layers)
  for src, dst, _ in graph.edges:
    preds[index[dst]] |= 1 << index[src]
  seen = {0}
  frontier = [0]
  while frontier:
    grown = []
    for down in frontier:
      for i, p in enumerate(preds):
        bit = 1 << i
        if not down & bit and p & down == p and down | bit not in seen:
          seen.add(down | bit)
          grown.append(down | bit)
      if len(seen) > MAX_DOWNSETS:
        raise PlacementError(
            f"the layer graph has more than {MAX_DOWNSETS} downsets (too many parallel "
            f"branches); group layers into coarser nodes before placing.")
    frontier = grown
  return sorted(seen, key=lambda s: (bin(s).count("1"), s))


def _completion_floor(before: int, t_max: float, longest: float, work: float, fastest: float,
                      spare: int, head: int, transfer: float) -> float:
  """A lower bound on (m + S - 1) * max T with `before` = m + (stages so far)
  and `head` still to place on at most `spare` devices in S' >= 1 more stages:
  min over S' of (before + S') * max(T so far, the slowest layer, the work
  over the devices, the layers' fastest times over S'), at the S' where the
  last two cross; each new stage also pays the least transfer `transfer`."""
  if not head:
    return before * t_max
  if spare <= 0:
    return math.inf
  floor = max(longest, work / spare)
  cross = fastest / floor
  counts = {max(1, min(spare, math.floor(cross))), max(1, min(spare, math.ceil(cross)))}
  return min((before + s) * max(t_max, max(floor, fastest / s) + transfer) for s in counts)


def _best_at(graph: LayerGraph, costs: StageCosts, downs: list[int], d: int, zero: int,
               bound: float) -> Placement | None:
  """The best placement with data-parallel degree d and ZeRO stage `zero`
  taking less than `bound` seconds per batch, if any."""
  problem = costs.problem
  m = problem.microbatches // d
  per_pipeline = problem.devices // d
  # fronts[k][remaining downset] -> Pareto front of (devices used, max T, max Y,
  # stages), built from the end of the graph backwards: stage positions count
  # from the pipeline's last device, and the k stages after a state fix the
  # in-flight count of the next one.
  # choices: a linked list ((members, width, recompute mode, first device,
  # in flight), rest of the list) of the stages chosen so far.
  fronts: list[dict[int, list[tuple]]] = [{downs[-1]: [(0, 0.0, 0.0, None)]}]
  best: Placement | None = None
  earlier: dict[int, list[tuple]] = {}
  single_level = costs.single_level
  for k in range(len(graph.layers)):
    after: dict[int, list[tuple]] = {}
    # This stage's microbatches in flight under 1F1B (`schedules.ONE_F_ONE_B`:
    # min(S - s, m) with k stages after it); the head's stages keep more.
    in_flight, ahead = min(k + 1, m), min(k + 2, m)
    for rest, front in fronts[k].items():
      least_used = min(f[0] for f in front)
      least_t, least_y = min(f[1] for f in front), min(f[2] for f in front)
      for head in costs.downsets_inside(rest, downs):
        members = rest & ~head
        most, choices = costs.choices(members, d, zero, per_pipeline)
        if in_flight > most:
          continue
        spare = per_pipeline - least_used - 1
        longest, work = costs.longest(head), (
            costs.packed_work(head, ahead, d, zero, spare) if head and spare > 0 else 0.0)
        if _completion_floor(m + k, least_t, longest, work, costs.fastest(head), spare, head,
                  costs.least_transfer) + least_y >= bound:
          continue
        for t, mode, base, per_flight, timing in choices:
          if base + in_flight * per_flight > problem.memory:
            continue
          if single_level:  # one link level: the stage's position changes nothing
            time, sync = timing
          else:
            table = timing  # first device -> (T, Y)
          for used, t_max, y_max, chosen in front:
            if used + t > per_pipeline:
              continue
            first = per_pipeline - used - t
            if not single_level:
              found = table.get(first)
              if found is None:
                found = table[first] = costs.times(members, t, mode, first, d,
                                                   per_pipeline, zero)
              time, sync = found
            t_new = t_max if t_max > time else time
            y_new = y_max if y_max > sync else sync
            # Any completion has at least k + 1 stages, these maxima, and
            # spreads the work left over the devices left at best.
            floor = t_new if t_new > longest else longest
            if first:
              floor = floor if floor > work / first else work / first
            elif head:
              continue
            if (m + k) * floor + y_new >= bound:
              continue
            if head and first < spare:  # the head's memory on fewer devices
              packed = costs.packed_work(head, ahead, d, zero, first) / first
              if (m + k) * packed + y_new >= bound:
                continue
            entry = (used + t, t_new, y_new, ((members, t, mode, first, in_flight), chosen))
            if any(f[0] <= entry[0] and f[1] <= t_new and f[2] <= y_new
                   for f in earlier.get(head, ())):
              continue
            target = after.setdefault(head, [])
            if any(f[0] <= entry[0] and f[1] <= t_new and f[2] <= y_new for f in target):
              continue
            target[:] = [f for f in target
                         if not (entry[0] <= f[0] and t_new <= f[1] and y_new <= f[2])]
            target.append(entry)
    for used, t_max, y_max, chosen in after.pop(0, []):
      time = (m + k) * t_max + y_max
      if time < bound and problem.stages in (None, k + 1):
        # Stage offsets were counted from the end; shift onto device 0.
        shift = per_pipeline - used
        stages = []
        while chosen is not None:
          (members, t, mode, first, n), chosen = chosen
          stage = costs.stage(members, t, mode, first, n, d, per_pipeline, zero)
          stages.append(dataclasses.replace(stage, first_device=first - shift))
        bound, best = time, Placement(d, m, zero, tuple(stages), used * d, time,
                                      shard_group=problem.hybrid_group(d, zero))
    if not after or (problem.stages is not None and k + 1 >= problem.stages):
      break
    if problem.stages is None:  # keep what no later entry can beat
      for rest, front in after.items():
        kept = [f for f in earlier.get(rest, ())
                if not any(e[0] <= f[0] and e[1] <= f[1] and e[2] <= f[2] for e in front)]
        earlier[rest] = kept + front
    fronts.append(after)
  return best


def place(graph: LayerGraph, *, devices: int, microbatches: int, hardware: str | Hardware,
          options: PlacementOptions | None = None, **keywords: Any) -> Placement:
  """The fastest placement of `graph` on `devices` devices.

  The DP searches pipeline stages (each a downset of the graph), their
  tensor-parallel widths and recompute modes, the data-parallel degree and
  the ZeRO stage under 1F1B; where the options allow, interleaved splits
  of the repeated block too (`PlacementOptions.virtual_stages`).

  Args:
    graph: the layer graph, its costs per microbatch.
    devices: devices in the cluster.
    microbatches: microbatches per batch over all data-parallel replicas
      (each of d replicas runs microbatches / d of them; d must divide it).
    hardware: a catalogue name or a `Hardware`: its links price collectives
      and transfers; its `hbm_capacity` is the memory limit unless the
      options give `memory_limit` (bytes per device, or None for none).
    options: an `automap.cluster.PlacementOptions`: memory_limit, optimizer,
      zero, recompute, widths, data_parallel, stages (see its docstring).
    **keywords: `options`' fields given one by one instead
      (`place(..., zero=0)`), but not both ways.

  Returns:
    The fastest `Placement` that fits the memory limit.

  Raises:
    PlacementError: no placement fits (the message says what the
      parameters alone need), a stated data_parallel or stages beyond the
      devices, or a graph too wide to enumerate.
    TypeError: a keyword that is no `PlacementOptions` field, or one given
      both ways.
  """
  options = with_keywords(PlacementOptions, options, keywords, "place")
  return place_any([(graph, microbatches)], devices=devices, hardware=hardware,
                   options=options)[0]


def place_any(candidates: Sequence[tuple[LayerGraph, int]], *, devices: int,
              hardware: str | Hardware, options: PlacementOptions | None = None,
              bound: float = math.inf) -> tuple[Placement, int]:
  """The fastest placement of any of (graph, microbatches) candidates (a model
  at several microbatch sizes), and the index of the one it places; the
  candidates share one bound, so the later ones are mostly pruned. Only
  plans faster than `bound` seconds per batch count: a caller that needs no
  slower one says so and the search prunes from the start."""
  options = options if options is not None else PlacementOptions()
  data_parallel, stages = options.data_parallel, options.stages
  for name, value in (("data_parallel", data_parallel), ("stages", stages)):
    if value is not None and not value <= devices:
      raise PlacementError(f"{name} must be None or an int in 1..devices={devices}, "
                           f"got {value!r}.")
  best: tuple[Placement, int] | None = None
  for i, (graph, microbatches) in enumerate(candidates):
    problem = stage_costs.problem(devices, microbatches, hardware, options)
    found = _search(graph, problem, data_parallel, bound if best is None else best[0].time)
    if found is not None:
      best = (found, i)
    sharding = tuple(z for z in problem.zero if z)
    if options.hybrid and sharding and devices > problem.hw.devices_per_node:
      # ZeRO within each slice, data parallelism across slices (HSDP).
      hybrid = dataclasses.replace(problem, zero=sharding, shard_group=stage_costs.SLICE)
      found = _search(graph, hybrid, data_parallel, bound if best is None else best[0].time)
      if found is not None:
        best = (found, i)
  if best is None and bound < math.inf:
    raise PlacementError(f"no placement takes less than bound={bound:.4g} s per batch.")
  if best is None and options.virtual_stages not in (None, 1):
    raise PlacementError(
        f"no interleaved placement with virtual_stages={options.virtual_stages} fits: it needs "
        f"2 or more stages, microbatches per replica a multiple of the stage count, stages x "
        f"virtual_stages blocks at least, and the memory; use virtual_stages=None to let the "
        f"plain schedule stand where interleaving cannot.")
  if best is None:
    graph = candidates[0][0]
    need = graph.least_params() / devices
    raise PlacementError(
        f"no placement of the {len(graph.layers)} layers on {devices} devices"
        f"{'' if data_parallel is None else f' with data_parallel={data_parallel}'}"
        f"{'' if stages is None else f' in {stages} stages'} fits "
        f"memory_limit={problem.memory:.4g} bytes per device (parameters alone need at least "
        f"{need:.4g} bytes per device when spread over all devices); raise the memory "
        "limit, allow recompute or ZeRO, or add devices.")
  return best


def _search(graph: LayerGraph, problem: Problem, data_parallel: int | None,
            bound: float) -> Placement | None:
  """The fastest placement under `bound` seconds per batch, if any: the DP's
  (plain 1F1B) and, where the options allow it, an interleaved one's."""
  costs = StageCosts(graph, problem)
  v = problem.virtual_stages
  best = None if v not in (None, 1) else _search_plain(graph, costs, data_parallel, bound)
  if v != 1:
    found = _search_interleaved(costs, data_parallel, bound if best is None else best.time,
                                (2, 4, 8) if v is None else (v,))
    best = found or best
  return best


def _search_plain(graph: LayerGraph, costs: StageCosts, data_parallel: int | None,
                  bound: float) -> Placement | None:
  """The DP's fastest plain-1F1B placement under `bound`, if any."""
  problem = costs.problem
  downs = _downsets(graph)
  best: Placement | None = None
  # ZeRO 1 costs what ZeRO 0 does (one all-reduce per batch) in less memory:
  # with both allowed only ZeRO 1 is searched, and its plan is reported as
  # ZeRO 0 when it fits unsharded too.
  zero1_for_zero0 = 0 in problem.zero and 1 in problem.zero
  # Most promising first (by lower bound): a good plan early prunes the rest.
  tries = sorted((costs.lower_bound(d, z), -d, z) for d in range(1, problem.devices + 1)
                 for z in problem.zero
                 if not problem.microbatches % d and data_parallel in (None, d)
                 and not (z and d == 1 and 0 in problem.zero)  # d = 1: nothing to shard
                 and not (z == 0 and d > 1 and zero1_for_zero0))
  # A tight bound prunes hard: with none given, plans are first sought under
  # a guess a little above the most promising floor, raised until some plan
  # beats it. A round that finds one is exact, as every try ran under the
  # guess or the best.
  slack = 0.25 if bound == math.inf else math.inf
  while tries:
    least = tries[0][0]
    limit = min(bound, least * (1 + slack)) if 0 < least < math.inf else bound
    for floor, d, z in tries:
      if floor >= (limit if best is None else best.time):
        break
      plan = _best_at(graph, costs, downs, -d, z, limit if best is None else best.time)
      best = plan or best
    if best is not None or limit >= bound:
      break
    slack = slack * 2 if slack < 2 else math.inf
  if best is not None and best.zero == 1 and zero1_for_zero0:
    best = _unsharded(costs, best) or best
  return best


def _stem(name: str) -> str:
  """A layer's name without its index, repeat or reuse suffixes:
  "block_3", "block_1*12" (a `LayerGraph.repeat` copy), "enc_0#2" -> "block",
  "block", "enc"."""
  return re.sub(r"_?\d+$", "", re.sub(r"(\*\d+)?(#\d+)?$", "", name))


def chunks(graph: LayerGraph, count: int) -> list[int] | None:
  """The graph cut into `count` chunks (layer bitmasks, in order) holding
  equally many of its most frequent layer kind (the repeated block), or
  where they do not divide, one fewer in the chunks nearest the ends (which
  also hold the embedding and the head, as Megatron-DeepSpeed and Llama 3
  split 70 and 126 layers); other layers join the chunk of the block before
  them (the first chunk before any). None where there are fewer blocks than
  chunks or some edge skips a chunk, which a pipeline of chunks cannot
  carry."""
  order = graph.order()
  # The repeated block: the most frequent kind of layers of one structure
  # (the ops they compute) where the graph was traced; else of layers priced
  # alike, or where no kind fills the chunks (a clock with overlap prices
  # equal blocks apart by what runs beside them), layers of one name but for
  # their index ("block_3", "enc_1") with equal parameters at every width.
  keys = ([lambda layer: layer.structure]
          if all(layer.structure is not None for layer in graph.layers) else
          [lambda layer: tuple(sorted(layer.widths.items())),
           lambda layer: (_stem(layer.name), tuple(sorted(
               (t, f"{c.params:.6g}") for t, c in layer.widths.items())))])
  block = kind = None
  for key in keys:
    templates: dict[tuple, int] = {}
    kind = [templates.setdefault(key(layer), len(templates)) for layer in graph.layers]
    counts: dict[int, int] = {}
    for i in order:  # a module used again ("embed#2", a tied head) is no block
      if "#" not in graph.layers[i].name:
        counts[kind[i]] = counts.get(kind[i], 0) + 1
    # Of as frequent kinds, the largest (a decoder's blocks over an
    # encoder's, either over a tied embedding's two uses).
    size = {k: min(layer.widths.items())[1].params for k, layer in zip(kind, graph.layers)}
    block = max(counts, key=lambda k: (counts[k], size[k], -k))
    if counts[block] >= count:
      break
  if counts[block] < count:
    return None
  base, extra = divmod(counts[block], count)
  # The `extra` chunks farthest from the ends take one block more.
  inner = sorted(range(count), key=lambda c: (-min(c, count - 1 - c), c))[:extra]
  ends = list(itertools.accumulate(base + (c in inner) for c in range(count)))
  seen, chunk = 0, 0
  chunk_of = [0] * len(order)
  for i in order:
    if kind[i] == block and "#" not in graph.layers[i].name:
      chunk = bisect.bisect_right(ends, seen)
      seen += 1
    chunk_of[i] = chunk
  index = {layer.name: i for i, layer in enumerate(graph.layers)}
  if any(not 0 <= chunk_of[index[d]] - chunk_of[index[s]] <= 1 for s, d, _ in graph.edges):
    return None
  masks = [0] * count
  for i, c in enumerate(chunk_of):
    masks[c] |= 1 << i
  return masks


def uniform(costs: StageCosts, masks: list[int], *, data_parallel: int, stages: int,
            virtual: int, width: int, zero: int, fits: bool = True,
            schedule: str | None = None) -> Placement | None:
  """The placement running chunk c of `masks` (S * v of them, in order) on
  stage c mod S, each stage on `width` devices, replicated `data_parallel`
  ways; per stage the fastest allowed recompute mode that fits in memory
  (with `fits` False: the fastest, fitting or not). None where no mode of
  some stage fits or a stage's layers lack the width. schedule: a
  registered schedule's name (None: 1F1B, interleaved where v > 1); each
  stage holds what it keeps in flight (`Schedule.in_flight`), and every
  schedule takes (m + (S - 1) / v) of the slowest stage's time per
  microbatch (GPipe: 1F1B's time, every microbatch held)."""
  o = costs.problem
  d, S, v, t = data_parallel, stages, virtual, width
  m = o.microbatches // d
  per_pipeline = S * t
  sched = schedules.get(schedule or schedules.default(v))
  chosen = []
  for s in range(S):
    members = 0
    for k in range(v):
      members |= masks[s + k * S]
    if t not in costs.widths(members):
      return None
    held = sched.in_flight(s, S, m, v)
    options = []
    for mode in o.recompute:
      memory = costs.memory(members, t, mode, held, d, zero)
      if fits and memory > o.memory:
        continue
      time, sync = costs.times(members, t, mode, s * t, d, per_pipeline, zero)
      options.append((time, sync, memory, mode))
    if not options:
      return None
    time, sync, _, mode = min(options)
    chosen.append((members, mode, held, time, sync))
  t_max = max(c[3] for c in chosen)
  total = (m + (S - 1) / v) * t_max + max(c[4] for c in chosen)
  built = tuple(costs.stage(members, t, mode, s * t, held, d, per_pipeline, zero)
                for s, (members, mode, held, _, _) in enumerate(chosen))
  return Placement(d, m, zero, built, per_pipeline * d, total, v, sched.name,
                   o.hybrid_group(d, zero))


def _search_interleaved(costs: StageCosts, data_parallel: int | None, bound: float,
                        virtuals: Sequence[int]) -> Placement | None:
  """The fastest interleaved placement (equal chunks, equal widths) under
  `bound`, if any. Megatron-LM's rule: microbatches per replica a multiple of
  the stage count."""
  o = costs.problem
  best: Placement | None = None
  widths = sorted({t for layer in costs.graph.layers for t in layer.widths
                   if o.widths is None or t in o.widths})
  # No stage does less than its share of the layers' fastest work: a floor
  # on (m + (S - 1) / v) * max T that skips most splits unpriced.
  work = costs.fastest((1 << len(costs.graph.layers)) - 1)
  for v in virtuals:
    for S in range(2, len(costs.graph.layers) // v + 1):
      if o.stages not in (None, S):
        continue
      masks = None
      for d in range(1, o.devices // S + 1):
        if o.microbatches % d or (o.microbatches // d) % S or data_parallel not in (None, d):
          continue
        m = o.microbatches // d
        if (m + (S - 1) / v) * work / S >= (bound if best is None else best.time):
          continue
        masks = masks or chunks(costs.graph, S * v)
        if masks is None:
          break
        for t in widths:
          if d * S * t > o.devices:
            break
          for zero in o.zero:
            if zero and d == 1 and 0 in o.zero:
              continue
            plan = uniform(costs, masks, data_parallel=d, stages=S, virtual=v, width=t,
                           zero=zero)
            if plan is not None and plan.time < (bound if best is None else best.time):
              best = plan
  return best


def _unsharded(costs: StageCosts, plan: Placement) -> Placement | None:
  """`plan` under ZeRO 0 (the same times), if every stage still fits."""
  stages = []
  for s in plan.stages:
    members = sum(1 << costs.index[name] for name in s.layers)
    memory = costs.memory(members, s.width, s.recompute_mode, s.in_flight, plan.data_parallel, 0)
    if memory > costs.problem.memory:
      return None
    stages.append(dataclasses.replace(s, memory=memory))
  return dataclasses.replace(plan, zero=0, stages=tuple(stages), shard_group=None)


__all__ = ["MAX_DOWNSETS", "place", "place_any"]
