"""The `automap` command line: demo, search, check, explain, bench.

Exit codes: 0 success; 1 the work itself failed (no plan meets the memory
limit, the user's function raised, a demo check failed, `check`'s layout
does not fit); 2 bad arguments or files.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys
import textwrap

_AXES = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "model")}
_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class UsageError(Exception):
  """A bad argument found after parsing: reported with exit code 2."""


def _sizes(text: str, flag: str = "--mesh", count: tuple[int, ...] = (1, 2, 3)
           ) -> tuple[int, ...]:
  try:
    sizes = tuple(int(x) for x in text.split(","))
  except ValueError:
    sizes = ()
  if len(sizes) not in count or any(s < 1 for s in sizes):
    want = " or ".join(f"{n} positive sizes" for n in count)
    example = {1: "8", 2: "4,2", 3: "2,2,2"}
    raise argparse.ArgumentTypeError(
        f"{flag} takes {want} separated by commas, like "
        f"{' or '.join(example[n] for n in count)}, got {text!r}")
  return sizes


def _demo_mesh(text: str) -> tuple[int, ...]:
  try:
    return _sizes(text, count=(2,))
  except argparse.ArgumentTypeError:
    raise argparse.ArgumentTypeError(
        f"--mesh takes two sizes like 4,2 (data, model), got {text!r}") from None


def _bytes(text: str) -> float | str | None:
  if text.strip().lower() in ("device", "none"):
    return None if text.strip().lower() == "none" else "device"
  m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", text)
  unit = m and _UNITS.get(m.group(2).lower())
  try:
    value = float(m.group(1)) * unit if unit else None
  except ValueError:
    value = None
  if not value or value <= 0:
    raise argparse.ArgumentTypeError(
        f"--memory-limit takes a positive size in bytes, like 16GiB, 800MB or "
        f"1.5e9, 'device' (the hardware's capacity) or 'none', got {text!r}")
  return value


def _positive(kind):
  def parse(text: str):
    try:
      value = kind(text)
    except ValueError:
      value = None
    if value is None or value <= 0:
      raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value
  return parse


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="automap", formatter_class=argparse.RawDescriptionHelpFormatter,
      description="Automatic partitioning of JAX programs.",
      epilog=textwrap.dedent("""\
          examples:
            automap demo                             a GPT step on 8 simulated CPU devices
            automap search mymodel:make_step --mesh 4,2 --out plan.json
            automap check mymodel:make_step --topology v5p-512 --mesh 32,8
            automap explain plan.json --plot plan.png
            automap bench --layers 8 --hidden 1024
          """))
  sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
  demo = sub.add_parser(
      "demo", help="partition a GPT training step on simulated CPU devices and "
      "compare the plan with Megatron + data parallelism",
      description="Partitions a GPT training step on simulated CPU devices, "
      "prints the plan beside Megatron + data parallelism, runs one step and "
      "checks numerics and compiled collectives.")
  _model_args(demo, layers=4)
  demo.add_argument("--mesh", type=_demo_mesh, default=(4, 2),
                    help="data,model mesh sizes (default 4,2)")
  demo.add_argument("--hardware", default="tpu-v4",
                    help="hardware whose costs the plan optimises (default tpu-v4)")
  demo.add_argument("--seconds", type=_positive(float), default=60.0,
                    help="search budget in seconds (default 60)")

  search = sub.add_parser(
      "search", help="plan a function of yours and print (and save) the plan",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description=textwrap.dedent("""\
          Plans FN without running it. TARGET is MODULE:FN, MODULE a module
          name importable from the current folder or a path to a .py file.
          FN() returns (fn, args): the function to partition and a tuple of
          its example arguments, whose leaves may be jax.ShapeDtypeStructs.
          """))
  search.add_argument("target", metavar="MODULE:FN")
  where = search.add_mutually_exclusive_group()
  where.add_argument("--mesh", type=_sizes, default=None,
                     help="mesh axis sizes, 1 to 3 of them (default 4,2)")
  where.add_argument("--devices", type=_positive(int),
                     help="a device count: try every 1-3 axis mesh of it, keep the best")
  search.add_argument("--axes", help="mesh axis names, comma separated (default "
                      "data / data,model / data,fsdp,model)")
  search.add_argument("--hardware", default="tpu-v4", help="default tpu-v4")
  search.add_argument("--episodes", type=_positive(int), default=200,
                      help="MCTS episodes (default 200)")
  search.add_argument("--seconds", type=_positive(float), default=60.0,
                      help="search budget in seconds (default 60)")
  search.add_argument("--memory-limit", type=_bytes, metavar="BYTES", default="device",
                      help="per device, e.g. 16GiB; 'none' for no limit (default: the "
                      "hardware's memory capacity)")
  search.add_argument("--time-tolerance", type=float, default=0.01, metavar="FRACTION",
                      help="within this fraction of the fastest step time, keep the plan "
                      "of least peak memory (default 0.01)")
  search.add_argument("--group", action="append", default=[], metavar="PATTERN",
                      help="name pattern of repeated layers sharing one decision, "
                      "e.g. 'block_*' (repeatable)")
  search.add_argument("--search", choices=("mcts", "ilp"), default="mcts",
                      help="backend (default mcts)")
  search.add_argument("--seed", type=int, default=0)
  search.add_argument("--constraints", choices=("keep", "hints", "ignore"), default="keep",
                      help="what to do with the program's own with_sharding_constraint "
                      "layouts (default keep)")
  search.add_argument("--start", choices=("search", "your layout"), default="search",
                      help="'your layout': also refine the layout the arguments state "
                      "(their shardings, flax partitioning metadata) and keep the better")
  search.add_argument("--out", metavar="PATH", help="save the plan as JSON")
  search.add_argument("--plot", metavar="PATH", help="write a PNG of per-layer time "
                      "and memory")
  search.add_argument("--quiet", action="store_true", help="print no explanation")

  _add_check(sub)

  explain = sub.add_parser("explain", help="print a saved plan (JSON) readably")
  explain.add_argument("plan", help="path of a plan saved with Plan.save, "
                       "ClusterPlan.save or `automap search --out`")
  explain.add_argument("--plot", metavar="PATH", help="also write a PNG of per-layer "
                       "time and memory (sharding plans)")

  bench = sub.add_parser(
      "bench", help="plan a GPT training step on several meshes and compare "
      "with data parallelism and Megatron",
      description="Plans (without running) a GPT training step on each mesh "
      "and prints the predicted step time of the plan, data parallelism and "
      "Megatron + data parallelism, and the search time.")
  _model_args(bench, layers=8)
  bench.add_argument("--meshes", type=_sizes, nargs="+",
                     default=[(8, 1), (4, 2), (2, 4), (1, 8)],
                     help="meshes as data,model sizes (default 8,1 4,2 2,4 1,8)")
  bench.add_argument("--hardware", default="tpu-v4", help="default tpu-v4")
  bench.add_argument("--seconds", type=_positive(float), default=30.0,
                     help="search budget per mesh in seconds (default 30)")
  return p


def _add_check(sub) -> None:
  """The `check` subcommand's arguments."""
  check = sub.add_parser(
      "check", help="compile a step for a TPU slice with XLA:TPU: does it fit, and what "
      "does the compiler emit?",
      formatter_class=argparse.RawDescriptionHelpFormatter,
      description=textwrap.dedent("""\
          Compiles TARGET's step for a TPU slice with XLA:TPU's own compiler
          (libtpu: pip install 'automap[tpu]'), on this machine, no TPU needed,
          and prints whether it fits: the compiled allocation per device
          against the chip's memory, the collectives by kind and mesh axis
          beside automap's prediction, and XLA:TPU's own time estimate.
          TARGET is MODULE:FN as for `search`. The layout is automap's plan
          (searched now, or --plan), or yours (--layout). Exit code 1 where
          it does not fit.
          """))
  check.add_argument("target", metavar="MODULE:FN")
  check.add_argument("--topology", required=True, metavar="SLICE",
                     help="the TPU slice as Cloud TPU names it: v5p-512 (v4 and v5p count "
                     "TensorCores), v6e-256, v5e-16, tpu7x-64 (chips), or v5p:4x4x12")
  check.add_argument("--slices", type=_positive(int), default=1,
                     help="how many such slices (multislice; default 1)")
  check.add_argument("--mesh", type=_sizes, default=None,
                     help="mesh axis sizes, comma separated, their product the slices' "
                     "devices (default: automap's plan picks a shape; your layout: one axis)")
  check.add_argument("--axes", help="mesh axis names, comma separated (default data / "
                     "data,model / data,fsdp,model)")
  layout = check.add_mutually_exclusive_group()
  layout.add_argument("--plan", metavar="PATH", help="a plan saved with Plan.save")
  layout.add_argument("--layout", metavar="MODULE:NAME",
                      help="your layout: a pytree of PartitionSpecs for the arguments "
                      "(as jax.jit's in_shardings), or a function returning one")
  check.add_argument("--hardware", default=None,
                     help="device spec to price with (default: the slice's chip)")
  check.add_argument("--seconds", type=_positive(float), default=30.0,
                     help="search budget in seconds, where automap plans (default 30)")
  check.add_argument("--out", metavar="PATH", help="save the plan searched as JSON")


