"""The `automap` command line."""

from __future__ import annotations

import argparse
import os
import sys


def _mesh(text: str) -> tuple[int, int]:
  try:
    data, model = (int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--mesh takes two sizes like 4,2 (data, model), got {text!r}") from None
  if data < 1 or model < 1:
    raise argparse.ArgumentTypeError(f"--mesh sizes must be positive, got {text!r}")
  return data, model


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="automap", description="Automatic partitioning of JAX programs.")
  sub = p.add_subparsers(dest="command", required=True)
  demo = sub.add_parser(
      "demo", help="partition a GPT training step on simulated CPU devices and "
      "compare the plan with Megatron + data parallelism")
  demo.add_argument("--layers", type=int, default=4)
  demo.add_argument("--hidden", type=int, default=512)
  demo.add_argument("--heads", type=int, default=8)
  demo.add_argument("--seq", type=int, default=128)
  demo.add_argument("--batch", type=int, default=32)
  demo.add_argument("--mesh", type=_mesh, default=(4, 2),
                    help="data,model mesh sizes (default 4,2)")
  demo.add_argument("--hardware", default="tpu-v4",
                    help="hardware whose costs the plan optimises (default tpu-v4)")
  demo.add_argument("--seconds", type=float, default=60.0,
                    help="search budget in seconds")
  explain = sub.add_parser("explain", help="print a saved plan (JSON) readably")
  explain.add_argument("plan", help="path of a plan saved with Plan.save or ClusterPlan.save")
  return p


def main(argv: list[str] | None = None) -> int:
  args = _parser().parse_args(argv)
  if args.command == "demo":
    n = args.mesh[0] * args.mesh[1]
    # Simulated devices must be requested before JAX starts its backends
    # (importing jax does not start them).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
      os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}"
    from automap._src import demo
    from automap._src.models.gpt import GPTConfig
    model = GPTConfig(vocab=512, seq=args.seq, hidden=args.hidden, heads=args.heads,
                      layers=args.layers)
    result = demo.run(demo.DemoConfig(model=model, batch=args.batch, mesh=args.mesh,
                                      hardware=args.hardware, seconds=args.seconds))
    return 0 if result["ok"] else 1
  if args.command == "explain":
    import json

    import automap
    try:
      with open(args.plan) as f:
        cluster = "placement" in json.load(f)
      kind = automap.ClusterPlan if cluster else automap.Plan
      print(kind.load(args.plan).explain())
    except (OSError, ValueError, KeyError, TypeError) as e:
      print(f"automap explain: {e}", file=sys.stderr)
      return 2
    return 0
  return 2


if __name__ == "__main__":
  sys.exit(main())
