"""The program zoo: train steps and losses of several model families, to try
automap on before your own model, and to compare with.

Builders return `(step, args)`: a train step `step(*args)` (Adam or AdamW;
parameters, optimizer state and data in, the same plus the loss out) and
its arguments. Most take `jax.ShapeDtypeStruct`s, so any size can be
planned without allocating it (`materialize` makes small ones concrete);
`gpt_step`, `gpt_loss`, `llama_loss` and `encoder_decoder_loss` are concrete and small
enough to compile in seconds. The tests and benchmarks run on these.

```python
import automap.zoo

step, args = automap.zoo.gpt(layers=12)
mesh = jax.sharding.AbstractMesh((4, 2), ("data", "model"))
plan = automap.search(step, *args, mesh=mesh)
```
"""

from automap._src.models.gpt import GPT as GPT
from automap._src.models.gpt import GPTConfig as GPTConfig
from automap._src.models.gpt import make_train_step as gpt_train_step
from automap._src.models.gpt import megatron_specs as megatron_specs
from automap._src.models.llama import LlamaConfig as LlamaConfig
from automap._src.models.llama import param_specs as llama_param_specs
from automap._src.models.llama import train_step as llama_train_step
from automap._src.models.moe import capacity as moe_capacity
from automap._src.models.moe import make_train_step as moe_train_step
from automap._src.models.zoo import catalogue as catalogue
from automap._src.models.zoo import encoder_decoder as encoder_decoder
from automap._src.models.zoo import encoder_decoder_loss as encoder_decoder_loss
from automap._src.models.zoo import gpt as gpt
from automap._src.models.zoo import gpt_loss as gpt_loss
from automap._src.models.zoo import gpt_step as gpt_step
from automap._src.models.zoo import graph_network as graph_network
from automap._src.models.zoo import llama_loss as llama_loss
from automap._src.models.zoo import loss_and_grads as loss_and_grads
from automap._src.models.zoo import materialize as materialize
from automap._src.models.zoo import mlp as mlp
from automap._src.models.zoo import moe as moe
from automap._src.models.zoo import moe_layers as moe_layers
from automap._src.models.zoo import small as small
from automap._src.models.zoo import ssm as ssm
from automap._src.models.zoo import vit as vit

__all__ = (
    "GPT",
    "GPTConfig",
    "LlamaConfig",
    "catalogue",
    "encoder_decoder",
    "encoder_decoder_loss",
    "gpt",
    "gpt_loss",
    "gpt_step",
    "gpt_train_step",
    "graph_network",
    "llama_loss",
    "llama_param_specs",
    "llama_train_step",
    "loss_and_grads",
    "materialize",
    "megatron_specs",
    "mlp",
    "moe",
    "moe_capacity",
    "moe_layers",
    "moe_train_step",
    "small",
    "ssm",
    "vit",
)
