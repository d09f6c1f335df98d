"""Throughput for M concurrent requests (solver/throughput.py) vs the ring simulated event by event, edge cases."""

import itertools
import math
import random
from dataclasses import replace

import pytest

from prima_rpc.spec.profiles import DeviceProfile, devices_from_json
from solver.cost_model import Instance, device_costs, evaluate, kappa
from solver.event_sim import simulate_pipeline
from solver.halda import halda
from solver.halda_batch import halda_for
from solver.model_profile import ModelProfile
from solver.pipeline import makespan
from solver.plan import Infeasible, build_plan
from solver.ring_sim import Member, ring_steps, simulate_ring
from solver.simulator import simulate
from solver.synthetic import small_instance
from solver.throughput import batch_sizes, candidates, predict_throughput


def with_batches(inst: Instance, rng: random.Random) -> Instance:
    """Random hosts (some devices share one) and batch cost curves."""
    devs = tuple(replace(d, host=rng.choice(["h0", "h1", ""]),
                         batch_cost=((1, 1.0), (2, 1 + rng.random()), (8, 2 + 6 * rng.random())))
                 for d in inst.devices)
    return replace(inst, devices=devs)


def ring_members(plan, inst, sizes):
    """The simulator's ring: each member's turns and hops per round at each batch size, from the cost model."""
    devs = inst.devices
    order = [i for i in list(range(1, len(devs))) + [0] if plan.in_ring[i]]
    comp, hop, kap = {i: {} for i in order}, {i: {} for i in order}, {}
    for b in set(sizes):
        br = evaluate(replace(inst, batch=b), plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring)
        kap[b] = br.kappa_s
        for i in order:
            comp[i][b], hop[i][b] = br.turn_s[i] / plan.k, br.hop_s[i] / plan.k
    return [Member(devs[i].name, devs[i].host or devs[i].name, comp[i], hop[i]) for i in order], kap


def resident_cases():
    """Random instances whose plan keeps every layer in memory (the simulator has no disk)."""
    out = []
    for seed in range(80):
        rng = random.Random(seed)
        inst = with_batches(small_instance(seed), rng)
        plan = halda(inst)
        if isinstance(plan, Infeasible):
            continue
        br = evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring)
        if not any(br.disk_s) and sum(plan.in_ring) >= 2:
            out.append((seed, inst, plan))
    assert len(out) >= 15
    return out


CASES = resident_cases()


@pytest.mark.parametrize("mode", ["async", "blocking", "free"])
@pytest.mark.parametrize("M,B,G", [(1, 1, 1), (4, 2, 2), (6, 2, 3), (5, 1, 5), (8, 8, 1), (8, 2, 4)])
def test_equal_batches_match_the_event_simulation(mode, M, B, G):
    for seed, inst, plan in CASES:
        t = predict_throughput(plan, inst, M, B, G, mode)
        assert len(set(t.batches)) == 1
        members, kap = ring_members(plan, inst, t.batches)
        sim = simulate_ring(members, plan.k, kap, list(t.batches), mode, steps=200)
        # exact in steady state; 200 steps leave a transient of well under 0.5 %
        assert t.tpot_s == pytest.approx(sim, rel=5e-3), (seed, t)
        assert t.aggregate_tps == pytest.approx(M / t.tpot_s)


@pytest.mark.parametrize("mode", ["async", "blocking"])
def test_unequal_batches_are_a_lower_bound_close_to_the_simulation(mode):
    # (3, 3, 2): the closed form is a lower bound; circuits through batches of different sizes can hold a
    # resource idle (seen up to 7 % here), which is why a plan asks for equal batches where it can
    for seed, inst, plan in CASES:
        t = predict_throughput(plan, inst, 8, 3, 3, mode)
        members, kap = ring_members(plan, inst, t.batches)
        sim = simulate_ring(members, plan.k, kap, list(t.batches), mode, steps=200)
        assert t.tpot_s <= sim * (1 + 5e-3) and t.tpot_s >= sim * 0.9, (seed, t.tpot_s, sim)


