"""The compiled program as referee: judge any layout by what XLA compiles.

automap's figures are predictions; this module reads the compiled program
itself, the same way for every layout, so a plan can be set beside layouts
written by hand on ground neither side chose: `compile_plan` compiles a
plan, `compile_layout` a layout given as argument shardings alone (XLA
propagates the rest, as `jax.jit(in_shardings=...)` does), `expert_specs`
writes the usual experts (data parallelism, Megatron + data parallelism,
FSDP) for a step, and `referee` reads a compiled program's time and peak
memory. `collectives`, `summarize`, `compiled_memory`,
`compiled_host_memory` and `compiled_seconds` (the backend's own time
estimate: XLA:TPU's `optimal_seconds`) read the compiled program on their
own, as `automap.verify` reads it; on a TPU slice from `automap.tpu_mesh`
they read XLA:TPU's compile.

```python
experts, traced = automap.referee.expert_specs(step, mesh, automap.HARDWARE["tpu-v4"])
specs, predicted, _ = experts["FSDP"]
compiled = automap.referee.compile_layout(traced, mesh, specs, step.args)
judged = automap.referee.referee(compiled, mesh, automap.HARDWARE["tpu-v4"])
```
"""

from automap._src.run.compiled import Collective as Collective
from automap._src.run.compiled import collectives as collectives
from automap._src.run.compiled import compiled_host_memory as compiled_host_memory
from automap._src.run.compiled import compiled_memory as compiled_memory
from automap._src.run.compiled import compiled_seconds as compiled_seconds
from automap._src.run.compiled import summarize as summarize
from automap._src.run.referee import compile_layout as compile_layout
from automap._src.run.referee import compile_plan as compile_plan
from automap._src.run.referee import expert_specs as expert_specs
from automap._src.run.referee import referee as referee

__all__ = (
    "Collective",
    "collectives",
    "compile_layout",
    "compile_plan",
    "compiled_host_memory",
    "compiled_memory",
    "compiled_seconds",
    "expert_specs",
    "referee",
    "summarize",
)
