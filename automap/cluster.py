"""Cluster planning: pipeline stages, tensor/data parallel widths, ZeRO,
microbatches and recompute for a whole cluster, and the accelerator
co-search around it."""

from automap._src.cluster.accelerator.chip import AREA_BUDGET as AREA_BUDGET
from automap._src.cluster.accelerator.chip import TPU_V4_LIKE as TPU_V4_LIKE
from automap._src.cluster.accelerator.chip import Accelerator as Accelerator
from automap._src.cluster.accelerator.chip import AcceleratorError as AcceleratorError
from automap._src.cluster.accelerator.cosearch import AcceleratorPlan as AcceleratorPlan
from automap._src.cluster.accelerator.cosearch import search_accelerator as search_accelerator
from automap._src.cluster.accelerator.options import CoSearchOptions as CoSearchOptions
from automap._src.cluster.accelerator.passes import Workload as Workload
from automap._src.cluster.cluster_plan import ClusterPlan as ClusterPlan
from automap._src.cluster.cluster_plan import ReplicatedWeightsWarning as ReplicatedWeightsWarning
from automap._src.cluster.cluster_plan import plan_cluster as plan_cluster
from automap._src.cluster.cluster_plan import price_cluster as price_cluster
from automap._src.cluster.errors import PlacementError as PlacementError
from automap._src.cluster.execute.executor import PipelineState as PipelineState
from automap._src.cluster.execute.executor import PipelineStep as PipelineStep
from automap._src.cluster.execute.pipeline import PipelineError as PipelineError
from automap._src.cluster.execute.pipeline import pipelined as pipelined
from automap._src.cluster.execute.pipeline import pipelined_loss as pipelined_loss
from automap._src.cluster.execute.stage_compile import ProgramCompile as ProgramCompile
from automap._src.cluster.execute.stage_compile import StageCompile as StageCompile
from automap._src.cluster.placement.configured import ClusterConfig as ClusterConfig
from automap._src.cluster.placement.configured import price as price_placement
from automap._src.cluster.placement.dp import place as place
from automap._src.cluster.placement.options import ClusterOptions as ClusterOptions
from automap._src.cluster.placement.options import PlacementOptions as PlacementOptions
from automap._src.cluster.placement.placed import Placement as Placement
from automap._src.cluster.placement.placed import Stage as Stage
from automap._src.cluster.profile.layer_graph import Layer as Layer
from automap._src.cluster.profile.layer_graph import LayerCost as LayerCost
from automap._src.cluster.profile.layer_graph import LayerGraph as LayerGraph
from automap._src.cluster.profile.layer_graph import Shared as Shared
from automap._src.cluster.schedule.schedules import Schedule as Schedule
from automap._src.cluster.schedule.schedules import get as get_schedule
from automap._src.cluster.schedule.schedules import names as schedule_names
from automap._src.cluster.schedule.schedules import register as register_schedule
from automap._src.cluster.schedule.schedules import unregister as unregister_schedule
from automap._src.cluster.schedule.timetable import Timetable as Timetable
from automap._src.cluster.schedule.timetable import timetable as timetable

__all__ = (
    "AREA_BUDGET",
    "Accelerator",
    "AcceleratorError",
    "AcceleratorPlan",
    "ClusterConfig",
    "ClusterOptions",
    "ClusterPlan",
    "CoSearchOptions",
    "Layer",
    "LayerCost",
    "LayerGraph",
    "PipelineError",
    "PipelineState",
    "PipelineStep",
    "Placement",
    "PlacementError",
    "PlacementOptions",
    "ProgramCompile",
    "ReplicatedWeightsWarning",
    "Schedule",
    "Shared",
    "Stage",
    "StageCompile",
    "TPU_V4_LIKE",
    "Timetable",
    "Workload",
    "get_schedule",
    "pipelined",
    "pipelined_loss",
    "place",
    "plan_cluster",
    "price_cluster",
    "price_placement",
    "register_schedule",
    "schedule_names",
    "search_accelerator",
    "timetable",
    "unregister_schedule",
)
