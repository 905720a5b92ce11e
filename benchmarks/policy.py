"""What a prior is worth to the search, on programs no policy trained on.

Rows: train steps of held-out families (a T5-style encoder-decoder, a ViT,
a mixture-of-experts layer, a jraph GraphNetwork), of a sealed family added
after the learned filter's corpus was drawn (a state-space model), and of
a trained family at a larger size than any trained (a GPT deeper and wider,
reported apart) on meshes (4, 2), (2, 4) and (2, 2, 2); each (program,
mesh) under two of the four settings {tpu-v4, h100} x {no memory limit, a
limit at half of data parallelism's peak}, alternating, so every setting
appears on every program (the MoE layer, cheap, under all four).

Phases, each resumable and split into parts (`--part i/n` runs every n-th
row); every row keeps its results in `benchmarks/policy_rows/<row>.json`
and its two best plans' states in `<row>.npz`:

  fix     the row's targets, fixed before any prior runs: the best searched
          plan (the best of `--long-seeds` uniform searches of
          `--long-episodes` each: what the search's actions can reach), and
          the best-known plan (the best of that, the refinement of the
          searches' best plans, and the ILP warm-started from them,
          `--ilp-seconds`, 0: none); then uniform priors on `--seeds` paired
          seeds. A row is hard when uniform needs a median of at least 30
          episodes to come within 1% of the best searched plan.
  run     the same seeds with each prior of `--methods`: the one-step
          lookahead, the oracle (the best searched plan's actions first),
          the shipped learned filter's scores alone, and the scores with
          the lookahead beside them near the root. Each run first reruns
          uniform priors (which must reach the target in the same episodes)
          to time them beside the priors it measures. A final plan better
          than the row's best known replaces it (the report rescores every
          method's final plans against it).
  primitive
          the paper's own setting: tilings only, no tactics; episodes to
          the best expert's plan that fits, uniform priors against the
          learned filter (`--primitive-seeds` seeds).
  report  the tables and the summary (RESULTS.md).

Per seed: episodes and wall seconds until the search's best plan is within
1% of the best searched plan (and fits the limit), censored at `--cap`
episodes; the final plan after 200 episodes and refinement, against the
best-known plan. Every prior gets fresh state per seed (the filter's
scores, the lookahead's cache), built inside the search's clock.

  python benchmarks/policy.py fix [--part 1/2] [--rows REGEX]
  python benchmarks/policy.py run [--part 1/2] [--rows REGEX] [--weights FILE]
  python benchmarks/policy.py primitive [--part 1/2] [--rows REGEX]
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

import automap  # noqa: E402
from automap import zoo  # noqa: E402
from automap._src.cost.program import Program  # noqa: E402
from automap._src.cost.tracker import Tracker  # noqa: E402
from automap._src.ir import trace  # noqa: E402
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
    "graphnet": ("GraphNetwork 4k nodes", zoo.graph_network),
    "gpt8": ("GPT 8L h768", lambda: zoo.gpt(8, 768)),
    "ssm": ("SSM 2L w256", zoo.ssm),
}
# What each program is to the learned filter: a family it never saw (held
# out), one added after its corpus was drawn (sealed), or a trained family
# at a larger size than any it trained on.
FAMILY = {"t5": "held out", "vit": "held out", "moe": "held out", "graphnet": "held out",
          "ssm": "sealed", "gpt8": "trained family, larger size"}
UNSEEN = ("held out", "sealed")
MESHES = ((4, 2), (2, 4), (2, 2, 2))
AXES = {2: ("data", "model"), 3: ("data", "fsdp", "model")}
# Two of the four settings per (program, mesh), alternating with the mesh.
SETTINGS = ((("tpu-v4", "none"), ("h100", "half")), (("h100", "none"), ("tpu-v4", "half")))
# Programs cheap enough to take all four settings on every mesh.
EVERY_SETTING = ("moe",)
HARD = 30  # uniform's median episodes to the best searched plan, at least
METHODS = ("uniform", "lookahead", "oracle", "learned", "learned+lookahead")
# The lookahead prices every action of a node it expands (a tracker update
# each, and the peak under a limit): it guides the root and its children,
# uniform priors the rest.
LOOKAHEAD_DEPTH = 1


def rows() -> list[dict]:
  out = []
  for key in PROGRAMS:
    for i, shape in enumerate(MESHES):
      settings = SETTINGS[0] + SETTINGS[1] if key in EVERY_SETTING else SETTINGS[i % 2]
      for hw, limit in settings:
        mesh = "x".join(map(str, shape))
        out.append({"id": f"{key}-{mesh}-{hw}-{limit}", "program": key, "mesh": list(shape),
                    "hardware": hw, "limit": limit})
  return out


def build(row: dict) -> tuple[Program, ActionSpace]:
  step, args = PROGRAMS[row["program"]][1]()
  shape = tuple(row["mesh"])
  program = Program.build(trace.trace(step, args), MeshSpec(AXES[len(shape)], shape),
                          automap.HARDWARE[row["hardware"]])
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
  return 0.5 * learned.dp_peak(space)


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
  state, score, _ = refine.refine_best(program, space, candidates, limit, float("inf"),
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


def policies(name: str, program: Program, data: dict, opts):
  """(a maker of the method's (policy, deep policy) for a seed, its MCTS
  settings). Every seed gets fresh policies: the learned filter's scores
  and the lookahead's cache are built inside the search's clock."""
  limit = data["memory_limit"]
  if name == "uniform":
    return (lambda: (None, None)), mcts.MCTSSettings()
  if name == "lookahead":
    return ((lambda: (baselines.LookaheadPolicy(program, limit), None)),
            mcts.MCTSSettings(policy_depth=LOOKAHEAD_DEPTH))
  if name == "oracle":
    path = [decode(a) for a in data["best"]["path"]]
    return (lambda: (baselines.OraclePolicy(path), None)), mcts.MCTSSettings()
  with warnings.catch_warnings():
    warnings.simplefilter("error", learned.PolicyWarning)
    shipped = learned.load(opts.weights)
  if name == "learned":
    return (lambda: (shipped.with_limit(limit), None)), mcts.MCTSSettings()

  def both():  # the filter everywhere, reweighed by the lookahead near the root
    scores = shipped.with_limit(limit)
    look = baselines.LookaheadPolicy(program, limit)
    return baselines.ProductPolicy(scores, look, "learned+lookahead"), scores

  return both, mcts.MCTSSettings(policy_depth=LOOKAHEAD_DEPTH)


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
  todo = [m for m in opts.methods.split(",")
          if m != "uniform" and (m not in data["runs"] or opts.redo)]
  if not todo:
    return data
  # Uniform priors again, timed in this run beside the priors it runs.
  uniform = measure(row, program, space, "uniform", data, target, opts)
  fixed = [compare.Run.from_json(r).episodes for r in data["runs"]["uniform"][:len(uniform)]]
  moved = [(a, r.episodes) for a, r in zip(fixed, uniform) if a != r.episodes]
  if moved:  # the clock's float noise can move a tie between two edges
    print(f"{row['id']}: uniform priors reached the target in other episodes than when "
          f"the row was fixed on {len(moved)} seeds (fixed, now: {moved}); the fixed "
          "episodes are compared", flush=True)
    if np.median(fixed) != np.median([r.episodes for r in uniform]):
      data.setdefault("moved", {})[time.strftime("%Y-%m-%d")] = moved
  adopt(row, data, uniform, "uniform")
  for name in todo:
    t0 = time.perf_counter()
    runs = measure(row, program, space, name, data, target, opts)
    data["runs"][name] = [r.to_json() for r in runs]
    data.setdefault("timed_with", {})[name] = [r.to_json() for r in uniform]
    if "lookahead" in name:
      data.setdefault("settings", {})["lookahead_depth"] = LOOKAHEAD_DEPTH
    data["seconds"][name] = time.perf_counter() - t0
    adopt(row, data, runs, name)
    save(data)
  return data


def adopt(row: dict, data: dict, runs: list[compare.Run], name: str) -> None:
  """A final plan better than the row's best known becomes it."""
  for r in runs:
    if r.final_state is not None and mcts.better(r.final, tuple(data["best"]["overall"])):
      data["best"]["overall"], data["best"]["source"] = list(r.final), name
      npz = os.path.join(ROWS_DIR, f"{row['id']}.npz")
      with np.load(npz) as states:
        kept = dict(states)
      kept["overall"] = r.final_state
      np.savez_compressed(npz, **kept)


