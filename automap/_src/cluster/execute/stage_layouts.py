"""Where a running cluster plan puts things: stage meshes, parameter layouts,
values moved between stages, and the optimizers a per-stage update keeps
exact.

Replica r's stage s runs on the devices at r * (devices per pipeline) + the
stage's first device onwards, as the cluster model lays them out; a stage's
mesh is (data, tensor), or under hybrid sharding (replica, shard, tensor):
the d replicas as d / g groups of g consecutive ones, ZeRO sharding over
"shard" within a group and the gradients' shards summed over "replica"
across the groups. Under context parallelism the tensor axis is preceded
by "context" (a stage's width devices as (context, width / context), the
tensor group minor, as the planner's `profile.context.stage_mesh` lays
them): the batch's sequence is split over it, and attention across the split
is what XLA's partitioner makes of that layout (keys and values gathered over
"context"). A parameter takes the plan's searched layout at the stage's width,
the search mesh's "model" renamed "tensor" ("context" kept). A plan
offloading the optimizer state keeps it in the devices' pinned host memory
(`HOST`) between steps, refused where the backend has none.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.cluster.errors import PlacementError
from automap._src.cluster.placement import slices
from automap._src.cluster.profile.context import CONTEXT

DATA, TENSOR = "data", "tensor"
REPLICA, SHARD = "replica", "shard"  # hybrid sharding's "data": groups x replicas of a group
HOST = "pinned_host"  # where an offloading plan keeps the optimizer state between steps


def data_axes(mesh: Mesh) -> tuple[str, ...]:
  """A stage mesh's axes of data-parallel replicas, major first."""
  return (DATA,) if DATA in mesh.axis_names else (REPLICA, SHARD)


def replicas(mesh: Mesh):
  """The spec entry splitting a dim over every replica (the batch's rows)."""
  return DATA if DATA in mesh.axis_names else (REPLICA, SHARD)


def zero_axis(mesh: Mesh) -> str:
  """The axis ZeRO shards over: every replica, or a hybrid group's."""
  return DATA if DATA in mesh.axis_names else SHARD


def across_groups(mesh: Mesh) -> str | None:
  """The axis a hybrid plan sums ZeRO's gradient shards over (None: none)."""
  return None if DATA in mesh.axis_names else REPLICA


def context_size(mesh: Mesh) -> int:
  """The devices a stage mesh splits the sequence over (1: none)."""
  return mesh.shape[CONTEXT] if CONTEXT in mesh.axis_names else 1


