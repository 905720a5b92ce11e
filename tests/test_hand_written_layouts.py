"""Layouts written by hand on the arguments alone, priced as XLA compiles
them: XLA's propagation (Shardy's rounds, its conflict rule) decides every
other layout, and its partitioner picks a lookup's route by cost."""

import jax
import jax.numpy as jnp
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
EVERY = ("data", "model")


def priced_and_compiled(fn, args, specs, mesh=MESH):
  """`evaluate`'s cost of `fn` laid out by argument specs alone (XLA:CPU's
  compiler), and the program compiled so: ({(kind, axes): bytes}, peak)."""
  cost = automap.evaluate(fn, *args, mesh=mesh, in_shardings=specs, hardware="cpu")
  compiled, peak, _ = compile_as_written(fn, args, mesh, specs)
  return cost, compiled, peak


def loss(p, tokens):
  """Embedding lookup, a normalisation scale, an MLP and a tied head."""
  x = jax.vmap(jax.vmap(lambda i: p["embed"][i]))(tokens)
  x = (x - x.mean(-1, keepdims=True)) * p["scale"][None, None]
  h = jax.nn.gelu(jnp.einsum("bsd,fd->bsf", x, p["up"]))
  x = x + jnp.einsum("bsf,df->bsd", h, p["down"])
  return jax.nn.logsumexp(x @ p["embed"].T, axis=-1).mean()


def momentum_step(loss_fn):
  """A train step of `loss_fn(p, tokens)`: SGD with momentum m."""
  def step(p, m, tokens):
    g = jax.grad(loss_fn)(p, tokens)
    m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, m), m
  return step


step = momentum_step(loss)


PARAMS = {"embed": jnp.ones((512, 128)), "scale": jnp.ones((128,)),
          "up": jnp.ones((512, 128)), "down": jnp.ones((128, 512))}
TOKENS = jnp.zeros((16, 32), jnp.int32)
FSDP = {"embed": P(EVERY), "scale": P(EVERY), "up": P(EVERY), "down": P(None, EVERY)}
LAYOUTS = {
    # ZeRO-3 by arguments alone: the weights' tilings must not reach the
    # activations, the embedding gradient is all-reduced, not its updates
    # gathered.
    "fsdp": (FSDP, FSDP, P(EVERY)),
    "data parallel": (P(), P(), P(EVERY)),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_layout_on_the_arguments_is_priced_as_compiled(name):
  specs = LAYOUTS[name]
  args = (PARAMS, PARAMS, TOKENS)
  cost, compiled, peak = priced_and_compiled(step, args, specs)
  assert cost.comm_bytes == pytest.approx(compiled, rel=0.01), (cost.comm_bytes, compiled)
  assert cost.peak_memory == pytest.approx(peak, rel=0.15)  # the memory model's bound


MESH3 = jax.make_mesh((2, 2, 2), ("data", "fsdp", "model"), axis_types=(AxisType.Auto,) * 3)


@pytest.mark.parametrize(
    "weight", [P("fsdp"), P(None, "model"), P("fsdp", "model"), P(("fsdp", "model"))])
def test_a_gradient_tiled_over_some_of_the_batch_axes_is_reduced_as_compiled(weight):
  """A weight's gradient sums over a batch tiled over every axis; each of
  its dims tiled over some of those axes all-reduces the whole partial sum
  over them first (XLA:CPU has no reduce-scatter), the other axes then
  reduce each device's tile."""
  def grad(x, w):
    g = jax.grad(lambda x, w: jnp.tanh(x @ w).sum(), argnums=1)(x, w)
    return jax.lax.with_sharding_constraint(g, weight)
  args = (jnp.ones((16, 64)), jnp.ones((64, 128)))
  specs = (P(("data", "fsdp", "model")), weight)
  cost, compiled, _ = priced_and_compiled(grad, args, specs, MESH3)
  assert cost.comm_bytes == pytest.approx(compiled), (cost.comm_bytes, compiled)


def pooled_loss(p, tokens):
  """An encoder's classifier: normalised tokens (a scale and a bias) mean
  pooled over the sequence into a head. The pool's backward broadcasts the
  head's input gradient, tiled like the head's weight, over the sequence;
  the bias's gradient reduces that broadcast."""
  x = jax.vmap(jax.vmap(lambda i: p["embed"][i]))(tokens)
  x = (x - x.mean(-1, keepdims=True)) * p["scale"][None, None] + p["bias"][None, None]
  return jax.nn.logsumexp(x.mean(1) @ p["head"], axis=-1).mean()


def test_a_pooled_gradient_keeps_the_batch_tiling_as_compiled():
  """FSDP by arguments alone: Shardy meets the module in post order, so the
  backward pass hands the pool's broadcast gradient the batch's tiling
  before the bias's gradient (whose reduction the post order puts last)
  could hand it the bias's; priced otherwise, every activation gradient
  of the backward would be resharded."""
  params = {"embed": jnp.ones((512, 128)), "scale": jnp.ones((128,)),
            "bias": jnp.ones((128,)), "head": jnp.ones((128, 16))}
  fsdp = {"embed": P(EVERY), "scale": P(EVERY), "bias": P(EVERY), "head": P(EVERY)}
  specs = (fsdp, fsdp, P(EVERY))
  args = (params, params, TOKENS)
  pooled_step = momentum_step(pooled_loss)
  cost, compiled, _ = priced_and_compiled(pooled_step, args, specs)
  assert cost.comm_bytes == pytest.approx(compiled, rel=0.01), (cost.comm_bytes, compiled)


@pytest.mark.parametrize("scale", [P("data"), P(), P(EVERY)])
@pytest.mark.parametrize("reduce", [jnp.mean, jnp.max])
def test_a_reduction_reshards_its_result_not_its_operand(reduce, scale):
  """A batch statistic of activations tiled (batch on data, features on
  model) read with a scale tiled otherwise: XLA reduces each device's tile
  as it is held, combines the partial results over data, then moves the
  small result to the scale's layout (a permute, a gather, a slice); it
  never gathers the activations to the scale's layout first."""
  def normalise(x, g):
    return reduce(x, axis=0) * g
  args = (jnp.ones((128, 1024)), jnp.ones((1024,)))
  specs = (P("data", "model"), scale)
  cost, compiled, _ = priced_and_compiled(normalise, args, specs)
  assert cost.comm_bytes == pytest.approx(compiled), (cost.comm_bytes, compiled)


@pytest.mark.parametrize("logits", [P("data", "model"), P(None, EVERY)])
def test_an_accuracy_over_tiled_classes_gathers_the_winners_not_the_logits(logits):
  """argmax over classes tiled across devices (vocabulary-parallel logits):
  no all-reduce combines (value, index) pairs, so XLA takes each device's
  winner and all-gathers the winners' values and indices, then picks among
  them; the logits themselves never move."""
  def accuracy(x, y):
    return (jnp.argmax(x, axis=-1) == y).mean()
  args = (jnp.ones((128, 1024)), jnp.zeros((128,), jnp.int32))
  specs = (logits, P())
  cost, compiled, _ = priced_and_compiled(accuracy, args, specs)
  assert cost.comm_bytes == pytest.approx(compiled), (cost.comm_bytes, compiled)


def attention_scores(x, w):
  """Self-attention scores of a projection split into 4 heads of 16."""
  q = (x @ w).reshape(*x.shape[:2], 4, 16)
  return jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, q)).sum()


