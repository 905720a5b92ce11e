"""The error of plans that cannot be read or do not fit a program."""


class PlanError(ValueError):
  """A plan file that cannot be read or does not fit the program."""