def meshes(plan, devices) -> list[Mesh]:
  """Per stage, its (data, tensor) mesh, or (replica, shard, tensor) under
  hybrid sharding, with "context" before "tensor" under context
  parallelism: replica r's stage s on the devices at r * (devices per
  pipeline) + the stage's first device onwards, replicas r // g in a group,
  a stage's devices (context, width / context)."""
  p = plan.placement
  if p.recompute_every > 1 and p.zero >= 3:
    raise PlacementError(
        f"plan: recompute_every={p.recompute_every} with ZeRO 3: a stage under ZeRO 3 "
        "recomputes its whole chunk at once (its parameter gathers stay inside what is "
        "rebuilt), so it cannot recompute every k-th layer alone; price the split with "
        "recompute_every=1, or zero <= 2.")
  devices = slices.devices(devices)
  if p.offload != "none":
    _host_memory(devices[:p.devices], f"offload={p.offload!r} keeps the optimizer state in",
                 "offload='none' (or more devices, or ZeRO, to fit the state on them)")
  if p.offload_activations:
    _host_memory(devices[:p.devices],
                 f"offload_activations={p.offload_activations!r} sends activations to",
                 "another recompute mode")
  if len(devices) < p.devices:
    raise PlacementError(
        f"devices: the plan uses {p.devices} devices ({p.data_parallel} data-parallel x "
        f"{len(p.stages)} stage(s) of widths {[s.width for s in p.stages]}); got "
        f"{len(devices)}. Plan for the devices there are, or pass enough.")
  per_pipeline = sum(s.width for s in p.stages)
  # Compile-only devices (a TPU slice's, `automap.tpu_mesh`) belong to hosts
  # no process here drives: nothing moves between them, so their hosts need
  # not match the processes.
  used = {d.process_index for d in devices[:p.devices]}
  if slices.compile_only(devices[:p.devices]):
    used = set(range(jax.process_count()))
  if len(used) < jax.process_count():
    raise PlacementError(
        f"devices: the plan uses {p.devices} devices, all in processes {sorted(used)} of "
        f"{jax.process_count()}; every process must run some of it. Plan for the devices of "
        "every process.")
  for r in range(p.data_parallel):
    owners = {d.process_index for d in devices[r * per_pipeline:(r + 1) * per_pipeline]}
    if len(owners) > 1 and not slices.compile_only(devices):
      raise PlacementError(
          f"devices: pipeline replica {r} spans processes {sorted(owners)}; with one process "
          f"per host each replica's {per_pipeline} devices must be one process's (stages "
          "pass values through the devices of their own process). Give each process a "
          "multiple of the devices per pipeline, or order `devices=` so.")
  meshes = []
  for index, stage in enumerate(p.stages):
    grid = np.array([[devices[r * per_pipeline + stage.first_device + k]
                      for k in range(stage.width)] for r in range(p.data_parallel)])
    rows, names = [p.data_parallel], [DATA]
    if p.shard_group is not None:
      g = p.shard_group
      if g < 2 or p.data_parallel % g:
        raise PlacementError(
            f"plan: shard_group={g} must be at least 2 and divide the {p.data_parallel} "
            "data-parallel replicas; plan it with ClusterConfig(shard_group=...).")
      rows, names = [p.data_parallel // g, g], [REPLICA, SHARD]
    within, inner = [stage.width], [TENSOR]
    if p.context > 1:
      if stage.width % p.context:
        raise PlacementError(
            f"plan: context={p.context} does not divide stage {index}'s width "
            f"{stage.width}; plan it with ClusterConfig(context=...).")
      within, inner = [p.context, stage.width // p.context], [CONTEXT, TENSOR]
    meshes.append(Mesh(grid.reshape(*rows, *within), (*names, *inner),
                       axis_types=(AxisType.Auto,) * (len(names) + len(inner))))
  return meshes


def _host_memory(devices, what: str, instead: str) -> None:
  """A PlacementError naming the first device without pinned host memory,
  which `what` needs."""
  for dev in devices:
    if HOST not in {m.kind for m in dev.addressable_memories()}:
      raise PlacementError(
          f"plan: {what} {HOST!r} memory, which the {dev.platform!r} backend's device "
          f"{dev.id} lacks; price the split with {instead}.")


def tensor_spec(spec: P | None, aval, width: int, path: str, context: int = 1) -> tuple:
  """The plan's layout of a parameter within a stage (its searched spec over
  the stage's mesh of `width` devices: ("model",), or ("context", "model")
  of (context, width / context)), "model" renamed "tensor"; whole where the
  plan has none."""
  entries: list = [None] * len(aval.shape)
  if spec is None or width == 1:
    return tuple(entries)
  sizes = {"model": width // context, CONTEXT: context}
  names = {"model": TENSOR, CONTEXT: CONTEXT}
  if len(spec) > len(aval.shape):
    raise PlacementError(
        f"plan: parameter {path!r} has layout {spec} of rank {len(spec)}, but the parameter "
        f"is {aval.dtype}{list(aval.shape)}; plan it for these parameters.")
  for k, e in enumerate(spec):
    if e is None:
      continue
    if context == 1:  # a one-axis mesh: whatever the entry names, it is "model"
      axes = ("model",)
    else:
      axes = tuple(e) if isinstance(e, (tuple, list)) else (e,)
    n = int(np.prod([sizes[a] for a in axes]))
    if aval.shape[k] % n:
      raise PlacementError(
          f"plan: parameter {path!r} dim {k} of size {aval.shape[k]} does not split over "
          f"{n} devices of its stage; plan it for these parameters.")
    kept = tuple(names[a] for a in axes if sizes[a] > 1)
    entries[k] = None if not kept else kept[0] if len(kept) == 1 else kept
  return tuple(entries)


def check_elementwise(optimizer: optax.GradientTransformation, params) -> None:
  """Refuses an optimizer whose update of one parameter reads another's
  gradient or state (a global norm): per-stage updates would be wrong."""
  if not (hasattr(optimizer, "init") and hasattr(optimizer, "update")):
    raise PlacementError(
        f"optimizer: expected an optax.GradientTransformation, got {type(optimizer).__name__}.")
  leaves, treedef = jax.tree.flatten(params)
  state = jax.eval_shape(optimizer.init, params)
  state_leaves = jax.tree.leaves(state)
  # State leaves in subtrees shaped like the parameters belong to one parameter.
  owner_of_state = [None] * len(state_leaves)
  for start in param_like_subtrees(state, treedef):
    for k in range(len(leaves)):
      owner_of_state[start + k] = k
  closed = jax.make_jaxpr(lambda g, st, p: optimizer.update(g, st, p))(params, state, params)
  n = len(leaves)
  tags: dict = {}
  invars = closed.jaxpr.invars
  for k, var in enumerate(invars):
    if k < n:
      tags[var] = {k}
    elif k < n + len(state_leaves):
      o = owner_of_state[k - n]
      tags[var] = set() if o is None else {o}
    else:
      tags[var] = {k - n - len(state_leaves)}
  for eqn in closed.jaxpr.eqns:
    deps = set()
    for a in eqn.invars:
      if not hasattr(a, "val"):
        deps |= tags.get(a, set())
    for out in eqn.outvars:
      tags[out] = deps
  outs = closed.jaxpr.outvars
  for k, var in enumerate(outs[:n]):
    found = set() if hasattr(var, "val") else tags.get(var, set())
    if found - {k}:
      raise PlacementError(
          "optimizer: its update of one parameter reads other parameters' gradients or "
          "state (e.g. optax.clip_by_global_norm); a pipeline updates each stage's "
          "parameters apart, so this would be wrong. Use an optimizer that updates each "
          "parameter from its own gradient and state (sgd, adam, adamw, lion, "
          "clip per parameter).")


def param_like_subtrees(state, treedef) -> list[int]:
  """Flat offsets of the subtrees of `state` with the parameters' structure."""
  starts: list[int] = []

  def walk(node, offset: int) -> int:
    if jax.tree.structure(node) == treedef:
      starts.append(offset)
      return offset + treedef.num_leaves
    children = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)[0]
    if len(children) == 1 and children[0] is node:
      return offset + len(jax.tree.leaves(node))
    for child in children:
      offset = walk(child, offset)
    return offset

  walk(state, 0)
  return starts


def arrival(mesh: Mesh, shape: tuple, split_batch: bool = False) -> NamedSharding:
  """How a value from another stage ([d, ...]) lands on `mesh`: each
  tensor-parallel device receives a 1/t slice, and the programs gather what
  they need, so a link carries 1/t of it, as the plan prices. The slice is
  of the batch (dim 1) where the stage's plan splits the batch inside the
  tensor group (`split_batch`), else of the last dim that divides
  (Megatron-LM's scatter/gather of activations between stages). Under
  context parallelism the sequence (dim 2) is split over "context" too."""
  t, c = mesh.shape[TENSOR], context_size(mesh)
  spec: list = [replicas(mesh)] + [None] * (len(shape) - 1)
  if c > 1 and len(shape) > 2 and shape[2] % c == 0:
    spec[2] = CONTEXT
  if t > 1 and split_batch and len(shape) > 1 and shape[1] % t == 0:
    spec[1] = TENSOR
    return NamedSharding(mesh, P(*spec))
  for k in range(len(shape) - 1, 0, -1):
    if t > 1 and spec[k] is None and shape[k] % t == 0:
      spec[k] = TENSOR
      break
  return NamedSharding(mesh, P(*spec))


def rows(mesh: Mesh, count: int, split_batch: bool, shape: tuple = ()) -> NamedSharding:
  """A microbatch's `count` rows (a batch leaf of `shape`) on a stage: over
  the replicas, and over "tensor" too where the stage's plan splits the
  batch inside the tensor group; its sequence (dim 1) over "context" where
  the stage splits it, as the plan pins it."""
  c = context_size(mesh)
  if c > 1 and len(shape) > 1 and shape[1] % c == 0:
    return NamedSharding(mesh, P(replicas(mesh), CONTEXT))
  if split_batch and count % (mesh.devices.size // c) == 0:
    return NamedSharding(mesh, P((*data_axes(mesh), TENSOR)))
  return NamedSharding(mesh, P(replicas(mesh)))


def splits_batch(specs: dict[str, P], batch_paths: list[str]) -> bool:
  """Whether a width's searched plan lays the batch out over the tensor
  group (every batch leaf's leading dim split): the stage's activations then
  arrive split by rows, as that plan runs them."""
  found = [specs.get(p) for p in batch_paths]
  return bool(found) and all(spec is not None and len(spec) > 0 and spec[0] is not None
                             for spec in found)


def place(x, sharding: NamedSharding) -> jax.Array:
  """`x` laid out by `sharding`, with one process or one per host. Across
  processes a host value is sliced per device, and an array on other devices
  is moved block by block through this process's devices that hold it: a
  pipeline replica lives in one process (the devices of replica r are
  consecutive), so what a device of this process needs is here."""
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  if not isinstance(x, jax.Array):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
  if x.sharding.device_set == sharding.device_set:
    return jax.device_put(x, sharding)
  shards = {tuple((s.start, s.stop) for s in shard.index): shard for shard in x.addressable_shards}
  blocks = [_block(shards.values(), index, x.shape, x.dtype, device)
            for device, index in sharding.addressable_devices_indices_map(x.shape).items()]
  return jax.make_array_from_single_device_arrays(x.shape, sharding, blocks)


def _block(shards, index: tuple, shape: tuple, dtype, device) -> jax.Array:
  """Block `index` of a global array, on `device`, from the shards given."""
  lo = [s.indices(n)[0] for s, n in zip(index, shape)]
  hi = [s.indices(n)[1] for s, n in zip(index, shape)]
  out = jax.device_put(jnp.zeros([b - a for a, b in zip(lo, hi)], dtype), device)
  for shard in shards:
    s_lo = [s.indices(n)[0] for s, n in zip(shard.index, shape)]
    s_hi = [s.indices(n)[1] for s, n in zip(shard.index, shape)]
    a = [max(p, q) for p, q in zip(lo, s_lo)]
    b = [min(p, q) for p, q in zip(hi, s_hi)]
    if any(x >= y for x, y in zip(a, b)):
      continue
    piece = shard.data[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, s_lo))]
    out = out.at[tuple(slice(x - o, y - o) for x, y, o in zip(a, b, lo))].set(
        jax.device_put(piece, device))
  return out


def device_bytes(x: jax.Array, sharding: NamedSharding) -> float:
  """Bytes of `x` on each device holding it, laid out by `sharding`."""
  return float(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize


def copy(x):
  """A copy of `x` the caller does not hold (a step may donate it)."""
  return jnp.array(x, copy=True) if isinstance(x, jax.Array) else np.array(x)


def inexact(aval) -> bool:
  """Whether values of `aval` have cotangents (floating or complex)."""
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def cotangent(x, aval):
  """A cotangent for a value of `aval`: float0 zeros for integers."""
  if inexact(aval):
    return x
  return np.zeros(aval.shape, jax.dtypes.float0)


def sum_on(parts: list, sharding: NamedSharding, aval):
  """Cotangent contributions summed on `sharding`'s devices ([d, ...])."""
  d = int(np.prod([sharding.mesh.shape[a] for a in data_axes(sharding.mesh)]))
  if not inexact(aval):
    return place(np.zeros((d, *aval.shape), np.float32), sharding)
  if not parts:
    return place(np.zeros((d, *aval.shape), aval.dtype), sharding)
  total = place(parts[0], sharding)
  for x in parts[1:]:
    total = total + place(x, sharding)
  return total


__all__ = ["CONTEXT", "DATA", "HOST", "REPLICA", "SHARD", "TENSOR", "across_groups", "arrival",
           "check_elementwise", "context_size", "copy", "cotangent", "data_axes",
           "device_bytes", "inexact", "meshes", "param_like_subtrees", "place", "replicas",
           "rows", "splits_batch", "sum_on", "tensor_spec", "zero_axis"]
