"""The error of arguments automap cannot take as given."""


class ArgumentError(TypeError):
  """An argument leaf automap can neither trace nor hold static, or a
  statement about the arguments (names, layouts) that does not fit them."""
