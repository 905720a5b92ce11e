"""Train steps written with other libraries' own model code: fixtures of
test_outside_libraries.py and test_library_names.py, and the programs of
`benchmarks/outside.py`.

Each builder returns a `Step`: an AdamW train step `(params, opt_state,
batch) -> (params, opt_state, loss)` as that library's users write it, and
concrete arguments of a `Size`: `BENCH` (2 layers, width 256, sequence
64, batch 32: enough work that layouts differ) or `TINY` for tests. The model code is the
library's: HuggingFace Flax BERT, GPT-2, BART, T5, Gemma and ViT; equinox, haiku,
keras 3, flax linen (an LSTM among them) and nnx layers; penzai's named-axis
transformer; diffrax's neural ODE. Needs the `outside` extra; keras runs
on JAX (`KERAS_BACKEND`, set before keras is first imported).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax


@dataclasses.dataclass(frozen=True)
class Size:
  batch: int
  seq: int
  width: int
  heads: int
  ff: int
  vocab: int
  layers: int = 2


BENCH = Size(batch=32, seq=64, width=256, heads=4, ff=1024, vocab=1024)
TINY = Size(batch=8, seq=16, width=64, heads=4, ff=256, vocab=256)


@dataclasses.dataclass
class Step:
  name: str
  library: str
  family: str
  fn: Callable
  args: tuple
  names: object = None  # `names=` for libraries whose state is lists


def _tokens(z: Size, seed: int, extra: int = 0) -> jax.Array:
  """(batch, seq + extra) token ids."""
  shape = (z.batch, z.seq + extra)
  return jnp.asarray(np.random.default_rng(seed).integers(0, z.vocab, shape), jnp.int32)


def _xent(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(
      logits.astype(jnp.float32), labels).mean()


def _train(loss: Callable, params, batch, name, library, family, names=None) -> Step:
  opt = optax.adamw(1e-3)

  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return Step(name, library, family, step, (params, opt.init(params), batch), names)


# HuggingFace Flax ----------------------------------------------------------

def _bert(z: Size):
  from transformers import BertConfig, FlaxBertForMaskedLM

  return FlaxBertForMaskedLM(BertConfig(
      vocab_size=z.vocab, hidden_size=z.width, num_hidden_layers=z.layers,
      num_attention_heads=z.heads, intermediate_size=z.ff, max_position_embeddings=z.seq),
      seed=0)


def hf_bert(z: Size = BENCH) -> Step:
  model = _bert(z)

  def loss(params, batch):
    logits = model(batch["inputs"], params=params, train=False).logits
    return _xent(logits, batch["labels"])

  return _train(loss, model.params, {"inputs": _tokens(z, 1), "labels": _tokens(z, 2)},
                "hf-bert", "transformers", "encoder")


def hf_bert_dropout(z: Size = BENCH) -> Step:
  """`run_mlm_flax`'s step: dropout on, its key part of the batch."""
  model = _bert(z)

  def loss(params, batch):
    logits = model(batch["inputs"], params=params, train=True,
                   dropout_rng=batch["dropout"]).logits
    return _xent(logits, batch["labels"])

  batch = {"inputs": _tokens(z, 1), "labels": _tokens(z, 2), "dropout": jax.random.key(3)}
  return _train(loss, model.params, batch, "hf-bert-dropout", "transformers", "encoder")


def hf_gpt2(z: Size = BENCH) -> Step:
  from transformers import FlaxGPT2LMHeadModel, GPT2Config

  # The output head is the token embedding, transposed (tied).
  model = FlaxGPT2LMHeadModel(GPT2Config(
      vocab_size=z.vocab, n_embd=z.width, n_layer=z.layers, n_head=z.heads, n_positions=z.seq + 1),
      seed=0)

  def loss(params, batch):
    logits = model(batch[:, :-1], params=params, train=False).logits
    return _xent(logits, batch[:, 1:])

  return _train(loss, model.params, _tokens(z, 1, 1), "hf-gpt2",
                "transformers", "decoder")


