"""Halda's rows for one device: the terms of solver/device_terms.py in linear form, on python-mip variables."""

from __future__ import annotations

import mip

from solver.device_costs import DeviceCosts


def device_rows(model, c: DeviceCosts, k: int, W: int, m: int, w, n, hop_on, T, unit: float,
                may_offload: bool = True, member=None):
    """Halda's rows for device m (mip variables w, n; hop_on: 1 when it talks; T: the cycle bound, all in
    units of `unit` seconds): the terms of `device_terms` and `stream_turn` in linear form. Returns its turns
    per token (an expression or a variable). may_offload=False: only plans where its share fits are wanted
    (any other costs more than the caller's bound). member: a binary that w > 0 forces to 1 (it pays the
    window visits; None: one is made when visits cost). Equation numbers: prima.cpp's paper, as in halda.py."""
    P = k / unit * (c.alpha * w + (c.beta * n if isinstance(n, mip.Var) else 0.0))
    if c.visit > 0:  # k visits a token when it holds layers (compute_time's w > 0)
        if member is None:
            member = model.add_var(f"holds({m})", var_type=mip.BINARY)
            model += w <= W * member, f"holds({m})"
        P = P + k * c.visit / unit * member
    cpu_w = w if c.uma else w - n  # layers per window held in RAM
    if c.uma:
        model += cpu_w <= c.ram_layers, f"window({m})"  # one window fits: its mmap prefetch can work
    if c.forced_fit or not may_offload:  # (31)-(33) M4 forced: disk too slow to offload to (or too slow to win)
        model += k * cpu_w <= c.ram_layers, f"eq31_fit({m})"
        return P
    y = model.add_var(f"y({m})", lb=0.0)  # disk seconds per token
    if c.experts:  # a mixture (device_terms.expert_terms): dense parts resident, expected misses read once routed
        model += k * c.dense_b_prime * (w - n) <= max(c.ram - c.step_bytes, 0), f"experts_dense({m})"
        model += y >= c.experts * (k * c.b_prime * (w - n) - c.ram) / c.disk / unit, f"experts_miss({m})"
        zt = model.add_var(f"turn({m})", lb=0.0)
        model += zt >= P + c.copy * c.disk * y, f"turn_compute({m})"
        model += zt >= y + k * c.dense_alpha / unit * (w - n), f"turn_reads({m})"
        return zt
    if c.uma:  # w = w4 + w2: M4 (z = 0, the share fits) or M2 (z = 1, (29): a = alpha + b/disk)
        z = model.add_var(f"z({m})", var_type=mip.BINARY)
        w4 = model.add_var(f"w4({m})", var_type=mip.INTEGER, lb=0, ub=c.ram_layers // k)
        w2 = model.add_var(f"w2({m})", var_type=mip.INTEGER, lb=0, ub=W)
        model += w == w4 + w2, f"uma_split({m})"
        model += w4 <= (c.ram_layers // k) * (1 - z), f"eq31_fit({m})"
        model += w2 <= W * z, f"m2_on({m})"
        model += w2 >= (c.ram_layers // k + 1) * z, f"m2_short({m})"  # short means over the fit
        model += y >= k * c.b / c.disk / unit * w2, f"eq29_m2({m})"  # the whole share re-read
        model += T >= P + y, f"eq6_prefetch({m})"  # Terms.cycle: its loads outlast the ring round
        return P
    # M1/M3 ((28)/(30): a = alpha + b'/disk, b = beta - b'/disk, minus what RAM keeps) or M4
    model += y >= (k * c.b_prime * (w - n) - c.ram) / c.disk / unit, f"eq30_m3({m})"
    o = model.add_var(f"o({m})", var_type=mip.BINARY)  # streams at all: it needs a stream buffer
    model += y <= k * W * c.b_prime / c.disk / unit * o, f"streams({m})"
    j = model.add_var(f"j({m})", var_type=mip.INTEGER, lb=0, ub=k * W)  # its stream buffer: whole layers
    model += j >= o, f"buffer({m})"  # at least one
    e = c.b / c.disk / unit * j  # its stream buffer's read time
    h = model.add_var(f"h({m})", lb=0.0)  # what one gap hides: at most the buffer
    model += h <= e, f"gap_fill({m})"
    v = model.add_var(f"v({m})", lb=0.0)  # reads in its own turns
    model += v >= y + e - k * h, f"inline({m})"
    zt = model.add_var(f"turn({m})", lb=0.0)  # its turns: compute and those reads side by side
    model += zt >= P + c.copy * c.disk * v, f"turn_compute({m})"  # the reader's CPU of its turns' bytes
    # ... but the streamed layers' compute (stream_turn): a per layer, (disk y + b j)/b layers; the layers it
    # waits for, disk v / b, start cold
    model += zt >= (v * (1 + c.cold * c.disk / c.b) + k * c.serial / unit * o + c.alpha * c.disk / c.b * y
                    + c.alpha / unit * j), f"turn_reads({m})"
    model += T >= zt + k * c.hop / unit * hop_on + k * h, f"cycle({m})"  # k gaps long enough
    # on a shared machine its gaps' bytes cost the device computing then their reader's CPU (stream_turn)
    return zt + c.copy * c.disk * k * h if c.shared_host else zt
