"""Trains the learned filter on the best plans teachers know.

Corpus: `--programs` random train steps (`synthetic.py`: eight families,
1-3 axis meshes of 8 devices, five kinds of hardware, half under a memory
limit). Per program, one example: the program's graph at the start state,
its decisions with their features (`decisions.py`), and each decision's
label, the share of the near-best plans that take it (`labels.py`). The
examples are written one file a program under `--corpus`, so data
generation runs in resumable parts (`--phase data --part i/n`) and the fit
reads them all.

Fit: the network (`network.PolicyNet`) gives each decision a logit; the
loss is the per-decision binary cross-entropy against the labels plus a
listwise cross-entropy between the softmax over the program's decisions
and its labels normalised. The last `--held-out` share of programs is held
out whole (`--leave-out FAMILY` holds out one family instead); every five
epochs their losses are logged, with how much of the label mass the
top-scored decisions carry beside the mean, and the parameters of the
least held-out loss are kept. Then the uniform share mixed into the priors is
calibrated on the held-out programs (the listwise likelihood of their
labels), and the weights are written.

The command is reproducible: the same arguments write the same weights,
byte for byte.

  python -m automap.policy.train [--programs 600] [--workers 2]
      [--phase all|data|fit] [--part 1/1] [--corpus DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap._src.cost.hardware import get_hardware
from automap._src.cost.program import Program
from automap._src.ir import trace
from automap._src.search.actions import ActionSpace
from automap._src.search.policy import decisions, labels, learned, synthetic
from automap._src.search.policy.features import SCHEMA, Features, Featurizer
from automap._src.search.policy.network import Batch, PolicyNet, pad
from automap._src.sharding.mesh import MeshSpec

AXES = ("data", "model", "seq")
DEFAULT_CORPUS = os.path.join(os.path.expanduser("~"), ".cache", "automap", "policy-corpus")
EPSILONS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5)  # the uniform shares calibration tries
TOP = 5  # decisions whose label mass the held-out report counts


@dataclasses.dataclass
class Example:
  """One program: its network input, labels [K padded] and family."""

  batch: Batch
  labels: np.ndarray
  family: str
  index: int


def sample_of(seed: int, index: int) -> synthetic.Sample:
  """Program `index` of the corpus drawn with `seed` (the same in every
  process)."""
  return synthetic.sample(np.random.default_rng([seed, index]))


def build(sample: synthetic.Sample) -> tuple[Program, ActionSpace, float | None, float]:
  """The program, its action space, its memory limit and data
  parallelism's peak, in bytes per device."""
  _, fn, args, shape, hw, share = sample
  program = Program.build(trace.trace(fn, args), MeshSpec(AXES[:len(shape)], shape),
                          get_hardware(hw))
  space = ActionSpace(program)
  dp = learned.dp_peak(space)
  limit = None if share is None else max(share * dp, program.memory_lower_bound() * 1.01)
  return program, space, limit, dp


def family_of(name: str) -> str:
  return name.split(" ")[0]


def example_arrays(seed: int, index: int, teachers: labels.Teachers) -> dict:
  """One program's example as plain arrays (what a corpus file holds)."""
  name, *_ = sample = sample_of(seed, index)
  program, space, limit, dp = build(sample)
  dec = decisions.describe(space, limit, dp)
  best = labels.near_best(labels.plans(program, space, limit, teachers, seed=index))
  f = Featurizer(space)(program.initial_state())
  return dict(nodes=f.nodes, edges=f.edges, senders=f.senders, receivers=f.receivers,
              globals=f.globals, members=f.members, num_groups=np.array(f.num_groups),
              actions=dec.features, action_group=dec.group.astype(np.int32),
              labels=labels.labels(space, dec, best), family=np.array(family_of(name)),
              plans=np.array(len(best)), schema=np.array(SCHEMA))


def _path(corpus: str, index: int) -> str:
  return os.path.join(corpus, f"{index:05d}.npz")


def _write(job) -> int:
  corpus, seed, index, teachers = job
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    arrays = example_arrays(seed, index, teachers)
  tmp = _path(corpus, index) + ".tmp.npz"
  np.savez_compressed(tmp, **arrays)
  os.replace(tmp, _path(corpus, index))
  return index


def generate(corpus: str, seed: int, indices: list[int], teachers: labels.Teachers,
             workers: int, log=print) -> None:
  """Writes the examples of `indices` not yet in `corpus`."""
  os.makedirs(corpus, exist_ok=True)
  todo = [i for i in indices if not os.path.exists(_path(corpus, i))]
  start = time.perf_counter()
  jobs = [(corpus, seed, i, teachers) for i in todo]
  if workers <= 1:
    done = map(_write, jobs)
  else:
    pool = multiprocessing.get_context("spawn").Pool(workers)
    done = pool.imap_unordered(_write, jobs)
  for n, _ in enumerate(done, 1):
    if n % 20 == 0 or n == len(todo):
      log(f"[{time.perf_counter() - start:6.0f} s] {n}/{len(todo)} programs labelled")
  if workers > 1:
    pool.close()