def test_one_request_is_todays_prediction():
    for seed in range(40):
        inst = with_batches(small_instance(seed), random.Random(seed))
        plan = halda(inst)
        if isinstance(plan, Infeasible):
            continue
        t = predict_throughput(plan, inst, 1)
        assert (t.max_batch, t.micro_batches, t.batches) == (1, 1, (1,))
        assert t.tpot_s == plan.predicted_tpot_s == simulate(plan, inst).tpot_s
        assert t.aggregate_tps == pytest.approx(1 / plan.predicted_tpot_s)


def loopback(n=3, batch_cost=((1, 1.0), (2, 1.2), (4, 1.6), (8, 2.4)), host="same", output_cost=None):
    base = dict(os="linux", cpu_flops=2e10, gpu_flops=0.0, gpu_kind="none", ram_bandwidth=3e10, vram_bandwidth=0.0,
                disk_seq_read=1e9, disk_rand_read=1e8, ram_available=8 << 30, vram_free=0, link_latency_s=1e-4,
                link_bandwidth=1e9, frame_s=1e-4, token_s=2e-4, output_s=1e-3)
    devs = devices_from_json({"devices": [
        dict(base, name=f"n{i}", host=host if host else f"h{i}",
             batch_cost={str(b): c for b, c in batch_cost},
             output_batch_cost={str(b): c for b, c in (batch_cost if output_cost is None else output_cost)})
        for i in range(n)]})
    model = ModelProfile.from_dims(hidden=576, intermediate=1536, n_layers=30, n_heads=9, n_kv_heads=3,
                                   vocab=49152, max_seq_len=2048)
    return Instance(devs, model, n_ctx=256)


def test_a_shared_host_is_one_resource_and_batches_beat_micro_batches_there():
    inst = loopback()
    plan = halda(inst, select=False)
    t8 = predict_throughput(plan, inst, 8)
    assert t8.bottleneck == "shared host CPU (n1, n2, n0)"
    assert (t8.max_batch, t8.micro_batches) == (8, 1)  # nothing overlaps on one CPU: one batch of all
    assert t8.aggregate_tps > predict_throughput(plan, inst, 1).aggregate_tps * 2
    # the same devices on three hosts: the stages overlap, more batches in flight pay
    apart = loopback(host="")
    plan = halda(apart, select=False)
    t = predict_throughput(plan, apart, 8)
    assert t.micro_batches > 1 and t.aggregate_tps > predict_throughput(plan, apart, 8, 8, 1).aggregate_tps


def test_concurrency_below_and_above_the_batch():
    inst = loopback(host="")
    plan = halda(inst, select=False)
    assert batch_sizes(3, 4, 2) == (3,)  # below max_batch: one batch
    assert batch_sizes(9, 4, 2) == (4, 4)  # above max_batch * micro_batches: the rest wait their turn
    below = predict_throughput(plan, inst, 3, 4, 2)
    assert below.batches == (3,) and below.tpot_s == pytest.approx(below.round_trip_s)
    full = predict_throughput(plan, inst, 8, 4, 2)
    above = predict_throughput(plan, inst, 16, 4, 2)
    assert above.tpot_s == pytest.approx(2 * full.tpot_s) and above.aggregate_tps == pytest.approx(full.aggregate_tps)


def test_old_profiles_assume_no_gain_from_batching():
    inst = loopback(batch_cost=())
    assert inst.devices[0].batch_factor(8) == 8.0
    plan = halda(inst, select=False)
    # b rows cost b times one (links and per-request work too): a batch of 8 is 8 one-at-a-time steps but for the
    # links' latency, paid once
    one, eight = predict_throughput(plan, inst, 1), predict_throughput(plan, inst, 8, 8, 1)
    assert one.aggregate_tps <= eight.aggregate_tps < one.aggregate_tps * 1.1


