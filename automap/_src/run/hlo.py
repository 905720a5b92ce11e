"""HLO text as XLA prints a compiled module: computations, their
instructions, and how often each computation runs per call.

Enough of the grammar for reading what a backend compiled (`as_text()` of a
`jax.stages.Compiled`): instruction names, result shapes (tuples nested),
opcodes, operands and the computations an instruction calls (fusions,
while bodies and conditions, async wrappers, reductions, branches).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

import numpy as np

_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_ARRAY = re.compile(r"([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_CALLED = re.compile(
    r"\b(calls|body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_KNOWN_TRIPS = re.compile(r'"known_trip_count":\{"n":"([0-9]+)"')
_COMMENT = re.compile(r"/\*.*?\*/")
DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
               "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8,
               "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
               "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1}


@dataclasses.dataclass(frozen=True)
class Instruction:
  """One instruction of a computation.

  Attributes:
    name: its name, without the `%`.
    shape: its result shape as printed (a tuple in parentheses, or an array
      such as `bf16[64,4096]{1,0:T(8,128)(2,1)}`).
    opcode: e.g. "all-gather-start", "fusion", "while".
    operands: the names of its operands, in order.
    attributes: the text after its operands (replica groups, calls, ...).
    root: whether it is its computation's ROOT.
    line: the instruction's text, stripped.
  """

  name: str
  shape: str
  opcode: str
  operands: tuple[str, ...]
  attributes: str
  root: bool = False
  line: str = ""


def _balanced(text: str, start: int) -> int:
  """The index just past the bracket group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    c = text[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth == 0:
        return i + 1
  return len(text)


def tuple_elements(shape: str) -> list[str]:
  """The top-level elements of a tuple shape; [shape] for an array."""
  shape = _COMMENT.sub("", shape).strip()
  if not shape.startswith("("):
    return [shape]
  inner, out, depth, begin = shape[1:_balanced(shape, 0) - 1], [], 0, 0
  for i, c in enumerate(inner):
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    elif c == "," and depth == 0:
      out.append(inner[begin:i].strip())
      begin = i + 1
  out.append(inner[begin:].strip())
  return [e for e in out if e]


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """(dtype, dims) of every array in a shape, tuples flattened."""
  found = []
  for dtype, dims in _ARRAY.findall(_COMMENT.sub("", shape)):
    found.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
  return found


def shape_bytes(shape: str) -> int:
  """Bytes of every array in a shape (4 per element of an unknown dtype)."""
  return int(sum(int(np.prod(dims, dtype=np.int64)) * DTYPE_BYTES.get(dtype, 4)
                 for dtype, dims in arrays(shape)))


def parse_instruction(line: str) -> Instruction | None:
  """An instruction line parsed; None for anything else."""
  m = _INSTRUCTION.match(line)
  if not m or m.group(2).startswith("//"):
    return None
  rest = m.group(3)
  if rest.startswith("("):
    end = _balanced(rest, 0)
  else:
    end = rest.find(" ")
    end = len(rest) if end < 0 else end
    # An array's layout may hold spaces only inside its braces.
    brace = rest.find("{")
    if 0 <= brace < end:
      end = _balanced(rest, brace)
  shape, rest = rest[:end], rest[end:].lstrip()
  paren = rest.find("(")
  if paren < 0:
    return None
  opcode = rest[:paren].strip()
  close = _balanced(rest, paren)
  operands = tuple(re.findall(r"%([\w.\-]+)", rest[paren:close]))
  return Instruction(m.group(2), shape, opcode, operands, rest[close:], bool(m.group(1)),
                     line.strip())


@dataclasses.dataclass(frozen=True)
class Module:
  """A compiled module's text, parsed.

  Attributes:
    computations: {computation name: its instructions, in order}.
    entry: the entry computation's name.
  """

  computations: dict[str, tuple[Instruction, ...]]
  entry: str

  @classmethod
  def parse(cls, text: str) -> Module:
    computations: dict[str, list[Instruction]] = {}
    current, entry = "", ""
    for line in text.splitlines():
      header = _HEADER.match(line)
      if header and not line.startswith(" "):
        current = header.group(1)
        computations.setdefault(current, [])
        if line.startswith("ENTRY"):
          entry = current
        continue
      instruction = parse_instruction(line)
      if instruction is not None:
        computations.setdefault(current, []).append(instruction)
    return cls({k: tuple(v) for k, v in computations.items()}, entry)

  def instructions(self) -> Iterator[tuple[str, Instruction]]:
    """(computation, instruction) of every instruction, in text order."""
    for name, body in self.computations.items():
      for instruction in body:
        yield name, instruction

  def by_name(self, computation: str) -> dict[str, Instruction]:
    return {i.name: i for i in self.computations.get(computation, ())}

  def root(self, computation: str) -> Instruction | None:
    body = self.computations.get(computation, ())
    return next((i for i in body if i.root), body[-1] if body else None)

  def users(self, computation: str, name: str) -> list[Instruction]:
    """The instructions of `computation` that read `name`."""
    return [i for i in self.computations.get(computation, ()) if name in i.operands]

  def callers(self) -> dict[str, tuple[str, Instruction]]:
    """{called computation: (its caller's computation, the calling
    instruction)}; where several call it, the first in text order."""
    out: dict[str, tuple[str, Instruction]] = {}
    for computation, instruction in self.instructions():
      for called in called_computations(instruction):
        out.setdefault(called, (computation, instruction))
    return out

  def trip_count(self, loop: Instruction) -> int | None:
    """Times a while loop runs its body: XLA's `known_trip_count` where the
    backend records it (XLA:CPU, XLA:GPU); else read off its condition, a
    compare of the induction variable with a constant (as jax's scan and
    fori_loop lower, counting up from 0 in steps of 1: XLA:TPU records no
    trip count). None where neither says."""
    known = _KNOWN_TRIPS.search(loop.attributes)
    if known:
      return int(known.group(1))
    condition = re.search(r"\bcondition=%?([\w.\-]+)", loop.attributes)
    if not condition:
      return None
    body = self.by_name(condition.group(1))
    root = self.root(condition.group(1))
    if root is None or root.opcode != "compare":
      return None
    direction = re.search(r"direction=(\w+)", root.attributes)
    constants = [body[o] for o in root.operands if o in body and body[o].opcode == "constant"]
    if len(constants) != 1 or not direction:
      return None
    value = re.search(r"constant\((-?[0-9]+)\)", constants[0].line)
    if not value:
      return None
    n = int(value.group(1))
    constant_first = root.operands[0] == constants[0].name
    bound = {"LT": n, "LE": n + 1, "GT": n, "GE": n + 1}.get(direction.group(1))
    if bound is None or constant_first != (direction.group(1) in ("GT", "GE")):
      return None  # Not "i < n": counting down, or a loop jax does not emit.
    return max(bound, 0)

  def runs(self) -> dict[str, int]:
    """{computation: times it runs per call of the entry}: while bodies and
    conditions their loops' trip counts (1 where unknown), nested loops
    multiplied; a computation called from several places counts its first
    caller's."""
    callers = self.callers()
    memo: dict[str, int] = {}

    def runs(name: str, seen: frozenset[str]) -> int:
      if name in memo:
        return memo[name]
      if name not in callers or name in seen:
        return 1
      caller, instruction = callers[name]
      n = runs(caller, seen | {name})
      if instruction.opcode == "while":
        n *= self.trip_count(instruction) or 1
      memo[name] = n
      return n
    return {name: runs(name, frozenset()) for name in self.computations}


def called_computations(instruction: Instruction) -> list[str]:
  """The computations an instruction calls."""
  called = [m.group(2) for m in _CALLED.finditer(instruction.attributes)]
  for group in _BRANCHES.findall(instruction.attributes):
    called += re.findall(r"%?([\w.\-]+)", group)
  return called


__all__ = ["DTYPE_BYTES", "Instruction", "Module", "arrays", "called_computations",
           "parse_instruction", "shape_bytes", "tuple_elements"]
