"""Rules users declare for their own primitives, checked against compiled HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
from automap._src.run.compiled import collectives


def _primitive(name: str, fn, shape_of):
  """A primitive of our own: `fn` as its implementation and lowering."""
  p = Primitive(name)
  p.def_impl(fn)
  p.def_abstract_eval(lambda *a: jax.core.ShapedArray(shape_of(*a), a[0].dtype))
  mlir.register_lowering(p, mlir.lower_fun(fn, multiple_results=False))
  return p


MATMUL = _primitive("test_matmul", lambda a, b: a @ b, lambda a, b: (a.shape[0], b.shape[1]))
SOFTSIGN = _primitive("test_softsign", lambda x: x / (1 + jnp.abs(x)), lambda x: x.shape)


def step(x, w1, w2):
  return SOFTSIGN.bind(MATMUL.bind(SOFTSIGN.bind(MATMUL.bind(x, w1)), w2)).sum()


ARGS = (jnp.ones((64, 128)) / 8, jnp.ones((128, 256)) / 16, jnp.ones((256, 128)) / 16)
SPECS = (P("data", None), P(None, "model"), P("model", None))


def test_an_undeclared_primitive_warns_and_a_declared_one_is_priced_as_compiled():
  m = mesh((4, 2))
  # The warning says what it costs and how to declare a rule.
  with pytest.warns(automap.UnknownPrimitiveWarning,
                    match=r"test_matmul \(x2\).* values of [\d.]+ MiB.*automap.declare_rule"):
    automap.evaluate(step, *ARGS, mesh=m, in_shardings=SPECS, hardware="cpu")
  automap.declare_rule(MATMUL, "ij,jk->ik")
  automap.declare_rule("test_softsign", "elementwise")
  cost = automap.evaluate(step, *ARGS, mesh=m, in_shardings=SPECS, hardware="cpu")
  shardings = tuple(NamedSharding(m, s) for s in SPECS)
  compiled = jax.jit(step, in_shardings=shardings).lower(*ARGS).compile()
  found = collectives(compiled.as_text(), m)
  assert cost.total_comm_bytes == sum(c.nbytes for c in found) > 0
  # Megatron's pair: the row-parallel product's partial sums all-reduced on 'model'.
  assert {c.kind for c in found if c.axes == ("model",)} == {"all-reduce"}
  plan = automap.partition(step, mesh=m, hardware="cpu")
  np.testing.assert_allclose(plan(*ARGS), step(*ARGS), rtol=1e-5)


@pytest.mark.parametrize("rule, match", [
    ("ij,jk", "einsum-style spec"), ("sum", "einsum-style spec"), (3, "einsum-style spec")])
def test_a_malformed_rule_is_refused_with_the_forms_it_takes(rule, match):
  with pytest.raises(automap.RuleError, match=match):
    automap.declare_rule("test_malformed", rule)


def test_a_rule_that_does_not_fit_its_equation_names_the_shapes():
  bad = _primitive("test_bad", lambda a, b: a @ b, lambda a, b: (a.shape[0], b.shape[1]))
  automap.declare_rule(bad, "ij,jk->i")
  with pytest.raises(automap.RuleError, match=r"does not fit its equation.*\(64, 128\)"):
    automap.evaluate(lambda a, b: bad.bind(a, b), *ARGS[:2], mesh=mesh((4, 2)),
                     in_shardings=SPECS[:2], hardware="cpu")