def test_batch_factor_interpolates_and_extrapolates():
    d = loopback().devices[0]
    assert [d.batch_factor(b) for b in (1, 2, 3, 4, 6, 8, 16)] == pytest.approx([1, 1.2, 1.4, 1.6, 2.0, 2.4, 4.0])


@pytest.mark.parametrize("bad,msg", [
    ({"2": 1.1}, "size 1 at cost 1.0"), ({"1": 1.0, "2": -1}, "costs > 0"), ({"1": 2.0}, "size 1 at cost 1.0"),
    ({"x": 1.0}, "map batch sizes"), ({"0": 1.0, "1": 1.0}, "sizes >= 1")])
def test_batch_cost_validation(bad, msg):
    with pytest.raises(ValueError, match=msg):
        DeviceProfile.from_json(dict(loopback().devices[1].to_json(), batch_cost=bad))


def test_profiles_round_trip_with_host_and_curve():
    d = replace(loopback().devices[1], output_batch_cost=((1, 1.0), (8, 1.5)))
    assert DeviceProfile.from_json(d.to_json()) == d and d.output_batch_factor(4) == pytest.approx(1 + 0.5 * 3 / 7)
    old = {k: v for k, v in d.to_json().items() if k not in ("host", "batch_cost", "output_batch_cost")}
    assert DeviceProfile.from_json(old).batch_cost == DeviceProfile.from_json(old).output_batch_cost == ()
    assert DeviceProfile.from_json(old).output_batch_factor(3) == 3.0


@pytest.mark.parametrize("call,msg", [
    (lambda p, i: predict_throughput(p, i, 0), "concurrency"),
    (lambda p, i: predict_throughput(p, i, 4, 0, 1), "max_batch"),
    (lambda p, i: predict_throughput(p, i, 4, 2, 0), "micro_batches"),
    (lambda p, i: predict_throughput(p, i, True), "concurrency"),
    (lambda p, i: predict_throughput(p, i, 2, mode="eager"), "mode"),
    (lambda p, i: candidates(-1), "concurrency"),
    (lambda p, i: replace(i, batch=0), "batch"),
])
def test_invalid_input(call, msg):
    inst = loopback()
    plan = halda(inst, select=False)
    with pytest.raises(ValueError, match=msg):
        call(plan, inst)


def one_fast_device():
    """A fast head and two slower devices, each able to hold the whole model."""
    inst = loopback(host="")
    slow = [replace(d, cpu_flops=1e10, ram_bandwidth=1.5e10) for d in inst.devices[1:]]
    return replace(inst, devices=(inst.devices[0], *slow))


def test_halda_for_eight_requests_spreads_what_one_request_keeps_on_one_device():
    inst = one_fast_device()
    one = halda(inst)
    assert one.window_sizes == [30, 0, 0]  # one request: the fast head alone, no hops
    plan, t8 = halda_for(inst, 8)
    assert plan.window_sizes != one.window_sizes and all(plan.window_sizes)  # eight: every device works at once
    assert t8.micro_batches > 1
    # it beats the one-request plan at its own best batching, and it is priced as every plan is (one request)
    assert t8.aggregate_tps > predict_throughput(one, inst, 8).aggregate_tps * 1.05
    assert t8 == predict_throughput(plan, inst, 8, t8.max_batch, t8.micro_batches)
    assert plan.predicted_tpot_s == evaluate(inst, plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring).tpot_s


def test_halda_for_one_request_is_halda():
    for seed in range(30):
        inst = with_batches(small_instance(seed), random.Random(seed))
        base, got = halda(inst), halda_for(inst, 1)
        if isinstance(base, Infeasible):
            assert isinstance(got, Infeasible)
            continue
        plan, t = got
        assert (plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring) == \
            (base.k, base.window_sizes, base.gpu_layers, base.in_ring)
        assert t.tpot_s == base.predicted_tpot_s


