"""Walking a jaxpr in program order: one visit per primitive equation.

Plain calls are inlined; calls with semantics of their own (custom
derivatives, rematerialisation) are sealed: walked, but marked so that a
rewriting walk can bind them whole. Scans, conds and while loops are walked
once per body, their bodies tied to the loop's or branch's operands and
results by the visitor. The graph builder (`graph.build`) and the rewriting
interpreter (`run/apply.py`) both walk with `Walk`, so value ids agree.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from jax.extend import core as jex

from automap._src.ir import constraints as constraints_lib

# Plain calls: inlined everywhere.
INLINE = {"jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr",
          "core_call": "call_jaxpr"}
# Calls with their own semantics: inlined in the graph, bound whole in apply.
SEALED = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
          "custom_vjp_call_jaxpr": "fun_jaxpr", "remat2": "jaxpr",
          "checkpoint": "jaxpr", "custom_lin": None}


class Step(NamedTuple):
  """One equation as the walk meets it."""

  eqn: Any  # jex.JaxprEqn
  scope: str  # joined name stack
  sealed: bool  # inside a call bound whole by apply
  out_ids: tuple[int, ...]  # value ids of the results (-1: not a value)
  trips: int = 1  # times it runs per call (inside scans: their lengths)
  region: int = 0  # the cond branch or while body it is in (0: neither)
  barrier: int = 0  # the recomputation behind an optimization barrier it is in (0: none)


# Primitives defined by a Python implementation in ordinary primitives:
# walked as the jaxpr of that implementation, a sealed call (equinox's
# `vprim`, a primitive vmapped: lineax's linear_solve in optimistix).
TRACED = frozenset({"vprim"})


def sub_jaxpr(eqn):
  """The jaxpr a call equation runs (None for a primitive of its own)."""
  name = eqn.primitive.name
  if name in TRACED:
    return _traced_impl(eqn)
  key = INLINE.get(name) or SEALED.get(name)
  return eqn.params.get(key) if key else None


def _traced_impl(eqn):
  """The closed jaxpr of the primitive's implementation on its operands'
  types; None where it does not trace to other primitives."""
  avals = [v.aval for v in eqn.invars]
  try:
    closed = jax.make_jaxpr(lambda *xs: eqn.primitive.impl(*xs, **eqn.params))(*avals)
  except Exception:  # noqa: BLE001 - an implementation that does not trace stays a primitive
    return None
  results = len(eqn.outvars) if eqn.primitive.multiple_results else 1
  if len(closed.jaxpr.outvars) != results or any(
      e.primitive is eqn.primitive for e in closed.jaxpr.eqns):
    return None
  return closed


def _behind_barrier(eqn) -> bool:
  """Whether JAX lowers this call behind an optimization barrier: a
  rematerialised body in a derivative, with prevent_cse (jax's
  `remat_lowering`), which XLA may not merge with what it recomputes."""
  p = eqn.params
  return (eqn.primitive.name in ("remat2", "checkpoint") and bool(p.get("differentiated"))
          and bool(p.get("prevent_cse")))


def _join(scope: str, inner: str) -> str:
  return f"{scope}/{inner}" if scope and inner else scope or inner


class Walk:
  """Linearises a jaxpr: one `visit` per primitive equation, calls inlined.

  Both the graph builder and the rewriting interpreter walk with this class,
  so value ids agree between the IR and the program apply rewrites. With
  `open_sealed=False` a sealed call is visited whole; its result ids are those
  the graph gave its body's results. A layout constraint takes no id:
  `constrain` sees it and its operand and returns its result (by default the
  operand itself); JAX's own reshards are passed through.
  """

  def __init__(self, visit: Callable[[Step, list], list],
               const: Callable[[int, Any], Any],
               literal: Callable[[Any], Any], open_sealed: bool,
               tie: Callable[[str, list, tuple, list, str, int, bool], list] | None = None,
               after_scan: Callable[[tuple, list], list] | None = None,
               constrain: Callable[[Step, list], list] | None = None):
    self.visit, self.const, self.literal = visit, const, literal
    self.constrain = constrain or (lambda step, ins: ins[:1])
    self.open_sealed = open_sealed
    # Results of the outermost sealed calls opened: what a walk that binds
    # those calls whole sees them return.
    self.bound: set = set()
    # Scan bodies are walked once. With `tie`, the walk records how a scan's
    # operands and results relate to its body's (see `_scan`); without, it
    # runs the scan, its body re-interpreted by this walk.
    self.tie = tie
    # Without `tie`: what becomes of a scan's results (by id) after the loop.
    self.after_scan = after_scan or (lambda ids, outs: outs)
    self.next_id = 0
    self.trips = 1  # iterations of the body being walked, nested scans multiplied
    # The computation being walked: a cond branch or while body gets its own
    # (XLA reshards inside each: copies are not shared across them).
    self.region, self.regions = 0, 0
    # The rematerialised body being walked: JAX lowers a differentiated
    # `remat2` with prevent_cse behind an optimization barrier, so XLA
    # recomputes there what it computed before, reshards included.
    self.barrier, self.barriers = 0, 0

  def fresh(self, n: int) -> tuple[int, ...]:
    ids = tuple(range(self.next_id, self.next_id + n))
    self.next_id += n
    return ids

  def closed(self, closed, inputs: list, scope: str = "",
             sealed: bool = False) -> list:
    if isinstance(closed, jex.ClosedJaxpr):
      consts = [self.const(i, c) for i, c in
                zip(self.fresh(len(closed.consts)), closed.consts)]
      return self.run(closed.jaxpr, consts, inputs, scope, sealed)
    return self.run(closed, [], inputs, scope, sealed)

  def run(self, jaxpr, consts, inputs, scope, sealed) -> list:
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, inputs))

    def read(atom):
      return self.literal(atom) if isinstance(atom, jex.Literal) else env[atom]

    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      inner_scope = _join(scope, str(eqn.source_info.name_stack))
      ins = [read(a) for a in eqn.invars]
      sub = sub_jaxpr(eqn)
      if name == constraints_lib.CONSTRAINT:
        outs = self.constrain(Step(eqn, inner_scope, sealed, (), self.trips, self.region,
                                   self.barrier),
                              ins)
      elif name in constraints_lib.PRIMITIVES:
        outs = ins[:1]
      elif name == "scan":
        outs = self._scan(eqn, ins, inner_scope, sealed)
      elif name == "cond":
        outs = self._cond(eqn, ins, inner_scope, sealed)
      elif name == "while":
        outs = self._while(eqn, ins, inner_scope, sealed)
      elif sub is not None and (name in INLINE or self.open_sealed):
        outer = self.barrier
        if _behind_barrier(eqn):
          self.barriers += 1
          self.barrier = self.barriers
        try:
          outs = self.closed(sub, ins, inner_scope, sealed or name not in INLINE)
        finally:
          self.barrier = outer
        if name not in INLINE and not sealed:
          self.bound.update(x for x in outs if isinstance(x, int))
      else:
        if sub is not None:  # A sealed call visited whole.
          dry = Walk(lambda s, i: list(s.out_ids), lambda i, c: i,
                     lambda a: -1, open_sealed=True,
                     tie=lambda name, ins, ids, avals, scope, trips, sealed: list(ids))
          dry.next_id = self.next_id
          out_ids = tuple(x if isinstance(x, int) else -1 for x in
                          dry.closed(sub, [-1] * len(ins)))
          self.next_id = dry.next_id
        else:
          out_ids = self.fresh(len(eqn.outvars))
        outs = self.visit(Step(eqn, inner_scope, sealed, out_ids, self.trips, self.region,
                               self.barrier),
                          ins)
      for var, x in zip(eqn.outvars, outs):
        if not isinstance(var, jex.DropVar):
          env[var] = x
    return [read(a) for a in jaxpr.outvars]


  def _scan(self, eqn, ins: list, scope: str, sealed: bool) -> list:
    """A scan: its body once, between the slices of its scanned operands
    and the ties of its carries and stacked results."""
    p = eqn.params
    body = p["jaxpr"]
    nc, nk, length = p["num_consts"], p["num_carry"], p["length"]
    consts, init, xs = ins[:nc], ins[nc:nc + nk], ins[nc + nk:]
    x_ids = self.fresh(len(xs))
    x_avals = [v.aval for v in body.jaxpr.invars[nc + nk:]]
    if self.tie is None:
      start, end = self.next_id, [self.next_id]

      def step(carry, x):
        self.next_id, trips = start, self.trips
        self.trips *= length
        outs = self.closed(body, list(consts) + list(carry) + list(x), scope, sealed)
        self.trips, end[0] = trips, self.next_id
        return outs[:nk], outs[nk:]

      carry, ys = jax.lax.scan(step, list(init), list(xs), length=length,
                               reverse=p["reverse"], unroll=p["unroll"])
      self.next_id = end[0]
      return self.after_scan(self.fresh(len(eqn.outvars)), list(carry) + list(ys))
    sliced = self.tie("scan_slice", list(xs), x_ids, x_avals, scope, self.trips, True)
    trips, self.trips = self.trips, self.trips * length
    outs = self.closed(body, list(consts) + list(init) + list(sliced), scope, sealed)
    self.trips = trips
    out_ids = self.fresh(len(eqn.outvars))
    avals = [v.aval for v in eqn.outvars]
    carry = [self.tie("scan_carry", [a, b], (i,), [v], scope, self.trips, sealed)[0]
             for a, b, i, v in zip(init, outs[:nk], out_ids[:nk], avals[:nk])]
    ys = self.tie("scan_stack", outs[nk:], out_ids[nk:], avals[nk:], scope, self.trips,
                  sealed)
    return carry + ys


  def _extent(self, body, inputs: list, scope: str, sealed: bool) -> tuple[int, int]:
    """(first, next) value ids walking `body` from here would take, taken."""
    dry = Walk(lambda s, i: list(s.out_ids), lambda i, c: i, lambda a: -1,
               open_sealed=True, tie=lambda name, ins, ids, avals, scope, trips, sealed: list(ids))
    dry.next_id = first = self.next_id
    dry.trips = self.trips
    dry.closed(body, [-1] * len(inputs), scope, sealed)
    self.next_id = dry.next_id
    return first, dry.next_id

  def _rewalk(self, body, first: int, scope: str, sealed: bool):
    """A function walking `body` from value id `first`, however often JAX
    traces it."""
    def run(*inputs):
      self.next_id = first
      return self.closed(body, list(inputs), scope, sealed)
    return run

  def _in_region(self, body, inputs: list, scope: str, sealed: bool) -> list:
    """Walks `body` as a computation of its own (`Step.region`)."""
    outer = self.region
    self.regions += 1
    self.region = self.regions
    try:
      return self.closed(body, inputs, scope, sealed)
    finally:
      self.region = outer

  def _cond(self, eqn, ins: list, scope: str, sealed: bool) -> list:
    """A cond: each branch once, on the cond's operands, and a tie per result
    joining each branch's value of it."""
    branches = eqn.params["branches"]
    index, operands = ins[0], list(ins[1:])
    if self.tie is None:
      spans = [self._extent(b, operands, scope, sealed) for b in branches]
      outs = jax.lax.switch(index, [self._rewalk(b, first, scope, sealed)
                                    for b, (first, _) in zip(branches, spans)], *operands)
      self.next_id = spans[-1][1]
      return self.after_scan(self.fresh(len(eqn.outvars)), list(outs))
    made = [self._in_region(b, operands, scope, sealed) for b in branches]
    out_ids = self.fresh(len(eqn.outvars))
    # The branch index is read too: XLA computes it whatever the branches do.
    return [self.tie("cond_result", [index] + [outs[k] for outs in made], (i,), [v.aval],
                     scope, self.trips, sealed)[0]
            for k, (i, v) in enumerate(zip(out_ids, eqn.outvars))]

  def _while(self, eqn, ins: list, scope: str, sealed: bool) -> list:
    """A while loop: per carry, the value its condition and body read (a
    "while_enter" tie from the initial value: the loop's entry reshards it),
    the condition and body once each, and a "while_carry" tie joining the
    read, the body's and the final value (one layout for the loop)."""
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = list(ins[:nc]), list(ins[nc:nc + nb]), list(ins[nc + nb:])
    carry_ids = self.fresh(len(init))
    avals = [v.aval for v in eqn.outvars]
    if self.tie is None:
      test = self._extent(p["cond_jaxpr"], cconsts + init, scope, sealed)
      body = self._extent(p["body_jaxpr"], bconsts + init, scope, sealed)
      run_test = self._rewalk(p["cond_jaxpr"], test[0], scope, sealed)
      run_body = self._rewalk(p["body_jaxpr"], body[0], scope, sealed)
      laid = lambda c: self.after_scan(carry_ids, list(c))  # noqa: E731
      outs = jax.lax.while_loop(lambda c: run_test(*cconsts, *laid(c))[0],
                                lambda c: run_body(*bconsts, *laid(c)), init)
      self.next_id = body[1]
      return self.after_scan(self.fresh(len(eqn.outvars)), list(outs))
    carries = [self.tie("while_enter", [a], (i,), [v], scope, self.trips, sealed)[0]
               for a, i, v in zip(init, carry_ids, avals)]
    (test,) = self._in_region(p["cond_jaxpr"], cconsts + carries, scope, sealed)
    made = self._in_region(p["body_jaxpr"], bconsts + carries, scope, sealed)
    out_ids = self.fresh(len(eqn.outvars))
    # The condition is read too: the loop computes it every iteration.
    return [self.tie("while_carry", [c, b, test], (i,), [v], scope, self.trips, sealed)[0]
            for c, b, i, v in zip(carries, made, out_ids, avals)]