def _hf_seq2seq(model, z: Size, name: str) -> Step:
  """A HuggingFace Flax encoder-decoder's train step: the inputs encoded, the
  targets decoded with teacher forcing, each next token's cross-entropy."""

  def loss(params, batch):
    logits = model(batch["inputs"], decoder_input_ids=batch["targets"][:, :-1],
                   params=params, train=False).logits
    return _xent(logits, batch["targets"][:, 1:])

  return _train(loss, model.params,
                {"inputs": _tokens(z, 1), "targets": _tokens(z, 2, 1)},
                name, "transformers", "encoder-decoder")


def hf_bart(z: Size = BENCH) -> Step:
  from transformers import BartConfig, FlaxBartForConditionalGeneration

  model = FlaxBartForConditionalGeneration(BartConfig(
      vocab_size=z.vocab, d_model=z.width, encoder_layers=z.layers, decoder_layers=z.layers,
      encoder_attention_heads=z.heads, decoder_attention_heads=z.heads, encoder_ffn_dim=z.ff,
      decoder_ffn_dim=z.ff, max_position_embeddings=z.seq * 2), seed=0)
  return _hf_seq2seq(model, z, "hf-bart")


class _ClipByOldNames:
  """jax.numpy as HF's Flax T5 calls it: `jnp.clip(x, a_max=)`, a keyword
  JAX 0.10 removed (now `max=`); every other name is jax.numpy's."""

  def __getattr__(self, name):
    return getattr(jnp, name)

  @staticmethod
  def clip(x, a_min=None, a_max=None, **kwargs):
    return jnp.clip(x, kwargs.pop("min", a_min), kwargs.pop("max", a_max), **kwargs)


def hf_t5(z: Size = BENCH) -> Step:
  from transformers import FlaxT5ForConditionalGeneration, T5Config
  from transformers.models.t5 import modeling_flax_t5

  modeling_flax_t5.jnp = _ClipByOldNames()  # its relative-position buckets
  model = FlaxT5ForConditionalGeneration(T5Config(
      vocab_size=z.vocab, d_model=z.width, d_kv=z.width // z.heads, d_ff=z.ff,
      num_layers=z.layers, num_decoder_layers=z.layers, num_heads=z.heads,
      decoder_start_token_id=0), seed=0)
  return _hf_seq2seq(model, z, "hf-t5")


def hf_gemma(z: Size = BENCH) -> Step:
  from transformers import FlaxGemmaForCausalLM, GemmaConfig

  # Multi-query attention (one key/value head) and a tied output head.
  model = FlaxGemmaForCausalLM(GemmaConfig(
      vocab_size=z.vocab, hidden_size=z.width, intermediate_size=z.ff, num_hidden_layers=z.layers,
      num_attention_heads=z.heads, num_key_value_heads=1, head_dim=z.width // z.heads,
      max_position_embeddings=z.seq * 2, hidden_activation="gelu_pytorch_tanh"), seed=0)

  def loss(params, batch):
    logits = model(batch[:, :-1], params=params, train=False).logits
    return _xent(logits, batch[:, 1:])

  return _train(loss, model.params, _tokens(z, 1, 1), "hf-gemma",
                "transformers", "decoder")


def hf_vit(z: Size = BENCH) -> Step:
  from transformers import FlaxViTForImageClassification, ViTConfig

  model = FlaxViTForImageClassification(ViTConfig(
      image_size=32, patch_size=8, num_channels=3, hidden_size=z.width,
      num_hidden_layers=z.layers, num_attention_heads=z.heads, intermediate_size=z.ff,
      num_labels=16), seed=0)
  rng = np.random.default_rng(3)

  def loss(params, batch):
    logits = model(batch["pixels"], params=params, train=False).logits
    return _xent(logits, batch["labels"])

  batch = {"pixels": jnp.asarray(rng.standard_normal((z.batch, 3, 32, 32)), jnp.float32),
           "labels": jnp.asarray(rng.integers(0, 16, z.batch), jnp.int32)}
  return _train(loss, model.params, batch, "hf-vit", "transformers", "vision")


# equinox --------------------------------------------------------------------

