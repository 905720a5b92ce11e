"""Every public function and class says what it takes, returns and raises.

The API reference (docs/api/) is generated from these docstrings, Google
style: a function has `Args:` (where it takes any), `Returns:`, and
`Raises:` where its body raises; a class `Args:` or `Attributes:`.
Exceptions and warnings are documented by their one line.
"""

import ast
import importlib
import inspect
import textwrap

import pytest

PUBLIC = ("automap", "automap.cluster", "automap.policy", "automap.referee", "automap.zoo")


def _public():
  for module_name in PUBLIC:
    try:
      module = importlib.import_module(module_name)
    except ImportError:
      continue
    for name in module.__all__:
      obj = getattr(module, name)
      if inspect.isfunction(obj) or inspect.isclass(obj):
        yield f"{module_name}.{name}", obj


def _raises(fn) -> bool:
  """Whether `fn`'s own body holds a `raise`."""
  tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
  return any(isinstance(node, ast.Raise) for node in ast.walk(tree))


def _takes_arguments(fn) -> bool:
  params = list(inspect.signature(fn).parameters.values())
  return bool(params[1:] if params and params[0].name in ("self", "cls") else params)


@pytest.mark.parametrize("name,obj", list(_public()), ids=lambda x: x if isinstance(x, str)
                         else "")
def test_public_names_document_their_arguments_results_and_errors(name, obj):
  doc = inspect.getdoc(obj) or ""
  assert doc, f"{name} has no docstring"
  if inspect.isclass(obj):
    if issubclass(obj, (Exception, Warning)):
      return
    assert "Args:" in doc or "Attributes:" in doc, f"{name}: no Args: or Attributes:"
    return
  if _takes_arguments(obj):
    assert "Args:" in doc, f"{name}: no Args:"
  assert "Returns:" in doc, f"{name}: no Returns:"
  if _raises(obj):
    assert "Raises:" in doc, f"{name}: no Raises:"
