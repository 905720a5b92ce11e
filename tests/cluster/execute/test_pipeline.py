"""Pipeline schedules: numerics against the unpipelined stack, and the compiled
stage-to-stage transfers."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from automap._src.cluster.execute.pipeline import PipelineError, pipelined, pipelined_loss

WIDTH, HIDDEN = 16, 32
# Layer dim on 'stage', Megatron split of the hidden dim on 'model'.
PARAM_SPECS = dict(w1=P("stage", None, "model"), b1=P("stage", "model"),
                   w2=P("stage", "model", None), b2=P("stage"))


def layer(p, x):  # x: [b, WIDTH]
  return x + jnp.tanh(x @ p["w1"] + p["b1"][None]) @ p["w2"] + p["b2"][None]


def stack(params, x):
  """The reference: the L layers in order, no mesh."""
  return jax.lax.scan(lambda h, p: (layer(p, h), None), x, params)[0]


def mse(y, t):
  return jnp.mean((y - t) ** 2)


def problem(layers=4, batch=8, seed=0):
  k = jax.random.split(jax.random.key(seed), 6)
  shapes = dict(w1=(layers, WIDTH, HIDDEN), b1=(layers, HIDDEN),
                w2=(layers, HIDDEN, WIDTH), b2=(layers, WIDTH))
  params = {n: jax.random.normal(k_, s) / 4 for k_, (n, s) in zip(k, shapes.items())}
  return params, jax.random.normal(k[4], (batch, WIDTH)), jax.random.normal(k[5], (batch, WIDTH))


def reference_step(params, x, t):
  return jax.value_and_grad(lambda p, x, t: mse(stack(p, x), t), argnums=(0, 1, 2))(params, x, t)


def jitted_step(loss, mesh, specs=PARAM_SPECS):
  shardings = ({n: NamedSharding(mesh, s) for n, s in specs.items()},
               NamedSharding(mesh, P("data")), NamedSharding(mesh, P("data")))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)), in_shardings=shardings)


def assert_same_step(got, want):
  # Gradients summed in another order (per microbatch, per stage) round
  # apart by float32's few 1e-6 on values below one; a wrong layout or
  # schedule errs by the values themselves.
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def stage_transfers(hlo: str, mesh) -> dict[tuple[int, int], list[str]]:
  """(from stage, to stage) -> shapes of the collective-permutes between them."""
  stage_of = {d.id: s for s in range(mesh.shape["stage"])
              for d in np.take(mesh.devices, s, mesh.axis_names.index("stage")).flat}
  moves: dict[tuple[int, int], list[str]] = {}
  for shape, pairs in re.findall(
      r"= (\S+) collective-permute\(.*?source_target_pairs=\{(.*?)\}\}", hlo):
    for a, b in re.findall(r"(\d+),(\d+)", pairs):
      moves.setdefault((stage_of[int(a)], stage_of[int(b)]), []).append(shape.split("{")[0])
  return moves


@pytest.mark.heavy
@pytest.mark.parametrize("axis_types", [AxisType.Explicit, AxisType.Auto])
def test_gpipe_training_step_equals_the_unpipelined_step(axis_types):
  mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"), axis_types=(axis_types,) * 3)
  params, x, t = problem()
  run = pipelined(layer, mesh=mesh, microbatches=4)
  step = jitted_step(lambda p, x, t: mse(run(p, x), t), mesh)
  got = step(params, x, t)
  assert_same_step(got, reference_step(params, x, t))
  # The gradients keep the layout of the parameters: layers per stage, hidden on 'model'.
  for name, grad in got[1][0].items():
    assert grad.sharding.is_equivalent_to(NamedSharding(mesh, PARAM_SPECS[name]), grad.ndim)


def test_gpipe_sends_microbatches_forward_and_cotangents_back():
  mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
  params, x, t = problem()
  run = pipelined(layer, mesh=mesh, microbatches=4)
  forward = jax.jit(run).lower(params, x).compile().as_text()
  assert set(stage_transfers(forward, mesh)) == {(0, 1)}
  step = jitted_step(lambda p, x, t: mse(run(p, x), t), mesh).lower(params, x, t).compile()
  moves = stage_transfers(step.as_text(), mesh)
  assert set(moves) == {(0, 1), (1, 0)}
  # A microbatch is 2 rows, split over 'data': each device moves 1 row.
  assert set(moves[0, 1]) == set(moves[1, 0]) == {f"f32[1,{WIDTH}]"}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_arguments_typed_on_an_explicit_mesh_keep_their_types(schedule):
  mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
  params, x, t = problem()
  typed = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = ({n: typed(a, PARAM_SPECS[n]) for n, a in params.items()}, typed(x, P("data")),
          typed(t, P("data")))
  loss = pipelined_loss(layer, mse, mesh=mesh, microbatches=4, schedule=schedule)
  with jax.set_mesh(mesh):
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*args)
  assert_same_step(got, reference_step(params, x, t))
  for grad, arg in zip(jax.tree.leaves(got[1]), jax.tree.leaves(args), strict=True):
    assert jax.typeof(grad).sharding.spec == jax.typeof(arg).sharding.spec


@pytest.mark.heavy
@pytest.mark.parametrize("schedule,remat", [("gpipe", False), ("gpipe", True), ("1f1b", False)])
def test_four_stages_by_two_data(schedule, remat):
  mesh = jax.make_mesh((4, 2), ("stage", "data"))
  params, x, t = problem(layers=8, batch=16)
  loss = pipelined_loss(layer, mse, mesh=mesh, microbatches=8, schedule=schedule, remat=remat)
  step = jitted_step(loss, mesh, {n: P("stage") for n in PARAM_SPECS}).lower(params, x, t).compile()
  assert_same_step(step(params, x, t), reference_step(params, x, t))
  moves = stage_transfers(step.as_text(), mesh)
  assert set(moves) == {(s, s + 1) for s in range(3)} | {(s + 1, s) for s in range(3)}


@pytest.mark.heavy
def test_1f1b_training_step_equals_the_unpipelined_step():
  mesh = jax.make_mesh((2, 2, 2), ("stage", "data", "model"))
  params, x, t = problem()
  loss = pipelined_loss(layer, mse, mesh=mesh, microbatches=4)
  assert_same_step(jitted_step(loss, mesh)(params, x, t), reference_step(params, x, t))
  np.testing.assert_allclose(loss(params, x, t), mse(stack(params, x), t), rtol=1e-5)


@pytest.mark.heavy
def test_1f1b_with_integer_class_labels():
  mesh = jax.make_mesh((2, 4), ("stage", "data"))
  params, x, _ = problem()
  labels = jnp.arange(8) % WIDTH  # [B] classes of the WIDTH logits
  xent = lambda y, t: -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(y), t[:, None], axis=1))
  loss = pipelined_loss(layer, xent, mesh=mesh, microbatches=4)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x, labels)
  want = jax.value_and_grad(lambda p, x: xent(stack(p, x), labels), argnums=(0, 1))(params, x)
  assert_same_step(got, want)


@pytest.mark.parametrize("stages,microbatches", [(4, 1), (4, 2), (1, 4)])
def test_1f1b_with_fewer_microbatches_than_stages_or_a_single_stage(stages, microbatches):
  mesh = jax.make_mesh((stages, 8 // stages), ("stage", "data"))
  params, x, t = problem(layers=4)
  loss = pipelined_loss(layer, mse, mesh=mesh, microbatches=microbatches)
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, t)
  assert_same_step(got, reference_step(params, x, t))


@pytest.mark.heavy
def test_1f1b_holds_fewer_activations_than_gpipe():
  mesh = jax.make_mesh((2, 4), ("stage", "data"))
  params, x, t = problem(batch=128)
  temp = {}
  for schedule in ("gpipe", "1f1b"):
    loss = pipelined_loss(layer, mse, mesh=mesh, microbatches=16, schedule=schedule)
    compiled = jax.jit(jax.grad(loss)).lower(params, x, t).compile()
    temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
  # GPipe keeps every tick's activations (M + S - 1); 1F1B at most 2S - 1 stage inputs.
  assert temp["1f1b"] < temp["gpipe"] / 2


def test_bad_arguments_are_named_with_a_fix():
  mesh = jax.make_mesh((2, 4), ("stage", "data"))
  params, x, t = problem()
  run = pipelined(layer, mesh=mesh, microbatches=4)
  with pytest.raises(PipelineError, match=r"no stage axis 'pipe'.*stage_axis="):
    pipelined(layer, mesh=mesh, microbatches=4, stage_axis="pipe")
  with pytest.raises(PipelineError, match="microbatches: expected an int >= 1, got 0"):
    pipelined(layer, mesh=mesh, microbatches=0)
  with pytest.raises(PipelineError, match="use pipelined_loss"):
    pipelined(layer, mesh=mesh, microbatches=4, schedule="1f1b")
  with pytest.raises(PipelineError, match="schedule: expected one of"):
    pipelined_loss(layer, mse, mesh=mesh, microbatches=4, schedule="zigzag")
  with pytest.raises(PipelineError, match="3 layers do not split over 2 stages"):
    run(jax.tree.map(lambda a: a[:3], params), x)
  with pytest.raises(PipelineError, match=r"x: batch dim of shape \(6, 16\).* 4 microbatches"):
    run(params, x[:6])
  with pytest.raises(PipelineError, match="same leading layer dim"):
    run(dict(params, b2=params["b2"][:2]), x)
  with pytest.raises(PipelineError, match=r"layer_fn: must map a microbatch to .*float32\[2, 16\]"):
    pipelined(lambda p, x: x[:, :8], mesh=mesh, microbatches=4)(params, x)
  elsewhere = jax.make_mesh((4, 2), ("stage", "data"))
  with pytest.raises(PipelineError, match=r"typed on a mesh of shape \{'stage': 4"):
    run(params, jax.device_put(x, NamedSharding(elsewhere, P("data"))))
  with pytest.raises(PipelineError, match=r"targets: expected the batch dim of x, 8"):
    pipelined_loss(layer, mse, mesh=mesh, microbatches=4)(params, x, t[:4])
