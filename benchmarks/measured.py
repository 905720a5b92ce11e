"""Predicted against published measured training throughput.

Every row of `measured_runs.json` is a training run whose configuration and
measured throughput were published (papers, official READMEs and configs;
each row names its source, the table or file and commit, and quotes it). A
row's model is traced as a 2-block bf16 GPT of its shape (hidden, heads,
key/value heads, MLP width and kind, sequence, vocabulary), priced by the
cost model at the row's tensor-parallel width under the runs' own layout
(Megatron-LM's tensor parallelism, `megatron`, with its sequence
parallelism where the run had it, gradients in their parameters' layout),
its block repeated to the row's depth, and run through the cluster
model exactly as published (`cluster.price_placement`: tensor x pipeline x
data, microbatch, recompute, schedule, ZeRO; mixed-precision Adam). Where
a source leaves a setting out (microbatch, interleaved chunks, recompute,
ZeRO, sequence parallelism), the fastest choice that fits the device's
memory stands in, as a tuned run would; the table says which were chosen
("sp": sequence parallel). The predicted time per iteration is turned
into the source's own unit with the source's own FLOP formula
(`SOURCE_FLOPS`), so "predicted / measured" compares like with like.

Split: the Narayanan et al. 2021 weak-scaling table (Table 1) and every
third other row (by id) are validation: nothing is ever fitted to them. The
training rows fit one constant per device, `Hardware.matmul_efficiency`,
from the rows whose prediction moves with it, where they come from at
least MIN_FIT_RUNS independent runs (a model at several scales is one run)
(`--fit` prints the fit; the catalogue's values in
`automap/_src/cost/calibration.py` came from it).

Stacks: automap emits XLA programs, so its constants describe XLA and are
fitted on JAX/XLA runs only (MaxText and Pax on TPU and GPU, NVIDIA's
dgxc-benchmarking and JAX-Toolbox, Google's GPU recipes). Runs of other
software (Megatron-LM and Megatron-Core, DeepSpeed's ZeRO-3, Meta's
PyTorch stack) are priced with the same constants and reported apart, with
their stack's factor (median predicted / measured over its training rows)
stated and never folded into a constant.

FSDP inside a slice with data parallelism across slices (hybrid sharding:
MaxText's multi-slice runs, PaLM's two pods) is priced as it ran: ZeRO 3
within each slice's replicas (`ClusterConfig.shard_group`), the slices
all-reducing their shards' gradients over the data-centre network, a slice
being the row's devices over its data-parallel width.

Context parallelism (Llama 3's 128K row) is priced on a (context, model)
stage mesh with Megatron-LM's layout: activations split along the sequence
over "context" (and by heads or hidden units over "model" out of a
column-parallel matmul), attention gathering keys and values over it, the
weight gradients reduced once per batch over data x context.

Sequence parallelism stated (`--stated`): where a run split the sequence
over its tensor group, the layouts priced are those `price_cluster` prices
when a user states `ClusterConfig(tensor=t, sequence_parallel=True)`
(`cluster_plan.stated_profiles`: the sharding search's at that width under
the sequence pins, `--episodes` per width, and Megatron-LM's layout with the
same pins), the fastest that fits standing, rather than the runs' layout
pinned parameter by parameter; the table marks which ("(searched)",
"(Megatron)").

Not priced (listed with the reason): rows whose model dimensions the
source leaves out.

  python benchmarks/measured.py [--only PREFIX] [--fit] [--planner] [--efficiency X]
                                [--stated] [--episodes N]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import automap
from automap import cluster
from automap._src.cluster import cluster_plan
from automap._src.cluster.placement.dp import place_any
from automap._src.cluster.profile import context as context_lib
from automap._src.cluster.profile import layers as layers_lib
from automap._src.cluster.profile.layers import Profile
from automap._src.cost import calibration
from automap._src.cost.program import Program
from automap._src.ir import trace as trace_lib
from automap._src.plan import planner
from automap._src.sharding.mesh import MeshSpec
from automap.cluster import PlacementError, PlacementOptions
from automap.zoo import GPT, GPTConfig

DATA = pathlib.Path(__file__).with_name("measured_runs.json")
# Sources whose runs used a fused (flash) attention kernel, and where they say
# so: MaxText's base.yml @76bd53b0 (`attention: 'flash'`) and its v5e scripts
# @9bc243c5 (`enable_flash_attention=true`); Megatron-Core r0.8's default
# `--transformer-impl transformer_engine` (arguments.py @f2e5db40), whose
# attention is Transformer Engine's fused kernel. Runs that predate
# FlashAttention (Dao et al., May 2022) did not: Narayanan et al. 2021,
# MT-NLG (2021), BLOOM (trained from March 2022 with Megatron-DeepSpeed's
# fused softmax). Where a source is silent (Llama 3), both are tried and the
# fastest that fits stands, as for any setting a source leaves out.
FUSED_ATTENTION = ("maxtext_v5e", "maxtext_v5p", "mcore_h100_2024")
UNFUSED_ATTENTION = ("narayanan21", "mtnlg", "bloom", "korthikanti22")
# Sources whose runs overlapped tensor-parallel collectives with the matmuls,
# and say so: the Megatron-LM README @f2e5db40 (`--tp-comm-overlap`);
# MaxText's run scripts (configs/v5p/*.sh @76bd53b0, largest_job/*.sh
# @9bc243c9), whose LIBTPU_INIT_ARGS set
# `--xla_tpu_enable_async_collective_fusion=true
# --xla_tpu_enable_async_collective_fusion_multiple_steps=true
# --xla_tpu_overlap_compute_collective_tc=true`.
OVERLAP_TENSOR = ("mcore_h100_2024", "maxtext_v5e", "maxtext_v5p")
def sync_overlapped(row: dict) -> bool:
  """Whether the run's data-parallel gradient sync overlapped its backward.
  Rows say so where their source does (`grad_sync`): Table 1's runs through
  `--DDP-impl` in Megatron-LM's examples/sc21/run_table_1.sh (torch DDP's
  bucketed all-reduce during the backward; Megatron's "local" DDP one
  all-reduce after it), DeepSpeed's pipeline engine (MT-NLG, BLOOM) after
  the last backward. Elsewhere it overlaps, as XLA's latency-hiding
  scheduler, Megatron-Core's --overlap-grad-reduce and DeepSpeed's ZeRO
  run it."""
  return row["parallel"].get("grad_sync") != "after_backward"


# Sources whose activations between blocks are split over the tensor axis
# along their embedding dimension: MaxText's logical_axis_rules
# ('activation_embed', 'tensor') in base.yml @76bd53b0 and @9bc243c9, applied
# to each decoder layer's input, norm, attention and MLP outputs and sum
# (layers/models.py). Megatron-LM's runs keep them whole in the group.
EMBED_SHARDED = ("maxtext_v5e", "maxtext_v5p")
# Megatron-LM's sequence parallelism splits the same activations over the
# tensor group along the sequence (norms, dropout and residual adds run on a
# slice; the group all-gathers before a column-parallel matmul and
# reduce-scatters after a row-parallel one). Megatron-Core's runs had it:
# their --tp-comm-overlap asserts --sequence-parallel (arguments.py
# @f2e5db40, line 199). Runs before it existed (Korthikanti et al., May 2022;
# Megatron-DeepSpeed as BLOOM ran it) did not; where a source is silent
# (Llama 3), both are tried and the fastest that fits stands.
SEQUENCE_PARALLEL = ("mcore_h100_2024",)
WHOLE_SEQUENCE = ("narayanan21", "mtnlg", "bloom", "palm")
# Sources whose runs' norms and GELU keep only their inputs for the backward,
# as Korthikanti et al. 2022 count a layer's activations (Section 4: the
# GeLU "requires its input", the layer norm "stores its input"): Megatron-LM
# with Apex's fused layer norm and its fused bias-GELU. JAX's own GELU and
# norm keep their tanh, products and float32 centred input besides.
FUSED_KERNELS = ("korthikanti22",)
# Sources whose blocks run attention and the MLP side by side on one norm's
# output and add both to the input: MaxText's DecoderLayer (layers/models.py
# @76bd53b0; layers.py @9bc243c9), as PaLM's.
PARALLEL_BLOCKS = ("maxtext_v5e", "maxtext_v5p", "palm")
# A device's constant is fitted only on rows that move with it from this many
# runs: one model measured at several scales is one run, whose software
# stack a kernel constant must not absorb.
MIN_FIT_RUNS = 3
# Sources that count model FLOPs as NVIDIA's dgxc-benchmarking READMEs do.
NVIDIA_FLOPS = ("dgxc_maxtext", "dgxc_paxml", "jaxtoolbox", "gpu_recipes")
# The software each source's runs used. The cost model describes XLA: its
# constants are fitted on JAX/XLA runs only; runs of other stacks are
# priced with them and their stack's factor (median predicted / measured
# over its training rows) is stated, never folded into a constant.
STACK = {"narayanan21": "megatron", "mcore_h100_2024": "megatron", "mtnlg": "megatron",
         "bloom": "megatron", "korthikanti22": "megatron",
         "llama3": "pytorch"}  # every other source: "jax"


def stack(row: dict) -> str:
  return row.get("stack") or STACK.get(row["source"], "jax")
MICROBATCHES = (1, 2, 4, 8, 16)
VIRTUAL = (2, 3, 4, 6, 8)


def load() -> tuple[list[dict], dict]:
  data = json.loads(DATA.read_text())
  return sorted(data["rows"], key=lambda r: r["id"]), data["sources"]


def validation(rows: list[dict]) -> set[str]:
  """Narayanan et al.'s Table 1, and every third other row by id; rows added
  later carry their split, fixed before they were first priced, so that
  adding them moves no earlier row's."""
  stated = {r["id"] for r in rows if r.get("split") == "validation"}
  rows = [r for r in rows if "split" not in r]
  rest = [r["id"] for r in rows if not r["id"].startswith("narayanan21-t1-")]
  return ({r["id"] for r in rows if r["id"].startswith("narayanan21-t1-")} | set(rest[::3])
          | stated)