def load_example(corpus: str, index: int) -> Example:
  with np.load(_path(corpus, index), allow_pickle=False) as d:
    if str(d["schema"]) != SCHEMA:
      raise SystemExit(f"{_path(corpus, index)} holds features {str(d['schema'])!r}, this "
                       f"automap computes {SCHEMA!r}: regenerate the corpus.")
    f = Features(d["nodes"], d["edges"], d["senders"], d["receivers"], d["globals"],
                 d["members"], int(d["num_groups"]), d["actions"], d["action_group"])
    batch = pad(f)
    y = np.zeros(len(batch.actions), np.float32)
    y[:len(d["labels"])] = d["labels"]
    return Example(batch, y, str(d["family"]), index)


def loss_fn(net: PolicyNet, params, batch: Batch, y):
  """Per-decision binary cross-entropy plus the listwise cross-entropy of
  the labels normalised, over the program's decisions."""
  z = net.apply({"params": params}, batch)
  mask = batch.action_mask
  bce = jnp.where(mask, optax.sigmoid_binary_cross_entropy(z, y), 0.0).sum() / mask.sum()
  target = y / jnp.maximum(y.sum(), 1e-9)
  listwise = -(target * jax.nn.log_softmax(z)).sum()
  return bce + listwise


def evaluate(width: int, rounds: int, params, examples: list[Example]) -> dict:
  """Held-out losses, and the label mass of the `TOP` top-scored decisions
  beside the mass `TOP` decisions carry on average."""
  apply = learned.network(width, rounds)
  bce, listwise, top, mean = [], [], [], []
  for ex in examples:
    z = np.asarray(apply(params, ex.batch), np.float64)
    k = int(ex.batch.action_mask.sum())
    z, y = z[:k], ex.labels[:k].astype(np.float64)
    p = 1 / (1 + np.exp(-z))
    bce.append(float(-(y * np.log(p + 1e-12) + (1 - y) * np.log(1 - p + 1e-12)).mean()))
    if y.sum() > 0:
      t = y / y.sum()
      logp = z - z.max() - np.log(np.exp(z - z.max()).sum())
      listwise.append(float(-(t * logp).sum()))
      top.append(float(t[np.argsort(-z, kind="stable")[:TOP]].sum()))
      mean.append(min(TOP, k) / k)
  return {"bce": float(np.mean(bce)), "listwise": float(np.mean(listwise)),
          f"top{TOP}_mass": float(np.mean(top)), f"top{TOP}_mass_uniform": float(np.mean(mean))}


def calibrate(width: int, rounds: int, params, examples: list[Example]) -> float:
  """The uniform share whose mixed priors give the held-out programs'
  labels the highest listwise likelihood."""
  apply = learned.network(width, rounds)
  rows = []
  for ex in examples:
    k = int(ex.batch.action_mask.sum())
    z, y = np.asarray(apply(params, ex.batch), np.float64)[:k], ex.labels[:k]
    if y.sum() > 0:
      p = np.exp(z - z.max())
      rows.append((p / p.sum(), y / y.sum()))
  if not rows:
    return learned.EPSILON
  like = [np.mean([(t * np.log((1 - e) * p + e / len(p))).sum() for p, t in rows])
          for e in EPSILONS]
  return EPSILONS[int(np.argmax(like))]


def _shape(ex: Example) -> tuple:
  return tuple(x.shape for x in jax.tree.leaves(ex.batch))


def minibatches(examples: list[Example], size: int, rng: np.random.Generator) -> list[list[int]]:
  """Indices of `examples` in shuffled minibatches of at most `size`, each
  of one padded shape (so they stack)."""
  by_shape: dict[tuple, list[int]] = {}
  for i in rng.permutation(len(examples)):
    by_shape.setdefault(_shape(examples[i]), []).append(int(i))
  out = [ids[j:j + size] for ids in by_shape.values() for j in range(0, len(ids), size)]
  return [out[i] for i in rng.permutation(len(out))]


