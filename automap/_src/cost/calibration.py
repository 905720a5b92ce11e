"""Calibrated constants of the cost model: one place, with where they came from.

MATMUL_EFFICIENCY: the share of a device's peak FLOP/s that large matmuls
sustain in training, `Hardware.matmul_efficiency` of the catalogue's
devices. Fitted by `python benchmarks/measured.py --fit` on the training
split of `benchmarks/measured_runs.json` (published runs' measured
throughput; the validation split, Narayanan et al. 2021's weak-scaling
table among it, is never fitted): per device, the grid value (0.50 to
1.00 in steps of 0.05, the largest on ties) that minimises the median
|log(predicted / measured)| over that device's training rows whose
prediction moves with it (by 10% or more across the grid), where there
are at least three such rows. Other devices take their family's (GPU or
TPU) value, and CPU stays 1.0 (the `cpu` spec describes XLA:CPU as
verified, not a measured machine).

Fit of 2026-12-03 (benchmarks/RESULTS.md, "Published training runs"):
h100 1.00 on 7 rows (Megatron-Core 2024), tpu-v5p 1.00 on 5 (MaxText);
tpu-v5e has 2 rows and a100 1 (the other three a100 training rows, ZeRO-3
runs, are bound by communication), so a100, h200, tpu-v3, tpu-v4 and
tpu-v5e take their family's 1.00. With the one a100 row alone the grid's
floor (0.50) would win and the validation rows' error would grow (Table 1
of Narayanan et al. from a median 12.9% to 26.2%): the three-row rule
exists so that one row cannot set a device's constant. Every value is
1.00 today, h100's and tpu-v5p's at the grid's top: the constant is where
a device's sustained share of peak is learnt, and it changes no price yet.
"""

from __future__ import annotations

import types

MATMUL_EFFICIENCY = types.MappingProxyType({
    "a100": 1.0,
    "h100": 1.0,
    "h200": 1.0,
    "tpu-v3": 1.0,
    "tpu-v4": 1.0,
    "tpu-v5e": 1.0,
    "tpu-v5p": 1.0,
    "cpu": 1.0,
})
