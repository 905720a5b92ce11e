"""A traced loss cut into pipeline chunks at a cluster plan's layer boundaries.

`loss_fn(params, *batch)` is traced once, at one replica's microbatch, and
its equations flattened in program order: plain calls (`jit`) are inlined,
everything else (custom derivatives, `checkpoint`, loops) stays one
equation. Each equation carries the layers of the primitives in it, named
exactly as the planner names them (`layers.LayerCut`: the first name-scope
component, unscoped operations joining the layer before them, a label met
again later numbered "#2"). A plan's stages list their layers. With one chunk
per stage, a stage's layers are its chunk wherever they lie in the program
(a tied embedding's second use, placed early); with v chunks per stage,
walking the layers in program order a new chunk starts wherever the stage
changes, S * v chunks in all, chunk c on stage c mod S.

A chunk is a function of the parameters and batch leaves it reads and of the
values earlier chunks made that it reads; it returns what later chunks read
(and the loss, for the last). A chunk reading what a later one makes is an
error naming both stages; so is an equation holding layers of two chunks (a
`scan` over the blocks, a `checkpoint` around two of them), which cannot be
cut.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jex

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.execute import rolled as rolled_lib
from automap._src.cluster.placement.placed import Placement
from automap._src.ir.naming import containers, layer_of, layer_runs
from automap._src.ir.walk import INLINE


@dataclasses.dataclass(frozen=True)
class Op:
  """One flattened equation: `ins` value ids per Var operand (literals stay in
  the equation), `outs` per result (-1: dropped)."""

  eqn: Any  # jex.JaxprEqn
  ins: tuple[int, ...]
  outs: tuple[int, ...]
  scope: str

  def run(self, *values):
    """The equation applied to its Var operands' values."""
    eqn = self.eqn
    variables = [v for v in eqn.invars if isinstance(v, jex.Var)]
    results = [v for v in eqn.outvars if not isinstance(v, jex.DropVar)]
    info = jex.DebugInfo("pipeline chunk", self.scope or "top level",
                         tuple(f"x{k}" for k in range(len(variables))),
                         tuple(f"y{k}" for k in range(len(results))))
    jaxpr = jex.Jaxpr((), variables, results, [eqn], eqn.effects, info)
    return jex.jaxpr_as_fun(jex.ClosedJaxpr(jaxpr, ()))(*values)


@dataclasses.dataclass(frozen=True)
class Chunk:
  """Model chunk `index`, run on pipeline stage `stage`.

  params, batch: indices of the flat parameter and batch leaves it reads.
  receives: ids of values earlier chunks made that it reads.
  sends: ids of values it makes that later chunks read; the last chunk sends
    the loss alone.
  """

  index: int
  stage: int
  layers: tuple[str, ...]
  ops: tuple[int, ...]
  params: tuple[int, ...]
  batch: tuple[int, ...]
  receives: tuple[int, ...]
  sends: tuple[int, ...]
  segments: tuple[tuple[int, ...], ...] = ()  # its ops per layer, in order