def _eqx_train(model, loss, batch, name, family) -> Step:
  """An equinox step: the whole model is the argument (its activation
  functions are static leaves), differentiated with filter_value_and_grad."""
  import equinox as eqx

  opt = optax.adamw(1e-3)

  def step(model, opt_state, batch):
    value, grads = eqx.filter_value_and_grad(loss)(model, batch)
    updates, opt_state = opt.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, value

  return Step(name, "equinox", family, step,
              (model, opt.init(eqx.filter(model, eqx.is_array)), batch))


def eqx_transformer(z: Size = BENCH) -> Step:
  import equinox as eqx

  class Block(eqx.Module):
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    norm1: eqx.nn.LayerNorm
    norm2: eqx.nn.LayerNorm

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.attn = eqx.nn.MultiheadAttention(z.heads, z.width, key=k1)
      self.mlp = eqx.nn.MLP(z.width, z.width, z.ff, 1, activation=jax.nn.gelu, key=k2)
      self.norm1, self.norm2 = eqx.nn.LayerNorm(z.width), eqx.nn.LayerNorm(z.width)

    def __call__(self, x):  # one sequence: (z.seq, z.width)
      h = jax.vmap(self.norm1)(x)
      x = x + self.attn(h, h, h)
      return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))

  class Model(eqx.Module):
    embed: eqx.nn.Embedding
    blocks: list
    head: eqx.nn.Linear

    def __init__(self, key):
      keys = jax.random.split(key, z.layers + 2)
      self.embed = eqx.nn.Embedding(z.vocab, z.width, key=keys[0])
      self.blocks = [Block(k) for k in keys[1:-1]]
      self.head = eqx.nn.Linear(z.width, z.vocab, key=keys[-1])

    def __call__(self, tokens):
      x = jax.vmap(self.embed)(tokens)
      for block in self.blocks:
        x = block(x)
      return jax.vmap(self.head)(x)

  def loss(model, batch):
    return _xent(jax.vmap(model)(batch[:, :-1]), batch[:, 1:])

  return _eqx_train(Model(jax.random.key(0)), loss, _tokens(z, 1, 1),
                    "eqx-transformer", "decoder")


def eqx_mlp(z: Size = BENCH) -> Step:
  import equinox as eqx

  model = eqx.nn.MLP(z.width, 16, z.ff, 3, activation=jax.nn.relu, key=jax.random.key(0))
  rng = np.random.default_rng(4)
  batch = {"x": jnp.asarray(rng.standard_normal((z.batch * 4, z.width)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, 16, z.batch * 4), jnp.int32)}

  def loss(model, batch):
    return _xent(jax.vmap(model)(batch["x"]), batch["y"])

  return _eqx_train(model, loss, batch, "eqx-mlp", "mlp")


def diffrax_node(z: Size = BENCH) -> Step:
  """diffrax's Neural ODE: an MLP vector field integrated by Tsit5 in 8
  fixed steps, differentiated through its checkpointed while loop
  (`RecursiveCheckpointAdjoint`, custom derivatives and equinox's loop
  primitives)."""
  import diffrax
  import equinox as eqx

  dim = z.width // 4

  class Func(eqx.Module):
    mlp: eqx.nn.MLP

    def __init__(self, key):
      self.mlp = eqx.nn.MLP(dim, dim, z.width, 2, activation=jax.nn.softplus,
                            final_activation=jax.nn.tanh, key=key)

    def __call__(self, t, y, args):
      return self.mlp(y)

  class NeuralODE(eqx.Module):
    func: Func

    def __init__(self, key):
      self.func = Func(key)

    def __call__(self, y0):  # one initial state: (dim,)
      sol = diffrax.diffeqsolve(
          diffrax.ODETerm(self.func), diffrax.Tsit5(), t0=0.0, t1=1.0, dt0=1 / 8, y0=y0,
          stepsize_controller=diffrax.ConstantStepSize(), max_steps=8,
          saveat=diffrax.SaveAt(t1=True))
      return sol.ys[-1]

  rng = np.random.default_rng(5)
  batch = {"y0": jnp.asarray(rng.standard_normal((z.batch * 4, dim)), jnp.float32),
           "y1": jnp.asarray(rng.standard_normal((z.batch * 4, dim)), jnp.float32)}

  def loss(model, batch):
    return jnp.mean((jax.vmap(model)(batch["y0"]) - batch["y1"]) ** 2)

  return _eqx_train(NeuralODE(jax.random.key(0)), loss, batch, "diffrax-node", "ode")