def _model_args(p: argparse.ArgumentParser, layers: int) -> None:
  for flag, default, what in (("--layers", layers, "transformer blocks"),
                              ("--hidden", 512, "model width"),
                              ("--heads", 8, "attention heads"),
                              ("--seq", 128, "sequence length"),
                              ("--batch", 32, "global batch")):
    p.add_argument(flag, type=_positive(int), default=default,
                   help=f"{what} (default {default})")


def _load_target(target: str):
  """(fn, args) from MODULE:FN."""
  module_name, sep, attr = target.rpartition(":")
  if not sep or not module_name or not attr:
    raise UsageError(f"expected MODULE:FN (e.g. mymodel:make_step), got {target!r}")
  try:
    if module_name.endswith(".py") or os.sep in module_name:
      if not os.path.isfile(module_name):
        raise UsageError(f"no such file: {module_name!r}")
      spec = importlib.util.spec_from_file_location(
          os.path.splitext(os.path.basename(module_name))[0], module_name)
      module = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(module)
    else:
      sys.path.insert(0, os.getcwd())
      module = importlib.import_module(module_name)
  except UsageError:
    raise
  except Exception as e:  # The user's module: report whatever it raised.
    raise UsageError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise UsageError(f"{module_name!r} has no callable {attr!r}")
  made = factory()
  if (not isinstance(made, tuple) or len(made) != 2 or not callable(made[0])
      or not isinstance(made[1], tuple)):
    raise UsageError(
        f"{target}() must return (fn, args): the function to partition and a "
        f"tuple of its example arguments; got {type(made).__name__}")
  return made