@pytest.mark.parametrize("fn", [attention_scores, jax.grad(attention_scores, argnums=1)],
                             ids=["forward", "weight gradient"])
def test_a_hidden_dim_tiled_over_both_axes_splits_into_heads_as_compiled(fn):
  """Activations and a projection whose hidden dim is tiled (data, model),
  as FSDP's backward leaves them: the split into heads keeps both axes,
  data on the 4 heads and model on the head width (Shardy's compound
  factors), so the scores contract a head width tiled over model with one
  all-reduce instead of gathering the heads."""
  args = (jnp.ones((8, 17, 64)), jnp.ones((64, 64)))
  specs = (P(None, None, EVERY), P(None, EVERY))
  cost, compiled, _ = priced_and_compiled(fn, args, specs)
  assert cost.comm_bytes == pytest.approx(compiled), (cost.comm_bytes, compiled)


def conv1d_loss(p, tokens):
  """HuggingFace GPT-2's layout of weights: `Conv1D` kernels stored
  (out, in) and read transposed, the head tied to the embedding and read
  as `embedding.T`."""
  x = jax.vmap(jax.vmap(lambda i: p["wte"][i]))(tokens)
  h = jax.nn.gelu(x @ p["fc"].T + p["fc_b"][None, None])
  x = x + h @ p["proj"].T
  return jax.nn.logsumexp(x @ p["wte"].T, axis=-1).mean()


def test_megatron_reaches_weights_read_transposed():
  """The Megatron yardstick follows a transpose to the weight it reads:
  the up projection split by its stored rows (its outputs), the down
  projection by its stored columns (its inputs), the tied embedding by
  vocabulary. Compiled, nothing is gathered: the model axis carries only
  Megatron's all-reduces of activations, the data axis the gradients'; and
  the layout is priced as compiled."""
  from automap._src.plan import planner
  from automap._src.search import tactics
  from automap._src.sharding.state import spec_of

  params = {"wte": jnp.ones((512, 128)), "fc": jnp.ones((512, 128)),
            "fc_b": jnp.ones((512,)), "proj": jnp.ones((128, 512))}
  args = (params, params, TOKENS)
  conv_step = momentum_step(conv1d_loss)
  program = planner.build_program(conv_step, args, MESH, "cpu")
  state = tactics.yardsticks(program)["Megatron + data parallel"]
  g = program.graph
  specs = [spec_of(state, program.mesh, v, g.rank(v)) for v in g.inputs]
  laid = dict(zip(program.traced.in_paths, specs))
  assert laid["0/fc"] == P("model") and laid["0/fc_b"] == P("model")
  assert laid["0/proj"] == P(None, "model") and laid["0/wte"] == P("model")
  flat = jax.tree.unflatten(jax.tree.structure(args), specs)
  cost, compiled, _ = priced_and_compiled(conv_step, args, flat)
  assert cost.comm_bytes == pytest.approx(compiled, rel=0.01), (cost.comm_bytes, compiled)
  assert set(compiled) == {("all-reduce", ("model",)), ("all-reduce", ("data",))}