# haiku ----------------------------------------------------------------------

def hk_transformer(z: Size = BENCH) -> Step:
  import haiku as hk

  def forward(tokens):
    x = hk.Embed(z.vocab, z.width)(tokens)
    for i in range(z.layers):
      h = hk.LayerNorm(-1, True, True, name=f"ln1_{i}")(x)
      attn = hk.MultiHeadAttention(z.heads, z.width // z.heads, name=f"attn_{i}",
                                   w_init=hk.initializers.VarianceScaling())
      x = x + attn(h, h, h)
      h = hk.LayerNorm(-1, True, True, name=f"ln2_{i}")(x)
      x = x + hk.nets.MLP([z.ff, z.width], activation=jax.nn.gelu, name=f"mlp_{i}")(h)
    return hk.Linear(z.vocab, name="head")(x)

  f = hk.without_apply_rng(hk.transform(forward))
  batch = _tokens(z, 1, 1)
  params = f.init(jax.random.key(0), batch[:, :-1])

  def loss(params, batch):
    return _xent(f.apply(params, batch[:, :-1]), batch[:, 1:])

  return _train(loss, params, batch, "hk-transformer", "haiku", "decoder")


def hk_mlp(z: Size = BENCH) -> Step:
  import haiku as hk

  f = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([z.ff, z.ff, 16])(x)))
  rng = np.random.default_rng(5)
  batch = {"x": jnp.asarray(rng.standard_normal((z.batch * 4, z.width)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, 16, z.batch * 4), jnp.int32)}
  params = f.init(jax.random.key(0), batch["x"])

  def loss(params, batch):
    return _xent(f.apply(params, batch["x"]), batch["y"])

  return _train(loss, params, batch, "hk-mlp", "haiku", "mlp")


# keras 3 --------------------------------------------------------------------

def _keras_train(model, loss, batch, name, family) -> Step:
  """keras' own JAX training loop: `stateless_call` on lists of variable
  values, named by the variables' paths."""
  opt = optax.adamw(1e-3)
  trainable = [v.value for v in model.trainable_variables]
  fixed = [v.value for v in model.non_trainable_variables]

  def step(trainable, opt_state, fixed, batch):
    def objective(t):
      out, _ = model.stateless_call(t, fixed, batch["x"])
      return loss(out, batch["y"])
    value, grads = jax.value_and_grad(objective)(trainable)
    updates, opt_state = opt.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates), opt_state, value

  names = ([v.path for v in model.trainable_variables], None,
           [v.path for v in model.non_trainable_variables], None)
  return Step(name, "keras", family, step, (trainable, opt.init(trainable), fixed, batch),
              names)


def keras_transformer(z: Size = BENCH) -> Step:
  os.environ.setdefault("KERAS_BACKEND", "jax")
  import keras

  keras.utils.set_random_seed(0)
  tokens = keras.Input((z.seq,), dtype="int32")
  x = keras.layers.Embedding(z.vocab, z.width, name="embed")(tokens)
  for i in range(z.layers):
    h = keras.layers.LayerNormalization(name=f"ln1_{i}")(x)
    x = x + keras.layers.MultiHeadAttention(z.heads, z.width // z.heads, name=f"attn_{i}")(h, h)
    h = keras.layers.LayerNormalization(name=f"ln2_{i}")(x)
    h = keras.layers.Dense(z.ff, activation="gelu", name=f"up_{i}")(h)
    x = x + keras.layers.Dense(z.width, name=f"down_{i}")(h)
  model = keras.Model(tokens, keras.layers.Dense(z.vocab, name="head")(x), name="lm")
  batch = _tokens(z, 1, 1)
  return _keras_train(model, _xent, {"x": batch[:, :-1], "y": batch[:, 1:]},
                      "keras-transformer", "decoder")


def keras_mlp(z: Size = BENCH) -> Step:
  os.environ.setdefault("KERAS_BACKEND", "jax")
  import keras

  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((z.width,)),
                            keras.layers.Dense(z.ff, activation="relu", name="up"),
                            keras.layers.BatchNormalization(name="norm"),
                            keras.layers.Dense(16, name="out")], name="mlp")
  rng = np.random.default_rng(6)
  batch = {"x": jnp.asarray(rng.standard_normal((z.batch * 4, z.width)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, 16, z.batch * 4), jnp.int32)}
  return _keras_train(model, _xent, batch, "keras-mlp", "mlp")


