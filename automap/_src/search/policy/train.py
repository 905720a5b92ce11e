"""Trains the policy network on targets from long searches.

For each random program (`synthetic.py`), a wide uniform-prior MCTS runs
`episodes` episodes; every node it visited at least twice, with at least
four of its actions tried, becomes an example. The target is the first of
the node's actions, in the action space's order, whose best reward found
below is within 0.5% of the best of them (stop is no target: the search
caps its prior); the value target is the log speed-up from the node to the
best found below it. Programs are split into training and held-out sets;
losses and how often the network's top action is a target action are
logged per epoch. Agreement with the targets is not the search's speed:
at the end, MCTS runs on held-out programs with the trained priors and
with uniform ones, and the episodes each takes to the best plan either
found are logged (`compare.py`).

  python -m automap.policy.train [--programs 120] [--episodes 400] [--epochs 5]
      [--compare 12] [--out automap/_src/search/policy/weights.npz] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap._src.cost.hardware import get_hardware
from automap._src.cost.program import Program
from automap._src.ir import trace
from automap._src.search import mcts
from automap._src.search.actions import ActionSpace
from automap._src.search.policy import compare, learned, synthetic
from automap._src.search.policy.features import Featurizer
from automap._src.search.policy.network import Batch, PolicyNet, pad
from automap._src.sharding.mesh import MeshSpec

AXES = ("data", "model", "seq")
_TOLERANCE = 0.005  # actions within this of a node's best are targets
_WIDEN = 8.0  # progressive widening of the target searches


@dataclasses.dataclass
class Example:
  batch: Batch
  target: np.ndarray  # [K padded] prior, sums to one
  value: float  # log speed-up reachable from the state
  weight: float  # how much the search leaned on the state (its visits)


def build(sample: synthetic.Sample) -> Program:
  _, fn, args, shape, hw = sample
  return Program.build(trace.trace(fn, args), MeshSpec(AXES[:len(shape)], shape),
                       get_hardware(hw))


def examples_of(sample: synthetic.Sample, episodes: int, seed: int) -> list[Example]:
  """Search targets of one program."""
  program = build(sample)
  space = ActionSpace(program)
  # Wide: every action of a node is tried before any is deepened much, so
  # the targets see all of them, not only those first in widening order.
  search = mcts.Search(program, space, None, seed, settings=mcts.MCTSSettings(widen=_WIDEN))
  search.run(episodes, 300.0)
  featurize = Featurizer(space)
  out = []
  for node in search.table.values():
    if node.actions is None or node.total < 2:
      continue
    if (node.visits[:-1] > 0).sum() < min(len(node.actions), 4):
      continue  # too few actions tried to tell good from bad
    own = search.reward(node)
    best = node.best[:-1]  # the actions; stopping is the search's own business
    top = best.max()
    if not np.isfinite(top):
      continue
    # The first good action in the space's order: the policy learns where
    # to depart from that order, not to spread over equivalent actions.
    first = int(np.flatnonzero(best >= top * (1 - _TOLERANCE))[0])
    f = featurize(node.state, node.actions)
    batch = pad(f)
    target = np.zeros(len(batch.actions), np.float32)
    target[first] = 1.0
    out.append(Example(batch, target, math.log(max(top, own) / own),
                       math.log2(2 + node.total)))
  return out


def _loss(net: PolicyNet, params, batch: Batch, target, value_target, weight):
  logits, value = net.apply({"params": params}, batch)
  cross_entropy = -(target * jax.nn.log_softmax(logits)).sum()
  return weight * (cross_entropy + 0.1 * (value - value_target) ** 2), (cross_entropy, logits)


def evaluate(net: PolicyNet, params, examples: list[Example]) -> dict:
  """Mean cross-entropy, how often the top action is a target, and the
  value head's mean absolute error (log speed-up) beside the best
  constant's (the targets' median): a head no better than that has
  learned nothing about the state."""
  apply = learned.network(net.width, net.rounds)  # compiled once per bucket, not per call
  ce, hits, first, values = [], [], [], []
  for ex in examples:
    logits, value = apply(params, ex.batch)
    values.append(float(value))
    logits = np.asarray(logits)
    logp = logits - logits.max() - np.log(np.exp(logits - logits.max()).sum())
    ce.append(float(-(ex.target * logp).sum()))
    hits.append(ex.target[int(logits.argmax())] > 0)
    first.append(ex.target[0] > 0)  # uniform priors try the space's first action first
  w = np.array([ex.weight for ex in examples])
  targets = np.array([ex.value for ex in examples])
  return {"cross_entropy": float(np.mean(ce)), "top1": float(np.mean(hits)),
          "value_error": float(np.abs(np.array(values) - targets).mean()),
          "value_error_constant": float(np.abs(np.median(targets) - targets).mean()),
          "top1_uniform": float(np.mean(first)),
          "top1_weighted": float(np.average(hits, weights=w)),
          "top1_uniform_weighted": float(np.average(first, weights=w))}


def train(examples: list[Example], held_out: list[Example], epochs: int, seed: int,
          width: int = PolicyNet.width, rounds: int = PolicyNet.rounds,
          learning_rate: float = 1e-3,
          log=print):
  net = PolicyNet(width, rounds)
  params = net.init(jax.random.key(seed), examples[0].batch)["params"]
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch, target, value, weight):
    (loss, _), grads = jax.value_and_grad(
        lambda p: _loss(net, p, batch, target, value, weight), has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  rng = np.random.default_rng(seed)
  mean = float(np.mean([ex.weight for ex in examples]))
  history = []
  for epoch in range(epochs):
    losses = []
    for i in rng.permutation(len(examples)):
      ex = examples[i]
      params, opt_state, loss = step(params, opt_state, ex.batch, jnp.asarray(ex.target),
                                     jnp.float32(ex.value), jnp.float32(ex.weight / mean))
      losses.append(float(loss))
    stats = {"epoch": epoch + 1, "train_loss": float(np.mean(losses))}
    if held_out:
      stats |= {f"held_out_{k}": v for k, v in evaluate(net, params, held_out).items()}
    history.append(stats)
    log("  " + ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in stats.items()))
  return params, history


def search_effect(samples: list[synthetic.Sample], policy: mcts.Policy, episodes: int,
                  seeds: tuple[int, ...] = (0, 1), log=print) -> dict:
  """Episodes to the best plan found (medians over seeds), uniform priors
  against `policy`, on each program: the median and geometric mean of
  uniform / policy, and on how many programs the policy's final plan is
  the worse."""
  ratios, worse = [], 0
  for sample in samples:
    name, _, _, shape, hw = sample
    program = build(sample)
    trails = compare.compare(program, ActionSpace(program), policy, seeds, episodes)
    best = compare.best_found(trails)
    took = {k: compare.medians(ts, best)[0] for k, ts in trails.items()}
    ratios.append(compare.speedup(took["uniform"], took["policy"]))
    worse += compare.worse(trails)
    log(f"  {name} on {shape} {hw}: episodes to the best plan found, uniform "
        f"{took['uniform']:.0f}, policy {took['policy']:.0f}")
  r = np.clip(np.array(ratios), 1e-2, 1e2)  # never reached: bounded, for the mean
  return {"median": float(np.median(ratios)), "geomean": float(np.exp(np.log(r).mean())),
          "worse": int(worse), "programs": len(ratios)}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--programs", type=int, default=120)
  parser.add_argument("--episodes", type=int, default=400)
  parser.add_argument("--epochs", type=int, default=5)
  parser.add_argument("--held-out", type=float, default=0.2)
  parser.add_argument("--compare", type=int, default=12,
                      help="held-out programs searched with and without the trained priors")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=learned.DEFAULT_WEIGHTS)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  rng = np.random.default_rng(args.seed)
  train_set, held_out, unseen = [], [], []
  cut = round(args.programs * (1 - args.held_out))
  for i in range(args.programs):
    sample = synthetic.sample(rng)
    if i >= cut:
      unseen.append(sample)
    name, _, _, shape, hw = sample
    t = time.perf_counter()
    ex = examples_of(sample, args.episodes, args.seed + i)
    (train_set if i < cut else held_out).extend(ex)
    print(f"[{time.perf_counter() - start:6.1f} s] program {i + 1}/{args.programs}: "
          f"{name} on {shape} {hw}: {len(ex)} examples ({time.perf_counter() - t:.1f} s)"
          + ("" if i < cut else " [held out]"), flush=True)
  print(f"training on {len(train_set)} examples, {len(held_out)} held out", flush=True)
  params, _ = train(train_set, held_out, args.epochs, args.seed,
                    log=lambda s: print(s, flush=True))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  width, rounds = PolicyNet.width, PolicyNet.rounds  # what `train` built
  learned.save(args.out, params, width, rounds)
  print(f"wrote {args.out} ({os.path.getsize(args.out) / 1024:.0f} KiB) in "
        f"{time.perf_counter() - start:.0f} s", flush=True)
  if args.compare > 0 and unseen:
    print(f"searching {min(args.compare, len(unseen))} held-out programs, uniform and "
          f"trained priors, {args.episodes // 2} episodes", flush=True)
    effect = search_effect(unseen[:args.compare], learned.LearnedPolicy(params, width, rounds),
                           args.episodes // 2, log=lambda s: print(s, flush=True))
    print(f"episodes to the best plan found, uniform / trained: median "
          f"{effect['median']:.2f}x, geometric mean {effect['geomean']:.2f}x; the trained "
          f"priors' final plan is worse on {effect['worse']} of {effect['programs']} programs")


if __name__ == "__main__":
  main()