@dataclasses.dataclass(frozen=True)
class Cut:
  """A loss program cut into chunks; `run(c, ...)` evaluates chunk c."""

  ops: tuple[Op, ...]
  consts: dict[int, Any]
  param_ids: tuple[int, ...]  # per flat parameter leaf, its value id
  batch_ids: tuple[int, ...]  # per flat batch leaf
  loss_id: int
  layers: tuple[str, ...]  # in program order
  chunks: tuple[Chunk, ...]

  @property
  def stages(self) -> int:
    return 1 + max(c.stage for c in self.chunks)

  @functools.cached_property
  def avals(self) -> dict[int, Any]:
    """Value id -> abstract value, for every value an equation makes."""
    return {i: v.aval for op in self.ops for i, v in zip(op.outs, op.eqn.outvars) if i >= 0}

  def run(self, index: int, params: Sequence, batch: Sequence, received: Sequence,
          tag: Callable[[int, Any], Any] = lambda i, x: x,
          wrap: Callable[[Callable], Callable] | None = None, every: int = 1,
          stacks: Sequence | None = None, roll: bool = True,
          own_remat: bool = False) -> list:
    """Chunk `index` on its parameter leaves, batch leaves and received
    values (in the order `Chunk` lists them): the values it sends.
    `tag(value id, value)` sees every value the chunk makes (selective
    recompute names some). With `wrap` (e.g. `jax.checkpoint`), each layer
    runs as `wrap(layer)(its inputs)`: recompute rebuilds one layer at a
    time, keeping each layer's inputs, as Megatron-LM recomputes; with
    `every` = k only the chunk's first layer and every k-th after it.
    With `own_remat`, a layer holding a `jax.checkpoint` of its own (flax's
    `nn.remat`) runs unwrapped, its own policy deciding what it keeps.
    With `roll`, runs of identical layers (`rolled`) run as one scan each
    (where every layer recomputes alike), over `stacks` (the parameters
    `stacked` names, stacked by the caller) or over their parameters stacked
    here."""
    c = self.chunks[index]
    env = dict(self.consts)
    env.update(zip((self.param_ids[i] for i in c.params), params))
    env.update(zip((self.batch_ids[i] for i in c.batch), batch))
    env.update(zip(c.receives, received))
    rolled = {r.first: r for r in self.rolled[index]} if roll and every == 1 else {}
    if wrap is None and not rolled:
      self._eval(c.ops, env, tag)
      return [env[i] for i in c.sends]
    needed_after = self.read_after(index)
    k, used = 0, 0
    while k < len(c.segments):
      segment, after = c.segments[k], needed_after[k]
      if k in rolled:
        run, n = rolled[k], len(rolled[k].stacked)
        own = own_remat and self._remats(segment)
        self._scan(c, run, env, tag, None if own else wrap,
                   None if stacks is None else stacks[used:used + n])
        k, used = k + run.count, used + n
        continue
      if wrap is None or k % every or (own_remat and self._remats(segment)):
        self._eval(segment, env, tag)
        k += 1
        continue
      made = [i for o in segment for i in self.ops[o].outs if i >= 0]
      inside = set(made)
      needs = sorted({i for o in segment for i in self.ops[o].ins
                      if i not in inside and i not in self.consts})
      keeps = [i for i in made if i in after]

      def layer(*xs, segment=segment, needs=needs, keeps=keeps):
        local = dict(self.consts)
        local.update(zip(needs, xs))
        self._eval(segment, local, tag)
        return [local[i] for i in keeps]

      env.update(zip(keeps, wrap(layer)(*(env[i] for i in needs))))
      k += 1
    return [env[i] for i in c.sends]

  def read_after(self, index: int) -> list[set[int]]:
    """Per layer of chunk `index` (its segments), the ids that later layers
    of the chunk read or the chunk sends."""
    c = self.chunks[index]
    later = set(c.sends)
    out: list[set[int]] = []
    for segment in reversed(c.segments):
      out.append(set(later))
      later |= {i for o in segment for i in self.ops[o].ins}
    return out[::-1]

  def _remats(self, segment: Sequence[int]) -> bool:
    """Whether the layer holds a `jax.checkpoint` equation of its own."""
    return any(self.ops[o].eqn.primitive.name in ("checkpoint", "remat2") for o in segment)

  @functools.cached_property
  def rolled(self) -> tuple[tuple[rolled_lib.Run, ...], ...]:
    """Per chunk, its runs of identical layers, each run as one scan."""
    return tuple(rolled_lib.runs(self, c) for c in self.chunks)

  def stacked(self, index: int) -> tuple[tuple[int, ...], ...]:
    """Chunk `index`'s parameters its rolled runs read stacked, in the order
    `run` takes their stacks: per stack, the positions in `Chunk.params` of
    its layers' leaves."""
    c = self.chunks[index]
    at = {self.param_ids[i]: k for k, i in enumerate(c.params)}
    return tuple(tuple(at[i] for i in ids) for r in self.rolled[index] for ids in r.stacked)

  def held_stacked(self, index: int) -> tuple[tuple[int, ...], ...]:
    """Chunk `index`'s stacks (`stacked`, in its order) that nothing outside
    their run reads, as the flat parameter indices of their layers' leaves:
    what a step's state may hold as one stacked leaf, the run's scan reading
    it whole and its gradient coming back stacked."""
    c = self.chunks[index]
    out = []
    for r in self.rolled[index]:
      inside = {o for segment in c.segments[r.first:r.first + r.count] for o in segment}
      for ids in r.stacked:
        if all(self._param_readers[i] <= inside for i in ids):
          out.append(tuple(self._param_leaf[i] for i in ids))
    return tuple(out)

  @functools.cached_property
  def _param_leaf(self) -> dict[int, int]:
    return {v: k for k, v in enumerate(self.param_ids)}

  @functools.cached_property
  def _param_readers(self) -> dict[int, set[int]]:
    """Parameter value id -> the ops reading it."""
    readers: dict[int, set[int]] = {i: set() for i in self.param_ids}
    for o, op in enumerate(self.ops):
      for i in op.ins:
        if i in readers:
          readers[i].add(o)
    return readers

  def _scan(self, chunk: Chunk, run: rolled_lib.Run, env: dict, tag: Callable,
            wrap: Callable | None, stacks: Sequence | None) -> None:
    """A run of identical layers as one `lax.scan` of the first's equations
    over their parameters stacked (`stacks`, else stacked here), each layer
    under `wrap` as unrolled."""
    template = chunk.segments[run.first]
    shared = [env[i] for i in run.shared]

    def layer(carry, xs):
      local = dict(self.consts)
      local.update(zip(run.shared, shared))
      local.update(zip(run.carry, carry))
      local.update(zip((ids[0] for ids in run.stacked), xs))
      self._eval(template, local, tag)
      return [local[i] for i in run.carry_out]

    step = layer if wrap is None else wrap(layer)
    xs = stacks if stacks is not None else [jnp.stack([env[i] for i in ids])
                                            for ids in run.stacked]
    carry, _ = jax.lax.scan(lambda c, x: (step(c, x), None), [env[i] for i in run.carry], xs)
    env.update(zip(run.last_out, carry))

  def _eval(self, ops: Sequence[int], env: dict, tag: Callable) -> None:
    for o in ops:
      op = self.ops[o]
      outs = op.run(*(env[i] for i in op.ins))
      for i, x in zip((i for i in op.outs if i >= 0), outs):
        env[i] = tag(i, x)

  def attention_scores(self) -> frozenset[int]:
    """Ids of the values downstream of a contraction of two activations
    (attention's q.k) up to the next such contraction, the first's result
    included: what selective recompute drops (the rule of
    `layers.attention_scores`, on these equations)."""
    derived, after = set(self.batch_ids), set()
    for op in self.ops:
      if not any(i in derived for i in op.ins):
        continue
      outs = [i for i in op.outs if i >= 0]
      derived.update(outs)
      if op.eqn.primitive.name in ("dot_general", "conv_general_dilated"):
        if (len(op.ins) == 2 and all(i in derived for i in op.ins)
            and not any(i in after for i in op.ins)):
          after.update(outs)
      elif any(i in after for i in op.ins):
        after.update(outs)
    return frozenset(after)