def unpriced(row: dict) -> str | None:
  """Why a row cannot be priced as published, or None."""
  m, p = row["model"], row["parallel"]
  if any(m.get(k) is None for k in ("layers", "hidden", "heads", "seq")):
    return "model dimensions not published"
  if p.get("tensor") is None or p.get("pipeline") is None:
    return "tensor / pipeline widths not published"
  if all(row["measured"].get(k) is None
         for k in ("tflops_per_device", "mfu", "seconds_per_iteration")):
    return "no per-device throughput published"
  return None


def model_config(row: dict, layers: int = 2) -> GPTConfig:
  m = row["model"]
  return GPTConfig(vocab=m.get("vocab") or 32000, seq=m["seq"], hidden=m["hidden"],
                   heads=m["heads"], layers=layers, mlp=m.get("ffn") or 0,
                   gated=bool(m.get("gated_mlp")),
                   kv_heads=m.get("kv_heads") or 0, head_size=m.get("head_dim") or 0,
                   parallel=row["source"] in PARALLEL_BLOCKS, dtype=jnp.bfloat16,
                   fused_kernels=row["source"] in FUSED_KERNELS,
                   tied=m.get("tied", row["source"] not in ("llama3", "mcore_h100_2024")))


def model_step(row: dict):
  """(loss, params, batch): the 2-block model's loss, its bf16 parameters
  and one sample's tokens, abstract, as a user hands them to price_cluster."""
  config = model_config(row)
  model = GPT(config)
  tokens = jax.ShapeDtypeStruct((1, config.seq), jnp.int32)
  params = jax.eval_shape(
      lambda: model.init(jax.random.key(0), jnp.zeros((1, config.seq), jnp.int32)))["params"]
  # bf16 parameters (mixed precision keeps the float32 copies in the optimizer).
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), params)

  def loss(p, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, x), y).mean()

  return loss, params, (tokens, tokens)


