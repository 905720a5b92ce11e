"""automap on small real programs as users write them: flax nnx models (split
into state, or passed as modules), plain-JAX dict-of-arrays models, optax
optimizers and bf16 / mixed precision. Each test checks the plan (parameter
specs under the argument paths), numerics against `jax.jit` of the same
function, and the collectives XLA compiled against the prediction."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import mesh
from jax.sharding import PartitionSpec as P

import automap
from automap._src.ir import graph as graph_lib
from automap._src.ir import groups as groups_lib
from automap._src.ir import trace as trace_lib
from automap._src.run.verify import compare_numerics

M = mesh((4, 2))
# Episodes end each search (deterministic plans); the seconds only cap it.
BUDGET = automap.Budget(episodes=50, seconds=60)
LR = 1e-3
SCHEDULE = optax.warmup_cosine_decay_schedule(
    init_value=1e-4, peak_value=LR, warmup_steps=10, decay_steps=100)


def partitioned(fn, **kw):
  return automap.partition(fn, mesh=M, hardware="cpu", budget=BUDGET, cache=False, **kw)


def specs_by_path(plan) -> dict[str, P]:
  return dict(zip(plan.in_paths, plan.in_specs))


def assert_moments_follow_parameters(plan, moments=("mu", "nu"), params="0/",
                                     trainable=lambda path: True):
  """Each optimizer moment of a trainable parameter has the parameter's
  spec; returns the parameter specs. A moment's path ends with
  `<moment>/<parameter path>`."""
  specs = specs_by_path(plan)
  found = {}
  for path, spec in specs.items():
    for moment in moments:
      marker = f"/{moment}/"
      if not path.startswith(params) and marker in path:
        param = params + path.split(marker, 1)[1]
        assert param in specs, f"{path} mirrors no parameter {param}"
        found[path] = (spec, specs[param])
  n_params = sum(p.startswith(params) and trainable(p) for p in specs)
  assert len(found) == len(moments) * n_params, sorted(found)
  differ = {k: v for k, v in found.items() if v[0] != v[1]}
  assert not differ, f"moment spec != parameter spec: {differ}"
  return {p: s for p, s in specs.items() if p.startswith(params) and trainable(p)}


def assert_placed_as_planned(plan, out):
  leaves = jax.tree.leaves(out)
  assert len(leaves) == len(plan.out_specs)
  for path, leaf, spec in zip(plan.out_paths, leaves, plan.out_specs):
    assert leaf.sharding.spec == spec, (path, leaf.sharding.spec, spec)


def assert_collectives_as_predicted(plan, fn, *args):
  report = automap.verify(plan, fn, *args, mesh=M, check_numerics=False)
  assert report.comm_error < 0.05, report.table()
  for key, nbytes in plan.cost.comm_bytes.items():
    assert report.compiled_comm_bytes.get(key, 0) == pytest.approx(nbytes, rel=0.05), (
        report.table())
  return report


def assert_close(expected, actual, tol: float):
  """Every float leaf within `tol` of its own largest magnitude."""
  for e, a in zip(jax.tree.leaves(expected), jax.tree.leaves(actual), strict=True):
    e = np.asarray(e, np.float64)
    a = np.asarray(a, np.float64)
    scale = max(float(np.abs(e).max()), 1e-30)
    assert float(np.abs(e - a).max()) <= tol * scale, (float(np.abs(e - a).max()), scale)


def assert_adam_step_matches(expected, actual, params, moments):
  """Loss and moments (linear in the gradients) tight, and parameters tight
  wherever the gradient is clear of rounding. Adam's first step moves each
  element by ~lr * sign(gradient): where the gradient is itself rounding
  noise (a few ulps of the largest), its sign, and so a step of up to lr,
  is up to the summation order."""
  assert float(actual[-1]) == pytest.approx(float(expected[-1]), rel=1e-6)
  for e, a in zip(moments(expected), moments(actual), strict=True):
    assert compare_numerics(e, a)[1] < 1e-5
  mu = [np.asarray(m) for m in jax.tree.leaves(moments(expected)[0])]
  floor = 1e-4 * max(float(np.abs(m).max()) for m in mu)
  clear = total = 0
  pairs = zip(jax.tree.leaves(params(expected)), jax.tree.leaves(params(actual)), mu,
              strict=True)
  for e, a, m in pairs:
    e, a = np.asarray(e), np.asarray(a)
    assert e.shape == m.shape
    diff, sure = np.abs(e - a), np.abs(m) > floor
    np.testing.assert_array_less(diff[sure], 1e-6 * (1 + np.abs(e[sure])))
    assert float(diff.max()) <= 2 * LR
    clear, total = clear + int(sure.sum()), total + sure.size
  assert clear > 0.99 * total, (clear, total)


def per_device_bytes(plan, args) -> float:
  """Bytes of the arguments on one device under the plan's specs."""
  size = dict(zip(plan.mesh.axis_names, plan.mesh.axis_sizes))
  total = 0.0
  for leaf, spec in zip(jax.tree.leaves(args), plan.in_specs, strict=True):
    axes = [a for e in spec if e is not None for a in (e if isinstance(e, tuple) else (e,))]
    total += leaf.size * leaf.dtype.itemsize / math.prod(size[a] for a in axes)
  return total


