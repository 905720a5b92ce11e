"""The error of cluster plans that cannot be made, priced or run."""


class PlacementError(ValueError):
  """A layer graph or placement option that cannot be planned."""


__all__ = ["PlacementError"]
