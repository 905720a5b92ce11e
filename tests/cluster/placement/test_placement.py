"""The placement DP against a brute force over every plan, written out here."""

import itertools

import numpy as np
import pytest

import automap
from automap import cluster
from automap._src.cluster.placement import stage_costs
from automap.cluster import Layer, LayerCost, LayerGraph

GiB = 2**30


def flat(hbm: float, sync: float = 4 * GiB, latency: float = 0.0) -> automap.Hardware:
  """One flat interconnect; `sync` counts both directions, as PHAZE does."""
  return automap.Hardware(name="flat", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12,
                          hbm_capacity=hbm, link_bandwidth=sync / 2, link_latency=latency,
                          network_bandwidth=sync / 2, network_latency=latency,
                          devices_per_node=1 << 20)


def downsets(graph: LayerGraph) -> list[frozenset]:
  names = [layer.name for layer in graph.layers]
  preds = {n: {s for s, d, _ in graph.edges if d == n} for n in names}
  return [frozenset(c) for r in range(len(names) + 1) for c in itertools.combinations(names, r)
          if all(preds[n] <= set(c) for n in c)]


def brute_force(graph: LayerGraph, *, devices, microbatches, hbm, sync, latency=0.0,
                optimizer=0.0, zero=0, recompute=("none", "full", "selective", "dots"),
                overlap=True):
  """min over every plan of its time per batch, from the cost rules in place()'s docs."""
  recompute = [("full" if r else "none") if isinstance(r, bool) else r for r in recompute]
  layers = {layer.name: layer for layer in graph.layers}
  downs = downsets(graph)
  full = frozenset(layers)
  bw = sync / 2

  def send(nbytes):
    return nbytes / bw + latency if nbytes else 0.0

  def chains(prefix):
    if prefix[-1] == full:
      yield prefix
    for nxt in downs:
      if prefix[-1] < nxt:
        yield from chains(prefix + [nxt])

  best = np.inf
  for d in range(1, devices + 1):
    if microbatches % d:
      continue
    m = microbatches // d
    for chain in chains([frozenset()]):
      stages = [b - a for a, b in zip(chain, chain[1:])]
      s_count = len(stages)
      options = []
      for i, stage in enumerate(stages):
        widths = set.intersection(*(set(layers[n].widths) for n in stage))
        choices = []
        for t, r in itertools.product(sorted(widths), recompute):
          c = [layers[n].widths[t] for n in stage]
          params = sum(x.params for x in c)
          acts = sum(x.activations for x in c)
          b_in = sum(b for s, e, b in graph.edges if e in stage and s not in stage) / t
          b_out = sum(b for s, e, b in graph.edges if s in stage and e not in stage) / t
          fw, bwd = sum(x.forward for x in c), sum(x.backward for x in c)
          n = min(s_count - i, m)
          opt = optimizer * params / (d if zero >= 1 else 1)
          # Per layer: full keeps every layer's input and rebuilds one layer at
          # a time; selective drops and rebuilds the attention scores; dots
          # keeps the inputs and matmul outputs and rebuilds one layer's rest.
          inputs = sum(b for n_ in stage for _, e, b in graph.edges if e == n_) / t
          selective = sum(x.selective for x in c)
          if r == "dots" and any(x.dots is None for x in c):
            continue
          if r == "none":
            held = n * acts
          elif r == "full":
            held = n * inputs + max(x.activations for x in c)
          elif r == "selective":
            held = n * (acts - selective) + max(x.selective for x in c)
          else:
            held = (n * (inputs + sum(x.dots for x in c))
                    + max(max(x.activations - x.dots, 0) for x in c))
          if 2 * params + opt + held > hbm:
            continue
          rebuild = {"none": 0.0, "full": fw,
                     "selective": sum(x.selective_forward for x in c),
                     "dots": sum(x.dots_forward for x in c)}[r]
          time = fw + bwd + rebuild + 2 * (send(b_in) + send(b_out))
          sync_time = 2 * ((d - 1) / d * params / bw + (d - 1) * latency) if d > 1 else 0.0
          if overlap:  # beside the last backward, one piece per layer
            k = len(stage)
            sync_time = sync_time / k + (k - 1) / k * max(0.0, sync_time - bwd - rebuild)
          choices.append((t, time, sync_time))
        options.append(choices)
      for combo in itertools.product(*options):
        if sum(t for t, _, _ in combo) * d > devices:
          continue
        total = (m + s_count - 1) * max(c[1] for c in combo) + max(c[2] for c in combo)
        best = min(best, total)
  return best