# flax nnx -------------------------------------------------------------------


class Block(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs, attention: bool = False):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    # No q/k/v biases: a key bias's gradient is zero exactly (softmax is
    # shift-invariant), so its computed value is the rounding noise of
    # cancelling sums, larger than any tolerance on the rest.
    self.attn = nnx.MultiHeadAttention(
        num_heads=4, in_features=width, qkv_features=width, decode=False,
        use_bias=False, rngs=rngs) if attention else None
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs) if attention else None

  def __call__(self, x):
    h = self.norm(x)
    if self.attn is not None:
      x = x + self.attn(h)
      h = x
    h = jax.nn.gelu(self.up(h))
    if self.drop is not None:
      h = self.drop(h)
    return x + self.down(h)


class Model(nnx.Module):
  def __init__(self, width: int, rngs: nnx.Rngs, attention: bool = False):
    self.layers = nnx.List([Block(width, rngs, attention) for _ in range(2)])
    self.head = nnx.Linear(width, width, rngs=rngs)

  def __call__(self, x):
    for layer in self.layers:
      x = layer(x)
    return self.head(x)


def nnx_split_step(width=64, tokens=32):
  """A train step over `nnx.split`'s state with plain optax (adam)."""
  graphdef, state = nnx.split(Model(width, nnx.Rngs(0)))
  tx = optax.adam(LR)

  def step(state, opt_state, x, y):
    def loss(s):
      return jnp.mean((nnx.merge(graphdef, s)(x) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(state)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, value

  x = jax.random.normal(jax.random.key(1), (tokens, width))
  y = jax.random.normal(jax.random.key(2), (tokens, width))
  return step, (state, tx.init(state), x, y)


@pytest.mark.heavy
def test_nnx_split_state_train_step_matches_jit():
  step, args = nnx_split_step()
  f = partitioned(step)
  out = f(*args)
  plan = f.plan
  # Paths are the state's pytree paths: nnx attributes, list indices, and
  # the Variable's `value` (as jax.tree_util.keystr prints them).
  params = {p for p in plan.in_paths if p.startswith("0/")}
  assert params == {f"0/{m}/{w}/value" for m in
                    ["head", *(f"layers/{i}/{n}" for i in range(2) for n in ("up", "down"))]
                    for w in ("kernel", "bias")} | {
      f"0/layers/{i}/norm/{w}/value" for i in range(2) for w in ("scale", "bias")}
  assert "1/0/mu/layers/1/up/kernel/value" in plan.in_paths
  # in_shardings comes back in the argument structure: an nnx State.
  shardings = plan.in_shardings
  assert isinstance(shardings[0], nnx.State)
  assert shardings[0]["layers"][0]["up"]["kernel"].get_value() == plan.in_specs[
      plan.in_paths.index("0/layers/0/up/kernel/value")]
  weights = assert_moments_follow_parameters(plan)
  assert any(s != P() for p, s in weights.items() if "kernel" in p), weights
  assert_placed_as_planned(plan, out)
  assert isinstance(out[0], nnx.State)
  expected = jax.jit(step)(*args)
  assert_adam_step_matches(expected, out, params=lambda o: o[0],
                           moments=lambda o: (o[1][0].mu, o[1][0].nu))
  assert_collectives_as_predicted(plan, step, *args)


@pytest.mark.heavy
def test_nnx_hints_match_state_paths():
  step, args = nnx_split_step()
  head = P(None, "model")
  hints = automap.Hints(groups=("layers/*",), fixed={"0/head/kernel/value": head})
  plan = automap.search(step, *args, mesh=M, hardware="cpu", hints=hints, budget=BUDGET)
  specs = specs_by_path(plan)
  assert specs["0/head/kernel/value"] == head
  # Only the parameter is pinned; its Adam moments follow by propagation.
  assert specs["1/0/mu/head/kernel/value"] == specs["1/0/nu/head/kernel/value"] == head
  assert_moments_follow_parameters(plan)
  # One group per role spans both layers, and they share every decision.
  traced = trace_lib.trace(step, args)
  found = groups_lib.hint_groups(graph_lib.build(traced), traced, hints.groups)
  names = {g.name: len(g.members) for g in found}
  assert names["0/layers/*/up/kernel/value"] == 2
  assert names["1/0/mu/layers/*/up/kernel/value"] == 2
  for path, spec in specs.items():
    if "/layers/0/" in path:
      assert specs[path.replace("/layers/0/", "/layers/1/")] == spec, path
  report = automap.verify(plan, step, *args, mesh=M)
  assert report.comm_error < 0.05, report.table()
  # A pattern without the Variable's trailing `value` matches nothing, and
  # the error shows what the paths look like.
  with pytest.raises(automap.MeshError, match="0/head/bias/value"):
    automap.search(step, *args, mesh=M, hardware="cpu", budget=BUDGET,
                   hints=automap.Hints(fixed={"0/head/kernel": head}))


def test_nnx_star_pattern_groups_the_layers():
  # '*layers*' also matches '0/layers'; the match that takes in the layer
  # index ('layers/0') is the one that groups the layers.
  step, args = nnx_split_step()
  traced = trace_lib.trace(step, args)
  graph = graph_lib.build(traced)
  up0, up1 = (graph.inputs[traced.in_paths.index(f"0/layers/{i}/up/kernel/value")]
              for i in range(2))
  (group,) = [g for g in groups_lib.hint_groups(graph, traced, ["*layers*"])
              if up0 in g.members]
  assert up1 in group.members, group


@pytest.mark.heavy
def test_nnx_modules_and_optimizer_as_arguments():
  """The nnx.jit style: the model and an nnx.Optimizer go in as pytrees; as
  with jax.jit (unlike nnx.jit) the step returns them updated."""
  model = Model(64, nnx.Rngs(0, dropout=1), attention=True)
  optimizer = nnx.Optimizer(model, optax.adamw(SCHEDULE, weight_decay=0.1), wrt=nnx.Param)

  def step(model, optimizer, x, y):
    def loss(m):
      return jnp.mean((m(x) - y) ** 2)
    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return model, optimizer, value

  x = jax.random.normal(jax.random.key(1), (8, 16, 64))
  y = jax.random.normal(jax.random.key(2), (8, 16, 64))
  args = (model, optimizer, x, y)
  # Under a memory limit the replicated step does not meet: the plan tiles
  # weights, and their moments must follow them.
  whole = automap.evaluate(step, *args, mesh=M, hardware="cpu").peak_memory
  f = partitioned(step, memory_limit=0.6 * whole)
  out = f(*args)
  plan = f.plan
  assert "0/layers/0/attn/query/kernel/value" in plan.in_paths
  assert "0/layers/1/drop/rngs/key/value" in plan.in_paths  # dropout RNG state
  assert "1/opt_state/0/mu/layers/1/attn/query/kernel/value" in plan.in_paths
  weights = assert_moments_follow_parameters(plan, trainable=lambda p: "/rngs/" not in p)
  assert any(s != P() for s in weights.values()), weights
  assert isinstance(out[0], Model) and isinstance(out[1], nnx.Optimizer)
  assert_placed_as_planned(plan, out)
  assert out[0].layers[0].up.kernel[...].sharding.spec == specs_by_path(plan)[
      "0/layers/0/up/kernel/value"]
  expected = jax.jit(step)(*args)
  # Dropout masks come from the same keys: the same loss, the same RNG state.
  assert compare_numerics(nnx.state(expected[0], nnx.RngState),
                          nnx.state(out[0], nnx.RngState))[1] == 0
  assert int(out[1].step[...]) == 1
  opt = lambda o: o[1].opt_state[0]  # noqa: E731
  assert_adam_step_matches(expected, out, params=lambda o: nnx.state(o[0], nnx.Param),
                           moments=lambda o: (opt(o).mu, opt(o).nu))
  assert_collectives_as_predicted(plan, step, *args)


def test_nnx_model_captured_by_closure_runs_but_is_not_partitioned():
  """A model closed over (not an argument) becomes constants of the jaxpr:
  computed correctly, kept whole; only arguments are planned."""
  model = Model(64, nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (32, 64))

  def forward(x):
    return model(x)

  f = partitioned(forward)
  out = f(x)
  assert f.plan.in_paths == ("0",)
  np.testing.assert_allclose(np.asarray(out), np.asarray(jax.jit(forward)(x)),
                             rtol=1e-5, atol=1e-5)
  weights = sum(v[...].nbytes for v in jax.tree.leaves(
      nnx.state(model, nnx.Param), is_leaf=lambda v: isinstance(v, nnx.Variable)))
  assert f.plan.cost.argument_memory >= weights  # every device holds them all


# plain JAX -------------------------------------------------------------------


def mlp_params(key, width=128, hidden=512, dtype=jnp.float32):
  keys = jax.random.split(key, 4)
  return {f"layer_{i}": {
      "w1": (jax.random.normal(keys[2 * i], (width, hidden)) / width**0.5).astype(dtype),
      "b1": jnp.full((hidden,), 0.1, dtype),
      "w2": (jax.random.normal(keys[2 * i + 1], (hidden, width)) / hidden**0.5).astype(dtype),
  } for i in range(2)}


def mlp_forward(params, x, compute_dtype=None):
  for i in range(2):
    p = params[f"layer_{i}"]
    if compute_dtype is not None:  # mixed precision: cast inside the step
      p = jax.tree.map(lambda a: a.astype(compute_dtype), p)
      x = x.astype(compute_dtype)
    x = x + jax.nn.gelu(x @ p["w1"] + p["b1"][None]) @ p["w2"]
  return x


def mlp_step(tx, compute_dtype=None):
  def step(params, opt_state, x, y):
    def loss(p):
      out = mlp_forward(p, x, compute_dtype).astype(jnp.float32)
      return jnp.mean((out - y.astype(jnp.float32)) ** 2)
    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def mlp_args(tx, dtype=jnp.float32, tokens=16, width=128):
  params = mlp_params(jax.random.key(0), width, dtype=dtype)
  x = jax.random.normal(jax.random.key(1), (tokens, width)).astype(dtype)
  y = jax.random.normal(jax.random.key(2), (tokens, width)).astype(dtype)
  return params, tx.init(params), x, y


def test_plain_jax_mlp_train_step_matches_jit():
  tx = optax.sgd(0.1, momentum=0.9)
  step, args = mlp_step(tx), mlp_args(tx)
  f = partitioned(step)
  out = f(*args)
  plan = f.plan
  shardings = plan.in_shardings
  assert set(shardings[0]) == {"layer_0", "layer_1"}
  assert set(shardings[0]["layer_1"]) == {"w1", "b1", "w2"}
  assert shardings[0]["layer_1"]["w1"] == specs_by_path(plan)["0/layer_1/w1"]
  weights = assert_moments_follow_parameters(plan, moments=("trace",))
  assert any(s != P() for s in weights.values()), weights
  assert_placed_as_planned(plan, out)
  expected = jax.jit(step)(*args)
  assert compare_numerics(expected, out)[1] < 1e-5  # SGD: linear in the gradients
  report = assert_collectives_as_predicted(plan, step, *args)
  assert report.memory_error < 0.15, report.table()


@pytest.mark.heavy
def test_plain_jax_attention_gradients_match_jit():
  heads, width, seq, batch = 4, 64, 16, 8

  def loss(params, x):
    q, k, v = (jnp.einsum("bsd,dhk->bshk", x, params[n]) for n in ("wq", "wk", "wv"))
    scores = jnp.einsum("bshk,bthk->bhst", q, k) / (width // heads) ** 0.5
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    scores = jnp.where(mask, scores, -1e9)
    h = jnp.einsum("bhst,bthk->bshk", jax.nn.softmax(scores, axis=-1), v)
    h = x + jnp.einsum("bshk,hkd->bsd", h, params["wo"])
    out = h + jax.nn.relu(h @ params["w1"]) @ params["w2"]
    return jnp.mean(out**2)

  keys = jax.random.split(jax.random.key(0), 7)
  shapes = {"wq": (width, heads, width // heads), "wk": (width, heads, width // heads),
            "wv": (width, heads, width // heads), "wo": (heads, width // heads, width),
            "w1": (width, 4 * width), "w2": (4 * width, width)}
  params = {n: jax.random.normal(k, s) / s[0] ** 0.5 for (n, s), k in zip(shapes.items(), keys)}
  x = jax.random.normal(keys[-1], (batch, seq, width))
  fn = jax.value_and_grad(loss)
  plan = automap.search(fn, params, x, mesh=M, hardware="cpu", budget=BUDGET)
  # Gradients come back in the parameters' layouts.
  specs = specs_by_path(plan)
  for path, spec in zip(plan.out_paths, plan.out_specs):
    if path.startswith("1/"):
      assert spec == specs["0/" + path[2:]], path
  report = automap.verify(plan, fn, params, x, mesh=M)
  assert report.max_rel_error < 1e-5, report.table()
  assert report.comm_error < 0.05, report.table()


# optax ------------------------------------------------------------------------


OPTIMIZERS = {
    "adam": lambda: optax.adam(LR),
    "adamw_schedule": lambda: optax.adamw(SCHEDULE, weight_decay=0.1),
    "clip_adamw_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(SCHEDULE, weight_decay=0.1)),
    "inject_hyperparams": lambda: optax.inject_hyperparams(optax.adamw)(
        learning_rate=SCHEDULE, weight_decay=0.1),
}


def adam_state(opt_state):
  """The ScaleByAdamState inside any of OPTIMIZERS' states."""
  found = [s for s in jax.tree.leaves(
      opt_state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
           if isinstance(s, optax.ScaleByAdamState)]
  (state,) = found
  return state


@pytest.mark.heavy
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optax_moments_share_their_parameters_specs(name):
  tx = OPTIMIZERS[name]()
  step, args = mlp_step(tx), mlp_args(tx)
  f = partitioned(step)
  out = f(*args)
  plan = f.plan
  weights = assert_moments_follow_parameters(plan)
  assert any(s != P() for s in weights.values()), weights
  # Schedules' step counts and injected hyperparameters are scalars: whole.
  assert all(s == P() for p, s in specs_by_path(plan).items() if "count" in p)
  assert_placed_as_planned(plan, out)
  expected = jax.jit(step)(*args)
  moments = lambda o: (adam_state(o[1]).mu, adam_state(o[1]).nu)  # noqa: E731
  assert_adam_step_matches(expected, out, params=lambda o: o[0], moments=moments)
  assert_collectives_as_predicted(plan, step, *args)


def test_optax_multisteps_is_priced_as_compiled():
  """Gradient accumulation updates inside a lax.cond: its branches are
  partitioned like any other ops, their operands in their own layouts."""
  tx = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
  step, args = mlp_step(tx), mlp_args(tx)
  plan = automap.search(step, *args, mesh=M, hardware="cpu", budget=BUDGET)
  assert any(s != P() for p, s in specs_by_path(plan).items() if p.startswith("0/"))
  assert_collectives_as_predicted(plan, step, *args)
  expected = jax.jit(step)(*args)
  out = partitioned(step)(*args)
  assert compare_numerics(expected, out)[1] < 1e-5


@pytest.mark.heavy
def test_optax_multisteps_moments_share_their_parameters_specs():
  """Accumulated gradients and the inner Adam moments, updated inside the
  cond's branches, are laid out like their parameters, and the step runs
  as jit runs it."""
  tx = optax.MultiSteps(optax.adam(LR), every_k_schedule=2)
  step, args = mlp_step(tx), mlp_args(tx)
  plan = automap.search(step, *args, mesh=M, hardware="cpu", budget=BUDGET)
  assert any(s != P() for p, s in specs_by_path(plan).items() if p.startswith("0/"))
  assert_moments_follow_parameters(plan, moments=("mu", "nu", "acc_grads"))
  assert_collectives_as_predicted(plan, step, *args)
  expected = jax.jit(step)(*args)
  assert compare_numerics(expected, partitioned(step)(*args))[1] < 1e-5


# bf16 -------------------------------------------------------------------------


def sgd_bf16_steps():
  """The same MLP train step three ways: f32, f32 parameters with bf16
  compute, and bf16 throughout."""
  tx = optax.sgd(0.1)
  return {"f32": (mlp_step(tx), mlp_args(tx)),
          "mixed": (mlp_step(tx, jnp.bfloat16), mlp_args(tx)),
          "bf16": (mlp_step(tx), mlp_args(tx, jnp.bfloat16))}


@pytest.mark.heavy
@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_low_precision_train_step_matches_jit(precision):
  step, args = sgd_bf16_steps()[precision]
  f = partitioned(step)
  out = f(*args)
  plan = f.plan
  assert_placed_as_planned(plan, out)
  assert all(x.dtype == args[0]["layer_0"]["w1"].dtype for x in jax.tree.leaves(out[0]))
  expected = jax.jit(step)(*args)
  eps = float(jnp.finfo(jnp.bfloat16).eps)  # 2**-7
  # Partial sums rounded to bf16 in another order: a few bf16 ulps.
  assert float(out[2]) == pytest.approx(float(expected[2]), rel=2 * eps)
  if precision == "mixed":  # f32 parameters: compare the bf16-computed steps
    delta = lambda o: jax.tree.map(lambda a, b: a - b, o[0], args[0])  # noqa: E731
    assert_close(delta(expected), delta(out), tol=4 * eps)
  else:  # bf16 parameters: within one ulp at each leaf's largest magnitude
    assert_close(expected[0], out[0], tol=eps)
  # The collectives XLA compiles are those predicted (their bytes: see below).
  report = automap.verify(plan, step, *args, mesh=M, check_numerics=False)
  compiled = {k for k, v in report.compiled_comm_bytes.items() if v}
  assert compiled == set(plan.cost.comm_bytes), report.table()


def test_bf16_collective_bytes_match_the_prediction_on_cpu():
  # XLA:CPU all-reduces bf16 in f32: the cpu spec (and verify's re-pricing on
  # CPU) counts those all-reduces at 4 bytes an element.
  step, args = sgd_bf16_steps()["bf16"]
  plan = automap.search(step, *args, mesh=M, hardware="cpu", budget=BUDGET)
  assert_collectives_as_predicted(plan, step, *args)


def test_bf16_halves_argument_memory():
  steps = sgd_bf16_steps()
  # Searched plans: argument memory is the arguments' per-device bytes at
  # their own dtypes (2 bytes for bf16), whatever layouts the search chose.
  for step, args in steps.values():
    plan = automap.search(step, *args, mesh=M, hardware="cpu", budget=BUDGET)
    assert plan.cost.argument_memory == pytest.approx(per_device_bytes(plan, args), rel=1e-9)
  # The same layouts at both precisions (given, or pinned for the search):
  # exactly half.
  (f32_step, f32_args), (bf16_step, bf16_args) = steps["f32"], steps["bf16"]
  layouts = (jax.tree.map(lambda a: P(None, "model") if a.ndim == 2 else P("model"),
                          f32_args[0]), P(), P("data"), P("data"))
  pinned = automap.Hints(fixed={"0/*/w*": P(None, "model"), "0/*/b1": P("model"),
                                "2": P("data"), "3": P("data")})
  for f32, bf16 in [
      (automap.evaluate(f32_step, *f32_args, mesh=M, hardware="cpu", in_shardings=layouts),
       automap.evaluate(bf16_step, *bf16_args, mesh=M, hardware="cpu",
                        in_shardings=layouts)),
      (automap.search(f32_step, *f32_args, mesh=M, hardware="cpu", budget=BUDGET,
                      hints=pinned).cost,
       automap.search(bf16_step, *bf16_args, mesh=M, hardware="cpu", budget=BUDGET,
                      hints=pinned).cost)]:
    assert bf16.argument_memory == pytest.approx(f32.argument_memory / 2, rel=1e-9)
    assert bf16.peak_memory < f32.peak_memory
