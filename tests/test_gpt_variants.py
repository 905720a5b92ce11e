"""The GPT's shape options, as the published runs' models need them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from automap._src.models.gpt import GPT, MLP, Attention, Block, GPTConfig


@pytest.mark.heavy
def test_head_size_need_not_divide_hidden():
  """MaxText's and PaLM's heads are 256 wide whatever the model width."""
  config = GPTConfig(vocab=64, seq=8, hidden=48, heads=2, head_size=32, layers=1)
  params = GPT(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  attn = params["block_0"]["attn"]
  assert attn["query"]["kernel"].shape == (48, 2, 32)
  assert attn["out"]["kernel"].shape == (2, 32, 48)


@pytest.mark.heavy
def test_parallel_block_adds_attention_and_mlp_of_one_norm():
  config = GPTConfig(vocab=64, seq=8, hidden=32, heads=2, layers=1, parallel=True)
  x = jax.random.normal(jax.random.key(1), (2, 8, 32))
  params = Block(config).init(jax.random.key(0), x)["params"]
  assert set(params) == {"ln1", "attn", "mlp"}
  y = nn.LayerNorm().apply({"params": params["ln1"]}, x)
  expected = (x + Attention(config).apply({"params": params["attn"]}, y)
              + MLP(config).apply({"params": params["mlp"]}, y))
  np.testing.assert_allclose(Block(config).apply({"params": params}, x), expected,
                             rtol=1e-5, atol=1e-5)
