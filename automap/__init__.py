"""automap: automatic partitioning of JAX programs."""

import warnings as _warnings

from automap import cluster as cluster
from automap._src.api import evaluate as evaluate
from automap._src.api import search as search
from automap._src.api import verify as verify
from automap._src.cost.hardware import CATALOGUE as HARDWARE
from automap._src.cost.hardware import Hardware as Hardware
from automap._src.cost.hardware import HardwareError as HardwareError
from automap._src.cost.hardware import hardware_for_devices as hardware_for_devices
from automap._src.cost.model import Cost as Cost
from automap._src.ir.declared import RuleError as RuleError
from automap._src.ir.declared import declare as declare_rule
from automap._src.ir.errors import ArgumentError as ArgumentError
from automap._src.ir.graph import UnknownPrimitiveWarning as UnknownPrimitiveWarning
from automap._src.ir.groups import GroupError as GroupError
from automap._src.partitioned import Partitioned as Partitioned
from automap._src.partitioned import partition as partition
from automap._src.plan.cache import PlanCacheWarning as PlanCacheWarning
from automap._src.plan.errors import PlanError as PlanError
from automap._src.plan.export import LogicalRules as LogicalRules
from automap._src.plan.export import shard_like as shard_like
from automap._src.plan.plan import Plan as Plan
from automap._src.run.check import Check as Check
from automap._src.run.check import check as check
from automap._src.run.verify import Report as Report
from automap._src.search.request import Budget as Budget
from automap._src.search.request import Hints as Hints
from automap._src.search.request import MemoryLimitError as MemoryLimitError
from automap._src.search.request import SearchOptions as SearchOptions
from automap._src.search.request import SearchWarning as SearchWarning
from automap._src.sharding.annotations import LayoutError as LayoutError
from automap._src.sharding.annotations import LayoutWarning as LayoutWarning
from automap._src.sharding.mesh import MeshError as MeshError
from automap._src.sharding.topology import TopologyError as TopologyError
from automap._src.sharding.topology import TpuSlice as TpuSlice
from automap._src.sharding.topology import parse_slice as parse_slice
from automap._src.sharding.topology import tpu_mesh as tpu_mesh

__version__ = "0.1.0"

# Cluster planning's names, once at the top level: still served, with a
# DeprecationWarning naming their home in `automap.cluster`.
_MOVED = frozenset(cluster.__all__)


def __getattr__(name: str):
  if name in _MOVED:
    _warnings.warn(
        f"automap.{name} moved to automap.cluster.{name}; the top-level name will be "
        "removed in a later release.", DeprecationWarning, stacklevel=2)
    return getattr(cluster, name)
  raise AttributeError(f"module 'automap' has no attribute {name!r}")

__all__ = (
    "cluster",
    "ArgumentError",
    "LayoutError",
    "LayoutWarning",
    "Budget",
    "Check",
    "Cost",
    "GroupError",
    "HARDWARE",
    "Hardware",
    "HardwareError",
    "Hints",
    "LogicalRules",
    "MemoryLimitError",
    "MeshError",
    "Partitioned",
    "Plan",
    "PlanCacheWarning",
    "PlanError",
    "Report",
    "RuleError",
    "SearchOptions",
    "SearchWarning",
    "TopologyError",
    "TpuSlice",
    "UnknownPrimitiveWarning",
    "check",
    "declare_rule",
    "evaluate",
    "hardware_for_devices",
    "parse_slice",
    "partition",
    "search",
    "shard_like",
    "tpu_mesh",
    "verify",
)
