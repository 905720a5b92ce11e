"""Calibrated constants of the cost model: one place, with where they came from."""

from __future__ import annotations

import types

# MATMUL_EFFICIENCY: the share of a device's peak FLOP/s that large matmuls
# sustain in training, `Hardware.matmul_efficiency` of the catalogue's
# devices. Fitted by `python benchmarks/measured.py --fit` on the training
# split of `benchmarks/measured_runs.json` (published runs' measured
# throughput; the validation split, Narayanan et al. 2021's weak-scaling
# table among it, is never fitted): per device, the grid value (0.50 to
# 1.00 in steps of 0.05, the largest on ties) that minimises the median
# |log(predicted / measured)| over that device's training rows whose
# prediction moves with it (by 10% or more across the grid), where those
# rows come from at least three independent runs (one model measured at
# several scales is one run: its software stack is not the kernels'
# efficiency). Other devices take their family's (GPU or TPU) value, and CPU
# stays 1.0 (the `cpu` spec describes XLA:CPU as verified, not a measured
# machine).
#
# Fit of 2026-12-05, on JAX/XLA runs only (automap's constants describe XLA;
# runs of other stacks are priced with them and reported apart, their
# stack's factor stated): h100 0.75 on 16 rows from 7 runs (NVIDIA's
# dgxc-benchmarking MaxText and Paxml, JAX-Toolbox, MaxText on A3), the
# value the earlier fit on Megatron-Core's runs gave; tpu-v5p 0.80 as below.
# a100's 2 JAX/XLA runs are fewer than three: it keeps the GPU fit.
#
# Fit of 2026-12-03 (benchmarks/RESULTS.md, "Published training runs"):
# h100 0.75 on 7 rows from 7 runs (Megatron-Core 2024, priced with the
# sequence parallelism its --tp-comm-overlap requires; without it the
# layer norms and residual adds ran replicated over the tensor group, a
# cost the earlier fit of 1.00 absorbed), tpu-v5p 0.80 on 5 rows from 4
# runs (MaxText, with its runs' own layout, recompute policy and collective
# overlap priced as their scripts state). tpu-v5e's 2 rows come from 2
# runs, so tpu-v3, tpu-v4 and tpu-v5e take the TPU fit (0.80, the same
# 128x128 MXUs). a100's 3 moving rows come from 2 runs (MT-NLG at two
# scales, one ZeRO-3 run) and alone would give 0.60: a100 and h200 take
# the GPU fit (0.75). With it the validation split (never fitted: Narayanan
# et al.'s Table 1, BLOOM, an MT-NLG row among it) is within a median 6.5%
# and at most 16.8% of its measured throughput. The runs rule was written
# when the MT-NLG rows were added and first priced, before this fit.
#
# tpu-v6e, tpu7x, b200 and gb200 joined the catalogue with no measured runs
# in the set: the TPUs take the TPU fit (0.80), the GPUs the GPU fit (0.75),
# until runs of their own are fitted.
MATMUL_EFFICIENCY = types.MappingProxyType({
    "a100": 0.75,
    "h100": 0.75,
    "h200": 0.75,
    "b200": 0.75,
    "gb200": 0.75,
    "tpu-v3": 0.8,
    "tpu-v4": 0.8,
    "tpu-v5e": 0.8,
    "tpu-v5p": 0.8,
    "tpu-v6e": 0.8,
    "tpu7x": 0.8,
    "cpu": 1.0,
})
