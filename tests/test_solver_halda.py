"""Halda on real python-mip: equals exhaustive search on small instances; rows hold on random ones."""

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest

from prima_rpc.spec.profiles import DeviceProfile, load_profiles
from prima_rpc.spec.windows import layer_ranges
from solver.cost_model import Instance, device_costs, evaluate
from solver.device_terms import allowed, fits, stream_turn
from solver.exhaustive import exhaustive
from solver.halda import _in_ring, build_model, divisors, halda, solve
from solver.model_profile import ModelProfile
from solver.plan import Infeasible
from solver.presets import preset
from solver.synthetic import N_CTX, cycled_devices, random_devices, small_instance, starved_devices
from tools.synth import synth

TESTBED = Path(__file__).resolve().parents[1] / "solver" / "testbeds" / "prima_d1_d4.json"


def check_rows(inst: Instance, plan) -> None:
    """The plan obeys every row of the LDA: (7), (8), RAM/VRAM, windows, roles."""
    L, cs = inst.model.n_layers, device_costs(inst)
    k, w = plan.k, plan.window_sizes
    assert k * sum(w) == L  # (8)
    for c, d, dev in zip(cs, plan.devices, inst.devices):
        assert 0 <= d.gpu_layers <= d.window  # (7)
        assert k * d.gpu_layers * c.b_prime <= (min(dev.vram_free, max(c.ram, 0)) if c.uma else dev.vram_free)
        assert allowed(c, k, d.window, d.gpu_layers)  # a Metal window fits in RAM (its prefetch premise)
        if c.forced_fit or d.set_label == "M4":
            assert fits(c, k, d.window, d.gpu_layers)  # M4 rows: the whole share fits
        if d.role in ("removed", "relay"):
            assert d.window == 0
        if d.role == "removed":
            assert c.routable
        if d.role == "relay":  # only a device the ring cannot drop (or no selection at all)
            assert d.name in inst.must_stay or plan.strategy == "halda-noselect"
    assert plan.devices[0].role == "head"
    covered = sorted(r for rs in layer_ranges(w, L) for r in rs)
    assert covered[0][0] == 0 and covered[-1][1] == L
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # contiguous, no overlap


def equal_to_oracle(instances, select: bool):
    """Halda's plan of each (seed, instance) checked against the exhaustive oracle (the same TPOT, or both
    infeasible) and every row; yields (instance, plan) where there is a plan."""
    for seed, inst in instances:
        plan, opt = halda(inst, select=select), exhaustive(inst, select=select)
        if opt is None:
            assert isinstance(plan, Infeasible), (seed, plan)
            continue
        assert not isinstance(plan, Infeasible), (seed, plan, opt)
        assert plan.predicted_tpot_s == pytest.approx(opt.tpot_s, rel=1e-6), (seed, plan, opt)
        check_rows(inst, plan)
        yield inst, plan


@pytest.mark.slow  # an exhaustive search beside each ILP
@pytest.mark.parametrize("select", [True, False])
@pytest.mark.parametrize("chunk", range(4))
def test_matches_exhaustive_search(select, chunk):
    seeds = range(chunk * 40, chunk * 40 + 40)
    assert list(equal_to_oracle(((s, small_instance(s)) for s in seeds), select))  # some are feasible


def with_visits(inst: Instance, seed: int) -> Instance:
    """The instance with a window-visit cost per device (0 to 3 of its layers' time: the term that makes a
    device's every round cost more than its layers)."""
    rng = random.Random(seed)
    devs = tuple(dataclasses.replace(d, visit_s=rng.choice([0.0, rng.uniform(0, 3) * c.alpha]))
                 for d, c in zip(inst.devices, device_costs(inst)))
    return dataclasses.replace(inst, devices=devs)


@pytest.mark.slow  # 9-13 s each
@pytest.mark.parametrize("select", [True, False])
def test_matches_exhaustive_search_with_window_visits(select):
    charged = 0
    for inst, plan in equal_to_oracle(((s, with_visits(small_instance(s), s)) for s in range(300, 380)), select):
        br = evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring)
        charged += sum(v > 0 for v in br.visit_s)
        assert br.terms_s["visits"] == pytest.approx(sum(plan.k * d.visit_s for d, w in
                                                         zip(inst.devices, plan.window_sizes) if w))
    assert charged > 20  # the term is really exercised


