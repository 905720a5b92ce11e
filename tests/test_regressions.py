"""Inputs that once broke automap, one test each."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh, mlp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.plan import build, planner
from automap._src.run import compiled as hlo

X = (jnp.ones((16, 32)), jnp.ones((32, 64)), jnp.ones((64, 32)))


def test_closed_over_constants():
  w = jnp.arange(32.0 * 8).reshape(32, 8) / 100
  bias = np.arange(8.0)[None]
  f = automap.partition(lambda x: x @ w + bias, mesh=mesh((4, 2)), hardware="cpu")
  np.testing.assert_allclose(f(X[0]), X[0] @ w + bias, rtol=1e-6)


def test_python_numbers_keep_weak_types():
  x = jnp.ones((16, 32), jnp.bfloat16)
  f = automap.partition(lambda x, s: x * s, mesh=mesh((8, 1)), hardware="cpu")
  assert f(x, 2.0).dtype == jnp.bfloat16
  i = jnp.ones((16,), jnp.int8)
  assert automap.partition(lambda x, s: x * s, mesh=mesh((8, 1)))(i, 3).dtype == jnp.int8


def test_verify_compares_prng_keys_and_integers_exactly():
  def f(key, x):
    key, sub = jax.random.split(key)
    return key, x * jax.random.uniform(sub, x.shape), jnp.argmax(x, axis=1)
  args = (jax.random.key(0), jnp.arange(16 * 32.0).reshape(16, 32))
  plan = automap.search(f, *args, mesh=mesh((4, 2)), hardware="cpu")
  report = automap.verify(plan, f, *args, mesh=mesh((4, 2)))
  assert report.max_abs_error == 0.0


def test_random_dropout_raises_no_unknown_primitive_warning():
  def f(key, x):
    keep = jax.random.bernoulli(key, 0.9, x.shape)
    return jnp.where(keep, x / 0.9, 0.0) @ X[1]
  automap.search(f, jax.random.key(0), X[0], mesh=mesh((4, 2)))  # warnings are errors


def test_dropout_bits_are_drawn_split_as_xla_draws_them():
  """Counter-based bits (`jax_threefry_partitionable`, JAX's default) do not
  depend on the layout: each device draws only its tile of a dropout mask,
  as XLA's partitioner has it. The compiled step holds no whole mask, its
  numerics are jit's, and its allocation is the plan's (a whole mask per
  device was priced as split and compiled 52% over on a BERT step)."""
  from automap._src.run.compiled import compiled_memory

  def step(w1, w2, x, key):
    def loss(w1, w2):
      h = jax.nn.relu(x @ w1)
      keep = jax.random.bernoulli(key, 0.9, h.shape)
      return jnp.mean((jnp.where(keep, h / 0.9, 0.0) @ w2) ** 2)
    return jax.grad(loss, argnums=(0, 1))(w1, w2)

  k = jax.random.split(jax.random.key(0), 4)
  args = (jax.random.normal(k[0], (64, 256)) / 8, jax.random.normal(k[1], (256, 64)) / 16,
          jax.random.normal(k[2], (512, 64)), k[3])
  f = automap.partition(step, mesh=mesh((4, 2)), hardware="cpu",
                        hints=automap.Hints(fixed={"2": P("data")}))
  for got, want in zip(f(*args), jax.jit(step)(*args)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
  compiled = f.lower(*args).compile()
  assert "u32[512,256]" not in compiled.as_text()
  allocated, _ = compiled_memory(compiled)
  assert abs(f.plan.cost.peak_memory - allocated) < 0.15 * allocated


def test_axes_out_of_mesh_order_are_refused_not_reordered():
  with pytest.raises(automap.MeshError, match="out of mesh order"):
    automap.evaluate(mlp, *X, mesh=mesh((4, 2)), in_shardings=(P(("model", "data")), P(), P()))


def test_equivalent_fixed_hints_do_not_conflict():
  hints = automap.Hints(fixed={"0": P("data"), "[0]": P("data", None)})
  plan = automap.search(mlp, *X, mesh=mesh((4, 2)), hints=hints, hardware="cpu")
  assert plan.in_specs[0] == P("data")
  assert hash(hints) == hash(automap.Hints(fixed={"0": P("data"), "[0]": P("data", None)}))


def test_call_inside_an_explicit_mesh_context_returns_arrays_on_that_mesh():
  m = mesh((4, 2))
  f = automap.partition(mlp, mesh=m, hardware="cpu")
  with jax.set_mesh(m):
    out = f(*X)
  assert out.sharding.mesh == m
  np.testing.assert_allclose(out, mlp(*X), rtol=1e-5)


def test_keyword_arguments_are_bound_positionally():
  f = automap.partition(mlp, mesh=mesh((4, 2)), hardware="cpu")
  np.testing.assert_allclose(f(X[0], w1=X[1], w2=X[2]), mlp(*X), rtol=1e-5)


def test_keyword_only_arguments_are_planned_and_sharded_like_the_others():
  def scaled(x, w1, w2, *, scale, bias=None):
    out = mlp(x, w1, w2) * scale
    return out if bias is None else out + bias

  f = automap.partition(scaled, mesh=mesh((4, 2)), hardware="cpu")
  np.testing.assert_allclose(f(*X, scale=2.0), mlp(*X) * 2.0, rtol=1e-5)
  bias = jnp.ones(mlp(*X).shape)
  np.testing.assert_allclose(f(*X, scale=jnp.float32(3), bias=bias), mlp(*X) * 3 + bias,
                             rtol=1e-5)
  # The keyword arguments are the plan's last argument, one dict.
  assert len(f.plan.in_specs) == len(X) + 2
  assert f.lower(*X, scale=2.0, bias=bias).compile() is not None


def test_partition_refuses_an_abstract_mesh():
  abstract = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
  with pytest.raises(automap.MeshError, match="automap.search"):
    automap.partition(mlp, mesh=abstract)
  assert automap.search(mlp, *X, mesh=abstract).mesh.axis_sizes == (4, 2)


def test_verify_prices_with_the_plans_own_hardware():
  hw = automap.Hardware(name="slow", flops=1e9, fp32_flops=1e9, hbm_bandwidth=1e9,
                        hbm_capacity=1e9, link_bandwidth=1e8, link_latency=1e-5,
                        network_bandwidth=1e8, network_latency=1e-5, devices_per_node=8,
                        platform="cpu")
  plan = automap.search(mlp, *X, mesh=mesh((4, 2)), hardware=hw)
  report = automap.verify(plan, mlp, *X, mesh=mesh((4, 2)))
  assert report.predicted.step_time == pytest.approx(plan.cost.step_time, rel=1e-9)
  assert automap.Plan.from_json(plan.to_json()).hardware == hw


def test_numpy_scalar_arguments_still_get_numerics_checked():
  f = lambda x, s: x * s  # noqa: E731
  plan = automap.search(f, X[0], np.float32(2), mesh=mesh((8, 1)), hardware="cpu")
  assert automap.verify(plan, f, X[0], np.float32(2), mesh=mesh((8, 1))).max_abs_error == 0


def test_async_collectives_count_their_result_only():
  line = ("%ags = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(%p), "
          "replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}")
  (c,) = hlo.collectives(line, mesh((4, 2)))
  assert (c.kind, c.nbytes, c.axes) == ("all-gather", 16 * 8 * 4, ("data",))


ODD = {
    "passthrough and literal outputs": (lambda x, w: (x, 3.0, x @ w), (X[0], X[1])),
    "zero-size array": (lambda x, z: (x.sum(), z * 2), (X[0], jnp.zeros((0, 4)))),
    "bf16 matmul": (lambda x, w: (x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)),
                    (X[0], X[1])),
    "integer indices": (lambda i, w: w[i].sum(0), (jnp.arange(8) % 32, X[1])),
    "nested outputs": (lambda x, w: {"a": x @ w, "b": [x.T, (x,)]}, (X[0], X[1])),
    "no arguments": (lambda: jnp.ones(4) * 2, ()),
    "cond": (lambda x, w: jax.lax.cond(x.sum() > 0, lambda: x @ w, lambda: -(x @ w)),
             (X[0], X[1])),
    "while": (lambda x: jax.lax.while_loop(lambda c: c[0] < 3,
                                           lambda c: (c[0] + 1, c[1] * 2), (0, x))[1],
              (X[0],)),
}


@pytest.mark.parametrize("name", sorted(ODD))
@pytest.mark.parametrize("shape,names", [((8,), ("x",)), ((2, 1, 4), ("a", "b", "c"))],
                         ids=["1-axis", "3-axis-with-unit"])
def test_odd_programs_and_meshes(name, shape, names):
  fn, args = ODD[name]
  out = automap.partition(fn, mesh=mesh(shape, names), hardware="cpu")(*args)
  expected = jax.jit(fn)(*args)
  assert jax.tree.structure(out) == jax.tree.structure(expected)
  for a, e, own in zip(jax.tree.leaves(out), jax.tree.leaves(expected),
                       jax.tree.leaves(fn(*args))):
    if not isinstance(own, jax.Array):  # a literal comes back as written, as eqx.filter_jit
      assert type(a) is type(own) and a == own
      continue
    assert a.dtype == e.dtype and a.shape == e.shape
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(e, np.float32), rtol=1e-2)


def test_dead_code_costs_nothing():
  # XLA removes what no output needs; an unused product must not be priced.
  x, w1, w2 = X

  def with_dead(x, w1, w2):
    _ = (x @ w1) @ w1.T  # never returned
    return jnp.tanh(x @ w1) @ w2

  m = mesh((4, 2))
  specs = (P("data"), P(None, "model"), P("model"))
  alive = automap.evaluate(mlp, x, w1, w2, mesh=m, in_shardings=specs, hardware="cpu")
  dead = automap.evaluate(with_dead, x, w1, w2, mesh=m, in_shardings=specs, hardware="cpu")
  assert dead.step_time == pytest.approx(alive.step_time)
  assert dead.comm_bytes == alive.comm_bytes
  assert dead.peak_memory == pytest.approx(alive.peak_memory)


@pytest.mark.heavy
def test_graph_network_data_parallel_is_priced_as_compiled():
  # Scatter-adds into nodes tiled over both axes: one all-reduce over both,
  # not one per axis; the unused sender aggregation is removed by XLA.
  from helpers import graph_network_step

  step, args = graph_network_step(256, 1024, 32)
  m = mesh((4, 2))
  split = P(("data", "model"))
  plan = automap.search(step, *args, mesh=m, hardware="cpu", hints=automap.Hints(fixed={
      f"2/{name}": split for name in ("nodes", "edges", "senders", "receivers")}))
  report = automap.verify(plan, step, *args, mesh=m)
  assert report.comm_error < 0.05, report.table()
  assert abs(report.memory_error) < 0.15, report.table()


@pytest.mark.heavy
def test_sliced_gradient_reductions_hold_their_results():
  # Without reduce-scatter (the CPU backend), gradients of weights tiled
  # over both axes are all-reduced whole, in one combined collective, then
  # sliced: its whole results sit beside its unreduced inputs.
  from helpers import gpt_step

  from automap._src.search.actions import ActionSpace, Tactic

  step, args = gpt_step()
  m = mesh((2, 4))
  program = planner.build_program(step, args, m, "cpu")
  space, state = ActionSpace(program), program.initial_state()
  for action in (Tactic("data-parallel", (0, 1)), Tactic("megatron", (1,)),
                 Tactic("megatron", (0,))):
    space.apply(state, action)
  plan = build.make_plan(program, state, {})
  report = automap.verify(plan, step, *args, mesh=m)
  assert ("all-reduce", ("data", "model")) in plan.cost.comm_bytes
  assert report.comm_error < 0.05, report.table()
  assert abs(report.memory_error) < 0.15, report.table()


def test_an_axis_of_one_device_in_a_spec_moves_nothing():
  m = jax.make_mesh((1, 8), ("a", "b"))
  x = jnp.arange(8.0 * 16).reshape(8, 16)
  hints = automap.Hints(fixed={"0": P("a", "b")})
  plan = automap.search(lambda x: jnp.abs(x).T, x, mesh=m, hints=hints, hardware="cpu")
  report = automap.verify(plan, lambda x: jnp.abs(x).T, x, mesh=m)
  assert report.max_abs_error == 0.0
  assert report.comm_error < 0.05, report.table()


@pytest.mark.parametrize("remat", [False, True])
def test_checkpoint_name_is_an_identity_as_compiled(remat):
  """`checkpoint_name` (primitive `name`), the tag remat policies read, is
  the value itself: priced with the tag as without it, and as XLA compiles
  it (no warning, no extra gathers), under a remat policy that saves it too."""
  from jax.ad_checkpoint import checkpoint_name

  from automap._src.run.compiled import collectives

  m = mesh((4, 2))
  w1, w2, x = jnp.ones((256, 1024)) / 256, jnp.ones((1024, 256)) / 1024, jnp.ones((64, 256))
  specs = (P(None, "model"), P("model", None), P("data", None))

  def loss(tag):
    def f(w1, w2, x):
      h = jax.nn.relu(x @ w1)
      return jnp.mean((((checkpoint_name(h, "h") if tag else h)) @ w2) ** 2)
    if remat:
      f = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("h"))
    return jax.grad(f, argnums=(0, 1))

  tagged = automap.evaluate(loss(True), w1, w2, x, mesh=m, in_shardings=specs, hardware="cpu")
  plain = automap.evaluate(loss(False), w1, w2, x, mesh=m, in_shardings=specs, hardware="cpu")
  assert tagged.comm_bytes == plain.comm_bytes
  assert tagged.peak_memory == plain.peak_memory
  shardings = tuple(NamedSharding(m, s) for s in specs)
  compiled = jax.jit(loss(True), in_shardings=shardings).lower(w1, w2, x).compile()
  found = sum(c.nbytes for c in collectives(compiled.as_text(), m))
  assert tagged.total_comm_bytes == found