def measure(row: dict, program: Program, space: ActionSpace, name: str, data: dict,
            target, opts) -> list[compare.Run]:
  make, settings = policies(name, program, data, opts)
  out = []
  for s in range(opts.seeds):
    policy, deep = make()
    out.append(compare.run(program, space, policy, s, target, data["memory_limit"],
                           cap=opts.cap, settings=settings, deep_policy=deep))
  return out


def primitive(row: dict, data: dict, opts) -> dict:
  """The paper's setting: tilings only, no tactics. Episodes until the
  search's best plan is within 1% of the best expert's that fits (data
  parallelism, Megatron, Megatron + DP, FSDP), uniform priors against the
  shipped policy, censored at `--cap`."""
  if "primitive" in data and not opts.redo:
    return data
  program, space = build(row)
  limit = data["memory_limit"]
  experts = [mcts.score_of(Tracker(program.model, s), limit)
             for s in expert_states(program, space).values()]
  fits = [s for s in experts if s[0] <= 0]
  out = {"expert": None if not fits else list(min(fits))}
  if fits:
    tiles = ActionSpace(program, with_tactics=False)
    target = min(fits)
    for name in ("uniform", "learned"):
      make, settings = policies(name, program, data, opts)
      out[name] = [compare.run(program, tiles, make()[0], s, target, limit, cap=opts.cap,
                               final_episodes=None, settings=settings).to_json()
                   for s in range(opts.primitive_seeds)]
  data["primitive"] = out
  return data


