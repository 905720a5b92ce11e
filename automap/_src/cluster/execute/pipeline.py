"""Pipeline: a stack of identical layers run as a GPipe or 1F1B schedule.

The mesh's stage axis holds S pipeline stages; stage s keeps layers
[s*L/S, (s+1)*L/S) of the stacked parameters (sharded on the layer dim). The
batch is cut into M microbatches that flow through the stages in lockstep
ticks: every stage runs its layers on the microbatch it holds, then
`ppermute` hands the result to the next stage. Idle ticks (the bubble) still
compute, on stand-in data, and are masked out.

The body is a `jax.shard_map` manual only over the stage axis. Every other
mesh axis stays Auto, so data and model shardings of the parameters and the
batch (from `jax.jit` shardings or constraints) keep applying inside a stage
and the partitioner inserts their collectives. It runs on the Auto view of the
mesh: on Explicit axes a partial-manual `shard_map` reshards every operand
through an all-gather, and layers would have to be written for typed
shardings. Arguments typed with Explicit shardings (`jax.set_mesh`,
`device_put` on an Explicit mesh) enter through `jax.sharding.auto_axes`, and
the results leave typed like the arguments they stand for.

Shape letters: L layers, S stages, M microbatches, B batch rows, b = B / M
rows per microbatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from automap._src.cluster.schedule import schedules
from automap._src.run.apply import auto_mesh

Params = Any  # a pytree of arrays; stacked: every leaf [L, ...]
LayerFn = Callable[[Params, jax.Array], jax.Array]  # (one layer's params, [b, ...]) -> [b, ...]
LossFn = Callable[[jax.Array, jax.Array], jax.Array]  # ([b, ...] out, [b, ...] target) -> []

# The registered schedules (`schedules.names()`) these shard_map pipelines
# implement; a cluster plan's executor runs every one.
IMPLEMENTED = ("gpipe", "1f1b")


class PipelineError(ValueError):
  """A mesh, schedule or argument a pipeline cannot run with."""


def pipelined(layer_fn: LayerFn, *, mesh: Mesh, microbatches: int, stage_axis: str = "stage",
              schedule: str = "gpipe", remat: bool = False,
              ) -> Callable[[Params, jax.Array], jax.Array]:
  """A stack of identical layers pipelined over the mesh's stage axis (GPipe).

  Differentiating the result gives the GPipe backward: all forwards, then
  all backwards, the cotangents moving back through the transposed
  `ppermute`s.

  Args:
    layer_fn: `layer_fn(one layer's params, [b, ...]) -> [b, ...]`.
    mesh: the mesh; its `stage_axis` holds the S stages, its other axes
      stay automatic inside a stage.
    microbatches: M, microbatches the batch is cut into.
    stage_axis: the mesh axis of the stages.
    schedule: "gpipe" ("1f1b" needs the loss: `pipelined_loss`).
    remat: keep only each stage's input per tick and recompute its layers
      in the backward pass.

  Returns:
    `run(stacked_params, x) -> y`: the L layers applied in order.
    stacked_params is a pytree whose leaves are [L, ...], L a multiple of S;
    x is [B, ...] with B a multiple of `microbatches`; y has x's shape.

  Raises:
    PipelineError: no such stage axis, microbatches not an int >= 1, or a
      schedule it does not implement; `run` raises it for arguments that
      do not fit (layers that do not split over the stages, a batch that
      does not split into microbatches, a layer_fn that changes the shape).
  """
  stages = _stages(mesh, stage_axis)
  _check_microbatches(microbatches)
  if schedule == "1f1b":
    raise PipelineError(
        "schedule='1f1b' interleaves each microbatch's backward with later forwards, so the "
        "pipeline must own the loss: use pipelined_loss(layer_fn, loss_fn, ...).")
  _check_schedule(schedule, ("gpipe",))
  body = _gpipe(_stage_apply(layer_fn, remat), stages, microbatches, stage_axis)

  def on_mesh(view, stacked_params, x):
    ys = jax.shard_map(body, mesh=view, in_specs=(P(stage_axis), P()), out_specs=P(),
                       axis_names={stage_axis})(stacked_params, _split(x, microbatches))
    return _merge(ys)

  def run(stacked_params: Params, x: jax.Array) -> jax.Array:
    _check_args(layer_fn, stacked_params, x, stages, microbatches, stage_axis)
    return _on_auto_axes(on_mesh, mesh, (stacked_params, x), lambda: _spec(x))

  return run


def pipelined_loss(layer_fn: LayerFn, loss_fn: LossFn, *, mesh: Mesh, microbatches: int,
                   stage_axis: str = "stage", schedule: str = "1f1b", remat: bool = False,
                   ) -> Callable[[Params, jax.Array, jax.Array], jax.Array]:
  """A stack of identical layers and their loss, pipelined (1F1B or GPipe).

  With schedule="1f1b" (PipeDream-Flush), `jax.grad` of the loss runs one
  pipeline in which each stage alternates one forward and one backward, so
  a stage holds at most 2S - 1 microbatch inputs instead of every tick's
  activations; a stage's layers are recomputed in its backward. Reverse
  mode only (it is a `jax.custom_vjp`). schedule="gpipe" differentiates
  `pipelined` instead.

  Args:
    layer_fn: `layer_fn(one layer's params, [b, ...]) -> [b, ...]`.
    loss_fn: `loss_fn(y_m, targets_m) -> []`, one microbatch's loss.
    mesh: the mesh; its `stage_axis` holds the S stages.
    microbatches: M, microbatches the batch is cut into.
    stage_axis: the mesh axis of the stages.
    schedule: "1f1b" or "gpipe" (a cluster plan's executor runs the other
      registered schedules).
    remat: under "gpipe", keep only each stage's input per tick.

  Returns:
    `loss(stacked_params, x, targets) -> []`: the mean over microbatches
    of `loss_fn(y_m, targets_m)`, y the L layers applied to x (with
    equal-sized microbatches and a mean `loss_fn`, the batch's mean).
    targets is [B, ...], cut into microbatches like x; integer targets
    (class labels) get no gradient.

  Raises:
    PipelineError: no such stage axis, microbatches not an int >= 1, or a
      schedule it does not implement; `loss` raises it for arguments that
      do not fit (as `pipelined`'s, and targets without x's batch dim).
  """
  stages = _stages(mesh, stage_axis)
  _check_microbatches(microbatches)
  _check_schedule(schedule, IMPLEMENTED)
  run = pipelined(layer_fn, mesh=mesh, microbatches=microbatches, stage_axis=stage_axis,
                  remat=remat)

  def mean_loss(stacked_params: Params, x: jax.Array, targets: jax.Array) -> jax.Array:
    _check_targets(x, targets)
    ys, ts = _split(run(stacked_params, x), microbatches), _split(targets, microbatches)
    return jnp.mean(jax.vmap(loss_fn)(ys, ts))

  if schedule == "gpipe":
    return mean_loss
  body = _one_f_one_b(_stage_apply(layer_fn, False), loss_fn, stages, microbatches, stage_axis)

  def on_mesh(view, stacked_params, x, targets):
    loss, grads, dxs, dts = jax.shard_map(
        body, mesh=view, in_specs=(P(stage_axis), P(), P()),
        out_specs=(P(), P(stage_axis), P(), P()), axis_names={stage_axis},
    )(stacked_params, _split(x, microbatches), _split(targets, microbatches))
    return loss, (grads, _merge(dxs), _merge(dts[0]) if dts else None)

  def loss_and_grads(stacked_params, x, targets):
    _check_args(layer_fn, stacked_params, x, stages, microbatches, stage_axis)
    _check_targets(x, targets)
    specs = lambda: (P(), (jax.tree.map(_spec, stacked_params), _spec(x),
                           _spec(targets) if _inexact(targets) else None))
    return _on_auto_axes(on_mesh, mesh, (stacked_params, x, targets), specs)

  loss = jax.custom_vjp(mean_loss)

  def bwd(cotangents, g):
    return jax.tree.map(lambda c: (g * c).astype(c.dtype), cotangents)

  loss.defvjp(loss_and_grads, bwd)
  return loss


def _gpipe(apply, stages: int, microbatches: int, axis: str):
  """The per-stage body: M + S - 1 ticks; stage s works on microbatch t - s."""

  def body(params, xs):  # params: leaves [L/S, ...]; xs: [M, b, ...]
    stage = jax.lax.axis_index(axis)

    def tick(held, t):
      fresh = jax.lax.dynamic_index_in_dim(xs, jnp.minimum(t, microbatches - 1), keepdims=False)
      out = apply(params, jnp.where(stage == 0, fresh, held))
      return _shift(out, axis, stages, +1), out

    # Before its first microbatch arrives a stage runs on microbatch 0, real data, so the
    # discarded bubble work stays finite and cannot put NaNs in the gradients.
    held = jax.lax.pcast(xs[0], (axis,), to="varying")
    _, outs = jax.lax.scan(tick, held, jnp.arange(microbatches + stages - 1))
    # The last stage finishes microbatch m at tick m + S - 1; the psum hands its results to
    # every stage, as out_specs P() promises.
    return jax.lax.psum(jnp.where(stage == stages - 1, outs[stages - 1:], 0), axis)

  return body


def _one_f_one_b(apply, loss_fn: LossFn, stages: int, microbatches: int, axis: str):
  """The per-stage body of 1F1B: M + 2S - 2 ticks. At tick t stage s runs the
  forward of microbatch t - s and the backward of microbatch t - (2S - 2 - s);
  the last stage runs both on the same microbatch, loss in between."""
  slots = 2 * stages - 1  # inputs a stage holds between a microbatch's forward and backward

  def body(params, xs, ts):  # params: leaves [L/S, ...]; xs, ts: [M, b, ...]
    stage = jax.lax.axis_index(axis)
    first, last = stage == 0, stage == stages - 1
    clip = lambda m: jnp.clip(m, 0, microbatches - 1)
    index = lambda a, m: jax.lax.dynamic_index_in_dim(a, m, keepdims=False)
    put = lambda a, m, v, keep: jax.lax.dynamic_update_index_in_dim(
        a, jnp.where(keep, v, index(a, m)), m, 0)
    mean_loss = lambda y, t: loss_fn(y, t) / microbatches
    wrt = (0, 1) if _inexact(ts) else (0,)  # integer targets have no cotangent

    def tick(carry, t):
      fwd_held, bwd_held, stash, loss, grads, dxs, dts = carry
      f, b = t - stage, t - (2 * stages - 2 - stage)
      x_in = jnp.where(first, index(xs, clip(f)), fwd_held)
      out = apply(params, x_in)
      # Slot f % (2S - 1) is free: the microbatches alive on a stage span at most 2S - 1.
      stash = jax.lax.dynamic_update_index_in_dim(stash, x_in, f % slots, 0)
      # Every stage evaluates the loss; only the last one's is used (SPMD runs one program).
      mb_loss, (dy, *dt) = jax.value_and_grad(mean_loss, wrt)(out, index(ts, clip(b)))
      _, vjp = jax.vjp(apply, params, index(stash, b % slots))
      dparams, dx = vjp(jnp.where(last, dy, bwd_held))
      done = (b >= 0) & (b < microbatches)
      loss = loss + jnp.where(done & last, mb_loss, 0)
      grads = jax.tree.map(lambda g, d: g + jnp.where(done, d, 0), grads, dparams)
      dxs = put(dxs, clip(b), dx, done & first)
      dts = [put(d, clip(b), g, done & last) for d, g in zip(dts, dt)]
      carry = (_shift(out, axis, stages, +1), _shift(dx, axis, stages, -1), stash, loss, grads,
               dxs, dts)
      return carry, None

    varying = lambda a: jax.lax.pcast(a, (axis,), to="varying")
    loss = jnp.zeros((), jax.eval_shape(loss_fn, xs[0], ts[0]).dtype)
    # Real data in the bubble and the unused stash slots, as in `_gpipe`.
    carry = (varying(xs[0]), varying(jnp.zeros_like(xs[0])), varying(jnp.repeat(xs[:1], slots, 0)),
             varying(loss), jax.tree.map(jnp.zeros_like, params), varying(jnp.zeros_like(xs)),
             [varying(jnp.zeros_like(ts))] * (len(wrt) - 1))
    carry, _ = jax.lax.scan(tick, carry, jnp.arange(microbatches + 2 * stages - 2))
    _, _, _, loss, grads, dxs, dts = carry
    return jax.lax.psum(loss, axis), grads, jax.lax.psum(dxs, axis), jax.lax.psum(dts, axis)

  return body


def _on_auto_axes(fn, mesh: Mesh, args: tuple, out_specs: Callable[[], Any]):
  """`fn(view, *args)`, view the Auto view of `mesh`. Arguments typed with Explicit
  shardings are seen Auto inside, and the results are typed `out_specs()`."""
  typed = [a for a in jax.tree.leaves(args) if _spec(a) is not None]
  if not typed:
    return fn(auto_mesh(mesh), *args)
  # `auto_axes` works on the context mesh; the arguments' types name it.
  context = jax.typeof(typed[0]).sharding.mesh
  if dict(context.shape) != dict(mesh.shape):
    raise PipelineError(
        f"mesh: the arguments are typed on a mesh of shape {dict(context.shape)}, but the "
        f"pipeline was built for {dict(mesh.shape)}; build both from the same mesh.")
  with jax.sharding.use_abstract_mesh(context):
    inner = lambda *a: fn(jax.sharding.get_abstract_mesh(), *a)
    return jax.sharding.auto_axes(inner, out_sharding=out_specs())(*args)


def _inexact(a) -> bool:
  return jnp.issubdtype(jnp.result_type(a), jnp.inexact)


def _spec(a) -> P | None:
  """The PartitionSpec in `a`'s type when its mesh has Explicit axes, else None."""
  sharding = jax.typeof(a).sharding
  if AxisType.Explicit not in getattr(sharding.mesh, "axis_types", ()):
    return None
  return sharding.spec


def _shift(x: jax.Array, axis: str, stages: int, step: int) -> jax.Array:
  """x moved `step` stages along (+1 forward, -1 backward); the end receiving nothing gets 0."""
  return jax.lax.ppermute(x, axis, [(s, s + step) for s in range(stages) if 0 <= s + step < stages])


def _stage_apply(layer_fn: LayerFn, remat: bool):
  """(params: leaves [L/S, ...], x: [b, ...]) -> [b, ...]: a stage's layers in order."""

  def apply(params, x):
    return jax.lax.scan(lambda h, p: (layer_fn(p, h), None), x, params)[0]

  return jax.checkpoint(apply) if remat else apply


def _split(x: jax.Array, microbatches: int) -> jax.Array:
  """[B, ...] -> [M, b, ...], microbatch m = rows m, m + M, m + 2M, ...: strided so that a
  data sharding of the batch dim shards every microbatch instead of spreading them."""
  return x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)