def fit(examples: list[Example], held_out: list[Example], epochs: int, seed: int,
        width: int = PolicyNet.width, rounds: int = PolicyNet.rounds,
        learning_rate: float = 1e-3, batch_size: int = 8, log=print, every: int = 5):
  """Trains a fresh network on `examples`; returns (params, history): the
  parameters of the evaluation (every `every` epochs) with the least
  held-out loss, or the last where nothing is held out."""
  net = PolicyNet(width, rounds)
  params = net.init(jax.random.key(seed), examples[0].batch)["params"]
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, 1e-4))
  opt_state = optimizer.init(params)

  def batch_loss(params, batch, y, weight):
    per = jax.vmap(lambda b, t: loss_fn(net, params, b, t))(batch, y)
    return (per * weight).sum() / jnp.maximum(weight.sum(), 1.0)

  @jax.jit
  def step(params, opt_state, batch, y, weight):
    loss, grads = jax.value_and_grad(batch_loss)(params, batch, y, weight)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  history = []
  kept, least = None, np.inf
  for epoch in range(epochs):
    losses = []
    for ids in minibatches(examples, batch_size, rng):
      # Every minibatch of one size (repeats of its first, weighing 0), so
      # each padded shape compiles once.
      chosen = [examples[i] for i in ids] + [examples[ids[0]]] * (batch_size - len(ids))
      weight = (np.arange(batch_size) < len(ids)).astype(np.float32)
      batch = jax.tree.map(lambda *xs: np.stack(xs), *[ex.batch for ex in chosen])
      params, opt_state, loss = step(params, opt_state, batch,
                                     np.stack([ex.labels for ex in chosen]), weight)
      losses.append(float(loss))
    stats = {"epoch": epoch + 1, "train_loss": float(np.mean(losses))}
    if held_out and ((epoch + 1) % every == 0 or epoch + 1 == epochs):
      stats |= {f"held_out_{k}": v for k, v in evaluate(width, rounds, params,
                                                        held_out).items()}
      loss = stats["held_out_bce"] + stats["held_out_listwise"]
      if loss < least:
        kept, least = params, loss
    history.append(stats)
    if len(stats) > 2 or epoch == 0:
      log("  " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in stats.items()))
  if kept is not None:
    best = min((h for h in history if "held_out_bce" in h),
               key=lambda h: h["held_out_bce"] + h["held_out_listwise"])
    log(f"  kept the parameters of epoch {best['epoch']} (least held-out loss)")
    params = kept
  return params, history


def split(examples: list[Example], held_out: float, leave_out: str | None
          ) -> tuple[list[Example], list[Example]]:
  """(train, held out): one family held out whole, or the last share of
  the programs."""
  if leave_out:
    return ([e for e in examples if e.family != leave_out],
            [e for e in examples if e.family == leave_out])
  cut = round(len(examples) * (1 - held_out))
  return examples[:cut], examples[cut:]


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--programs", type=int, default=600)
  parser.add_argument("--phase", choices=("all", "data", "fit"), default="all")
  parser.add_argument("--part", default="1/1", help="i/n: every n-th program from the i-th")
  parser.add_argument("--corpus", default=DEFAULT_CORPUS)
  parser.add_argument("--teacher-seeds", type=int, default=labels.Teachers.seeds)
  parser.add_argument("--teacher-episodes", type=int, default=labels.Teachers.episodes)
  parser.add_argument("--epochs", type=int, default=30)
  parser.add_argument("--held-out", type=float, default=0.2)
  parser.add_argument("--leave-out", default=None,
                      help="a family held out whole instead (e.g. decoder)")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=learned.DEFAULT_WEIGHTS)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  log = lambda s: print(s, flush=True)  # noqa: E731
  corpus = os.path.join(args.corpus, f"seed{args.seed}")
  if args.phase in ("all", "data"):
    i, n = (int(x) for x in args.part.split("/"))
    teachers = labels.Teachers(seeds=args.teacher_seeds, episodes=args.teacher_episodes)
    generate(corpus, args.seed, list(range(args.programs))[i - 1::n], teachers,
             args.workers, log)
  if args.phase == "data":
    return
  missing = [i for i in range(args.programs) if not os.path.exists(_path(corpus, i))]
  if missing:
    raise SystemExit(f"{len(missing)} programs of the corpus are not labelled yet (the "
                     f"first: {missing[0]}); run `--phase data` for them.")
  examples = [load_example(corpus, i) for i in range(args.programs)]
  train_set, held = split(examples, args.held_out, args.leave_out)
  families = sorted({e.family for e in train_set})
  log(f"[{time.perf_counter() - start:6.0f} s] fitting on {len(train_set)} programs "
      f"({', '.join(families)}), {len(held)} held out"
      + (f" (the {args.leave_out} family)" if args.leave_out else ""))
  width, rounds = PolicyNet.width, PolicyNet.rounds
  params, _ = fit(train_set, held, args.epochs, args.seed, width, rounds, log=log)
  epsilon = calibrate(width, rounds, params, held)
  log(f"uniform share calibrated on the held-out programs: {epsilon}")
  if held:
    for family in sorted({e.family for e in held}):
      stats = evaluate(width, rounds, params, [e for e in held if e.family == family])
      log(f"  held out, {family}: " + ", ".join(f"{k}={v:.3f}" for k, v in stats.items()))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  learned.save(args.out, params, width, rounds, epsilon=epsilon)
  log(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB) in "
      f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
  main()