def _median(runs: list[compare.Run], cap: int, what: str) -> float:
  """Median over seeds; a censored run counts as `cap` episodes and as the
  seconds its episodes to the cap took (so a ratio against it is a bound;
  inf where those were not timed)."""
  if what == "episodes":
    return float(np.median([min(r.episodes, cap) for r in runs]))
  xs = [r.seconds_bound for r in runs]
  return float(np.median([x if np.isfinite(x) else np.inf for x in xs]))


def _row_runs(data: dict, seeds: int) -> tuple[dict, dict]:
  """(method -> runs for episodes and finals, method -> uniform's runs timed
  beside it), the first `seeds` seeds each."""
  def of(xs):
    return [compare.Run.from_json(r) for r in xs][:seeds]

  runs = {m: of(data["runs"][m]) for m in METHODS if data["runs"].get(m) is not None}
  timed = {m: of(xs) for m, xs in data.get("timed_with", {}).items()}
  legacy = data["runs"].get("uniform_timed")
  for m in runs:
    if m not in timed and legacy and m != "uniform":
      timed[m] = of(legacy)  # timed in an earlier run of this benchmark
  return runs, timed


def _geomean(logs: list[float]) -> float:
  return float(np.exp(np.mean(logs))) if logs else float("nan")


def _log_ratio(a: float, b: float) -> float:
  return 0.0 if a == b else float(np.log(max(a, 1.0) / max(b, 1.0)))