def _merge(ys: jax.Array) -> jax.Array:
  """[M, b, ...] -> [B, ...], undoing `_split`."""
  return ys.swapaxes(0, 1).reshape(ys.shape[0] * ys.shape[1], *ys.shape[2:])


def _stages(mesh: Mesh, stage_axis: str) -> int:
  if not isinstance(mesh, Mesh):
    raise PipelineError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}.")
  if stage_axis not in mesh.axis_names:
    raise PipelineError(
        f"mesh: has axes {tuple(mesh.axis_names)} and no stage axis {stage_axis!r}; add one "
        f"(e.g. jax.make_mesh((2, 4), ({stage_axis!r}, 'data'))) or pass stage_axis= one of "
        f"{tuple(mesh.axis_names)}.")
  return mesh.shape[stage_axis]


def _check_microbatches(microbatches: int) -> None:
  if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
    raise PipelineError(f"microbatches: expected an int >= 1, got {microbatches!r}.")


def _check_schedule(schedule: str, allowed: tuple[str, ...]) -> None:
  if schedule in allowed:
    return
  if schedule in schedules.names():
    raise PipelineError(
        f"schedule: expected one of {allowed}, got {schedule!r}, a registered schedule these "
        "pipelines of identical layers do not implement; a cluster plan runs it "
        f"(`ClusterPlan.train_step(..., schedule={schedule!r})`).")
  raise PipelineError(f"schedule: expected one of {allowed}, got {schedule!r}.")