def _search(args) -> int:
  import jax

  import automap

  fn, fn_args = _load_target(args.target)
  if args.devices is None:
    sizes = args.mesh or (4, 2)
    names = _axis_names(args.axes, sizes)
    where = {"mesh": jax.sharding.AbstractMesh(sizes, names)}
  else:
    if args.axes:
      raise UsageError("--axes goes with --mesh; --devices names its axes x, y, z")
    where = {"devices": args.devices}
  plan = automap.search(
      fn, *fn_args, **where, hardware=args.hardware, seed=args.seed, search=args.search,
      constraints=args.constraints, start=args.start,
      budget=automap.Budget(episodes=args.episodes, seconds=args.seconds),
      memory_limit=args.memory_limit, time_tolerance=args.time_tolerance,
      hints=automap.Hints(groups=tuple(args.group)))
  if not args.quiet:
    print(plan.explain())
  if args.out:
    plan.save(args.out)
    print(f"plan saved to {args.out}", file=sys.stderr)
  if args.plot:
    plan.plot(args.plot)
  return 0


def _load_layout(target: str):
  """A layout from MODULE:NAME: the attribute, or what it returns if callable."""
  module_name, sep, attr = target.rpartition(":")
  if not sep or not module_name or not attr:
    raise UsageError(f"--layout expects MODULE:NAME, got {target!r}")
  try:
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
  except Exception as e:  # The user's module: report whatever it raised.
    raise UsageError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from e
  if not hasattr(module, attr):
    raise UsageError(f"{module_name!r} has no {attr!r}")
  value = getattr(module, attr)
  return value() if callable(value) else value


def _check(args) -> int:
  # Compile-only TPU devices need no TPU runtime: keep jax on the CPU here.
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import automap

  fn, fn_args = _load_target(args.target)
  tpu = automap.parse_slice(args.topology, args.slices)
  hardware = args.hardware or tpu.hardware
  sizes = args.mesh
  plan = None
  if args.plan:
    plan = automap.Plan.load(args.plan)
    if sizes is not None and tuple(sizes) != plan.mesh.axis_sizes:
      raise UsageError(f"--mesh {sizes} differs from the plan's {plan.mesh.axis_sizes}")
    sizes, names = plan.mesh.axis_sizes, plan.mesh.axis_names
  else:
    names = _axis_names(args.axes, sizes) if sizes is not None else None
  if args.layout or args.plan:
    sizes = sizes or (tpu.num_devices,)
    names = names or _axis_names(args.axes, sizes)
    mesh = automap.tpu_mesh(args.topology, sizes, names, slices=args.slices)
    layout = _load_layout(args.layout) if args.layout else None
    result = automap.check(fn, *fn_args, mesh=mesh, plan=plan, in_shardings=layout,
                           hardware=args.hardware)
  else:
    budget = automap.Budget(episodes=10**6, seconds=args.seconds)
    if sizes is None:  # automap picks the mesh's shape, then compiles on that shape.
      if args.axes:
        raise UsageError("--axes goes with --mesh")
      plan = automap.search(fn, *fn_args, devices=tpu.num_devices, hardware=hardware,
                            budget=budget)
      sizes, names = plan.mesh.axis_sizes, plan.mesh.axis_names
      mesh = automap.tpu_mesh(args.topology, sizes, names, slices=args.slices)
    else:
      mesh = automap.tpu_mesh(args.topology, sizes, names, slices=args.slices)
      plan = automap.search(fn, *fn_args, mesh=mesh, hardware=hardware, budget=budget)
    if args.out:
      plan.save(args.out)
      print(f"plan saved to {args.out}", file=sys.stderr)
    result = automap.check(fn, *fn_args, mesh=mesh, plan=plan, hardware=args.hardware)
  print(f"{tpu}")
  print(result.table())
  return 0 if result.fits else 1


