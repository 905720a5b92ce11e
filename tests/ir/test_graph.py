"""The partitioning IR built from real traced programs."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import gpt_step

from automap._src.ir import graph, trace


def build(fn, *args):
  return graph.build(trace.trace(fn, args))


def test_gpt_step_graph_keeps_names_and_inlines_calls():
  step, args = gpt_step()
  g = build(step, *args)
  assert "jit" not in g.prims and "pjit" not in g.prims
  assert g.num_values == len(g.shapes) == len(g.names)
  names = [g.names[v] for v in g.inputs]
  assert "0/block_0/mlp/wi/kernel" in names
  assert "1/0/mu/block_1/attn/query/kernel" in names
  scopes = {s for s in g.scopes if "block_1/mlp/wi" in s}
  assert any(s.startswith("jvp(") for s in scopes)
  assert any(s.startswith("transpose(") for s in scopes)
  assert not g.unknown


def test_every_operand_is_defined_before_use():
  step, args = gpt_step()
  g = build(step, *args)
  for o, operands in enumerate(g.operands):
    for v in operands:
      assert v < 0 or g.producer[v] < o


def test_custom_derivative_bodies_are_sealed():
  g = build(lambda x: jax.nn.relu(x) * 2, jnp.ones((8, 4)))
  assert g.sealed.any() and not g.sealed[list(g.inputs)].any()


def test_a_sealed_call_binds_only_the_results_it_returns():
  """Inside a rematerialised call nothing may be pinned; what it returns is
  bound, seen (and pinned) where the call returns it."""
  def f(x, w):
    inner = jax.checkpoint(lambda h: jnp.tanh(h @ w) * 2)
    return inner(x) + 1

  g = build(f, jnp.ones((8, 4)), jnp.ones((4, 4)))
  made = {g.prims[o]: g.results[o][0] for o in range(g.num_ops)}
  assert g.sealed[made["tanh"]] and not g.bound[made["tanh"]]
  assert g.sealed[made["mul"]] and g.bound[made["mul"]]
  assert not g.sealed[made["add"]] and not g.bound[made["add"]]


def test_scan_body_is_walked_once_between_ties():
  def f(x):
    return jax.lax.scan(lambda c, y: (c + y, c * y), x[0], x)[1]
  g = build(f, jnp.ones((4, 8)))
  assert "scan" not in g.prims
  (sliced,) = [i for i, p in enumerate(g.prims) if p == "scan_slice"]
  assert g.rules[sliced].operands[0][0] == -1  # the step dim stays whole
  body = [i for i, p in enumerate(g.prims) if p in ("add", "mul")]
  assert len(body) == 2 and all(g.trips[i] == 4 for i in body)
  ties = [i for i, p in enumerate(g.prims) if p.startswith("scan_")]
  assert all(g.trips[i] == 1 for i in ties)
  # Slices live inside the loop (XLA lays them out); the final carry and
  # the stacked results are constrained after it.
  assert all(g.sealed[g.results[i][0]] == (g.prims[i] == "scan_slice") for i in ties)
  assert {g.prims[i] for i in ties} == {"scan_slice", "scan_carry", "scan_stack"}


def test_while_and_cond_bodies_join_the_graph():
  """A while loop's carry is read through a "while_enter" tie and joined to
  the body's and the final value by a "while_carry" tie (its condition read
  beside them); a cond's branches read its operands and a "cond_result" tie
  joins their values (its index read beside them). Ties share every factor
  of their members of the result's shape: one layout for all."""
  def f(x, n):
    x = jax.lax.while_loop(lambda c: c[1] < n, lambda c: (c[0] * 2, c[1] + 1), (x, 0))[0]
    return jax.lax.cond(n > 2, lambda y: y + 1, lambda y: y - 1, x)
  g = build(f, jnp.ones((4, 8)), 3)
  assert "while" not in g.prims and "cond" not in g.prims
  (branch_add,) = [o for o, p in enumerate(g.prims) if p == "add" and g.shapes[g.results[o][0]]]
  (branch_sub,) = [o for o, p in enumerate(g.prims) if p == "sub" and g.shapes[g.results[o][0]]]
  assert g.regions[branch_add] != g.regions[branch_sub] != 0  # one computation each
  (result,) = [o for o, p in enumerate(g.prims) if p == "cond_result"]
  index, *branches = g.operands[result]
  assert g.shapes[index] == () and set(branches) == {g.results[branch_add][0],
                                                     g.results[branch_sub][0]}
  rule = g.rules[result]
  assert rule.operands[1] == rule.operands[2] == rule.results[0]  # one layout
  carry = [o for o, p in enumerate(g.prims) if p == "while_carry"
           and g.shapes[g.results[o][0]] == (4, 8)]
  (enter,) = [o for o, p in enumerate(g.prims) if p == "while_enter"
              and g.shapes[g.results[o][0]] == (4, 8)]
  (loop,) = carry
  assert g.operands[loop][0] == g.results[enter][0]  # the carry the body reads
  assert g.operands[enter] == (g.inputs[0],)


def test_nn_scan_stack_is_walked_with_its_trip_count():
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
      return nn.Dense(16)(x), None

  stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                  length=3)()
  x = jnp.ones((8, 16))
  params = stack.init(jax.random.key(0), x, None)
  g = build(lambda p, x: stack.apply(p, x, None)[0].sum(), params, x)
  (dot,) = [i for i, p in enumerate(g.prims) if p == "dot_general"]
  assert g.trips[dot] == 3 and g.flops[dot] == 2 * 8 * 16 * 16


def test_unknown_primitive_warns_once_with_its_name():
  with pytest.warns(graph.UnknownPrimitiveWarning, match="fft"):
    g = build(lambda x: jnp.fft.fft(x).real, jnp.ones((8, 16)))
  assert "fft" in g.unknown


def test_non_array_leaves_are_static():
  t = trace.trace(lambda a: a["x"] * len(a["cfg"]["name"]),
                  ({"x": np.ones(3), "cfg": {"name": "adam"}},))
  assert t.in_paths == ("0/x",) and t.in_static.values == ("adam",)


def test_unhashable_static_leaf_names_its_path():
  with pytest.raises(trace.ArgumentError, match="'0/cfg/name'"):
    trace.trace(lambda a: a["x"], ({"x": np.ones(3), "cfg": {"name": bytearray(b"a")}},))