def _check_args(layer_fn: LayerFn, stacked_params: Params, x: jax.Array, stages: int,
                microbatches: int, stage_axis: str) -> None:
  leaves = jax.tree.leaves(stacked_params)
  if not leaves:
    raise PipelineError("stacked_params: has no arrays; expected leaves of shape [L, ...].")
  sizes = {jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves}
  if len(sizes) != 1 or None in sizes:
    shapes = [jnp.shape(a) for a in leaves]
    raise PipelineError(
        f"stacked_params: every leaf needs the same leading layer dim L; got shapes {shapes}.")
  (layers,) = sizes
  if layers % stages:
    raise PipelineError(
        f"stacked_params: {layers} layers do not split over {stages} stages of mesh axis "
        f"{stage_axis!r}; use a multiple of {stages} layers or a stage count dividing {layers}.")
  if jnp.ndim(x) < 1 or jnp.shape(x)[0] % microbatches:
    raise PipelineError(
        f"x: batch dim of shape {jnp.shape(x)} does not split into {microbatches} microbatches; "
        f"use a batch that is a multiple of {microbatches} or change microbatches.")
  one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), stacked_params)
  mb = jax.ShapeDtypeStruct((x.shape[0] // microbatches, *x.shape[1:]), x.dtype)
  out = jax.eval_shape(layer_fn, one, mb)
  if not isinstance(out, jax.ShapeDtypeStruct) or (out.shape, out.dtype) != (mb.shape, mb.dtype):
    raise PipelineError(
        f"layer_fn: must map a microbatch to the same shape and dtype, {mb.dtype}{list(mb.shape)}"
        f", to chain through the layers; it returned {out}.")


def _check_targets(x: jax.Array, targets: jax.Array) -> None:
  if jnp.ndim(targets) < 1 or jnp.shape(targets)[0] != jnp.shape(x)[0]:
    raise PipelineError(
        f"targets: expected the batch dim of x, {jnp.shape(x)[0]}, got shape "
        f"{jnp.shape(targets)}.")
