"""Lookups along a tiled dim: XLA's masked local gather and scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import compile_as_written
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import automap

MESH = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
VOCAB, WIDTH = 512, 64


def lookup(table, tokens):
  return (table[tokens] ** 2).sum()


def embedding_grad(table, tokens):
  return jax.grad(lookup)(table, tokens)


def label_logits(logits, labels):
  return jnp.take_along_axis(logits, labels[..., None], axis=-1).sum()


ARGS = {
    "lookup": (lookup, (jnp.ones((VOCAB, WIDTH)), jnp.arange(64).reshape(8, 8) % VOCAB)),
    "embedding grad": (embedding_grad,
                       (jnp.ones((VOCAB, WIDTH)), jnp.arange(64).reshape(8, 8) % VOCAB)),
    "take_along_axis": (label_logits,
                        (jnp.ones((8, 16, VOCAB)), jnp.arange(128).reshape(8, 16) % VOCAB)),
}
SPECS = {"lookup": (P("model"), P("data")), "embedding grad": (P("model"), P("data")),
         "take_along_axis": (P("data", None, "model"), P("data"))}


@pytest.mark.parametrize("name", sorted(ARGS))
def test_a_lookup_along_a_tiled_dim_is_priced_as_compiled(name):
  fn, args = ARGS[name]
  specs = SPECS[name]
  cost = automap.evaluate(fn, *args, mesh=MESH, in_shardings=specs, hardware="cpu")
  compiled, _, _ = compile_as_written(fn, args, MESH, specs)
  # No gather of the whole table (or logits) over "model": the lookups stay
  # local and, for a gather, an all-reduce sums the masked rows.
  assert cost.comm_bytes.get(("all-gather", ("model",)), 0) == 0
  assert sum(v for (k, a), v in compiled.items() if k == "all-gather" and "model" in a) < 1024
  assert cost.total_comm_bytes == pytest.approx(sum(compiled.values()), rel=0.05, abs=1024)


def test_vocab_parallel_lookup_runs_with_exact_numerics():
  fn, args = ARGS["embedding grad"]
  table = jax.random.normal(jax.random.key(0), args[0].shape)
  plan = automap.search(fn, table, args[1], mesh=MESH, hardware="cpu",
                        hints=automap.Hints(fixed={"0": P("model")}),
                        budget=automap.Budget(episodes=20))
  report = automap.verify(plan, fn, table, args[1], mesh=MESH)
  assert report.max_rel_error < 1e-6
  assert report.comm_error < 0.05, report.table()
  np.testing.assert_array_equal(plan.in_specs[0], P("model"))