def trace(loss_fn: Callable, params, batch: Sequence) -> tuple[list[Op], dict, tuple, tuple, int]:
  """(ops, consts, param ids, batch ids, loss id) of `loss_fn(params, *batch)`."""
  closed = jax.make_jaxpr(loss_fn)(params, *batch)
  if len(closed.out_avals) != 1 or closed.out_avals[0].shape != ():
    raise PlacementError(
        f"loss_fn: must return one scalar loss to pipeline, got {closed.out_avals}; return "
        "the loss alone (auxiliary outputs are not carried between stages).")
  ops: list[Op] = []
  consts: dict[int, Any] = {}
  counter = [0]

  def new() -> int:
    counter[0] += 1
    return counter[0] - 1

  n_params = len(jax.tree.leaves(params))
  inputs = [new() for _ in closed.jaxpr.invars]
  (loss_id,) = _flatten(closed, inputs, "", ops, consts, new)
  if loss_id in inputs or loss_id in consts:
    raise PlacementError("loss_fn: returns an argument or a constant, not a computed loss.")
  return ops, consts, tuple(inputs[:n_params]), tuple(inputs[n_params:]), loss_id


def _flatten(closed, inputs: list[int], scope: str, ops: list, consts: dict, new) -> list[int]:
  jaxpr = closed.jaxpr if isinstance(closed, jex.ClosedJaxpr) else closed
  env: dict = {}
  for var, value in zip(jaxpr.constvars, closed.consts if isinstance(
      closed, jex.ClosedJaxpr) else ()):
    env[var] = new()
    consts[env[var]] = value
  env.update(zip(jaxpr.invars, inputs))

  def read(atom) -> int:
    if isinstance(atom, jex.Literal):
      i = new()
      consts[i] = atom.val
      return i
    return env[atom]

  for eqn in jaxpr.eqns:
    inner = _join(scope, str(eqn.source_info.name_stack))
    key = INLINE.get(eqn.primitive.name)
    if key is not None:
      outs = _flatten(eqn.params[key], [read(a) for a in eqn.invars], inner, ops, consts, new)
    else:
      outs = [-1 if isinstance(v, jex.DropVar) else new() for v in eqn.outvars]
      ops.append(Op(eqn, tuple(env[v] for v in eqn.invars if isinstance(v, jex.Var)),
                    tuple(outs), inner))
    for var, x in zip(eqn.outvars, outs):
      if not isinstance(var, jex.DropVar):
        env[var] = x
  return [read(a) for a in jaxpr.outvars]