@pytest.mark.slow  # ILPs for each concurrency
def test_halda_for_concurrency_never_loses_to_the_one_request_plan():
    for seed in range(12):
        inst = with_batches(small_instance(seed, max_devices=3), random.Random(seed))
        base = halda(inst)
        if isinstance(base, Infeasible):
            continue
        for M in (2, 8):
            _, t = halda_for(inst, M)
            assert t.tpot_s <= predict_throughput(base, inst, M).tpot_s * (1 + 1e-9)


def test_a_batch_costs_its_layers_output_hops_and_head_work_by_their_own_rules():
    inst = loopback(host="", output_cost=((1, 1.0), (8, 1.5)))
    one, eight = (device_costs(replace(inst, batch=b)) for b in (1, 8))
    d, m = inst.devices[1], inst.model
    assert eight[1].alpha == pytest.approx(2.4 * one[1].alpha)  # the layers' curve
    assert eight[1].serial == pytest.approx(2.4 * one[1].serial) and eight[1].copy == one[1].copy  # reads: once
    # a hop: the latency once, each frame's bytes and software cost
    assert eight[1].hop == pytest.approx(d.link_latency_s + 8 * (m.activation_bytes / d.link_bandwidth + d.frame_s))
    head = inst.devices[0]
    assert kappa(replace(inst, batch=8)) == pytest.approx(head.output_s * 1.5 + 8 * head.token_s)
    assert kappa(inst) == head.output_s + head.token_s


def best_by_enumeration(inst: Instance, M: int) -> float:
    """The least period for M requests over every (k, w, n) of a small instance, each at its best batching."""
    cs, L, best = device_costs(inst), inst.model.n_layers, math.inf
    for k in (k for k in range(1, L + 1) if L % k == 0):
        for w in itertools.product(range(L // k + 1), repeat=len(cs)):
            if sum(w) != L // k:
                continue
            ring = [wm > 0 or not c.routable for c, wm in zip(cs, w)]
            for n in itertools.product(*[range(min(wm, c.gpu_cap // k) + 1) for c, wm in zip(cs, w)]):
                if evaluate(inst, k, list(w), list(n), ring, strict=True) is not None:
                    plan = build_plan(inst, k, list(w), list(n), ring, 0.0, "enumerated")
                    best = min(best, predict_throughput(plan, inst, M).tpot_s)
    return best


@pytest.mark.slow  # 45 s
def test_halda_for_concurrency_finds_the_best_plan_of_small_instances():
    checked = 0
    for seed in range(24):
        rng = random.Random(seed)
        inst = with_batches(small_instance(seed, L=rng.choice([4, 6, 8]), max_devices=3), rng)
        if isinstance(halda(inst), Infeasible):
            continue
        for M in (4, 8):
            _, t = halda_for(inst, M)
            assert t.tpot_s == pytest.approx(best_by_enumeration(inst, M), rel=1e-9), (seed, M)
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("mode", ["free", "async"])
def test_the_simulated_ring_s_first_wave_is_heteropipe_s_makespan(mode):
    # One round, every member on its own host, hops no longer than any compute (no send waits for another):
    # G batches started together reach the head after event_sim's (and pipeline.makespan's) time for G micro-batches.
    rng = random.Random(7)
    for _ in range(50):
        S, G = rng.randint(1, 5), rng.randint(1, 6)
        tau = [rng.uniform(1.0, 5.0) for _ in range(S)]
        d = [rng.uniform(0.0, 1.0) for _ in range(S)] if S > 1 else [0.0]
        members = [Member(f"m{s}", f"h{s}", {1: tau[s]}, {1: d[s]}) for s in range(S)]
        first = max(steps[0] for steps in ring_steps(members, 1, {1: 0.0}, [1] * G, mode, 1))
        assert first == pytest.approx(makespan(tau, d, G, mode), rel=1e-12)
        assert first == pytest.approx(simulate_pipeline(tau, d, G, mode), rel=1e-12)
