"""One process of a two-process run of a cluster plan (tests/cluster/execute/test_executor.py).

Usage: python multiprocess_step.py PROCESS_ID PORT. Each process has 4 CPU
devices; the plan is 2 stages of 2 tensor-parallel devices x 2 data-parallel
replicas, a replica per process. Prints "ok <loss error> <largest parameter error>" after 3 steps
against the unpipelined step run in this process alone.
"""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"localhost:{sys.argv[2]}", num_processes=2,
                           process_id=int(sys.argv[1]))

import numpy as np  # noqa: E402

here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(os.path.dirname(here))]  # the test module, tests/
import test_executor as t  # noqa: E402
from helpers import jitted_training  # noqa: E402

from automap import cluster  # noqa: E402

loss, params, batch = t.gpt_loss()
plan = cluster.price_cluster(loss, params, *batch, config=cluster.ClusterConfig(
    tensor=2, pipeline=2, data=2, microbatch=2, zero=1), global_batch=t.BATCH, hardware="cpu",
                             budget=t.BUDGET)
step = plan.train_step(loss, t.TX, params, *batch)
state, losses = step.init(params), []
for _ in range(3):
  state, value = step(state, *batch)
  losses.append(float(np.asarray(value.addressable_data(0))))
want_losses, want = jitted_training(loss, t.TX, params, batch, 3)
loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses))
param_error = 0.0
for got, ref in zip(jax.tree.leaves(step.params(state)), jax.tree.leaves(want)):
  for shard in got.addressable_shards:
    param_error = max(param_error, float(np.max(np.abs(
        np.asarray(shard.data) - np.asarray(ref)[shard.index]))))
assert step.executed == step.timetable.in_order()
print("ok", loss_error, param_error, flush=True)