def _join(scope: str, inner: str) -> str:
  return f"{scope}/{inner}" if scope and inner else scope or inner


def _primitive_scopes(eqn, scope: str) -> list[str]:
  """The name scope of each primitive in the equation, nested ones opened."""
  subs = list(jex.jaxprs_in_params(eqn.params))
  if not subs or eqn.primitive.name in ("pure_callback", "io_callback"):
    return [scope]
  scopes = []
  for sub in subs:
    for inner in sub.eqns:
      scopes += _primitive_scopes(inner, _join(scope, str(inner.source_info.name_stack)))
  return scopes or [scope]


def layer_names(ops: Sequence[Op]) -> tuple[list[str], list[set[str]]]:
  """(layers in program order, per op the layers of its primitives), named
  as `layers.LayerCut` names them (`naming.containers`, `naming.layer_runs`)."""
  scopes = [_primitive_scopes(op.eqn, op.scope) for op in ops]
  held = containers([s for per in scopes for s in per])
  per_op = [[layer_of(s, containers=held) for s in per] for per in scopes]
  names, index = layer_runs([label for labels in per_op for label in labels])
  of_op, k = [], 0
  for labels in per_op:
    of_op.append({names[i] for i in index[k:k + len(labels)]})
    k += len(labels)
  return names, of_op