def with_reader_cpu(inst: Instance, seed: int) -> Instance:
    """The instance with a reader's CPU per byte per device (none, or up to twice its disk's time a byte: then
    the reader, not the disk, bounds its reads), the compute's loss per byte read beside it (none, or up to
    three times), a streamed layer's cold start (none, or up to 2 of its layers' time) and machines shared by
    some devices."""
    rng = random.Random(seed)
    devs = tuple(dataclasses.replace(d, read_cpu_s=rng.choice([0.0, rng.uniform(0, 2) / d.disk_seq_read]),
                                     read_loss_s=rng.choice([0.0, rng.uniform(0, 3) / d.disk_seq_read]),
                                     stream_layer_s=rng.choice([0.0, rng.uniform(0, 2) * c.alpha]),
                                     host=rng.choice(["", "a", "a", "b"]))
                 for d, c in zip(inst.devices, device_costs(inst)))
    return dataclasses.replace(inst, devices=devs)


@pytest.mark.slow  # 9-13 s each
@pytest.mark.parametrize("select", [True, False])
def test_matches_exhaustive_search_with_reader_cpu(select):
    shared = lone = 0
    for inst, plan in equal_to_oracle(((s, with_reader_cpu(small_instance(s), s)) for s in range(500, 600)), select):
        br = evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring)
        for c, cpu in zip(device_costs(inst), br.read_cpu_s):
            shared += cpu > 0 and c.shared_host
            lone += cpu > 0 and not c.shared_host
    assert shared >= 3 and lone >= 3, (shared, lone)  # both charges are really exercised


def test_a_reader_s_cpu_is_lost_by_the_compute_beside_it():
    """Disk 100 B/s, layers of 10 B, 35 B a token past memory, compute 0.5 s, k = 1 (one layer of buffer: 45 B
    read a token, 10 of them in the gap), 0.004 s of CPU a byte read. Alone on its machine the turn loses the
    CPU of the 35 B it reads itself: 0.5 + 0.14; where another device computes while it reads in its gap, that
    device loses the gap's 10 B too - charged to this device's share of the ring, all 45 B: 0.68 (and the turn
    needs no gap then: its compute outlasts its reads)."""
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.5, 35.0, 10.0, 0.0, 0.004, False) == pytest.approx((0.64, 10.0, 10.0))
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.5, 35.0, 10.0, 0.0, 0.004, True) == pytest.approx((0.68, 10.0, 0.0))
    # read-bound: the reads (0.35 s) outlast the compute and its CPU loss (0.5 -> 0.1 s of compute) ...
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.1, 35.0, 10.0, 0.0, 0.004, False)[0] == pytest.approx(0.35)
    # ... and do not hide the gap's loss on a shared machine: that is the neighbour's compute (0.35 + 10 x 0.004)
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.1, 35.0, 10.0, 0.0, 0.004, True) == pytest.approx((0.39, 10.0, 10.0))
    # A fast disk (1000 B/s) under 0.5 s the reads cannot overlap: a byte read in the turn costs 0.001 s, in a gap
    # on a shared machine 0.004; so it reads none there (0.5 + 0.045), where alone it hides the buffer's 10 B
    assert stream_turn(1000.0, 10.0, 0.5, 1, 0.1, 35.0, 10.0, 0.0, 0.004, True) == pytest.approx((0.545, 10.0, 0.0))
    assert stream_turn(1000.0, 10.0, 0.5, 1, 0.1, 35.0, 10.0, 0.0, 0.004, False) == pytest.approx((0.535, 10.0, 10.0))
    # a layer the turn waits for starts cold, 0.02 s more: a read-bound turn waits for 3.5 layers (0.35 + 0.07);
    # a compute-bound one waits for none (0.64 as without)
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.1, 35.0, 10.0, 0.0, 0.004, False, 0.02)[0] == pytest.approx(0.42)
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.5, 35.0, 10.0, 0.0, 0.004, False, 0.02)[0] == pytest.approx(0.64)
    inst = small_instance(3)
    two = dataclasses.replace(inst.devices[0], read_cpu_s=2e-9, disk_seq_read=1e9, host="m")
    costs = device_costs(dataclasses.replace(inst, devices=(two,), must_stay=frozenset()))[0]
    assert costs.disk == pytest.approx(5e8) and not costs.shared_host  # the reader's CPU bounds its rate
    assert costs.copy == 2e-9
    # measured, the compute's loss beside a reader is what a byte costs it; the reader's CPU still bounds its rate
    lossy = dataclasses.replace(two, read_loss_s=3e-9)
    costs = device_costs(dataclasses.replace(inst, devices=(lossy,), must_stay=frozenset()))[0]
    assert costs.copy == 3e-9 and costs.disk == pytest.approx(5e8)