def stated_states(row: dict, hw, episodes: int) -> dict[str, tuple]:
  """Layout name -> (traced, state) of the layouts `price_cluster` prices
  for the row's tensor width with sequence parallelism stated
  (`ClusterConfig(tensor=t, sequence_parallel=True)`: the sharding search's
  at `episodes`, held to the device's memory times the row's stages as
  price_cluster holds it, and Megatron-LM's with the same pins), at one
  sample per microbatch."""
  loss, params, batch = model_step(row)
  t, stages = row["parallel"]["tensor"], row["parallel"]["pipeline"]
  search = planner.searcher(automap.Budget(episodes=episodes, seconds=3600, progress=False), 0,
                            hw.hbm_capacity * stages)
  profiles = cluster_plan.stated_profiles(
      loss, params, batch, cluster.ClusterConfig(tensor=t, sequence_parallel=True), hw, search)
  return {name: (prof.programs[(1, t)][0].traced, prof.programs[(1, t)][1])
          for name, prof in profiles.items()}


def traced_step(row: dict):
  """The 2-block step at one sample per microbatch, abstract, and its
  parameters' count."""
  loss, params, batch = model_step(row)
  traced = trace_lib.trace(jax.value_and_grad(loss), (params, *batch))
  return traced, len(jax.tree.leaves(params))


