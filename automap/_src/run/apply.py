"""Apply: a plan becomes a jitted function with shardings and constraints.

The traced jaxpr is re-interpreted equation by equation (the same walk that
built the graph, so value ids agree) and every value the plan constrains is
wrapped in `with_sharding_constraint`. Arguments and results get the plan's
`NamedSharding`s through `jax.jit(in_shardings=, out_shardings=)`.

The program's own layout constraints stay where it wrote them when the plan
keeps them; otherwise they are removed before the rewrite
(`Traced.without_constraints`), inside sealed calls too.

`with_sharding_constraint` accepts only Auto mesh axes, and flax layers reject
sharded contractions under Explicit axes, so the program runs on an Auto view
of the user's mesh (same devices, same names); behaviour is identical for
meshes made either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from automap._src.ir import constraints as constraints_lib
from automap._src.ir import slices
from automap._src.ir import trace as trace_lib
from automap._src.ir.trace import Traced
from automap._src.ir.walk import Step, Walk


def auto_mesh(mesh: Mesh) -> Mesh:
  """The same devices and axis names with every axis of type Auto."""
  types = getattr(mesh, "axis_types", None)
  if types is not None and all(t == AxisType.Auto for t in types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def interpreter(traced: Traced, constraints: Mapping[int, PartitionSpec],
                mesh: Mesh,
                reshards: Mapping[tuple[int, int], PartitionSpec] | None = None,
                natural: Mapping[int, PartitionSpec] | None = None,
                ) -> Callable[..., Any]:
  """`fn` re-expressed from its jaxpr with the plan's constraints inserted:
  on operands it reshards on entry, on results in the layout their op
  computes them in, then on results in their own layout."""
  shardings = {v: NamedSharding(mesh, s) for v, s in constraints.items()}
  natural = {v: NamedSharding(mesh, s) for v, s in (natural or {}).items()}
  entry: dict[int, dict[int, NamedSharding]] = {}
  for (v, p), s in (reshards or {}).items():
    entry.setdefault(v, {})[p] = NamedSharding(mesh, s)
  closed = traced.jaxpr
  # Concatenations made so far: id of the result -> (the result, kept so its
  # id stays its own; dimension, operands, their shapes), so a slice within
  # one operand reads that operand, as the graph records it
  # (`slices.within_one_operand`).
  concats: dict[int, tuple] = {}

  def visit(step: Step, ins: list) -> list:
    eqn = step.eqn
    bind_params = eqn.params
    if eqn.primitive.name == "slice" and id(ins[0]) in concats:
      found = slices.within_one_operand(*concats[id(ins[0])][1:], eqn.params)
      if found is not None:
        ins = [found[0], *ins[1:]]
        bind_params = found[2]
    if step.out_ids and step.out_ids[0] in entry:
      ins = list(ins)
      for p, sharding in entry[step.out_ids[0]].items():
        ins[p] = jax.lax.with_sharding_constraint(ins[p], sharding)
    params = eqn.primitive.get_bind_params(bind_params)
    subfuns = ()
    if isinstance(params, tuple):  # Older JAX returns (subfuns, params).
      subfuns, params = params
    with jax.named_scope(step.scope) if step.scope else contextlib.nullcontext():
      outs = eqn.primitive.bind(*subfuns, *ins, **params)
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    for i, v in enumerate(step.out_ids):
      if v in natural:
        outs[i] = jax.lax.with_sharding_constraint(outs[i], natural[v])
      sharding = shardings.get(v)
      if sharding is not None:
        outs[i] = jax.lax.with_sharding_constraint(outs[i], sharding)
    if eqn.primitive.name == "concatenate":
      concats[id(outs[0])] = (outs[0], eqn.params["dimension"], list(ins),
                              [tuple(x.aval.shape) for x in eqn.invars])
    return outs

  def constrain(step: Step, ins: list) -> list:
    """A constraint the plan keeps, as written."""
    return [step.eqn.primitive.bind(*ins, **step.eqn.params)]

  def after_scan(ids: tuple, outs: list) -> list:
    return [jax.lax.with_sharding_constraint(x, shardings[v]) if v in shardings else x
            for v, x in zip(ids, outs)]

  def run(*args):
    flat, tree = jax.tree.flatten(args)
    if tree != traced.in_tree:
      raise TypeError(
          f"arguments have structure {tree}, but the plan was made for "
          f"{traced.in_tree}.")
    walk = Walk(visit, lambda i, c: c, lambda atom: atom.val, open_sealed=False,
                after_scan=after_scan, constrain=constrain)
    ids = walk.fresh(len(flat))
    # Arguments carry their layout from in_shardings; nothing to insert.
    del ids
    outs = walk.closed(closed, flat)
    return jax.tree.unflatten(traced.out_tree, outs)

  return run


def plan_shardings(mesh: Mesh, specs, tree) -> Any:
  """NamedShardings on the Auto view of `mesh`, in the structure `tree`."""
  mesh = auto_mesh(mesh)
  return jax.tree.unflatten(tree, [NamedSharding(mesh, s) for s in specs])


def jit_with_plan(traced: Traced, mesh: Mesh, plan,
                  donate_argnums=()) -> Callable[..., Any]:
  """`jax.jit` of the rewritten program with the plan's shardings."""
  in_shardings = plan_shardings(mesh, plan.in_specs, traced.in_tree)
  out_shardings = plan_shardings(mesh, plan.out_specs, traced.out_tree)
  if plan.program_constraints != constraints_lib.KEEP:
    traced = traced.without_constraints()
  run = interpreter(traced, plan.constraints, auto_mesh(mesh), plan.reshards,
                    plan.natural)
  return jax.jit(run, in_shardings=tuple(in_shardings),
                 out_shardings=out_shardings, donate_argnums=donate_argnums)


def compile_with_plan(traced: Traced, mesh: Mesh, plan, args: tuple):
  """`jit_with_plan`'s program lowered for `traced`'s dynamic `args` and
  compiled, under the Auto view of `mesh` (the program's constraints
  resolve there)."""
  jitted = jit_with_plan(traced, mesh, plan)
  with jax.set_mesh(auto_mesh(mesh)):
    return jitted.lower(*abstract_args(traced.dynamic_args(args))).compile()


def abstract_args(args: tuple) -> tuple:
  """`args` as ShapeDtypeStructs, for `lower`: jit refuses host (numpy)
  arguments whose shardings span devices of other processes."""
  _, tree, _, avals = trace_lib.flatten_args(args)
  return jax.tree.unflatten(tree, [
      jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals])
