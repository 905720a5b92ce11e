"""The learned filter behind the search's default priors: load weights, or
train new ones with `python -m automap.policy.train`."""

from automap._src.search.policy.features import SCHEMA
from automap._src.search.policy.learned import DEFAULT_WEIGHTS, LearnedPolicy, PolicyWarning, load

__all__ = ["DEFAULT_WEIGHTS", "SCHEMA", "LearnedPolicy", "PolicyWarning", "load"]