# flax linen and nnx (the library's layers) ----------------------------------

def _linen_encoder(z: Size, remat: bool) -> Step:
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = nn.LayerNorm()(x)
      x = x + nn.MultiHeadDotProductAttention(z.heads)(h, h)
      h = nn.LayerNorm()(x)
      return x + nn.Dense(z.width)(nn.gelu(nn.Dense(z.ff)(h)))

  layer = nn.remat(Block) if remat else Block

  class Encoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(z.vocab, z.width)(tokens)
      for _ in range(z.layers):
        x = layer()(x)
      return nn.Dense(16)(nn.LayerNorm()(x).mean(axis=1))

  model = Encoder()
  batch = {"x": _tokens(z, 1), "y": jnp.asarray(np.arange(z.batch) % 16, jnp.int32)}
  params = model.init(jax.random.key(0), batch["x"])["params"]

  def loss(params, batch):
    return _xent(model.apply({"params": params}, batch["x"]), batch["y"])

  name = "linen-encoder-remat" if remat else "linen-encoder"
  return _train(loss, params, batch, name, "flax.linen", "encoder")


def linen_encoder(z: Size = BENCH) -> Step:
  return _linen_encoder(z, remat=False)


def linen_encoder_remat(z: Size = BENCH) -> Step:
  """The encoder with each block rematerialised (`nn.remat`): its forward
  recomputed in the backward, FSDP's gathers made again."""
  return _linen_encoder(z, remat=True)


def linen_lstm(z: Size = BENCH) -> Step:
  """A recurrent language model of flax's own LSTM layers: `nn.RNN` scans
  an `OptimizedLSTMCell` over the sequence, a residual block per layer."""
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
      return x + nn.RNN(nn.OptimizedLSTMCell(z.width))(nn.LayerNorm()(x))

  class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
      x = nn.Embed(z.vocab, z.width)(tokens)
      for _ in range(z.layers):
        x = Block()(x)
      return nn.Dense(z.vocab)(nn.LayerNorm()(x))

  model = LM()
  tokens = _tokens(z, 1, 1)
  params = model.init(jax.random.key(0), tokens[:, :-1])["params"]

  def loss(params, batch):
    return _xent(model.apply({"params": params}, batch[:, :-1]), batch[:, 1:])

  return _train(loss, params, tokens, "linen-lstm", "flax.linen", "recurrent")


