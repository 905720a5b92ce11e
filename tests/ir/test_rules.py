"""Factor rules: which dims of an op tile together."""

import numpy as np
from jax import lax

from automap._src.ir import rules
from automap._src.ir.factor_rule import UNSHARDABLE


def test_dot_general_names_batch_contracting_and_free_factors():
  # [b, s, h] x [h, f] -> [b, s, f]
  dn = (((2,), (0,)), ((), ()))
  r = rules.rule_for("dot_general", [(8, 16, 32), (32, 64)], [(8, 16, 64)],
                     {"dimension_numbers": dn})
  lhs, rhs = r.operands
  (out,) = r.results
  assert lhs[2] == rhs[0] and r.reduction[lhs[2]]  # h is contracted
  assert out == (lhs[0], lhs[1], rhs[1])
  assert not any(r.reduction[f] for f in out)


def test_dot_general_batch_dims_are_shared_by_all_three():
  dn = (((3,), (3,)), ((0, 2), (0, 2)))  # bqnd,bknd->bnqk
  r = rules.rule_for("dot_general", [(2, 8, 4, 16), (2, 8, 4, 16)],
                     [(2, 4, 8, 8)], {"dimension_numbers": dn})
  lhs, rhs = r.operands
  assert r.results[0][:2] == (lhs[0], lhs[2]) == (rhs[0], rhs[2])


def test_a_merged_or_split_dim_indexes_both_factors_major_first():
  """Shardy's compound factors: the one dim of a merge or split indexes
  both factors, major then minor; axes tiling it fill the major factor
  first and tile the minor one only once the major is whole."""
  merge = rules.rule_for("reshape", [(8, 32, 64)], [(256, 64)],
                         {"new_sizes": (256, 64), "dimensions": None})
  batch, seq = merge.operands[0][:2]
  assert merge.results[0][0] == batch >= 0 and seq >= 0
  assert merge.minor == ((1, 0, seq),)  # the result's dim 0: (batch, seq)
  assert merge.operands[0][2] == merge.results[0][1]
  assert not any(merge.reduction)
  split = rules.rule_for("reshape", [(8, 32, 64)], [(8, 32, 4, 16)],
                         {"new_sizes": (8, 32, 4, 16), "dimensions": None})
  heads, width = split.results[0][2:]
  assert split.operands[0][2] == heads and split.sizes[heads] == 4
  assert split.sizes[width] == 16 and split.minor == ((0, 2, width),)
  assert split.dim_of(0, width) == 2 and split.dim_of(1, width) == 3
  # Hidden tiled (4 devices, then 2): heads, then head width.
  assert split.factor_on(0, 2, before=(), tiles=4) == heads
  assert split.factor_on(0, 2, before=(4,), tiles=2) == width
  # 2 devices then 4 straddle the heads: neither factor, nor for any after.
  assert split.factor_on(0, 2, before=(2,), tiles=4) == UNSHARDABLE
  assert split.factor_on(0, 2, before=(2, 4), tiles=2) == UNSHARDABLE


def test_only_the_major_factor_crosses_longer_merges():
  r = rules.rule_for("reshape", [(2, 3, 4)], [(24,)], {"new_sizes": (24,), "dimensions": None})
  assert r.operands[0][0] == r.results[0][0] >= 0
  assert r.operands[0][1:] == (UNSHARDABLE, UNSHARDABLE) and r.minor == ()


def test_broadcast_in_dim_never_tiles_a_broadcast_unit_dim():
  r = rules.rule_for("broadcast_in_dim", [(1, 64)], [(8, 64)],
                     {"shape": (8, 64), "broadcast_dimensions": (0, 1),
                      "sharding": None})
  assert r.operands[0] == (UNSHARDABLE, r.results[0][1])


def test_implicit_unit_broadcast_in_elementwise_ops():
  r = rules.rule_for("add", [(8, 32, 64), (1, 32, 64)], [(8, 32, 64)], {})
  assert r.operands[1][0] == UNSHARDABLE
  assert r.operands[1][1:] == r.operands[0][1:] == r.results[0][1:]


def test_reductions_and_argmax_mark_partial_factors():
  s = rules.rule_for("reduce_sum", [(8, 64)], [(8,)], {"axes": (1,)})
  assert s.reduction[s.operands[0][1]]
  a = rules.rule_for("argmax", [(8, 64)], [(8,)], {"axes": (1,),
                                                   "index_dtype": np.int32})
  assert a.reduction[a.operands[0][1]] and not a.reduction[a.operands[0][0]]


def test_embedding_gather_looks_up_vocabulary_tiles_locally():
  # A vocab-tiled table: each device looks up the rows it holds (the others
  # masked), so the vocabulary is a reduction factor the result is summed over.
  dn = lax.GatherDimensionNumbers(offset_dims=(2,), collapsed_slice_dims=(0,),
                                  start_index_map=(0,))
  r = rules.rule_for("gather", [(256, 64), (8, 32, 1)], [(8, 32, 64)],
                     {"dimension_numbers": dn, "slice_sizes": (1, 64)})
  table, idx = r.operands
  assert table[0] != UNSHARDABLE and r.reduction[table[0]]
  assert r.results[0] == (idx[0], idx[1], table[1])


def test_a_scatter_add_into_vocabulary_tiles_writes_its_own_rows():
  dn = lax.ScatterDimensionNumbers(update_window_dims=(2,), inserted_window_dims=(0,),
                                   scatter_dims_to_operand_dims=(0,))
  r = rules.rule_for("scatter-add", [(256, 64), (8, 32, 1), (8, 32, 64)], [(256, 64)],
                     {"dimension_numbers": dn})
  table, idx, updates = r.operands
  assert table[0] != UNSHARDABLE and not r.reduction[table[0]]
  assert r.results[0] == table and table[0] not in updates


def test_unknown_primitive_is_replicated():
  r = rules.rule_for("mystery", [(8, 4)], [(8, 4)], {})
  assert r.replicated and r.operands == ((UNSHARDABLE, UNSHARDABLE),)


def test_flops_of_a_matmul():
  dn = (((1,), (0,)), ((), ()))
  assert rules.flops("dot_general", [(8, 32), (32, 4)], [(8, 4)],
                     {"dimension_numbers": dn}) == 2 * 8 * 32 * 4
