"""What a prior is worth to the search, on programs no policy trained on.

Rows: train steps of held-out families (a T5-style encoder-decoder, a ViT,
a mixture-of-experts layer, and a GPT deeper and wider than any trained) on
meshes (4, 2), (2, 4) and (2, 2, 2); each (program, mesh) under two of the
four settings {tpu-v4, h100} x {no memory limit, a limit at half of data
parallelism's peak}, alternating, so every setting appears on every program.

Two phases, each resumable and split into parts (`--part i/n` runs every
n-th row); every row keeps its results in `benchmarks/policy_rows/<row>.json`
and its two best plans' states in `<row>.npz`:

  fix     the row's targets, fixed before any prior runs: the best searched
          plan (the best of `--long-seeds` uniform searches of
          `--long-episodes` each: what the search's actions can reach), and
          the best-known plan (the best of that, the refinement of the
          searches' best plans, and the ILP warm-started from them,
          `--ilp-seconds`, 0: none); then uniform priors on `--seeds` paired
          seeds. A row is hard when uniform needs a median of at least 30
          episodes to come within 1% of the best searched plan.
  run     the same seeds with the one-step lookahead prior, the oracle
          prior (the best searched plan's actions first) and the shipped
          learned policy.
  report  the table and the summary (RESULTS.md).

Per seed: episodes and wall seconds until the search's best plan is within
1% of the best searched plan (and fits the limit), censored at `--cap`
episodes; the final plan after 200 episodes and refinement, against the
best-known plan.

  python benchmarks/policy.py fix [--part 1/2] [--rows REGEX]
  python benchmarks/policy.py run [--part 1/2] [--rows REGEX] [--weights FILE]
  python benchmarks/policy.py report
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np  # noqa: E402

from automap._src.cost.hardware import get_hardware  # noqa: E402
from automap._src.cost.program import Program  # noqa: E402
from automap._src.cost.tracker import Tracker  # noqa: E402
from automap._src.ir import trace  # noqa: E402
from automap._src.models import zoo  # noqa: E402
from automap._src.search import ilp, mcts, refine  # noqa: E402
from automap._src.search.actions import ActionSpace, Tactic, Tile  # noqa: E402
from automap._src.search.policy import baselines, compare, learned  # noqa: E402
from automap._src.search.tactics import expert_states  # noqa: E402
from automap._src.sharding.mesh import MeshSpec  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS_DIR = os.path.join(HERE, "policy_rows")

PROGRAMS = {
    "t5": ("T5 2+2L w512", zoo.encoder_decoder),
    "vit": ("ViT 4L w384", zoo.vit),
    "moe": ("MoE 8x2048", zoo.moe),
    "gpt8": ("GPT 8L h768", lambda: zoo.gpt(8, 768)),
}
MESHES = ((4, 2), (2, 4), (2, 2, 2))
AXES = {2: ("data", "model"), 3: ("data", "fsdp", "model")}
# Two of the four settings per (program, mesh), alternating with the mesh.
SETTINGS = ((("tpu-v4", "none"), ("h100", "half")), (("h100", "none"), ("tpu-v4", "half")))
HARD = 30  # uniform's median episodes to the best searched plan, at least
METHODS = ("uniform", "lookahead", "oracle", "policy")


def rows() -> list[dict]:
  out = []
  for key in PROGRAMS:
    for i, shape in enumerate(MESHES):
      for hw, limit in SETTINGS[i % 2]:
        mesh = "x".join(map(str, shape))
        out.append({"id": f"{key}-{mesh}-{hw}-{limit}", "program": key, "mesh": list(shape),
                    "hardware": hw, "limit": limit})
  return out


def build(row: dict) -> tuple[Program, ActionSpace]:
  step, args = PROGRAMS[row["program"]][1]()
  shape = tuple(row["mesh"])
  program = Program.build(trace.trace(step, args), MeshSpec(AXES[len(shape)], shape),
                          get_hardware(row["hardware"]))
  return program, ActionSpace(program)


def encode(action) -> list:
  if isinstance(action, Tile):
    return ["tile", action.group, action.dim, action.axis]
  return ["tactic", action.name, list(action.axes)]


def decode(d: list):
  return Tile(*d[1:]) if d[0] == "tile" else Tactic(d[1], tuple(d[2]))


def path_of(row_id: str) -> str:
  return os.path.join(ROWS_DIR, f"{row_id}.json")


def load(row_id: str) -> dict | None:
  try:
    with open(path_of(row_id)) as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def save(data: dict) -> None:
  os.makedirs(ROWS_DIR, exist_ok=True)
  tmp = path_of(data["id"]) + ".tmp"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1)
  os.replace(tmp, path_of(data["id"]))


def memory_limit(program: Program, space: ActionSpace, kind: str) -> float | None:
  if kind == "none":
    return None
  dp = expert_states(program, space)["data parallel"]
  return 0.5 * Tracker(program.model, dp).peak_memory


def fix(row: dict, opts) -> dict:
  """The row's targets, and uniform's runs against them."""
  t0 = time.perf_counter()
  program, space = build(row)
  limit = memory_limit(program, space, row["limit"])
  candidates, best = [], None
  for s in range(opts.long_seeds):
    search = mcts.Search(program, space, limit, 10_000 + s)
    result = search.run(opts.long_episodes, float("inf"))
    seen = sorted(((n.state, n.score) for n in search.table.values()), key=lambda c: c[1])
    candidates += seen[:64]  # refinement takes the best 16 distinct
    if best is None or mcts.better(result.score, best.score):
      best = result
  found = {"mcts": (best.state, best.score)}
  state, score, _ = refine.refine_best(program, space.colour, candidates, limit, float("inf"),
                                       10 * opts.long_episodes)
  found["refined"] = (state, score)
  if opts.ilp_seconds > 0:
    solution = ilp.solve(program, ilp.SolverSettings(seconds=opts.ilp_seconds,
                                                     memory_limit=limit, workers=1),
                         hint=state)
    if solution.state is not None:
      found["ilp"] = (solution.state, mcts.score_of(Tracker(program.model, solution.state),
                                                    limit))
  source = min(found, key=lambda k: found[k][1])
  os.makedirs(ROWS_DIR, exist_ok=True)
  np.savez_compressed(os.path.join(ROWS_DIR, f"{row['id']}.npz"), search=best.state,
                      overall=found[source][0])
  data = dict(row, fingerprint=program.graph.fingerprint, memory_limit=limit,
              best={"search": list(best.score), "overall": list(found[source][1]),
                    "source": source, "scores": {k: list(v[1]) for k, v in found.items()},
                    "path": [encode(a) for a in best.path],
                    "episodes": opts.long_episodes, "seeds": opts.long_seeds},
              runs={}, seconds={"fix": time.perf_counter() - t0})
  target = tuple(best.score)
  if target[0] > 0:
    data["runs"]["uniform"] = None  # no plan fits: the row is left out
    return data
  data["runs"]["uniform"] = [compare.run(program, space, None, s, target, limit,
                                         cap=opts.cap).to_json()
                             for s in range(opts.seeds)]
  data["seconds"]["fix"] = time.perf_counter() - t0
  return data


def policies(name: str, program: Program, data: dict, space: ActionSpace, opts):
  """(policy, settings) of a method."""
  if name == "lookahead":
    return baselines.LookaheadPolicy(program, data["memory_limit"]), mcts.MCTSSettings()
  if name == "oracle":
    path = [decode(a) for a in data["best"]["path"]]
    settings = mcts.MCTSSettings()
    return (baselines.OraclePolicy(path),
            mcts.MCTSSettings(policy_depth=settings.max_depth))
  with warnings.catch_warnings():
    warnings.simplefilter("error", learned.PolicyWarning)
    return learned.load(opts.weights), mcts.MCTSSettings()


def run_row(row: dict, data: dict, opts) -> dict:
  program, space = build(row)
  if program.graph.fingerprint != data["fingerprint"]:
    raise SystemExit(f"{row['id']}: the program changed since its best-known plan was "
                     "fixed; run `fix` for it again.")
  limit = data["memory_limit"]
  with np.load(os.path.join(ROWS_DIR, f"{row['id']}.npz")) as states:
    for key in ("search", "overall"):
      priced = mcts.score_of(Tracker(program.model, states[key]), limit)
      if abs(priced[1] / data["best"][key][1] - 1) > 1e-3:
        raise SystemExit(f"{row['id']}: the cost model prices the best-known {key} plan "
                         f"at {priced[1]:.6g} s, {data['best'][key][1]:.6g} s when it was "
                         "fixed; run `fix` again on this clock.")
  target = tuple(data["best"]["search"])
  for name in METHODS[1:]:
    if name in data["runs"] and not opts.redo:
      continue
    t0 = time.perf_counter()
    policy, settings = policies(name, program, data, space, opts)
    data["runs"][name] = [compare.run(program, space, policy, s, target, limit, cap=opts.cap,
                                      settings=settings).to_json()
                          for s in range(opts.seeds)]
    data["seconds"][name] = time.perf_counter() - t0
    save(data)
  return data


def _median(runs: list[compare.Run], cap: int, what: str) -> float:
  """Median over seeds; a censored run counts as `cap` episodes (so a
  ratio against it is a bound) and as inf seconds."""
  xs = [getattr(r, what) for r in runs]
  if what == "episodes":
    xs = [min(x, cap) for x in xs]
  return float(np.median(xs))


def report(opts) -> None:
  table, hard_ratios = [], {m: [] for m in METHODS[1:]}
  easy_extra = {m: [] for m in METHODS[1:]}
  worse = {m: 0 for m in METHODS[1:]}
  fewer = {m: 0 for m in METHODS[1:]}
  seconds = {m: [] for m in METHODS[1:]}
  done = 0
  print("| row | best searched ms | best-known ms (from) | hard "
        "| episodes to best searched, median: uniform "
        "| lookahead | oracle | policy | seconds: uniform | lookahead | oracle | policy "
        "| reached (of seeds): u / l / o / p | final / best-known: u / l / o / p |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  fmt = lambda x: "-" if not np.isfinite(x) else f"{x:.0f}"  # noqa: E731
  for row in rows():
    data = load(row["id"])
    if data is None or data["runs"].get("uniform") is None:
      continue
    runs = {m: [compare.Run.from_json(r) for r in data["runs"][m]]
            for m in METHODS if data["runs"].get(m) is not None}
    if len(runs) < len(METHODS):
      continue
    done += 1
    best, overall = data["best"]["search"][1], data["best"]["overall"][1]
    med = {m: _median(rs, opts.cap, "episodes") for m, rs in runs.items()}
    sec = {m: _median(rs, opts.cap, "seconds") for m, rs in runs.items()}
    reached = {m: sum(np.isfinite(r.episodes) for r in rs) for m, rs in runs.items()}
    final = {m: float(np.median([r.final[1] if r.final[0] <= 0 else np.inf for r in rs]))
             for m, rs in runs.items()}
    hard = med["uniform"] >= HARD
    for m in METHODS[1:]:
      if hard:
        hard_ratios[m].append((runs["uniform"], runs[m]))
        seconds[m].append((sec["uniform"], sec[m]))
      else:
        easy_extra[m].append(med[m] - med["uniform"])
      worse[m] += final[m] > final["uniform"] * 1.005
      fewer[m] += reached[m] < reached["uniform"]
    table.append(row["id"])
    print(f"| {row['id']} | {best * 1e3:.3f} | {overall * 1e3:.3f} ({data['best']['source']}) | "
          f"{'yes' if hard else 'no'} | " + " | ".join(fmt(med[m]) for m in METHODS)
          + " | " + " | ".join(f"{sec[m]:.2f}" if np.isfinite(sec[m]) else "-" for m in METHODS)
          + " | " + " / ".join(str(reached[m]) for m in METHODS)
          + " | " + " / ".join(f"{final[m] / overall:.3f}" for m in METHODS) + " |")
  print()
  print(f"- rows measured: {done} of {len(rows())}; hard (uniform's median >= {HARD} "
        f"episodes): {len(hard_ratios['policy'])}")
  rng = np.random.default_rng(0)
  for m in METHODS[1:]:
    pairs = hard_ratios[m]
    if not pairs:
      continue
    point = _geomean_ratio(pairs, opts.cap)
    boot = [_geomean_ratio([(_resample(u, rng), _resample(p, rng)) for u, p in pairs], opts.cap)
            for _ in range(1000)]
    s = np.array(seconds[m])
    wall = (float(np.exp(np.mean(np.log(s[:, 0] / s[:, 1]))))
            if np.isfinite(s).all() else float("nan"))
    print(f"- {m} on hard rows: uniform / {m} episodes to the best searched plan, "
          f"geometric mean "
          f"{point:.2f}x (bootstrap 95% lower bound {np.quantile(boot, 0.025):.2f}x); "
          f"wall seconds {wall:.2f}x; final plan > 0.5% worse than uniform's on "
          f"{worse[m]} rows, fewer seeds reaching on {fewer[m]}; easy rows: "
          f"{np.mean(easy_extra[m]) if easy_extra[m] else 0:+.1f} episodes on average "
          f"(max {max(easy_extra[m], default=0):+.0f})")


def _resample(runs: list, rng) -> list:
  return [runs[i] for i in rng.integers(len(runs), size=len(runs))]


def _geomean_ratio(pairs, cap: int) -> float:
  """Geometric mean over rows of uniform's median episodes over the
  method's (censored runs at `cap`; a row where both start at the target
  counts 1)."""
  logs = []
  for u, m in pairs:
    a, b = _median(u, cap, "episodes"), _median(m, cap, "episodes")
    logs.append(0.0 if a == b else np.log(max(a, 1.0) / max(b, 1.0)))
  return float(np.exp(np.mean(logs)))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("phase", choices=("fix", "run", "report"))
  parser.add_argument("--part", default="1/1", help="i/n: every n-th row from the i-th")
  parser.add_argument("--rows", default=".*", help="a regex the row ids must match")
  parser.add_argument("--seeds", type=int, default=20)
  parser.add_argument("--cap", type=int, default=1000)
  parser.add_argument("--long-seeds", type=int, default=5)
  parser.add_argument("--long-episodes", type=int, default=2000)
  parser.add_argument("--ilp-seconds", type=float, default=30.0)
  parser.add_argument("--weights", default=None, help="a weights file (default: the shipped)")
  parser.add_argument("--redo", action="store_true", help="recompute rows already stored")
  opts = parser.parse_args()
  if opts.phase == "report":
    report(opts)
    return
  i, n = (int(x) for x in opts.part.split("/"))
  todo = [r for r in rows() if re.search(opts.rows, r["id"])][i - 1::n]
  warnings.simplefilter("ignore", UserWarning)
  for row in todo:
    t0 = time.perf_counter()
    data = load(row["id"])
    if opts.phase == "fix":
      if data is not None and not opts.redo:
        continue
      data = fix(row, opts)
    elif data is None:
      print(f"{row['id']}: no best-known plan; run `fix` first", flush=True)
      continue
    else:
      data = run_row(row, data, opts)
    save(data)
    print(f"{row['id']}: {opts.phase} in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
  main()