def cut(loss_fn: Callable, params, batch: Sequence, placement: Placement) -> Cut:
  """`loss_fn(params, *batch)` (batch at one replica's microbatch) cut into
  the chunks of `placement`'s stages."""
  ops, consts, param_ids, batch_ids, loss_id = trace(loss_fn, params, batch)
  names, of_op = layer_names(ops)
  stage_of: dict[str, int] = {}
  for s, stage in enumerate(placement.stages):
    for name in stage.layers:
      stage_of[name] = s
  missing = [n for n in names if n not in stage_of]
  unknown = [n for n in stage_of if n not in names]
  if missing or unknown:
    raise PlacementError(
        f"plan: its stages name layers {unknown[:4] or 'all of'} that the traced loss_fn "
        f"does not have, and the loss_fn has layers {missing[:4] or 'none'} no stage holds "
        f"(the loss_fn's layers: {names[:8]}{' ...' if len(names) > 8 else ''}); plan it "
        "for this loss_fn and these argument shapes.")
  chunk_of: dict[str, int] = {}
  chunk_stage: list[int] = []
  S, v = len(placement.stages), placement.virtual_stages
  if v == 1:  # a stage is one chunk, its layers wherever they are in the program
    chunk_of, chunk_stage = dict(stage_of), list(range(S))
  for name in names if v > 1 else ():
    if not chunk_stage or chunk_stage[-1] != stage_of[name]:
      chunk_stage.append(stage_of[name])
    chunk_of[name] = len(chunk_stage) - 1
  if chunk_stage != [c % S for c in range(S * v)]:
    raise PlacementError(
        f"plan: walking the loss_fn's layers in program order visits stages {chunk_stage}; a "
        f"plan of {S} stages with {v} chunk(s) each must visit {[c % S for c in range(S * v)]}."
        " Each stage's layers must be consecutive runs, in stage order.")
  op_chunk = []
  for op, mine in zip(ops, of_op):
    chunks = sorted({chunk_of[n] for n in mine})
    if len(chunks) > 1:
      layers = sorted(mine, key=names.index)
      raise PlacementError(
          f"plan: cuts inside one `{op.eqn.primitive.name}` equation (at "
          f"{op.scope or 'the top level'!r}) holding layers {layers}: a pipeline can only cut "
          "between equations. Put these layers in one stage, or call them apart (no "
          "jax.checkpoint, custom derivative, nn.scan or lax.scan around several layers).")
    op_chunk.append(chunks[0])
  made = {i: c for o, c in zip(ops, op_chunk) for i in o.outs if i >= 0}
  for op, c in zip(ops, op_chunk):
    late = [made[i] for i in op.ins if made.get(i, -1) > c]
    if late:
      raise PlacementError(
          f"plan: stage {chunk_stage[c]} reads (at {op.scope or 'the top level'!r}) a value "
          f"stage {chunk_stage[late[0]]} makes later in the pipeline; a stage may only read "
          "what earlier stages or itself make. Place the layers so that values flow forward.")
  if made.get(loss_id) != len(chunk_stage) - 1:
    raise PlacementError(
        f"plan: the loss is computed in chunk {made.get(loss_id)} of {len(chunk_stage)}; the "
        "last stage's last layers must compute it.")
  reads: dict[int, set[int]] = defaultdict(set)  # value id -> chunks reading it
  for o, c in zip(ops, op_chunk):
    for i in o.ins:
      reads[i].add(c)
  param_of = {v: k for k, v in enumerate(param_ids)}
  batch_of = {v: k for k, v in enumerate(batch_ids)}
  chunks = []
  for c, stage in enumerate(chunk_stage):
    mine = [o for o, k in enumerate(op_chunk) if k == c]
    read = sorted({i for o in mine for i in ops[o].ins})
    sends = sorted(i for i, k in made.items() if k == c and any(r > c for r in reads[i]))
    if c == len(chunk_stage) - 1:
      sends = [loss_id]
    segments: dict[str, list[int]] = {}
    for o in mine:  # an equation spanning layers runs with the first
      segments.setdefault(min(of_op[o], key=names.index), []).append(o)
    chunks.append(Chunk(
        c, stage, tuple(n for n in names if chunk_of[n] == c), tuple(mine),
        tuple(param_of[i] for i in read if i in param_of),
        tuple(batch_of[i] for i in read if i in batch_of),
        tuple(i for i in read if i in made and made[i] != c), tuple(sends),
        tuple(tuple(ops) for ops in segments.values())))
  return Cut(tuple(ops), consts, param_ids, batch_ids, loss_id, tuple(names), tuple(chunks))


__all__ = ["Chunk", "Cut", "Op", "cut", "layer_names", "trace"]