def _axis_names(axes: str | None, sizes) -> tuple[str, ...]:
  names = tuple(axes.split(",")) if axes else _AXES.get(len(sizes), ())
  if len(names) != len(sizes) or len(set(names)) != len(names) or not all(names):
    raise UsageError(f"--axes must give {len(sizes)} distinct names for mesh "
                     f"{','.join(map(str, sizes))}, got {axes!r}")
  return names


def _explain(args) -> int:
  import json

  import automap

  with open(args.plan) as f:
    cluster = "placement" in json.load(f)
  plan = (automap.cluster.ClusterPlan if cluster else automap.Plan).load(args.plan)
  print(plan.explain())
  if args.plot:
    if cluster:
      raise UsageError("--plot draws sharding plans; a cluster plan has no layer breakdown")
    plan.plot(args.plot)
  return 0


def _bench(args) -> int:
  import jax
  from rich.console import Console
  from rich.table import Table

  import automap
  from automap._src.models.gpt import GPTConfig, make_train_step

  config = GPTConfig(vocab=512, seq=args.seq, hidden=args.hidden, heads=args.heads,
                     layers=args.layers)
  step, abstract = make_train_step(config, batch=args.batch, abstract=True)
  table = Table(title=f"GPT train step, {args.layers} layers, hidden {args.hidden}, "
                f"batch {args.batch} x seq {args.seq}: predicted ms per step on "
                f"{args.hardware}")
  for col in ("mesh", "automap", "data parallel", "Megatron + DP", "vs best expert",
              "search s"):
    table.add_column(col, justify="right")
  for sizes in args.meshes:
    if len(sizes) != 2:
      raise UsageError(f"--meshes takes data,model pairs, got {sizes}")
    plan = automap.search(
        step, *abstract, mesh=jax.sharding.AbstractMesh(sizes, ("data", "model")),
        hardware=args.hardware, budget=automap.Budget(episodes=10**6, seconds=args.seconds))
    dp = plan.yardsticks["data parallel"].cost.step_time
    mt = plan.yardsticks["Megatron + data parallel"].cost.step_time
    table.add_row(f"{sizes[0]}x{sizes[1]}", f"{plan.cost.step_time * 1e3:.3f}",
                  f"{dp * 1e3:.3f}", f"{mt * 1e3:.3f}",
                  f"{plan.cost.step_time / min(dp, mt):.3f}x",
                  f"{plan.timings['search']:.1f}")
  Console(width=None if sys.stdout.isatty() else 120).print(table)
  return 0


def _demo(args) -> int:
  n = args.mesh[0] * args.mesh[1]
  # Simulated devices must be requested before JAX starts its backends
  # (importing jax does not start them).
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
  from automap._src.cli import demo
  from automap._src.models.gpt import GPTConfig
  model = GPTConfig(vocab=512, seq=args.seq, hidden=args.hidden, heads=args.heads,
                    layers=args.layers)
  result = demo.run(demo.DemoConfig(model=model, batch=args.batch, mesh=args.mesh,
                                    hardware=args.hardware, seconds=args.seconds))
  return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  run = {"demo": _demo, "search": _search, "check": _check, "explain": _explain,
         "bench": _bench}
  try:
    return run[args.command](args)
  except UsageError as e:
    print(f"automap {args.command}: {e}", file=sys.stderr)
    return 2
  except (OSError, ValueError, KeyError, TypeError) as e:
    import automap

    # Errors automap raises about the work (no plan fits) exit 1; bad
    # inputs (files, plans, meshes, hardware names) exit 2.
    failed = isinstance(e, automap.MemoryLimitError)
    print(f"automap {args.command}: {e}", file=sys.stderr)
    return 1 if failed else 2


if __name__ == "__main__":
  sys.exit(main())