@pytest.mark.parametrize("seed, L", [(1, 24), (2, 32), (3, 24), (5, 32), (7, 32), (9, 24)])
def test_matches_exhaustive_search_deeper_models(seed, L):
    inst = small_instance(seed, L=L, max_devices=3)
    plan, opt = halda(inst), exhaustive(inst)
    if opt is None:
        assert isinstance(plan, Infeasible)
    else:
        assert plan.predicted_tpot_s == pytest.approx(opt.tpot_s, rel=1e-6)


@pytest.mark.parametrize("name, count, seed", [("llama3-70b", 8, 1), ("qwen2.5-72b", 12, 2),
                                               ("qwen2.5-32b", 16, 3), ("llama3-8b", 6, 4)])
def test_rows_hold_on_random_clusters(name, count, seed):
    devs = random_devices(count, seed)
    inst = Instance(devs, preset(name), must_stay=frozenset({devs[-1].name}))
    plan = halda(inst)
    check_rows(inst, plan)
    br = evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring, strict=True)
    assert br is not None and br.tpot_s == pytest.approx(plan.predicted_tpot_s)


def test_rows_hold_on_small_random_instances():
    for seed in range(200, 260):
        inst = small_instance(seed)
        plan = halda(inst)
        if not isinstance(plan, Infeasible):
            check_rows(inst, plan)


def test_relay_when_ring_cannot_route_around():
    base = small_instance(11)
    inst = dataclasses.replace(base, must_stay=frozenset())
    plan = halda(inst)
    idle = [d.name for d in plan.devices[1:] if d.window == 0]
    assert idle, "instance should leave some device idle"
    stuck = dataclasses.replace(base, must_stay=frozenset(idle[:1]))
    p2 = halda(stuck)
    assert {d.name: d.role for d in p2.devices}[idle[0]] == "relay"


def test_noselect_keeps_every_device_computing():
    inst = Instance(random_devices(5, 7), preset("qwen2.5-32b"))
    plan = halda(inst, select=False)
    assert all(d.window >= 1 for d in plan.devices)
    assert plan.strategy == "halda-noselect"
    assert halda(inst).predicted_tpot_s <= plan.predicted_tpot_s


def test_infeasible_is_a_typed_result():
    inst = small_instance(0)
    head = inst.devices[0]
    poor = dataclasses.replace(head, ram_available=10)
    res = halda(Instance((poor,) + inst.devices[1:], inst.model, n_ctx=N_CTX))
    assert isinstance(res, Infeasible) and "cannot hold the embedding" in res.reason
    # Nobody can hold even one layer window, and the slow disk forbids offloading.
    tiny = dataclasses.replace(head, ram_available=inst.model.head_extra_bytes + 10, gpu_kind="none",
                               gpu_flops=0.0, vram_free=0, disk_seq_read=0.05e9)
    res = halda(Instance((tiny,), inst.model, n_ctx=N_CTX))
    assert isinstance(res, Infeasible) and "total memory + disk cannot hold the model" in res.reason


def test_layer_ranges_prima_order():
    assert layer_ranges([2, 1, 1], 8) == [[(2, 4), (6, 8)], [(0, 1), (4, 5)], [(1, 2), (5, 6)]]
    assert layer_ranges([0, 32, 0], 32) == [[], [(0, 32)], []]
    assert layer_ranges([3], 6) == [[(0, 3), (3, 6)]]


@pytest.mark.parametrize("windows, L, msg", [([2, 1], 8, "does not divide"), ([0, 0], 8, "at least one"),
                                             ([2, -1, 3], 8, ">= 0"), ([1], 0, "n_layers")])
def test_layer_ranges_validation(windows, L, msg):
    with pytest.raises(ValueError, match=msg):
        layer_ranges(windows, L)


