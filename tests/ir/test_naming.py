"""Layer names as the cluster planner and the stage cut read them off name
scopes, for models written as libraries write them."""

from automap._src.ir.naming import UNSCOPED, containers, layer_of


def names(scopes):
  held = containers(scopes)
  return [layer_of(s, containers=held) for s in scopes]


def test_top_level_layers_are_named_by_their_first_scope():
  scopes = ["jvp(GPT)/embed", "jvp(GPT)/block_0/attn/query", "jvp(GPT)/block_0/mlp/wi",
            "jvp(GPT)/block_1/mlp/wo", "transpose(jvp(GPT))/block_1/attn", "jvp(GPT)/ln_f"]
  assert containers(scopes) == frozenset()
  assert names(scopes) == ["embed", "block_0", "block_0", "block_1", "block_1", "ln_f"]


def test_huggingface_blocks_are_named_below_the_scopes_that_hold_them():
  scopes = ["jvp(FlaxGPT2LMHeadModule)/transformer/wte",
            "jvp(FlaxGPT2LMHeadModule)/transformer",
            "jvp(FlaxGPT2LMHeadModule)/transformer/h/0/attn/c_attn",
            "jvp(FlaxGPT2LMHeadModule)/transformer/h/1/mlp/c_fc",
            "transpose(jvp(FlaxGPT2LMHeadModule))/transformer/h/1/ln_2",
            "jvp(FlaxGPT2LMHeadModule)/transformer/ln_f",
            "jvp(FlaxGPT2LMHeadModule)/lm_head"]
  assert containers(scopes) == {"transformer", "transformer/h"}
  # An op in a container itself joins the layer before it.
  assert names(scopes) == ["transformer/wte", UNSCOPED, "transformer/h/0", "transformer/h/1",
                           "transformer/h/1", "transformer/ln_f", "lm_head"]


def test_encoder_and_decoder_stacks_each_hold_their_layers():
  scopes = [f"Bart/model/{part}/layers/{i}/fc1" for part in ("encoder", "decoder")
            for i in range(2)] + ["Bart/model/shared", "Bart/lm_head"]
  assert containers(scopes) == {"model", "model/encoder", "model/encoder/layers",
                                "model/decoder", "model/decoder/layers"}
  assert names(scopes)[:4] == ["model/encoder/layers/0", "model/encoder/layers/1",
                               "model/decoder/layers/0", "model/decoder/layers/1"]
  assert names(scopes)[4:] == ["model/shared", "lm_head"]


def test_a_blocks_own_numbered_sublayers_stay_inside_it():
  # Haiku's MLP names its linears linear_0, linear_1 inside each mlp_i; flax
  # names Dense_0, Dense_1 inside each block.
  scopes = ["embed", "mlp_0/linear_0", "mlp_0/linear_1", "mlp_1/linear_0", "mlp_1/linear_1",
            "Model/Block_0/Dense_0", "Model/Block_0/Dense_1", "Model/Block_1/Dense_0", "head"]
  assert containers(scopes) == frozenset()
  assert names(scopes) == ["embed", "mlp_0", "mlp_0", "mlp_1", "mlp_1", "Block_0", "Block_0",
                           "Block_1", "head"]


def test_a_set_named_from_its_bare_first_member_is_one_set():
  # Haiku and keras name repeats `block`, `block_1`, ...: `block` is the first.
  scopes = ["embed", "block/linear", "block/linear_1", "block_1/linear", "block_1/linear_1",
            "head"]
  assert containers(scopes) == frozenset()
  assert names(scopes) == ["embed", "block", "block", "block_1", "block_1", "head"]


def test_towers_of_more_blocks_than_towers_hold_their_blocks():
  scopes = [f"Model/Encoder_{e}/EncoderBlock_{b}/Dense_0" for e in range(2) for b in range(3)]
  assert containers(scopes) == {"Encoder_0", "Encoder_1"}
  assert names(scopes)[:3] == [f"Encoder_0/EncoderBlock_{b}" for b in range(3)]
