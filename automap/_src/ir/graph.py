"""Partitioning IR: the traced program as flat, numpy-backed tables.

One *op* per primitive equation, in program order; one *value* per array the
program reads or writes. Calls (`jit`, `closed_call`) are inlined. Calls with
semantics of their own (custom derivatives, rematerialisation) are *sealed*:
their bodies join the graph so decisions propagate through them, but the
rewritten program binds them whole, so their inner values take no
constraints. A `scan` body joins the graph once, its ops marked with the
trip count, linked to the scan's operands and results by tie ops that keep
the step dimension whole; the rewritten program runs the scan with its body
re-interpreted, constraints inside. A `cond`'s branches and a `while`'s
condition and body join the graph alike, once each: branches read the
cond's operands as they are (XLA's branches capture them), and a tie per
result joins every branch's value of it, as a tie per carry joins a loop's
initial, body and final values (one layout for all: Shardy's data-flow
edges). Every branch is priced, as if each ran; a while body once (its trip
count is unknown). The program's own layout constraints
(`with_sharding_constraint`) are no ops: their result is their operand's
value, and the layout they state is recorded beside the graph
(`constraints.py`).

Shape letters: V values, O ops.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex

from automap._src.ir import constraints as constraints_lib
from automap._src.ir import factor_rule, rules, slices
from automap._src.ir.constraints import Constraint
from automap._src.ir.trace import Traced
from automap._src.ir.walk import Step, Walk, sub_jaxpr

ARG, CONST, INTERMEDIATE = 0, 1, 2

# Ties joining the values control flow gives one layout: a scan's or while
# loop's carry (initial, body and final values; the first operand is the
# initial), a cond's result (each branch's value).
CARRIES = frozenset({"scan_carry", "while_carry", "cond_result"})
# Ops kept whole on purpose: their results must not depend on the layout, or
# XLA's partitioner gathers them whole anyway (top_k). random_bits is split
# where its bits do not depend on the layout (`jax_threefry_partitionable`).
DELIBERATELY_REPLICATED = frozenset({
    "top_k",
    "random_bits", "random_seed", "random_wrap",
    "random_unwrap", "random_fold_in", "random_split", "threefry2x32",
    "rng_bit_generator", "rng_uniform", "debug_callback", "pure_callback",
    "io_callback", "debug_print", "device_put", "shard_map", "custom_call", "platform_index"})


# Other libraries' primitives that compute what a JAX primitive does, priced
# and propagated as it: equinox's runtime checks reduce over every element
# (`unvmap_*`, outside vmap), its markers are the value itself, and its
# loops' `select_if_vmap` selects between two values (their first, unbatched).
ALIASES = {"unvmap_any": "reduce_or", "unvmap_all": "reduce_and", "unvmap_max": "reduce_max",
           "nonbatchable": "copy", "nondifferentiable_backward": "copy",
           "nontraceable": "copy", "select_if_vmap": "select_n"}


class UnknownPrimitiveWarning(UserWarning):
  """A primitive without a sharding rule: its arrays are kept whole."""


class Literal(NamedTuple):
  shape: tuple[int, ...]
  value: Any


def itemsize(dtype) -> int:
  try:
    return int(np.dtype(dtype).itemsize)
  except TypeError:  # Extended dtypes (PRNG keys): two uint32 words.
    return 8


def body_flops(jaxpr) -> float:
  """FLOPs of a (closed) jaxpr; a scan body counts once per trip, a while
  body once (its trip count is unknown)."""
  if isinstance(jaxpr, jex.ClosedJaxpr):
    jaxpr = jaxpr.jaxpr
  total = 0.0
  for eqn in jaxpr.eqns:
    total += eqn_flops(eqn)
  return total


def eqn_flops(eqn) -> float:
  name, params = ALIASES.get(eqn.primitive.name, eqn.primitive.name), eqn.params
  if name == "scan":
    return params["length"] * body_flops(params["jaxpr"])
  if name == "while":
    return body_flops(params["body_jaxpr"]) + body_flops(params["cond_jaxpr"])
  if name == "cond":
    return max(body_flops(b) for b in params["branches"])
  sub = sub_jaxpr(eqn)
  if sub is not None:
    return body_flops(sub)
  ins = [tuple(getattr(a.aval, "shape", ())) for a in eqn.invars]
  outs = [tuple(v.aval.shape) for v in eqn.outvars]
  return rules.flops(name, ins, outs, params)


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
  """The partitioning IR of one traced program.

  Values [V]: shapes, dtypes, nbytes (whole array, bytes), kind (ARG, CONST,
  INTERMEDIATE), producer (op index, -1 for args and consts), sealed (no
  constraint may be placed on it inside the call that makes it), bound
  (sealed, and returned by the outermost such call: the rewritten program
  sees it there and may pin it), names (argument path or name scope),
  uses (per value, its (op, operand position) pairs), last_use (op index of
  the last reader, -1 if none).
  Ops [O]: prims, operands (value ids, -1 for literals), operand_shapes,
  results (value ids), rules, flops (whole op, one run), trips (runs per
  call: the product of the lengths of the scans around it), scopes.
  inputs: value ids of the flat arguments; outputs: value ids of the flat
  outputs (-1 for a literal output); fingerprint: digest of the program;
  constraints: the program's own layout constraints, in program order.
  checkpoint_names: op -> the name `jax.ad_checkpoint.checkpoint_name` gives
    its result, for its "name" ops (what remat and offload policies select).
  default_precision: the dot_general ops at the default matmul precision
    (no `precision=` above DEFAULT, none set by `jax.default_matmul_precision`),
    which a backend may compute in a narrower type than their operands'.
  """

  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  nbytes: np.ndarray  # [V] int64
  kind: np.ndarray  # [V] int8
  producer: np.ndarray  # [V] int32
  sealed: np.ndarray  # [V] bool
  bound: np.ndarray  # [V] bool: sealed, but a result of a call bound whole
  names: tuple[str, ...]  # [V]
  uses: tuple[tuple[tuple[int, int], ...], ...]  # [V]
  last_use: np.ndarray  # [V] int32
  prims: tuple[str, ...]  # [O]
  operands: tuple[tuple[int, ...], ...]  # [O]
  operand_shapes: tuple[tuple[tuple[int, ...], ...], ...]  # [O]
  results: tuple[tuple[int, ...], ...]  # [O]
  rules: tuple[factor_rule.Rule, ...]  # [O]
  flops: np.ndarray  # [O] float64, one run
  trips: np.ndarray  # [O] int64, runs per call (scan bodies: trip counts)
  regions: np.ndarray  # [O] int32, the cond branch or while body it is in (0: none)
  barriers: np.ndarray  # [O] int32, the recomputation behind a barrier it is in (0: none)
  scopes: tuple[str, ...]  # [O]
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  fingerprint: str
  unknown: tuple[str, ...]  # primitives replicated for want of a rule
  touching: tuple[tuple[int, ...], ...]  # [V] ops that read or write it
  constraints: tuple[Constraint, ...] = ()
  checkpoint_names: dict[int, str] = dataclasses.field(default_factory=dict)
  default_precision: frozenset[int] = frozenset()

  @property
  def num_values(self) -> int:
    return len(self.shapes)

  @property
  def num_ops(self) -> int:
    return len(self.prims)

  def rank(self, v: int) -> int:
    return len(self.shapes[v])

  def ops_of(self, v: int) -> tuple[int, ...]:
    """The ops that read or write value v."""
    return self.touching[v]

  def narrowable(self, o: int, p: int) -> bool:
    """Whether operand p of op o is a float32 operand of a dot at the
    default precision: one a backend may compute, and reshard, in bfloat16
    (`Compiler.narrows_dot_operands`)."""
    if p >= 2 or o not in self.default_precision:
      return False
    u = self.operands[o][p]
    return u >= 0 and self.dtypes[u] == np.float32  # -1: a literal, never resharded


def _default_precision(precision) -> bool:
  """Whether a dot's `precision` param asks for no more than the default:
  None (then `jax.default_matmul_precision` decides) or DEFAULT for both
  operands; an algorithm preset or a higher precision asks for more."""
  if precision is None:
    return jax.config.jax_default_matmul_precision in (None, "default", "bfloat16", "fastest")
  if isinstance(precision, tuple):
    return all(p is None or p == jax.lax.Precision.DEFAULT for p in precision)
  return precision == jax.lax.Precision.DEFAULT


class _Builder:
  """Visitor that records values and ops while `Walk` linearises."""

  def __init__(self):
    self.shapes, self.dtypes, self.kind, self.producer = [], [], [], []
    self.sealed, self.names = [], []
    self.checkpoint_names: dict[int, str] = {}
    self.default_precision: set[int] = set()
    self.prims, self.operands, self.operand_shapes = [], [], []
    self.results, self.rules, self.flops, self.scopes = [], [], [], []
    self.trips: list[int] = []
    self.regions: list[int] = []
    self.barriers: list[int] = []
    self.unknown: dict[str, int] = {}
    self.kept_whole: set[int] = set()  # values of ops without a rule
    # pad results -> (padding config, operand shape), for `slices.reads_padding_only`.
    self.pads: dict[int, tuple] = {}
    # concatenate results -> (dimension, operands, operand shapes), for
    # `slices.within_one_operand`.
    self.concats: dict[int, tuple] = {}
    self.constraints: list[Constraint] = []
    self.region = lambda: 0  # the walk's current region, for ties
    self.barrier = lambda: 0  # and its barrier

  def value(self, vid: int, aval, kind: int, producer: int, sealed: bool,
            name: str) -> int:
    assert vid == len(self.shapes), "value ids must be dense"
    self.shapes.append(tuple(int(d) for d in aval.shape))
    self.dtypes.append(aval.dtype)
    self.kind.append(kind)
    self.producer.append(producer)
    self.sealed.append(sealed)
    self.names.append(name)
    return vid

  def const(self, vid: int, c) -> int:
    aval = jax.core.ShapedArray(np.shape(c), getattr(c, "dtype", None) or np.result_type(c))
    return self.value(vid, aval, CONST, -1, False, "const")

  def literal(self, atom) -> Literal:
    return Literal(tuple(np.shape(atom.val)), atom.val)

  def constrain(self, step: Step, ins: list) -> list:
    spec, axes = constraints_lib.spec_of(step.eqn)
    value = -1 if isinstance(ins[0], Literal) else ins[0]
    self.constraints.append(Constraint(value, spec, axes, step.scope))
    return ins[:1]

  def visit(self, step: Step, ins: list) -> list:
    eqn = step.eqn
    name = ALIASES.get(eqn.primitive.name, eqn.primitive.name)
    op = len(self.prims)
    if eqn.primitive.name == "name":
      self.checkpoint_names[op] = str(eqn.params["name"])
    if eqn.primitive.name == "dot_general" and _default_precision(eqn.params.get("precision")):
      self.default_precision.add(op)
    in_shapes = [x.shape if isinstance(x, Literal) else self.shapes[x]
                 for x in ins]
    out_shapes = [tuple(int(d) for d in v.aval.shape) for v in eqn.outvars]
    for vid, var in zip(step.out_ids, eqn.outvars):
      self.value(vid, var.aval, INTERMEDIATE, op, step.sealed, step.scope)
    # PRNG keys and other extended dtypes hide dims we cannot tile.
    exotic = not all(_is_numpy(self.dtypes[x]) for x in ins
                     if not isinstance(x, Literal)) or not all(
                         _is_numpy(v.aval.dtype) for v in eqn.outvars)
    params = eqn.params
    if eqn.primitive.name.startswith("unvmap_"):
      params = {"axes": tuple(range(len(in_shapes[0])))}
    if (name == "slice" and not step.sealed and not isinstance(ins[0], Literal)
        and ins[0] in self.concats):
      # A slice within one operand of a concatenate reads that operand (as
      # XLA simplifies it, and as apply rewrites it).
      found = slices.within_one_operand(*self.concats[ins[0]], params)
      if found is not None:
        operand, in_shapes[0], params = found
        ins = [operand, *ins[1:]]
    # Counter-based bits: split like any generator, the key's hidden words
    # (its extended dtype) never tiled.
    bits = name == "random_bits" and jax.config.jax_threefry_partitionable
    if (name in DELIBERATELY_REPLICATED or exotic) and not bits:
      rule = factor_rule.replicated_rule(in_shapes, out_shapes)
    else:
      if not rules.has_rule(name):
        self.unknown[name] = self.unknown.get(name, 0) + 1
        self.kept_whole.update(x for x in (*ins, *step.out_ids) if not isinstance(x, Literal))
      rule = rules.rule_for(name, in_shapes, out_shapes, params)
    if name == "pad" and not isinstance(ins[0], Literal):
      self.pads[step.out_ids[0]] = (params["padding_config"], in_shapes[0])
    if name == "concatenate" and not step.sealed:
      self.concats[step.out_ids[0]] = (params["dimension"], list(ins), list(in_shapes))
    if name == "slice" and not isinstance(ins[0], Literal) and ins[0] in self.pads:
      if slices.reads_padding_only(*self.pads[ins[0]], params):
        # XLA folds it into a constant: the slice reads no array.
        ins = [Literal(in_shapes[0], None), *ins[1:]]
    self._record(name, ins, in_shapes, step.out_ids, rule, eqn_flops(eqn), step.scope,
                 step.trips, step.region, step.barrier)
    return list(step.out_ids)

  def _record(self, name: str, ins: list, in_shapes: list, out_ids: tuple,
              rule: factor_rule.Rule, flops: float, scope: str, trips: int, region: int,
              barrier: int) -> None:
    """Appends one op to the tables."""
    self.prims.append(name)
    self.operands.append(tuple(-1 if isinstance(x, Literal) else x for x in ins))
    self.operand_shapes.append(tuple(in_shapes))
    self.results.append(tuple(out_ids))
    self.rules.append(rule)
    self.flops.append(flops)
    self.scopes.append(scope)
    self.trips.append(trips)
    self.regions.append(region)
    self.barriers.append(barrier)

  def tie(self, name: str, ins: list, out_ids: tuple, avals: list, scope: str,
          trips: int, sealed: bool) -> list:
    """Ops that relate control flow to its bodies, one per operand:
    "scan_slice" (a scanned operand [T, ...] to the body's slice of it),
    "scan_stack" (a body result to the stacked [T, ...] one), and per result
    "scan_carry" and "while_carry" (initial carry, or the one a while loop
    reads, and body carry out to the final carry: one layout for all three;
    a while loop's condition read beside them),
    "while_enter" (a while loop's initial carry to the one it reads),
    "cond_result" (the branch index, and each branch's value to the
    cond's). They compute nothing. Slices live inside the loop, where XLA lays them
    out: sealed; the final carry and the stacked results are constrained
    after the loop."""
    if name in CARRIES:
      pairs = [(list(ins), out_ids[0], avals[0])]
    else:
      pairs = [([x], i, v) for x, i, v in zip(ins, out_ids, avals)]
    for operands, vid, aval in pairs:
      op = len(self.prims)
      self.value(vid, aval, INTERMEDIATE, op, sealed, scope)
      out = tuple(int(d) for d in aval.shape)
      in_shapes = [x.shape if isinstance(x, Literal) else self.shapes[x] for x in operands]
      self._record(name, operands, in_shapes, (vid,),
                   factor_rule.scan_tie_rule(name, in_shapes, out), 0.0, scope, trips,
                   self.region(), self.barrier())
    return list(out_ids)


def is_float(dtype) -> bool:
  """A floating-point dtype, bfloat16 and float16 included."""
  try:
    return bool(jnp.issubdtype(dtype, jnp.floating))
  except TypeError:
    return False


def _is_numpy(dtype) -> bool:
  try:
    np.dtype(dtype)
    return True
  except TypeError:
    return False


def build(traced: Traced) -> Graph:
  """Builds the partitioning IR of a traced program (one pass, linear)."""
  b = _Builder()
  walk = Walk(b.visit, b.const, b.literal, open_sealed=True, tie=b.tie,
              constrain=b.constrain)
  b.region = lambda: walk.region
  b.barrier = lambda: walk.barrier
  arg_ids = walk.fresh(len(traced.in_avals))
  for vid, aval, path in zip(arg_ids, traced.in_avals, traced.in_paths):
    b.value(vid, aval, ARG, -1, False, path)
  outs = walk.closed(traced.jaxpr, list(arg_ids))
  if b.unknown:
    listed = ", ".join(f"{k} (x{n})" for k, n in sorted(b.unknown.items()))
    whole = sum(math.prod(b.shapes[v]) * itemsize(b.dtypes[v]) for v in b.kept_whole)
    warnings.warn(
        f"automap has no sharding rule for: {listed}. Their operands and results, "
        f"{len(b.kept_whole)} values of {whole / 2**20:,.2f} MiB in all, are kept whole on "
        "every device (numerics are unaffected): each is held and computed whole, and "
        "gathered where its neighbours are split. Declare what the primitive computes with "
        "automap.declare_rule(primitive, 'elementwise' | 'identity' | 'ij,jk->ik').",
        UnknownPrimitiveWarning, stacklevel=3)
  num_values = len(b.shapes)
  uses: list[list[tuple[int, int]]] = [[] for _ in range(num_values)]
  last_use = np.full(num_values, -1, np.int32)
  for op, operands in enumerate(b.operands):
    for pos, v in enumerate(operands):
      if v >= 0:
        uses[v].append((op, pos))
        last_use[v] = op
  nbytes = np.array([int(np.prod(s, dtype=np.int64)) * itemsize(d)
                     for s, d in zip(b.shapes, b.dtypes)], np.int64)
  return Graph(
      shapes=tuple(b.shapes), dtypes=tuple(b.dtypes), nbytes=nbytes,
      kind=np.array(b.kind, np.int8), producer=np.array(b.producer, np.int32),
      sealed=np.array(b.sealed, bool),
      bound=np.isin(np.arange(num_values), list(walk.bound)) & np.array(b.sealed, bool),
      names=tuple(b.names),
      uses=tuple(tuple(u) for u in uses), last_use=last_use,
      prims=tuple(b.prims), operands=tuple(b.operands),
      operand_shapes=tuple(b.operand_shapes), results=tuple(b.results),
      rules=tuple(b.rules), flops=np.array(b.flops, np.float64),
      trips=np.array(b.trips, np.int64), regions=np.array(b.regions, np.int32),
      barriers=np.array(b.barriers, np.int32),
      scopes=tuple(b.scopes), inputs=tuple(arg_ids),
      outputs=tuple(x if isinstance(x, int) else -1 for x in outs),
      fingerprint=traced.fingerprint(), unknown=tuple(sorted(b.unknown)),
      touching=tuple(tuple(sorted({o for o, _ in u} | ({p} if p >= 0 else set())))
                     for u, p in zip(uses, b.producer)),
      constraints=tuple(b.constraints), checkpoint_names=dict(b.checkpoint_names),
      default_precision=frozenset(b.default_precision))

