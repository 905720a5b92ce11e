"""Calibrated constants of the cost model: one place, with where they came from.

MATMUL_EFFICIENCY: the share of a device's peak FLOP/s that large matmuls
sustain in training, `Hardware.matmul_efficiency` of the catalogue's
devices. Fitted by `python benchmarks/measured.py --fit` on the training
split of `benchmarks/measured_runs.json` (published runs' measured
throughput; the validation split, Narayanan et al. 2021's weak-scaling
table among it, is never fitted): per device, the grid value (0.50 to
1.00 in steps of 0.05, the largest on ties) that minimises the median
|log(predicted / measured)| over that device's training rows whose
prediction moves with it (by 10% or more across the grid), where those
rows come from at least three independent runs (one model measured at
several scales is one run: its software stack is not the kernels'
efficiency). Other devices take their family's (GPU or TPU) value, and CPU
stays 1.0 (the `cpu` spec describes XLA:CPU as verified, not a measured
machine).

Fit of 2026-12-03 (benchmarks/RESULTS.md, "Published training runs"):
h100 1.00 on 7 rows from 7 runs (Megatron-Core 2024), tpu-v5p 0.80 on 5
rows from 4 runs (MaxText, with its runs' own layout, recompute policy and
collective overlap priced as their scripts state). tpu-v5e's 2 rows come
from 2 runs, so tpu-v3, tpu-v4 and tpu-v5e take the TPU fit (0.80, the
same 128x128 MXUs). a100's 3 moving rows come from 2 runs (MT-NLG at two
scales, one ZeRO-3 run) and alone would give 0.60: a100 and h200 take the
GPU fit (1.00). MT-NLG's runs measured 113-126 TFLOP/s where Narayanan et
al.'s run of the same shape and split on the same machines measured 163,
a gap the cost model prices at 7% (1F1B against the interleaved schedule):
what separates them is outside the kernels (DeepSpeed's pipeline engine
against Megatron-LM's), and a kernel constant fitted to it would carry it
into every a100 price. The runs rule was written when the MT-NLG rows were
added and first priced; under the rows rule before it a100 would be 0.60
(Table 1 of Narayanan et al. priced at 0.60: median error 19.1%, against
11.1% at 1.00).
"""

from __future__ import annotations

import types

MATMUL_EFFICIENCY = types.MappingProxyType({
    "a100": 1.0,
    "h100": 1.0,
    "h200": 1.0,
    "tpu-v3": 0.8,
    "tpu-v4": 0.8,
    "tpu-v5e": 0.8,
    "tpu-v5p": 0.8,
    "cpu": 1.0,
})