def phaze_chain():
  """Four layers: forward 1, backward 2, 1e9 bytes of parameters, 0.5e9 of activations."""
  return LayerGraph.chain([Layer.of(f"layer{i}", 1, 2, 1e9, 0.5e9) for i in range(4)])


@pytest.mark.parametrize("hbm, recompute, data_parallel, stages, expected", [
    (100e9, False, 8, [4], 27.2596),
    (5e9, False, 2, [1, 1, 1, 1], 33.4657),
    (5e9, True, 4, [2, 2], 41.3970),
])
def test_phaze_cases_match_brute_force(hbm, recompute, data_parallel, stages, expected):
  """PHAZE's model: the sync after the flush, nothing overlapped."""
  graph = phaze_chain()
  plan = cluster.place(graph, devices=8, microbatches=16, hardware=flat(hbm), optimizer="sgd",
                       zero=0, recompute=recompute, overlap=False)
  assert plan.data_parallel == data_parallel
  assert [len(s.layers) for s in plan.stages] == stages
  assert all(s.recompute == recompute for s in plan.stages)
  brute = brute_force(graph, devices=8, microbatches=16, hbm=hbm, sync=4 * GiB,
                      recompute=(recompute,), overlap=False)
  assert plan.time == pytest.approx(brute, rel=1e-12)
  assert plan.time == pytest.approx(expected, abs=1e-4)


def random_cost(rng, speed: float = 1.0, width: int = 1) -> LayerCost:
  """A layer's cost; part of its activations (attention scores) selective
  recompute may drop and rebuild in a share of its forward; the "dots"
  policy keeps a share (matmul outputs) and reruns another."""
  forward, acts = rng.uniform(0.5, 1.5) / speed, rng.uniform(0.2, 1) * 1e9 / width
  return LayerCost(forward, rng.uniform(1, 3) / speed, rng.uniform(0.5, 2) * 1e9 / width, acts,
                   selective=rng.uniform(0, 0.7) * acts,
                   selective_forward=rng.uniform(0.05, 0.3) * forward,
                   dots=rng.uniform(0.1, 0.6) * acts, dots_forward=rng.uniform(0.2, 0.8) * forward)


def random_graph(rng, n_layers, branching):
  layers = []
  for i in range(n_layers):
    tp = {}
    if rng.random() < 0.7:  # a 2-wide version: faster per device, with overheads
      tp[2] = random_cost(rng, rng.uniform(1.2, 2.0), 2)
    layers.append(Layer(f"l{i}", {1: random_cost(rng), **tp}))
  if not branching:
    return LayerGraph.chain(layers, [float(rng.uniform(0, 2e8)) for _ in layers[1:]])
  edges = [(f"l{i}", f"l{j}", float(rng.uniform(0, 2e8)))
           for j in range(1, n_layers) for i in range(j) if i == j - 1 or rng.random() < 0.3]
  return LayerGraph(tuple(layers), tuple(edges))


def matches_brute_force(graph, *, devices, microbatches, hbm, latency=0.0, optimizer=0.0,
                        zero=0):
  """place() finds the brute force's optimum, or says no plan fits."""
  brute = brute_force(graph, devices=devices, microbatches=microbatches, hbm=hbm, sync=4 * GiB,
                      latency=latency, optimizer=optimizer, zero=zero)
  run = lambda: cluster.place(  # noqa: E731
      graph, devices=devices, microbatches=microbatches, optimizer=optimizer, zero=zero,
      hardware=flat(hbm, latency=latency))
  if np.isinf(brute):
    with pytest.raises(cluster.PlacementError, match="memory_limit"):
      run()
    return
  plan = run()
  assert plan.time == pytest.approx(brute, rel=1e-9)
  assert sum(s.width for s in plan.stages) * plan.data_parallel == plan.devices <= devices
  assert all(s.memory <= hbm for s in plan.stages)
  assert sorted(n for s in plan.stages for n in s.layers) == sorted(
      layer.name for layer in graph.layers)


@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_match_brute_force(seed):
  rng = np.random.default_rng(seed)
  graph = random_graph(rng, int(rng.integers(2, 6)), branching=seed % 2 == 1)
  devices = int(rng.choice([2, 4, 8]))
  microbatches = int(rng.choice([2, 4, 8]))
  hbm = float(rng.uniform(4, 12)) * 1e9
  latency = float(rng.choice([0.0, 1e-3]))
  optimizer, zero = (2.0, int(rng.integers(0, 2))) if seed % 3 == 0 else (0.0, 0)
  matches_brute_force(graph, devices=devices, microbatches=microbatches, hbm=hbm,
                      latency=latency, optimizer=optimizer, zero=zero)