def parameters(row: dict) -> float:
  """Parameters of the full-depth model as traced (embeddings included)."""
  config = model_config(row, layers=1)
  shapes = jax.eval_shape(lambda: GPT(config).init(
      jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))["params"]
  sizes = {k: sum(math.prod(x.shape) for x in jax.tree.leaves(v)) for k, v in shapes.items()}
  block = sizes.pop("block_0")
  return sum(sizes.values()) + block * row["model"]["layers"]


def source_flops(row: dict) -> float:
  """FLOPs per iteration as the row's source counts them."""
  m, p = row["model"], row["parallel"]
  B, s, L, h = p["global_batch"], m["seq"], m["layers"], m["hidden"]
  V = m.get("vocab") or 0
  source = row["source"]
  if source in ("narayanan21", "mtnlg"):  # eq. (3), recompute's forward included
    return 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
  if source in ("mcore_h100_2024", "korthikanti22"):  # Megatron-LM's model FLOPs, no recompute
    return 72 * B * s * L * h**2 * (1 + s / (6 * h) + V / (12 * L * h))
  if source == "bloom":  # math/README.md: model size x 4 x 2 x seq x batch
    return m["params"] * 8 * s * B
  if source in NVIDIA_FLOPS:  # dgxc-benchmarking's model FLOPs per sequence
    mlp = (18 if m.get("gated_mlp") else 12) * L * m["ffn"] * h
    attention = 12 * L * h**2 * (1 + (m.get("kv_heads") or m["heads"]) / m["heads"] + s / h)
    return B * s * (attention + mlp + 6 * V * h)
  if source in ("maxtext_v5e", "maxtext_v5p", "maxtext_a3"):  # calculate_training_tflops
    head_dim = m.get("head_dim") or h // m["heads"]
    attention = 12 * m["heads"] * L * head_dim * s**2 * B
    if source != "maxtext_v5e":  # halved for causality from 2023-11-29 on
      attention /= 2
    return 6 * parameters(row) * s * B + attention
  if source in ("llama3", "palm"):  # PaLM's MFU: 6N + 12 L H Q T per token
    head_dim = m.get("head_dim") or h // m["heads"]
    return (6 * m["params"] + 12 * L * m["heads"] * head_dim * s) * s * B
  raise ValueError(f"no FLOP formula for source {source!r}")


def hybrid(row: dict) -> bool:
  """FSDP within each slice, data parallelism across the slices."""
  p = row["parallel"]
  return (p.get("fsdp") or 1) > 1 and (p.get("data") or 1) > 1


def measured_flops(row: dict) -> float:
  """FLOP/s per device in the source's own unit: as published, its MFU (by
  the source's own FLOP formula) times the device's peak, or that formula
  over the published seconds per step (the formula then cancels out of
  predicted / measured)."""
  m = row["measured"]
  if m.get("tflops_per_device") is not None:
    return m["tflops_per_device"] * 1e12
  if m.get("mfu") is not None:
    return m["mfu"] * automap.HARDWARE[row["hardware"]].flops
  return source_flops(row) / (m["seconds_per_iteration"] * row["devices"])


