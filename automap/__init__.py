"""automap: automatic partitioning of JAX programs."""

from automap._src.api import Partitioned as Partitioned
from automap._src.api import evaluate as evaluate
from automap._src.api import partition as partition
from automap._src.api import search as search
from automap._src.api import verify as verify
from automap._src.cluster.accelerator import AREA_BUDGET as AREA_BUDGET
from automap._src.cluster.accelerator import TPU_V4_LIKE as TPU_V4_LIKE
from automap._src.cluster.accelerator import Accelerator as Accelerator
from automap._src.cluster.accelerator import AcceleratorError as AcceleratorError
from automap._src.cluster.configured import ClusterConfig as ClusterConfig
from automap._src.cluster.configured import price as price_placement
from automap._src.cluster.cosearch import AcceleratorPlan as AcceleratorPlan
from automap._src.cluster.cosearch import search_accelerator as search_accelerator
from automap._src.cluster.model import Layer as Layer
from automap._src.cluster.model import LayerCost as LayerCost
from automap._src.cluster.model import LayerGraph as LayerGraph
from automap._src.cluster.model import Placement as Placement
from automap._src.cluster.model import PlacementError as PlacementError
from automap._src.cluster.model import Stage as Stage
from automap._src.cluster.options import ClusterOptions as ClusterOptions
from automap._src.cluster.options import CoSearchOptions as CoSearchOptions
from automap._src.cluster.options import PlacementOptions as PlacementOptions
from automap._src.cluster.passes import Workload as Workload
from automap._src.cluster.pipeline import PipelineError as PipelineError
from automap._src.cluster.pipeline import pipelined as pipelined
from automap._src.cluster.pipeline import pipelined_loss as pipelined_loss
from automap._src.cluster.placement import place as place
from automap._src.cluster.plan import ClusterPlan as ClusterPlan
from automap._src.cluster.plan import plan_cluster as plan_cluster
from automap._src.cluster.plan import price_cluster as price_cluster
from automap._src.cost.hardware import CATALOGUE as HARDWARE
from automap._src.cost.hardware import Hardware as Hardware
from automap._src.cost.hardware import HardwareError as HardwareError
from automap._src.cost.model import Cost as Cost
from automap._src.ir.errors import ArgumentError as ArgumentError
from automap._src.ir.graph import UnknownPrimitiveWarning as UnknownPrimitiveWarning
from automap._src.ir.groups import GroupError as GroupError
from automap._src.plan.cache import PlanCacheWarning as PlanCacheWarning
from automap._src.plan.errors import PlanError as PlanError
from automap._src.plan.export import LogicalRules as LogicalRules
from automap._src.plan.export import shard_like as shard_like
from automap._src.plan.plan import Plan as Plan
from automap._src.run.verify import Report as Report
from automap._src.search.request import Budget as Budget
from automap._src.search.request import Hints as Hints
from automap._src.search.request import MemoryLimitError as MemoryLimitError
from automap._src.search.request import SearchOptions as SearchOptions
from automap._src.search.request import SearchWarning as SearchWarning
from automap._src.sharding.annotations import LayoutError as LayoutError
from automap._src.sharding.annotations import LayoutWarning as LayoutWarning
from automap._src.sharding.mesh import MeshError as MeshError

__version__ = "0.1.0"

__all__ = (
    "AREA_BUDGET",
    "Accelerator",
    "AcceleratorError",
    "AcceleratorPlan",
    "ArgumentError",
    "LayoutError",
    "LayoutWarning",
    "Budget",
    "ClusterConfig",
    "ClusterOptions",
    "ClusterPlan",
    "CoSearchOptions",
    "Cost",
    "GroupError",
    "HARDWARE",
    "Hardware",
    "HardwareError",
    "Hints",
    "Layer",
    "LayerCost",
    "LayerGraph",
    "LogicalRules",
    "MemoryLimitError",
    "MeshError",
    "Partitioned",
    "PipelineError",
    "Placement",
    "PlacementError",
    "PlacementOptions",
    "Plan",
    "PlanCacheWarning",
    "PlanError",
    "Report",
    "SearchOptions",
    "SearchWarning",
    "Stage",
    "TPU_V4_LIKE",
    "UnknownPrimitiveWarning",
    "Workload",
    "evaluate",
    "partition",
    "pipelined",
    "pipelined_loss",
    "place",
    "plan_cluster",
    "price_cluster",
    "price_placement",
    "search",
    "search_accelerator",
    "shard_like",
    "verify",
)