@pytest.mark.parametrize("seed", range(12))
def test_repeated_blocks_under_tight_memory_match_brute_force(seed):
  # Stages of a repeated block share their costs, and the memory bounds
  # prune: both must leave the optimum where the brute force finds it.
  rng = np.random.default_rng(100 + seed)
  block = random_graph(rng, 1, branching=False).layers[0]
  ends = random_graph(rng, 2, branching=False).layers
  graph = LayerGraph.chain([ends[0], Layer("block", block.widths), ends[1]],
                           float(rng.uniform(0, 2e8))).repeat("block", int(rng.integers(2, 5)))
  devices, microbatches = int(rng.choice([4, 8])), int(rng.choice([4, 8, 16]))
  # From roomy to barely enough: stashing, recompute and ZeRO each decide.
  hbm = float(rng.uniform(5, 14)) * 1e9
  matches_brute_force(graph, devices=devices, microbatches=microbatches, hbm=hbm,
                      optimizer=2.0, zero=int(rng.integers(0, 2)))


@pytest.mark.parametrize("seed", range(6))
def test_memory_bound_never_exceeds_the_best_assignment(seed):
  # The planner prunes with `packed`: a relaxation of choosing each layer's
  # width and recompute within a memory budget. It must never exceed the
  # best such choice, or the search would discard optimal plans.
  rng = np.random.default_rng(200 + seed)
  graph = random_graph(rng, 4, branching=False)
  options = cluster.PlacementOptions(optimizer=2.0, zero=(0, 1))
  problem = stage_costs.problem(8, 8, flat(4e9), options)
  costs = stage_costs.StageCosts(graph, problem)
  in_flight, d, zero = int(rng.integers(1, 5)), int(rng.choice([1, 2])), int(rng.integers(0, 2))
  menus = []
  for layer in graph.layers:
    menu = []
    entering = sum(b for _, e, b in graph.edges if e == layer.name)
    for t, c in layer.widths.items():
      fixed = 2 * c.params + 2.0 * c.params / (d if zero else 1)
      menu += [(t * (c.forward + c.backward), t * (fixed + in_flight * c.activations)),
               (t * (2 * c.forward + c.backward),
                t * (fixed + in_flight * entering / t + c.activations)),
               (t * (c.forward + c.backward + c.selective_forward),
                t * (fixed + in_flight * (c.activations - c.selective) + c.selective)),
               (t * (c.forward + c.backward + c.dots_forward),
                t * (fixed + in_flight * (entering / t + c.dots)
                     + max(c.activations - c.dots, 0.0)))]
    menus.append(menu)
  everything = (1 << len(graph.layers)) - 1
  for devices in (1, 2, 4, 5, 6, 7, 8, 10, 12, 16):
    best = min((sum(w for w, _ in pick) for pick in itertools.product(*menus)
                if sum(b for _, b in pick) <= devices * 4e9), default=np.inf)
    bound = costs.packed_work(everything, in_flight, d, zero, devices)
    assert bound <= best * (1 + 1e-12)
    assert bound >= sum(min(w for w, _ in menu) for menu in menus) * (1 - 1e-12)


def test_branching_stages_are_downsets():
  """A diamond a -> (b, c) -> d: stages must keep every predecessor earlier."""
  layers = [Layer.of(n, 1.0, 2.0, 1e9, 0.4e9) for n in "abcd"]
  edges = (("a", "b", 1e8), ("a", "c", 1e8), ("b", "d", 1e8), ("c", "d", 1e8))
  graph = LayerGraph(tuple(layers), edges)
  plan = cluster.place(graph, devices=4, microbatches=8, hardware=flat(4e9), optimizer="sgd",
                       zero=0, recompute=False)
  seen: set[str] = set()
  for stage in plan.stages:
    for name in stage.layers:
      assert {s for s, d, _ in edges if d == name} <= seen | set(stage.layers)
    seen |= set(stage.layers)
  brute = brute_force(graph, devices=4, microbatches=8, hbm=4e9, sync=4 * GiB,
                      recompute=(False,))
  assert plan.time == pytest.approx(brute, rel=1e-12)
  assert len(plan.stages) > 1  # the memory limit forces a pipeline


