"""Trains the policy network by expert iteration.

Programs: `--programs` random train steps (`synthetic.py`: six families,
1-3 axis meshes, five kinds of hardware, half under a memory limit); the
last fifth are held out whole.

Teacher: on each program, uniform MCTS with `--teacher-episodes` episodes
finds a plan the search's actions reach; any later search that finds a
better one replaces it (the best known).

Rounds: in round r, a student search of `--episodes` episodes runs on each
program (round 0: uniform priors; later: the current network, with
Dirichlet noise at the root). Each node it expanded is an example: the
target over its actions is each action's progress towards the best-known
plan (the value layouts it gets right minus those it gets wrong, shared
out over the actions that make progress; a state where none does is no
example): a listwise target that says which tilings are in the best plan,
not where the space's order puts them. After each round the network is
trained on every example so far, and the held-out programs' cross-entropy
and top-1 agreement are logged. At the end, MCTS with the trained priors
and with uniform ones runs on `--compare` held-out programs, and the
episodes each takes to the best-known plan are logged.

The command is reproducible: the same arguments write the same weights,
byte for byte.

  python -m automap.policy.train [--programs 600] [--rounds 2] [--workers 2]
      [--out automap/_src/search/policy/weights.npz] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap._src.cost.hardware import get_hardware
from automap._src.cost.program import Program
from automap._src.cost.tracker import Tracker
from automap._src.ir import trace
from automap._src.search import mcts
from automap._src.search.actions import Action, ActionSpace
from automap._src.search.policy import compare, learned, synthetic
from automap._src.search.policy.features import Featurizer
from automap._src.search.policy.network import Batch, PolicyNet, pad
from automap._src.search.tactics import expert_states
from automap._src.sharding.mesh import MeshSpec
from automap._src.sharding.state import State

AXES = ("data", "model", "seq")
_NOISE = 0.25  # share of Dirichlet noise in a student's root priors
_EXAMPLES = 8  # examples per program and round: its most visited nodes


@dataclasses.dataclass
class Example:
  batch: Batch
  target: np.ndarray  # [K padded] a distribution over the actions and "stop"
  weight: float  # how much the search leaned on the state (its visits)


@dataclasses.dataclass
class Known:
  """The best plan known on one program: its state and score."""

  state: State
  score: mcts.Score


def sample_of(seed: int, index: int) -> synthetic.Sample:
  """Program `index` of the corpus drawn with `seed` (the same in every
  process)."""
  return synthetic.sample(np.random.default_rng([seed, index]))


def build(sample: synthetic.Sample) -> tuple[Program, ActionSpace, float | None]:
  """The program, its action space and its memory limit in bytes."""
  _, fn, args, shape, hw, share = sample
  program = Program.build(trace.trace(fn, args), MeshSpec(AXES[:len(shape)], shape),
                          get_hardware(hw))
  space = ActionSpace(program)
  limit = None
  if share is not None:
    dp = expert_states(program, space)["data parallel"]
    limit = max(share * Tracker(program.model, dp).peak_memory,
                program.memory_lower_bound() * 1.01)
  return program, space, limit


def progress(space: ActionSpace, state: State, actions: list[Action], best: State) -> np.ndarray:
  """[len(actions) + 1] each action's progress from `state` towards `best`:
  the (value, axis) layouts it makes agree minus those it makes disagree
  ("stop": 0)."""
  out = np.zeros(len(actions) + 1)
  work = state.copy()
  for i, action in enumerate(actions):
    changed = np.unique(space.apply(work, action))
    if len(changed):
      before = (state[changed] != best[changed]).sum()
      out[i] = before - (work[changed] != best[changed]).sum()
      work[changed] = state[changed]
  return out


def target_of(gain: np.ndarray) -> np.ndarray | None:
  """The listwise target: progress shared out over the actions that make
  it; None when none does (the state is as close to the best plan as
  adding tilings gets, and where to stop is the search's business)."""
  t = np.maximum(gain, 0.0)
  t[-1] = 0.0
  return t / t.sum() if t.sum() > 0 else None


def examples_of(seed: int, index: int, params, width: int, rounds: int,
                known: Known | None, episodes: int, teacher_episodes: int,
                round_: int) -> tuple[list[Example], Known]:
  """One program's examples for a round, and its best-known plan after it."""
  sample = sample_of(seed, index)
  program, space, limit = build(sample)
  if known is None:  # the teacher
    teacher = mcts.Search(program, space, limit, seed + index)
    result = teacher.run(teacher_episodes, float("inf"))
    known = Known(result.state, result.score)
  policy = None if params is None else learned.LearnedPolicy(params, width, rounds)
  noise = 0.0 if policy is None else _NOISE
  student = mcts.Search(program, space, limit, seed * 7919 + index * 31 + round_,
                        policy=policy, settings=mcts.MCTSSettings(noise=noise))
  result = student.run(episodes, float("inf"))
  if mcts.better(result.score, known.score):
    known = Known(result.state, result.score)
  nodes = [n for n in student.table.values() if n.actions is not None and n.actions]
  nodes.sort(key=lambda n: -n.total)
  featurize = Featurizer(space)
  out = []
  for node in nodes:
    t = target_of(progress(space, node.state, node.actions, known.state))
    if t is None:
      continue
    batch = pad(featurize(node.state, node.actions))
    target = np.zeros(len(batch.actions), np.float32)
    target[:len(t)] = t
    out.append(Example(batch, target, math.log2(2 + node.total)))
    if len(out) == _EXAMPLES:
      break
  return out, known


def _loss(net: PolicyNet, params, batch: Batch, target, weight):
  logits = net.apply({"params": params}, batch)
  return weight * -(target * jax.nn.log_softmax(logits)).sum()


def evaluate(width: int, rounds: int, params, examples: list[Example]) -> dict:
  """Mean cross-entropy, and how often the top action makes progress
  (`top1`) beside how often the space's first action does (`first`, what
  uniform priors try first)."""
  apply = learned.network(width, rounds)  # compiled once per bucket, not per call
  ce, hits, first = [], [], []
  for ex in examples:
    logits = np.asarray(apply(params, ex.batch), np.float64)
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    ce.append(float(-(ex.target * logp).sum()))
    hits.append(ex.target[int(logits.argmax())] > 0)
    first.append(ex.target[0] > 0)
  return {"cross_entropy": float(np.mean(ce)), "top1": float(np.mean(hits)),
          "first": float(np.mean(first))}


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


def train(examples: list[Example], held_out: list[Example], epochs: int, seed: int,
          width: int = PolicyNet.width, rounds: int = PolicyNet.rounds,
          learning_rate: float = 1e-3, params=None, batch_size: int = 16, log=print):
  """Trains (from `params`, or fresh) on `examples` in minibatches of one
  padded shape."""
  net = PolicyNet(width, rounds)
  if params is None:
    params = net.init(jax.random.key(seed), examples[0].batch)["params"]
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))
  opt_state = optimizer.init(params)

  def loss_of(params, batch, target, weight):
    per = jax.vmap(lambda b, t, w: _loss(net, params, b, t, w))(batch, target, weight)
    return per.sum() / jnp.maximum((weight > 0).sum(), 1)  # padding weighs 0

  @jax.jit
  def step(params, opt_state, batch, target, weight):
    loss, grads = jax.value_and_grad(loss_of)(params, batch, target, weight)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  mean = float(np.mean([ex.weight for ex in examples]))
  history = []
  for epoch in range(epochs):
    losses = []
    for ids in minibatches(examples, batch_size, rng):
      # Every minibatch of one size (repeats of its first, weighing 0), so
      # each padded shape compiles once.
      chosen = [examples[i] for i in ids] + [examples[ids[0]]] * (batch_size - len(ids))
      weight = np.array([ex.weight / mean for ex in chosen], np.float32)
      weight[len(ids):] = 0.0
      batch = jax.tree.map(lambda *xs: np.stack(xs), *[ex.batch for ex in chosen])
      params, opt_state, loss = step(params, opt_state, batch,
                                     np.stack([ex.target for ex in chosen]), weight)
      losses.append(float(loss))
    stats = {"epoch": epoch + 1, "train_loss": float(np.mean(losses))}
    if held_out:
      stats |= {f"held_out_{k}": v for k, v in evaluate(width, rounds, params,
                                                        held_out).items()}
    history.append(stats)
    log("  " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in stats.items()))
  return params, history