def report(opts) -> None:
  """The per-row table, then per prior against uniform on the hard rows of
  families no policy trained on: the geometric mean of uniform's median
  episodes over its, with 95% lower bounds from a bootstrap over seeds
  and one over rows clustered by program; wall seconds against uniform
  timed in the same run; against the lookahead where it needs 10 or more
  episodes; per family; and every row's median final plan against the
  best known and against uniform's."""
  cell = lambda x, f: "-" if x is None or not np.isfinite(x) else format(x, f)  # noqa: E731
  table, no_fit = [], []
  print("| row | family | best searched ms | best-known ms (from) | hard | episodes to best "
        "searched, median: " + " | ".join(METHODS) + " | seconds: "
        + " | ".join(METHODS) + " | final / best-known: " + " / ".join(METHODS) + " |")
  print("|---|---|---|---|---|" + "---|" * (2 * len(METHODS) + 1))
  for row in rows():
    data = load(row["id"])
    if data is None:
      continue
    if data["runs"].get("uniform") is None:
      no_fit.append(row["id"])
      continue
    runs, timed = _row_runs(data, opts.seeds)
    overall = data["best"]["overall"][1]
    med = {m: _median(rs, opts.cap, "episodes") for m, rs in runs.items()}
    sec = {m: _median(rs, opts.cap, "seconds") for m, rs in runs.items()}
    sec["uniform"] = float(np.median([_median(t, opts.cap, "seconds")
                                      for t in timed.values()])) if timed else np.nan
    final = {m: float(np.median([r.final[1] if r.final[0] <= 0 else np.inf for r in rs]))
             / overall for m, rs in runs.items()}
    # Hard on every seed fixed, not only those compared here.
    hard = _median([compare.Run.from_json(r) for r in data["runs"]["uniform"]], opts.cap,
                   "episodes") >= HARD
    table.append(dict(row=row, runs=runs, timed=timed, med=med, final=final, hard=hard))
    print(f"| {row['id']} | {FAMILY[row['program']]} | {data['best']['search'][1] * 1e3:.3f} | "
          f"{overall * 1e3:.3f} ({data['best']['source']}) | {'yes' if hard else 'no'} | "
          + " | ".join(cell(med.get(m), ".0f") for m in METHODS) + " | "
          + " | ".join(cell(sec.get(m), ".2f") for m in METHODS) + " | "
          + " / ".join(cell(final.get(m), ".3f") for m in METHODS) + " |")
  print()
  unseen = [t for t in table if FAMILY[t["row"]["program"]] in UNSEEN]
  hard = [t for t in unseen if t["hard"]]
  print(f"- rows measured: {len(table)} of {len(rows())}; on families no policy trained on: "
        f"{len(unseen)}, {len(hard)} hard (uniform's median >= {HARD} episodes); no plan "
        f"fits the limit: {', '.join(no_fit) or 'none'}")
  rng = np.random.default_rng(0)
  for m in METHODS[1:]:
    rows_m = [t for t in hard if m in t["runs"]]
    if not rows_m:
      continue
    logs = [_log_ratio(t["med"]["uniform"], t["med"][m]) for t in rows_m]
    point = _geomean(logs)
    by_seed = [_geomean([_log_ratio(_median(_resample(t["runs"]["uniform"], rng), opts.cap,
                                            "episodes"),
                                    _median(_resample(t["runs"][m], rng), opts.cap,
                                            "episodes")) for t in rows_m])
               for _ in range(1000)]
    by_row_iid = [_geomean(list(rng.choice(logs, len(logs)))) for _ in range(1000)]
    programs = sorted({t["row"]["program"] for t in rows_m})
    by_row = []
    for _ in range(1000):
      drawn = rng.choice(programs, len(programs))
      by_row.append(_geomean([x for p in drawn for t, x in zip(rows_m, logs)
                              if t["row"]["program"] == p]))
    wall = [np.log(_median(t["timed"][m], opts.cap, "seconds")
                   / _median(t["runs"][m], opts.cap, "seconds"))
            for t in rows_m if m in t["timed"]]
    wall = [w for w in wall if np.isfinite(w)]
    deep = [t for t in rows_m if "lookahead" in t["med"] and t["med"]["lookahead"] >= 10]
    vs_look = _geomean([_log_ratio(t["med"]["lookahead"], t["med"][m]) for t in deep])
    easy = [t["med"][m] - t["med"]["uniform"] for t in unseen
            if not t["hard"] and m in t["med"]]
    print(f"- {m}, {len(rows_m)} hard unseen rows: uniform / {m} episodes to the best "
          f"searched plan, geometric mean {point:.2f}x (95% lower bound: seeds "
          f"{np.quantile(by_seed, 0.025):.2f}x, rows {np.quantile(by_row_iid, 0.025):.2f}x, "
          f"rows clustered by program {np.quantile(by_row, 0.025):.2f}x); wall seconds "
          f"{_geomean(wall):.2f}x over {len(wall)} rows (uniform timed in the same run)"
          + ("" if m == "lookahead" else f"; lookahead / {m} {vs_look:.2f}x on the "
             f"{len(deep)} rows where the lookahead needs 10 or more")
          + f"; easy unseen rows: {np.mean(easy) if easy else 0:+.1f} episodes on average "
          f"(max {max(easy, default=0):+.0f})")
    for family in sorted({FAMILY[t["row"]["program"]] for t in table}):
      for program in sorted({t["row"]["program"] for t in table
                             if FAMILY[t["row"]["program"]] == family}):
        fam = [t for t in table if t["row"]["program"] == program and t["hard"]
               and m in t["runs"]]
        if fam:
          print(f"  - {program} ({family}), {len(fam)} hard rows: "
                f"{_geomean([_log_ratio(t['med']['uniform'], t['med'][m]) for t in fam]):.2f}x")
    measured = [t for t in table if m in t["final"]]
    worst = max(measured, key=lambda t: t["final"][m])
    print(f"  - final plan (median over seeds, 200 episodes and refinement) / best known: "
          f"worst {worst['final'][m]:.3f} ({worst['row']['id']}), over 1.02 on "
          f"{sum(t['final'][m] > 1.02 for t in measured)} of {len(measured)} rows, over 0.5% "
          f"worse than uniform's on "
          f"{sum(t['final'][m] > t['final']['uniform'] * 1.005 for t in measured)}")
  finals = [t for t in table if "uniform" in t["final"]]
  worst = max(finals, key=lambda t: t["final"]["uniform"])
  print(f"- uniform's final plan / best known: worst {worst['final']['uniform']:.3f} "
        f"({worst['row']['id']}), over 1.02 on "
        f"{sum(t['final']['uniform'] > 1.02 for t in finals)} of {len(finals)} rows")


