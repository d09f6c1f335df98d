"""Predict TPOT, TTFT and multi-request throughput of any plan on given profiles, and name its bottlenecks."""

from __future__ import annotations

from dataclasses import dataclass

from solver.cost_model import Instance, device_costs, evaluate
from solver.device_costs import layer_time
from solver.pipeline import makespan, phase_transition
from solver.plan import RingPlan


@dataclass(frozen=True)
class Prediction:
    tpot_s: float  # one request, decode
    ttft_s: float  # prompt of prompt_tokens, through the first sampled token
    throughput_tps: float  # tokens/s with `concurrency` requests in flight
    concurrency: int
    makespan_s: float  # time for one token of each of the concurrent requests
    prefetch: bool
    per_device_s: dict[str, float]  # busy per token: compute beside loads, outgoing hops (+ output on the head)
    stage_s: dict[str, float]  # pipeline stage time per token (no hops), the tau of `makespan`
    bottleneck_device: str
    bottleneck_links: tuple[str, ...]  # devices whose outgoing hop exceeds its slack (blocking case)
    serial_loads: tuple[str, ...]  # devices with loads prefetch cannot hide (on the ring's critical path)


def simulate(plan: RingPlan, inst: Instance, prompt_tokens: int = 128, concurrency: int = 1,
             prefetch: bool = True) -> Prediction:
    """prefetch=True: PRP, a device reads ahead into its stream buffer while the rest of the ring works and
    beside its own compute (cost_model: turns max(P_m, I_m)). prefetch=False: every load is serialised
    with compute (prima.cpp's additive model)."""
    if prompt_tokens < 1 or concurrency < 1:
        raise ValueError(f"prompt_tokens and concurrency must be >= 1, got {prompt_tokens}, {concurrency}")
    if [d.name for d in plan.devices] != [d.name for d in inst.devices]:
        raise ValueError("the plan's devices do not match the profiles (names / ring order)")
    k, w, n, ring = plan.k, plan.window_sizes, plan.gpu_layers, plan.in_ring
    br = evaluate(inst, k, w, n, ring, prefetch=prefetch)
    cs, m_ = device_costs(inst), inst.model
    kap = br.kappa_s

    # TTFT: the prompt's P tokens go round together: compute becomes FLOP-bound, hops carry P
    # activations, disk loads are paid once, and only the last token hits the output layer.
    pre, hops = [], []
    for c, d, wm, nm, r in zip(cs, inst.devices, w, n, ring):
        flops = prompt_tokens * m_.layer_flops
        cpu = layer_time(flops, c.b, d.cpu_flops, d.ram_bandwidth)
        gpu = layer_time(flops, c.b, d.gpu_flops, d.vram_bandwidth) if nm else 0.0
        pre.append(k * (cpu * (wm - nm) + gpu * nm + (c.visit if wm else 0.0)))
        hops.append(k * (d.link_latency_s + prompt_tokens * m_.activation_bytes / d.link_bandwidth
                          + d.frame_s) if r else 0.0)

    def beside(p: float, x: float) -> float:  # compute and reads: side by side with prefetch, else in turn
        return max(p, x) if prefetch else p + x

    ring_t = kap + sum(hops) + sum(beside(p, x) for p, x in zip(pre, br.inline_s))
    ttft = max([ring_t] + [kap + beside(p, x) for p, x in zip(pre, br.disk_s) if x > 0])

    # Throughput: the ring as a pipeline, one stage per member in token order (ranks 1..M-1,
    # then the head), stage time = its busy time per token (each token pays its loads), links =
    # its k hops; gRPC streams overlap sends with compute, hence "async". Conservative.
    members = [i for i in list(range(1, len(cs))) + [0] if ring[i]]
    tau = [br.stage_s[i] for i in members]
    d_links = [br.hop_s[i] for i in members]
    span = makespan(tau, d_links, concurrency, "async")
    busy = {cs[members[s]].name: t + d_links[s] for s, t in enumerate(tau)}
    return Prediction(
        tpot_s=br.tpot_s, ttft_s=ttft, throughput_tps=concurrency / span, concurrency=concurrency,
        makespan_s=span, prefetch=prefetch, per_device_s=busy,
        stage_s={cs[i].name: t for i, t in zip(members, tau)},
        bottleneck_device=max(busy, key=busy.get),
        bottleneck_links=tuple(cs[members[s]].name for s in phase_transition(tau, d_links)),
        serial_loads=tuple(c.name for c, x in zip(cs, br.inline_s) if x > 0))