def test_slow_network_keeps_data_parallel_sync_inside_a_node():
  """Across nodes the sync is 100x slower: the plan pipelines over nodes instead."""
  layers = [Layer.of(f"l{i}", 1.0, 2.0, 4e9, 0.1e9) for i in range(4)]
  graph = LayerGraph.chain(layers, 1e6)
  hw = automap.Hardware(name="two-level", flops=1e12, fp32_flops=1e12, hbm_bandwidth=1e12,
                        hbm_capacity=100e9, link_bandwidth=10e9, link_latency=0.0,
                        network_bandwidth=0.1e9, network_latency=0.0, devices_per_node=2)
  plan = cluster.place(graph, devices=8, microbatches=8, hardware=hw, optimizer="sgd", zero=0)
  assert plan.data_parallel <= 2
  flat_plan = cluster.place(graph, devices=8, microbatches=8, optimizer="sgd", zero=0,
                            hardware=flat(100e9, sync=20e9))
  assert flat_plan.data_parallel == 8


def test_memory_limit_none_means_no_limit_as_in_a_sharding_search():
  """One meaning for memory_limit across automap: "device" (the default)
  holds plans to the hardware's capacity, None to nothing, a number to
  that many bytes per device."""
  assert cluster.PlacementOptions().memory_limit == "device"
  assert cluster.ClusterOptions().memory_limit == automap.SearchOptions().memory_limit
  graph = LayerGraph.chain([Layer.of(f"l{i}", 1.0, 2.0, 2e9, 0.1e9) for i in range(2)])
  kw = dict(devices=4, microbatches=4, hardware=flat(7e9), optimizer="adam", zero=0)
  for limit in ("device", 7e9):
    with pytest.raises(cluster.PlacementError, match="memory_limit"):
      cluster.place(graph, memory_limit=limit, **kw)
  unlimited = cluster.place(graph, memory_limit=None, **kw)
  assert max(s.memory for s in unlimited.stages) > 7e9


def test_zero_shards_optimizer_state_to_fit():
  layers = [Layer.of(f"l{i}", 1.0, 2.0, 2e9, 0.1e9) for i in range(2)]
  graph = LayerGraph.chain(layers)
  with pytest.raises(cluster.PlacementError, match="memory_limit"):
    cluster.place(graph, devices=4, microbatches=4, hardware=flat(7e9), optimizer="adam",
                  zero=0)
  plan = cluster.place(graph, devices=4, microbatches=4, hardware=flat(7e9), optimizer="adam")
  assert plan.zero >= 1
  assert all(s.memory <= 7e9 for s in plan.stages)


def test_placement_round_trips_through_json():
  plan = cluster.place(phaze_chain(), devices=8, microbatches=16, hardware=flat(5e9),
                       optimizer="sgd", zero=0)
  assert cluster.Placement.from_json(plan.to_json()) == plan
  assert sum(plan.breakdown.values()) == pytest.approx(plan.time)


@pytest.mark.parametrize("kwargs, match", [
    ({"devices": 0}, "devices must be a positive int"),
    ({"microbatches": 2.5}, "microbatches must be a positive int"),
    ({"optimizer": "lion"}, "optimizer must be one of"),
    ({"zero": 4}, "zero must be a stage in 0..3"),
    ({"memory_limit": -1}, "memory_limit must be a positive number"),
    ({"hardware": "tpu-v9"}, "hardware must be"),
    ({"widths": [0]}, "widths must be positive ints"),
])
def test_bad_options_name_the_argument(kwargs, match):
  args = {"devices": 8, "microbatches": 16, "hardware": flat(5e9)} | kwargs
  with pytest.raises((cluster.PlacementError, automap.HardwareError), match=match):
    cluster.place(phaze_chain(), **args)


def test_bad_graphs_name_the_problem():
  with pytest.raises(cluster.PlacementError, match="unique"):
    LayerGraph.chain([Layer.of("a", 1, 1, 1, 1), Layer.of("a", 1, 1, 1, 1)])
  with pytest.raises(cluster.PlacementError, match="cycle"):
    LayerGraph((Layer.of("a", 1, 1, 1, 1), Layer.of("b", 1, 1, 1, 1)),
               (("a", "b", 0.0), ("b", "a", 0.0)))
  with pytest.raises(cluster.PlacementError, match="known layers"):
    LayerGraph((Layer.of("a", 1, 1, 1, 1),), (("a", "z", 0.0),))
  with pytest.raises(cluster.PlacementError, match="LayerCost.forward"):
    Layer.of("a", -1, 1, 1, 1)