def report_primitive(opts) -> None:
  print()
  print("Tilings only (no tactics): episodes to the best expert's plan, medians over seeds")
  print()
  print("| row | best expert ms | uniform | learned | reached: uniform / learned |")
  print("|---|---|---|---|---|")
  ratios = []
  for row in rows():
    data = load(row["id"])
    p = None if data is None else data.get("primitive")
    if not p or p.get("expert") is None or "learned" not in p:
      continue
    runs = {m: [compare.Run.from_json(r) for r in p[m]] for m in ("uniform", "learned")}
    med = {m: _median(rs, opts.cap, "episodes") for m, rs in runs.items()}
    reached = {m: sum(np.isfinite(r.episodes) for r in rs) for m, rs in runs.items()}
    ratios.append(1.0 if med["uniform"] == med["learned"]
                  else max(med["uniform"], 1) / max(med["learned"], 1))
    print(f"| {row['id']} | {p['expert'][1] * 1e3:.3f} | {med['uniform']:.0f} "
          f"| {med['learned']:.0f} | {reached['uniform']} / {reached['learned']} |")
  if ratios:
    print()
    print(f"- uniform / learned episodes to the best expert's plan: median "
          f"{np.median(ratios):.2f}x over {len(ratios)} rows (censored at {opts.cap})")


def _resample(runs: list, rng) -> list:
  return [runs[i] for i in rng.integers(len(runs), size=len(runs))]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("phase", choices=("fix", "run", "primitive", "report"))
  parser.add_argument("--part", default="1/1", help="i/n: every n-th row from the i-th")
  parser.add_argument("--rows", default=".*", help="a regex the row ids must match")
  parser.add_argument("--seeds", type=int, default=10)
  parser.add_argument("--cap", type=int, default=1000)
  parser.add_argument("--primitive-seeds", type=int, default=10)
  parser.add_argument("--long-seeds", type=int, default=5)
  parser.add_argument("--long-episodes", type=int, default=2000)
  parser.add_argument("--ilp-seconds", type=float, default=30.0)
  parser.add_argument("--weights", default=None, help="a weights file (default: the shipped)")
  parser.add_argument("--redo", action="store_true", help="recompute rows already stored")
  parser.add_argument("--methods", default=",".join(METHODS[1:]),
                      help="the priors `run` measures, comma-separated")
  opts = parser.parse_args()
  if opts.phase == "report":
    report(opts)
    report_primitive(opts)
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
    elif data["runs"].get("uniform") is None:
      continue  # no plan fits its memory limit
    elif opts.phase == "primitive":
      data = primitive(row, data, opts)
    else:
      data = run_row(row, data, opts)
    save(data)
    print(f"{row['id']}: {opts.phase} in {time.perf_counter() - t0:.0f} s", flush=True)


if __name__ == "__main__":
  main()