@pytest.mark.parametrize("share, k", [(0.8, 6), (0.5, 12)])
def test_halda_picks_the_rounds_that_hide_the_disk(tmp_path, share, k):
    """tools/bench/bench_offload's ring: 3 nodes, 72 x 43 MiB layers, budgets of 80 % / 50 % of a 24-layer
    share, disks of 245 MB/s. k = 1 reads most loads on the ring's path (measured 2.2-2.5x the disk bound);
    enough rounds read them all in the gaps, at the bound (docs/offload.md, offload benchmark). Halda must find
    such k from the profiles alone, with one-layer stream buffers: more would only add reads."""
    store = synth(tmp_path / "o72", "offload-1g", layers=72, manifest_only=True)
    model = ModelProfile.from_json(json.loads((store / "manifest.json").read_text()))
    budget = int(share * 24 * model.layer_bytes_max)
    devs = tuple(DeviceProfile(name=f"n{i}", os="linux", cpu_flops=1e12, gpu_flops=0, gpu_kind="none",
                               ram_bandwidth=16e9, vram_bandwidth=0, disk_seq_read=245e6, disk_rand_read=245e6,
                               ram_available=budget + (model.head_extra_bytes if i == 0 else 0), vram_free=0,
                               link_latency_s=3e-4, link_bandwidth=1e9, frame_s=2.5e-4, is_head=i == 0)
                 for i in range(3))
    plan = halda(Instance(devs, model, n_ctx=512))
    assert plan.k == k and [d.window for d in plan.devices] == [24 // k] * 3
    assert [d.buffer_layers for d in plan.devices] == pytest.approx([1.0] * 3)
    one_round = evaluate(Instance(devs, model, n_ctx=512), 1, [24] * 3, [0] * 3)
    assert one_round.tpot_s > 1.8 * plan.predicted_tpot_s  # measured: 2.1x (80 %), 2.5x (50 %)


def test_stream_buffers_are_whole_layers():
    """A disk of 100 B/s, layers of 10 B, 35 B a token past memory, compute 0.1 s, k = 2. A buffer of j layers
    hides h = min(10 j, (G - P) d / k) a gap, no more than the turn needs ((35 + 10 j - 10) / 2: the turn reads
    10 B beside its compute); turn = max(0.1, (35 + 10 j - 2 h) / 100). j = 1: 0.25; j = 2: 0.15; j = 3: h = 27.5,
    0.1, the least, and the first so. (A buffer of 2.5 layers would reach it too, but a gap fills only whole
    matrices, and a buffer of whole layers exactly; nodes.engine.prefetch.)"""
    assert stream_turn(100.0, 10.0, 0.0, 2, 0.1, 35.0, 10.0) == pytest.approx((0.1, 30.0, 27.5))
    # a cycle of 0.5 s: (35 + 10 j) / 100 must fit, only j = 1: h = min(10, 0.4 * 100 / 2) = 10, turn 0.25
    assert stream_turn(100.0, 10.0, 0.0, 2, 0.1, 35.0, 0.5) == pytest.approx((0.25, 10.0, 10.0))
    assert stream_turn(100.0, 10.0, 0.0, 2, 0.1, 35.0, 0.4)[0] == math.inf  # not even one layer's reads fit
    # k = 1: a gap hides what the turn would read anyway, one layer; vectorised over options
    turn, buf, h = stream_turn(100.0, 10.0, 0.0, 1, [0.1, 0.1], [35.0, 5.0], 10.0)
    assert turn == pytest.approx([0.35, 0.1]) and buf == pytest.approx([10.0, 10.0])
    # 0.01 s per layer: its 4.5 streamed layers a token (35 + 10 B) compute beside no read, 0.045 s more in the
    # turn: the gap hides 10 B, the turn reads 35 B (0.35 s) and computes them: max(0.1, 0.35 + 0.045)
    assert stream_turn(100.0, 10.0, 0.0, 1, 0.1, 35.0, 10.0, 0.01) == pytest.approx((0.395, 10.0, 10.0))


def ilp_alone(inst: Instance) -> float:
    """The least TPOT over one ILP per k, with none of Halda's bounds, incumbents or its DP."""
    best = math.inf
    for k in divisors(inst.model.n_layers):
        sol = solve(build_model(inst, k))
        if sol:
            br = evaluate(inst, k, sol[0], sol[1], _in_ring(device_costs(inst), sol[0], sol[2], True), strict=True)
            best = min(best, br.tpot_s if br else math.inf)
    return best


@pytest.mark.parametrize("make, name, count, seed", [
    (lambda n, s: cycled_devices(load_profiles(TESTBED), n, s), "llama3-70b", 8, 0),
    (lambda n, s: cycled_devices(load_profiles(TESTBED), n, s), "llama3-70b", 6, 3),
    (random_devices, "llama3-8b", 8, 5), (random_devices, "qwen2.5-32b", 6, 6), (starved_devices, "llama3-70b", 5, 1)])
def test_every_speed_up_keeps_the_ilps_optimum(make, name, count, seed):
    """The fitting DP, the offload floors and the reads bound skip only what cannot win: Halda's TPOT is the
    least over plain per-k ILPs (the fitting DP decides the D1-D4 clusters here, the ILPs the starved one)."""
    inst = Instance(make(count, seed), preset(name))
    plan = halda(inst)
    assert plan.predicted_tpot_s == pytest.approx(ilp_alone(inst), rel=1e-6)