def search_effect(seed: int, indices: list[int], known: dict[int, Known],
                  policy: mcts.Policy, episodes: int, log=print) -> dict:
  """Episodes to within 1% of each program's best-known plan (censored at
  `episodes`), uniform priors against `policy`, one seed each: the
  geometric mean and median of uniform / policy over the programs."""
  ratios = []
  for i in indices:
    program, space, limit = build(sample_of(seed, i))
    took = {}
    for label, p in (("uniform", None), ("policy", policy)):
      run = compare.run(program, space, p, 0, known[i].score, limit, cap=episodes,
                        final_episodes=min(episodes, 20))
      took[label] = min(run.episodes, episodes)
    ratios.append(max(took["uniform"], 1.0) / max(took["policy"], 1.0))
    log(f"  program {i}: episodes to the best-known plan, uniform {took['uniform']:.0f}, "
        f"policy {took['policy']:.0f}")
  r = np.array(ratios)
  return {"geomean": float(np.exp(np.log(r).mean())), "median": float(np.median(r)),
          "programs": len(r)}


def _work(job):
  return examples_of(*job)


def _numpy(tree):
  return None if tree is None else jax.tree.map(np.asarray, tree)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--programs", type=int, default=600)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--round-programs", type=int, default=200,
                      help="training programs a round after the first searches again")
  parser.add_argument("--episodes", type=int, default=40, help="a student search's")
  parser.add_argument("--teacher-episodes", type=int, default=300)
  parser.add_argument("--epochs", type=int, default=3, help="per round")
  parser.add_argument("--held-out", type=float, default=0.2)
  parser.add_argument("--compare", type=int, default=12,
                      help="held-out programs searched with and without the trained priors")
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=learned.DEFAULT_WEIGHTS)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  width, depth = PolicyNet.width, PolicyNet.rounds
  cut = round(args.programs * (1 - args.held_out))
  train_ids, held_ids = list(range(cut)), list(range(cut, args.programs))
  known: dict[int, Known] = {}
  examples: dict[int, list[Example]] = {i: [] for i in range(args.programs)}
  params = None
  context = multiprocessing.get_context("spawn")
  with context.Pool(args.workers) as pool:
    for r in range(args.rounds):
      ids = train_ids + held_ids if r == 0 else train_ids[:args.round_programs]
      jobs = [(args.seed, i, _numpy(params), width, depth, known.get(i), args.episodes,
               args.teacher_episodes, r) for i in ids]
      for i, (ex, k) in zip(ids, pool.imap(_work, jobs, chunksize=4)):
        examples[i] += ex
        known[i] = k
      train_set = [e for i in train_ids for e in examples[i]]
      held = [e for i in held_ids for e in examples[i]]
      print(f"[{time.perf_counter() - start:6.0f} s] round {r + 1}/{args.rounds}: searched "
            f"{len(ids)} programs; training on {len(train_set)} examples, {len(held)} held "
            "out", flush=True)
      params, _ = train(train_set, held, args.epochs, args.seed + r, width, depth,
                        params=params, log=lambda s: print(s, flush=True))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  learned.save(args.out, params, width, depth)
  print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB) in "
        f"{time.perf_counter() - start:.0f} s", flush=True)
  if args.compare > 0 and held_ids:
    print(f"searching {min(args.compare, len(held_ids))} held-out programs, uniform and "
          f"trained priors, to their best-known plans", flush=True)
    effect = search_effect(args.seed, held_ids[:args.compare], known,
                           learned.LearnedPolicy(params, width, depth), 200,
                           log=lambda s: print(s, flush=True))
    print(f"episodes to the best-known plan, uniform / trained: geometric mean "
          f"{effect['geomean']:.2f}x, median {effect['median']:.2f}x over "
          f"{effect['programs']} held-out programs", flush=True)


if __name__ == "__main__":
  main()