def test_a_fixed_split_is_priced_as_given():
  """Megatron-style p x d: the DP only splits the layers, so free search never loses."""
  graph = phaze_chain()
  fixed = cluster.place(graph, devices=8, microbatches=16, hardware=flat(100e9),
                        optimizer="sgd", zero=0, data_parallel=2, stages=4, recompute=False)
  assert (fixed.data_parallel, len(fixed.stages)) == (2, 4)
  # (8 microbatches + 3) x 3 s per layer + the 2-way sync of one layer.
  assert fixed.time == pytest.approx(11 * 3 + 2 * 0.5 * 1e9 / (2 * GiB))
  free = cluster.place(graph, devices=8, microbatches=16, hardware=flat(100e9),
                       optimizer="sgd", zero=0, recompute=False)
  assert free.time < fixed.time
  with pytest.raises(cluster.PlacementError, match="in 5 stages"):
    cluster.place(graph, devices=8, microbatches=16, hardware=flat(100e9), stages=5)


def test_repeat_stands_a_block_for_many():
  graph = LayerGraph.chain([Layer.of("embed", 1, 1, 1e9, 0.1e9),
                            Layer.of("block", 1, 2, 1e9, 0.5e9),
                            Layer.of("head", 1, 1, 1e9, 0.1e9)], [3e6, 5e6])
  deep = graph.repeat("block", 3)
  assert [layer.name for layer in deep.layers] == ["embed", "block", "block*2", "block*3", "head"]
  assert sorted(deep.edges) == sorted([("embed", "block", 3e6), ("block", "block*2", 3e6),
                                       ("block*2", "block*3", 3e6), ("block*3", "head", 5e6)])
  with pytest.raises(cluster.PlacementError, match="no layer 'tail'"):
    graph.repeat("tail", 2)


def test_options_object_and_keywords_place_alike():
  keywords = {"optimizer": "sgd", "zero": 0, "recompute": False, "widths": [1],
              "data_parallel": 2, "stages": 4, "memory_limit": 90e9}
  by_keywords = cluster.place(phaze_chain(), devices=8, microbatches=16, hardware=flat(100e9),
                              **keywords)
  options = cluster.PlacementOptions(**keywords)
  assert options.zero == (0,) and options.widths == (1,)
  by_options = cluster.place(phaze_chain(), devices=8, microbatches=16, hardware=flat(100e9),
                             options=options)
  assert by_options == by_keywords
  default = cluster.place(phaze_chain(), devices=8, microbatches=16, hardware=flat(5e9))
  assert cluster.place(phaze_chain(), devices=8, microbatches=16, hardware=flat(5e9),
                       options=cluster.PlacementOptions()) == default


@pytest.mark.parametrize("fields, match", [
    ({"zero": (1, 5)}, r"PlacementOptions.zero must be a stage in 0..3.*zero=1"),
    ({"optimizer": "lion"}, r"PlacementOptions.optimizer must be one of \['adam'.*factor"),
    ({"optimizer": -1.0}, r"PlacementOptions.optimizer state factor must be a number >= 0"),
    ({"recompute": "yes"}, r"PlacementOptions.recompute must be True .*, False .* or None"),
    ({"widths": 4}, r"PlacementOptions.widths must be positive ints, got 4; e.g. widths="),
    ({"memory_limit": 0}, r"PlacementOptions.memory_limit must be a positive number.*'device'"),
    ({"stages": 0}, r"PlacementOptions.stages must be None \(searched\) or a positive int"),
])
def test_bad_placement_options_name_the_field(fields, match):
  with pytest.raises(cluster.PlacementError, match=match):
    cluster.PlacementOptions(**fields)


def test_an_option_given_both_ways_or_misspelt_is_a_type_error():
  run = lambda **kw: cluster.place(phaze_chain(), devices=8, microbatches=16,  # noqa: E731
                                   hardware=flat(5e9), **kw)
  with pytest.raises(TypeError, match=r"place\(\) got zero= as keyword\(s\) and options= too"):
    run(options=cluster.PlacementOptions(zero=1), zero=1)
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'zeros'.*memory_limit"):
    run(zeros=1)
  with pytest.raises(TypeError,
                     match=r"options must be an automap.cluster.PlacementOptions, got dict"):
    run(options={"zero": 1})