def hardware(row: dict, efficiency: float | None = None) -> automap.Hardware:
  hw = automap.HARDWARE[row["hardware"]]
  if hybrid(row) and hw.platform == "tpu":  # the slices: devices over data-parallel width
    hw = dataclasses.replace(hw, devices_per_node=row["devices"] // row["parallel"]["data"])
  if "40GB" in row.get("notes", "") and row["hardware"] == "a100":
    hw = dataclasses.replace(hw, hbm_capacity=40e9)
  if efficiency is not None:
    hw = dataclasses.replace(hw, matmul_efficiency=efficiency)
  return hw


def megatron(path: str, ndim: int) -> P:
  """Megatron-LM's tensor parallelism of a parameter over "model": attention
  by heads (q, k, v by columns, the output by rows), the MLP's first
  layer(s) by columns and its second by rows, the vocabulary split in the
  embedding and the output head; the rest replicated."""
  leaf = path.split("/")
  if leaf[-1] == "kernel" and leaf[-2] in ("query", "key", "value"):
    return P(None, "model", None)
  if leaf[-2:] == ["out", "kernel"]:
    return P("model", None, None)
  if leaf[-2] in ("wi", "wg"):
    return P(None, "model") if leaf[-1] == "kernel" else P("model")
  if leaf[-2:] == ["wo", "kernel"]:
    return P("model", None)
  if leaf[-2:] == ["embed", "embedding"]:
    return P("model", None)
  if leaf[-2:] == ["head", "kernel"]:
    return P(None, "model")
  return P()


def whole_where_indivisible(spec: P, shape, width: int) -> P:
  """`spec` with the dims `width` does not divide left whole: multi-query
  attention's single key / value head is replicated over the tensor axis
  (PaLM's layout), not split."""
  return P(*[None if e is not None and shape[k] % width else e for k, e in enumerate(spec)])


def mesh_of(width: int, context: int = 1) -> MeshSpec:
  """A stage's mesh: tensor parallelism over "model" (minor: within a
  node), and context parallelism (the sequence split) over "context" where
  the row has it."""
  return context_lib.stage_mesh(width * context, context)


def published_state(traced, params_count: int, width: int, hw, hidden: int = 0,
                    split: str = "", context: int = 1) -> np.ndarray:
  """The runs' own intra-layer layout (Megatron-LM's, MaxText's tensor
  axis alike) on a `width`-device mesh; the batch whole on it. `split`
  "embed": every [1, seq, hidden] activation and its gradient is split over
  the axis along hidden, as MaxText constrains them; "sequence": the
  blocks' along the sequence, as Megatron-LM's sequence parallelism splits
  them (the vocabulary-parallel lookup makes its rows whole and
  reduce-scatters them into the first block). With `context`, the tokens
  split along the sequence over "context" too (Llama 3's context
  parallelism: attention gathers keys and values over it)."""
  program = Program.build(traced, mesh_of(width, context), hw)
  if width * context == 1:
    return program.initial_state()
  g = program.graph
  paths = [str(p) for p in traced.in_paths]
  layouts = [(v, whole_where_indivisible(megatron(p, 0), g.shapes[v], width)
              if i < params_count else P())
             for i, (v, p) in enumerate(zip(g.inputs, paths))]
  # Each gradient in its parameter's layout, as Megatron-LM keeps them.
  layouts += [(v, whole_where_indivisible(megatron(p, 0), g.shapes[v], width))
              for v, p in zip(g.outputs, traced.out_paths)
              if v >= 0 and g.producer[v] >= 0 and p.startswith("1/")]
  if split and width > 1:
    spec = P(None, None, "model") if split == "embed" else P(None, "model", None)
    if split == "sequence" and context > 1:
      spec = P(None, (context_lib.CONTEXT, "model"), None)
    for v in range(g.num_values):
      if (g.producer[v] < 0 or len(g.shapes[v]) != 3 or g.shapes[v][0] != 1
          or g.shapes[v][2] != hidden):
        continue
      scope = g.scopes[g.producer[v]]
      if split == "embed" or (g.shapes[v][1] > 1 and ("/block_" in scope or "/ln_f" in scope)):
        layouts.append((v, spec))
  if context > 1:
    # Megatron-LM's context parallelism: every activation split along the
    # sequence over the context group and, out of a column-parallel matmul,
    # by heads or hidden units over the tensor group (queries, keys and
    # values, the MLP's hidden layer, their gradients); attention gathers
    # keys and values over the context group.
    seq = g.shapes[g.inputs[params_count]][1]
    model = "model" if width > 1 else None
    layouts += [(v, P(None, context_lib.CONTEXT, model, *[None] * (len(g.shapes[v]) - 3)))
                for v in range(g.num_values)
                if g.producer[v] >= 0 and len(g.shapes[v]) in (3, 4) and g.shapes[v][0] == 1
                and g.shapes[v][1] == seq and g.shapes[v][2] % width == 0
                and g.shapes[v][2] != hidden and "/block_" in g.scopes[g.producer[v]]]
  return program.pinned_state(layouts, "published layout")


def profile(traced, state, width: int, hw, fused: bool, context: int,
            params_count: int) -> Profile:
  """Layer costs at one sample per microbatch (scaled to others by `at`),
  keyed by the stage's devices (width x context)."""
  program = Program.build(traced, mesh_of(width, context), hw)
  graphs = layers_lib.layer_graphs({width * context: (program, state)}, params_count, fused)
  return Profile({1: graphs}, {}, {})


def candidates(row: dict) -> list[cluster.ClusterConfig]:
  """The row's split with every unpublished setting's choices."""
  p, m = row["parallel"], row["model"]
  t, pp = p["tensor"], p["pipeline"]
  group = None
  if hybrid(row):  # ZeRO 3 within each slice, its shards synced across slices
    d, zeros, group = p["fsdp"] * p["data"], (3,), p["fsdp"]
  elif (p.get("fsdp") or 1) > 1:  # FSDP over one slice: ZeRO 3 over its replicas
    d, zeros = p["fsdp"], (3,)
  else:
    d = p["data"] or row["devices"] // (t * pp * (p.get("context") or 1))
    zeros = (p["zero"],) if p.get("zero") is not None else (0, 1)
  per_replica = p["global_batch"] // d
  if p.get("microbatch"):
    sizes = (p["microbatch"],)
  elif (p.get("fsdp") or 1) > 1:  # MaxText: no gradient accumulation
    sizes = (per_replica,)
  else:
    sizes = tuple(b for b in MICROBATCHES if per_replica % b == 0)
  stated = p.get("recompute")  # a mode, modes a policy lies between, or unpublished
  modes = ((stated,) if isinstance(stated, str) else tuple(stated) if stated
           else ("none", "selective", "full"))
  if pp == 1 or p.get("schedule") == "1f1b":
    schedules = [("1f1b", 1)]
  elif p.get("virtual_stages"):
    schedules = [("interleaved", p["virtual_stages"])]
  else:
    woven = [("interleaved", v) for v in VIRTUAL if m["layers"] >= pp * v]
    schedules = woven if p.get("schedule") == "interleaved" else [("1f1b", 1), *woven]
  out = []
  for b in sizes:
    for mode in modes:
      for schedule, v in schedules:
        if schedule == "interleaved" and (per_replica // b) % pp:
          continue
        for z in zeros:
          out.append(cluster.ClusterConfig(tensor=t, pipeline=pp, data=d, microbatch=b,
                                           recompute=mode, schedule=schedule,
                                           virtual_stages=v, zero=z, shard_group=group,
                                           context=p.get("context") or 1))
  return out


def attention(row: dict) -> tuple[bool, ...]:
  """Whether attention runs fused, as the row or its source states it; both
  where they are silent."""
  if row["parallel"].get("fused_attention") is not None:
    return (row["parallel"]["fused_attention"],)
  if row["source"] in FUSED_ATTENTION:
    return (True,)
  return (False,) if row["source"] in UNFUSED_ATTENTION else (False, True)


def sequence_parallel(row: dict) -> tuple[bool, ...]:
  """Whether activations are split along the sequence (`SEQUENCE_PARALLEL`),
  as the source states it; both where it is silent. MaxText's split along
  the embedding (`EMBED_SHARDED`) stands in its place there. A row that
  states it (Korthikanti et al.'s pairs, one with and one without) is
  priced as it states."""
  if row["parallel"].get("sequence_parallel") is not None:
    return (bool(row["parallel"]["sequence_parallel"]),)
  if row["source"] in SEQUENCE_PARALLEL:
    return (True,)
  if row["source"] in WHOLE_SEQUENCE + EMBED_SHARDED or row["parallel"]["tensor"] == 1:
    return (False,)
  return (False, True)


def priced(row: dict, profiles: dict[tuple, Profile],
           hw) -> tuple[cluster.Placement, cluster.ClusterConfig, bool, tuple]:
  """The fastest candidate that fits (or the leanest, marked as not fitting),
  over the candidates and the layouts `profiles` price, keyed (attention
  fused, (sequence parallel, layout)): (plan, config, fits, key)."""
  depth = row["model"]["layers"]
  best, leanest = None, None
  for (key, prof), config in itertools.product(profiles.items(), candidates(row)):
    graph = prof.at(config.microbatch).repeat("block_1", depth - 1)
    try:
      plan = cluster.price_placement(
          graph, config, global_batch=row["parallel"]["global_batch"], hardware=hw,
          devices=max(row["devices"], config.devices), optimizer="adam",
          mixed_precision=True, overlap_tensor=row["source"] in OVERLAP_TENSOR,
          overlap=sync_overlapped(row))
    except PlacementError:
      continue
    memory = max(s.memory for s in plan.stages)
    if memory <= hw.hbm_capacity and (best is None or plan.time < best[0].time):
      best = (plan, config, True, key)
    if leanest is None or memory < leanest[1]:
      leanest = ((plan, config, False, key), memory)
  if best is None and leanest is None:
    raise PlacementError(f"{row['id']}: no candidate configuration prices")
  return best or leanest[0]


def planned(row: dict, prof: Profile, hw, bound: float) -> cluster.Placement | None:
  """The planner's own plan at the row's tensor width, on its devices and batch, hybrid
  sharding (ZeRO within a slice) among its choices as in the published runs."""
  p = row["parallel"]
  depth, batch = row["model"]["layers"], p["global_batch"]
  sizes = [b for b in MICROBATCHES if batch % b == 0]
  options = PlacementOptions(optimizer="adam", mixed_precision=True, virtual_stages=None,
                             widths=(p["tensor"],), hybrid=True,
                             overlap_tensor=row["source"] in OVERLAP_TENSOR)
  try:
    plan, _ = place_any([(prof.at(b).repeat("block_1", depth - 1), batch // b) for b in sizes],
                        devices=row["devices"], hardware=hw, options=options, bound=bound)
  except PlacementError:
    return None
  return plan


def describe(config: cluster.ClusterConfig, key: tuple[bool, tuple[bool, str]]) -> str:
  fused, (sequence, layout) = key
  woven = f" v{config.virtual_stages}" if config.schedule == "interleaved" else ""
  context = f" c{config.context}" if config.context > 1 else ""
  return (f"t{config.tensor}{context} p{config.pipeline} d{config.data} mb{config.microbatch} "
          f"{config.recompute}{woven} z{config.zero}"
          f"{'' if config.shard_group is None else f' in {config.shard_group}'}"
          f"{' flash' if fused else ''}"
          f"{' sp' if sequence else ''}"
          f"{'' if layout == 'published' else f' ({layout})'}")


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default="", help="price only rows whose id starts so")
  parser.add_argument("--fit", action="store_true",
                      help="fit matmul_efficiency per device on the training rows")
  parser.add_argument("--planner", action="store_true", help="also run the planner per row")
  parser.add_argument("--efficiency", type=float, default=None,
                      help="price every row at this matmul_efficiency (what-if)")
  parser.add_argument("--stated", action="store_true",
                      help="price sequence parallelism as price_cluster does when a user states "
                      "it (ClusterConfig(tensor=t, sequence_parallel=True)), not pinned")
  parser.add_argument("--episodes", type=int, default=200,
                      help="the sharding search's episodes per width with --stated")
  opts = parser.parse_args()
  rows, _ = load()
  held_out = validation(rows)
  grid = [round(0.5 + 0.05 * i, 2) for i in range(11)]
  results = []
  print("| row | split | device | as published (choices) | fits | memory GB | measured "
        "TFLOP/s | predicted | predicted / measured |" + (" planner / published |"
                                                            if opts.planner else ""))
  print("|---|---|---|---|---|---|---|---|---|" + ("---|" if opts.planner else ""))
  for row in rows:
    if not row["id"].startswith(opts.only):
      continue
    reason = unpriced(row)
    split = "validation" if row["id"] in held_out else "training"
    if reason:
      print(f"| {row['id']} | {split} | {row['hardware']} | not priced: {reason} |"
            + " |" * (6 + opts.planner))
      continue
    t0 = time.perf_counter()
    traced, count = traced_step(row)
    width = row["parallel"]["tensor"]
    hidden = row["model"]["hidden"]
    embed = "embed" if row["source"] in EMBED_SHARDED else ""
    context = row["parallel"].get("context") or 1
    # (sequence parallel, layout) -> (traced, state): the runs' own layout
    # pinned, or with --stated where the run split the sequence, the layouts
    # price_cluster prices for it.
    states = {}
    for sp in sequence_parallel(row):
      if opts.stated and sp and width > 1 and context == 1:
        states.update({(sp, name): found for name, found in
                       stated_states(row, hardware(row), opts.episodes).items()})
      else:
        states[(sp, "published")] = (traced, published_state(
            traced, count, width, hardware(row), hidden, "sequence" if sp else embed, context))
    flops = source_flops(row)
    keys = list(itertools.product(attention(row), states))
    measured = measured_flops(row)
    ratios = {}
    for eff in (grid if opts.fit and split == "training" and stack(row) == "jax" else []):
      plan, *_ = priced(row, {(f, k): profile(*states[k], width, hardware(row, eff), f,
                                              context, count)
                               for f, k in keys},
                        hardware(row, eff))
      ratios[eff] = flops / (plan.time * row["devices"]) / measured
    hw = hardware(row, opts.efficiency)
    profiles = {(f, k): profile(*states[k], width, hw, f, context, count) for f, k in keys}
    plan, config, fits, key = priced(row, profiles, hw)
    predicted = flops / (plan.time * row["devices"])
    memory = max(s.memory for s in plan.stages)
    cell = ""
    if opts.planner and context > 1:  # the planner does not split the sequence
      cell = " - |"
    elif opts.planner:
      own = planned(row, profiles[key], hw, bound=plan.time * 1.5)
      cell = f" {plan.time / own.time:.2f}x |" if own else " - |"
    print(f"| {row['id']} | {split} | {row['hardware']} | {describe(config, key)} | "
          f"{'yes' if fits else 'NO'} | {memory / 1e9:.1f} | {measured / 1e12:.0f} | "
          f"{predicted / 1e12:.0f} | {predicted / measured:.3f} |{cell}", flush=True)
    run = (row["source"], *(row["model"].get(k) for k in ("layers", "hidden", "heads", "seq")))
    results.append({"id": row["id"], "split": split, "hardware": row["hardware"], "run": run,
                    "stack": stack(row),
                    "ratio": predicted / measured, "fits": fits, "grid": ratios,
                    "seconds": time.perf_counter() - t0})
  print()
  for split in ("training", "validation"):
    for st in sorted({r["stack"] for r in results}):
      errors = [abs(r["ratio"] - 1) for r in results if r["split"] == split and r["stack"] == st]
      if errors:
        fit = sum(r["fits"] for r in results if r["split"] == split and r["stack"] == st)
        print(f"{split}, {st} stack: {len(errors)} rows, |predicted / measured - 1| median "
              f"{statistics.median(errors):.1%}, max {max(errors):.1%}; fit in memory "
              f"{fit}/{len(errors)}")
  for device in sorted({r["hardware"] for r in results}):
    errors = [abs(r["ratio"] - 1) for r in results
              if r["hardware"] == device and r["stack"] == "jax" and r["split"] == "validation"]
    if errors:
      print(f"{device}, JAX/XLA validation: {len(errors)} rows, median "
            f"{statistics.median(errors):.1%}, max {max(errors):.1%}")
  # Other stacks: their factor over the training rows, applied to the validation rows.
  for st in sorted({r["stack"] for r in results} - {"jax"}):
    for device in sorted({r["hardware"] for r in results if r["stack"] == st}):
      mine = [r for r in results if r["stack"] == st and r["hardware"] == device]
      train = [r["ratio"] for r in mine if r["split"] == "training"]
      if not train:
        continue
      factor = statistics.median(train)
      held = [abs(r["ratio"] / factor - 1) for r in mine if r["split"] == "validation"]
      print(f"stack {st} on {device}: factor {factor:.3f} (median predicted / measured over "
            f"{len(train)} training rows)" + (
                f"; validation with it: {len(held)} rows, median {statistics.median(held):.1%}, "
                f"max {max(held):.1%}" if held else ""))
  by_source: dict[str, list[float]] = {}
  for r in results:
    by_source.setdefault(r["id"].split("-")[0], []).append(abs(r["ratio"] - 1))
  print("by source: " + ", ".join(f"{k} median {statistics.median(v):.1%} ({len(v)})"
                                  for k, v in sorted(by_source.items())))
  if opts.fit:
    print()
    for device in sorted({r["hardware"] for r in results if r["grid"]}):
      rows_of = [r for r in results if r["hardware"] == device and r["grid"]]  # JAX/XLA
      # Only rows whose prediction moves with the constant can fit it: a row
      # bound by communication predicts the same at any matmul efficiency.
      fitted = [r for r in rows_of if r["grid"][grid[0]] / r["grid"][grid[-1]] < 0.9]
      runs = len({r["run"] for r in fitted})
      best = min(grid, key=lambda e: (statistics.median(abs(math.log(r["grid"][e]))
                                                        for r in fitted), -e)) if fitted else None
      if runs < MIN_FIT_RUNS:
        print(f"fit {device}: {len(fitted)} of its {len(rows_of)} training rows move with "
              f"matmul_efficiency (by 10% from {grid[0]} to {grid[-1]}), from {runs} runs, "
              f"fewer than {MIN_FIT_RUNS}; not fitted (its family's value stands"
              + (f"; they alone would give {best:.2f})" if best else ")"))
        continue
      print(f"fit {device}: matmul_efficiency {best:.2f} on {len(fitted)} of its "
            f"{len(rows_of)} training rows from {runs} runs (catalogue: "
            f"{calibration.MATMUL_EFFICIENCY.get(device)})")


if __name__ == "__main__":
  main()