def _nnx_decoder_model(z: Size):
  """A decoder of nnx modules, its blocks in an `nnx.List`."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1, self.ln2 = nnx.LayerNorm(z.width, rngs=rngs), nnx.LayerNorm(z.width, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(z.heads, z.width, decode=False, rngs=rngs)
      self.up = nnx.Linear(z.width, z.ff, rngs=rngs)
      self.down = nnx.Linear(z.ff, z.width, rngs=rngs)

    def __call__(self, x):
      h = self.ln1(x)
      x = x + self.attn(h, mask=nnx.make_causal_mask(x[..., 0]))
      return x + self.down(nnx.gelu(self.up(self.ln2(x))))

  class Decoder(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(z.vocab, z.width, rngs=rngs)
      self.blocks = nnx.List([Block(rngs) for _ in range(z.layers)])
      self.head = nnx.Linear(z.width, z.vocab, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens)
      for block in self.blocks:
        x = block(x)
      return self.head(x)

  return Decoder(nnx.Rngs(0))


def nnx_decoder(z: Size = BENCH) -> Step:
  from flax import nnx

  graphdef, state = nnx.split(_nnx_decoder_model(z))

  def loss(state, batch):
    return _xent(nnx.merge(graphdef, state)(batch[:, :-1]), batch[:, 1:])

  return _train(loss, state, _tokens(z, 1, 1), "nnx-decoder", "flax.nnx",
                "decoder")


def nnx_trainer(z: Size = BENCH) -> Step:
  """The decoder trained as flax's nnx guides write the step: an
  `nnx.Optimizer` updating the model in place inside the step, which runs
  over the split state of both (`nnx.split` / `nnx.merge`, the functional
  form `jax.jit` takes) and returns the state they leave."""
  from flax import nnx

  model = _nnx_decoder_model(z)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
      return _xent(model(batch[:, :-1]), batch[:, 1:])

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss

  return Step("nnx-trainer", "flax.nnx", "decoder", train_step, (state, _tokens(z, 1, 1)))


# penzai (named axes) ---------------------------------------------------------

def penzai_transformer(z: Size = BENCH) -> Step:
  """penzai's own llama-like transformer, its arrays named by axis. Split
  as penzai's `StatefulTrainer` splits it: `pz.unbind_params` into a
  stateless model and its parameters, frozen into `ParameterValue`s."""
  from penzai import pz

  stateless, params = pz.unbind_params(_penzai_model(z))

  def loss(params, batch):
    logits = pz.bind_variables(stateless, params)(
        pz.nx.wrap(batch[:, :-1]).tag("batch", "seq"))
    return _xent(logits.unwrap("batch", "seq", "vocabulary"), batch[:, 1:])

  return _train(loss, pz.freeze_params(params), _tokens(z, 1, 1),
                "penzai-transformer", "penzai", "decoder")


def _penzai_model(z: Size):
  """penzai's llama-like transformer at size `z`."""
  from penzai.models.transformer.variants import llamalike_common

  return llamalike_common.build_llamalike_transformer(
      llamalike_common.LlamalikeTransformerConfig(
          num_kv_heads=z.heads, query_head_multiplier=1, embedding_dim=z.width,
          projection_dim=z.width // z.heads, mlp_hidden_dim=z.ff,
          num_decoder_blocks=z.layers, vocab_size=z.vocab, mlp_variant="swiglu",
          tie_embedder_and_logits=False, parameter_dtype=jnp.float32,
          activation_dtype=jnp.float32),
      init_base_rng=jax.random.key(0))


def penzai_trainer(z: Size = BENCH) -> Step:
  """The same transformer through penzai's own training step
  (`toolshed.basic_training`, what `StatefulTrainer.step` jits): its
  arguments are the model with every variable unbound (`ParameterSlot`s,
  whose `.value` raises) and the frozen values apart, with the trainer's
  state, its random key and the batch as keywords."""
  import functools

  from penzai import pz
  from penzai.toolshed import basic_training

  model = _penzai_model(z)
  stateless, variables = pz.unbind_variables(model)
  opt = optax.adamw(1e-3)
  params = pz.freeze_variables(tuple(variables))

  def loss_fn(*, model, state, rng, batch):
    logits = model(pz.nx.wrap(batch[:, :-1]).tag("batch", "seq"))
    return _xent(logits.unwrap("batch", "seq", "vocabulary"), batch[:, 1:]), state, None

  step = functools.partial(basic_training._stateful_trainer_step, loss_fn=loss_fn,
                           optimizer_def=opt)

  def train_step(root_rng, state, stateless_model, trainable, kwargs):
    return step(root_rng=root_rng, state=state, stateless_model=stateless_model,
                trainable_params=trainable, frozen_params=(), state_vars=(), kwargs=kwargs)

  state = basic_training.InternalTrainerState(step=0, opt_state=opt.init(params),
                                              loss_fn_state=None)
  return Step("penzai-trainer", "penzai", "decoder", train_step,
              (jax.random.key(0), state, stateless, params, {"batch": _tokens(z, 1, 1)}))


BUILDERS = (hf_bert, hf_bert_dropout, hf_gpt2, hf_bart, hf_t5, hf_gemma, hf_vit, eqx_transformer,
            eqx_mlp,
            diffrax_node, hk_transformer, hk_mlp, keras_transformer, keras_mlp, linen_encoder,
            linen_encoder_remat, linen_lstm, nnx_decoder, nnx_trainer, penzai_transformer,
            penzai_trainer)
