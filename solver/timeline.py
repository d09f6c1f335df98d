"""One token's journey through a plan, as bars on a time axis: where the time goes, which device is the bottleneck.

Input: the plan JSON of `solver.strategies.plan_to_json` with the cost model's terms (per device compute_ms,
disk_ms, inline_ms, serial_ms, turn_ms, cycle_ms, link_ms; output_ms). It draws them; it computes no cost:

    each round r = 0..k-1: the head sends (link), ranks 1..M-1 in ring order compute [+ reads] link,
    then the head computes the round's last window; after the last round the output layer.

A device's reads in its own turns (inline_ms) run beside its compute, but for serial_ms of it (a round's
first attention and last down projection); where they outlast it, the rest is on the critical path.
The prefetched rest runs in its own lane during the gap before each turn;
those of the first round began during the previous token, so they are drawn wrapped round to its end
(the steady state, modulo one TPOT). When a device's cycle (turns, link, and gaps long enough for its
prefetch) outlasts the ring round, the token waits for it (the cost model's max): that wait is spread
over the rounds, before its turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

KINDS = ("compute", "output", "load", "beside", "prefetch", "link", "wait")
COLORS = {"compute": "#4C72B0", "output": "#1B2F5C", "load": "#DD8452", "beside": "#E9A97A", "prefetch": "#F2B98C",
          "link": "#55A868", "wait": "#FFFFFF"}
LEGEND = {"compute": "compute (its layers)", "output": "output layer (head)", "load": "disk reads, on the path",
          "beside": "disk reads beside compute", "prefetch": "disk reads, prefetched in the gap",
          "link": "link to the successor", "wait": "ring waits for a device's cycle"}
SIDE = ("beside", "prefetch")  # lanes beside the critical path


@dataclass(frozen=True)
class Bar:
    device: int  # index in plan["devices"] (ring order, head first)
    kind: str  # one of KINDS
    start_ms: float
    ms: float
    round: int
    label: str = ""  # the layers of a compute bar, e.g. "[14,37)"


KEYS = ("compute_ms", "disk_ms", "inline_ms", "serial_ms", "turn_ms", "cycle_ms", "link_ms")


def _timings(plan: dict) -> list[dict]:
    if "infeasible" in plan:
        raise ValueError(f"the plan is infeasible: {plan['infeasible']}")
    devices = plan.get("devices") or []
    if not devices or not all(set(KEYS) <= set(d) for d in devices) or "output_ms" not in plan:
        raise ValueError(f"the plan has no per-device timings ({', '.join(KEYS)}, output_ms); "
                         "solve it again with this version of `prima-ctl plan`")
    return devices


def journey(plan: dict) -> tuple[list[Bar], float]:
    """The bars of one token in the steady state, and its duration in ms (the cost model's TPOT)."""
    devices = _timings(plan)
    k = int(plan["k"])
    members = [i for i, d in enumerate(devices) if d["role"] != "removed"]
    order = [i for i in members if i != 0] + [0]  # a round: ranks 1..M-1, then the head
    per = [{key: d[key] / k for key in KEYS} for d in devices]
    out_ms = float(plan["output_ms"])

    # TPOT = max(ring, each device's cycle): the cost model's terms, as the plan carries them.
    ring = out_ms + sum(d["turn_ms"] + d["link_ms"] for d in devices)
    own = {i: d["cycle_ms"] for i, d in enumerate(devices) if d["cycle_ms"] > 0}
    slowest = max(own, key=own.get, default=None)
    wait = max(own[slowest] - ring, 0.0) / k if slowest is not None else 0.0
    wait = wait if wait > 1e-9 * ring else 0.0  # a cycle that binds as tightly as the ring: no wait

    bars: list[Bar] = []
    t = 0.0

    def put(device: int, kind: str, ms: float, r: int, label: str = "") -> None:
        nonlocal t
        if ms > 0:
            bars.append(Bar(device, kind, t, ms, r, label))
            t += ms

    for r in range(k):
        if len(members) > 1:
            put(0, "link", per[0]["link_ms"], r)
        for i in order:
            d, p = devices[i], per[i]
            if not d["window"]:  # a relay forwards (the head's own send opens the round)
                if i:
                    put(i, "link", p["link_ms"], r)
                continue
            if i == slowest:
                put(i, "wait", wait, r)
            if p["disk_ms"] > p["inline_ms"]:
                hidden = p["disk_ms"] - p["inline_ms"]
                bars.append(Bar(i, "prefetch", t - hidden, hidden, r))
            on_path = p["turn_ms"] - p["compute_ms"]  # reads that outlast the compute they can overlap
            if p["inline_ms"] > on_path:
                bars.append(Bar(i, "beside", t + p["serial_ms"] / 2, p["inline_ms"] - on_path, r))
            a, b = d["layers"][r] if r < len(d.get("layers", ())) else ("", "")
            put(i, "compute", p["compute_ms"], r, f"[{a},{b})" if a != "" else "")
            put(i, "load", on_path, r)
            if i:
                put(i, "link", p["link_ms"], r)
    put(0, "output", out_ms, k - 1)
    return bars, t


def bottleneck(plan: dict) -> int:
    """The device busiest per token (compute beside loads, hops, + the output layer on the head)."""
    devices = _timings(plan)
    return max(range(len(devices)), key=lambda i: devices[i]["predicted_ms"])


def render(plan: dict, path: Path, title: str = "") -> Path:
    """Draw the journey of `plan` into path (.png or .svg, by suffix)."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    path = Path(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in ("png", "svg"):
        raise ValueError(f"the timeline is drawn as .png or .svg, got {path.name!r}")
    devices = _timings(plan)
    bars, total = journey(plan)
    n = len(devices)

    fig = Figure(figsize=(13, 1.9 + 0.75 * n), dpi=110, layout="constrained")
    ax = fig.add_subplot()
    y = {i: n - 1 - i for i in range(n)}  # the head on top
    _draw_bars(ax, bars, y, total)
    _draw_rounds(ax, plan, bars, n)
    _label_devices(ax, plan, devices, y, bottleneck(plan))
    ax.set_xlim(0, max(total, plan["predicted_tpot_ms"]) * 1.005)
    ax.set_ylim(-0.85, n - 0.2)
    ax.set_xlabel("ms since the head sent the token's embedding")
    ax.spines[["top", "right"]].set_visible(False)
    _legend(ax, bars, n)
    head = f"{plan['strategy']} plan, k = {plan['k']} round{'s' if plan['k'] > 1 else ''} per token"
    ax.set_title(f"{title}: {head}" if title else head, loc="left", fontsize=11)
    fig.savefig(path, format=fmt)
    return path


def _draw_bars(ax, bars: list[Bar], y: dict[int, int], total: float) -> None:
    """Each bar in its device's row and lane; a prefetch begun in the previous token wraps round to the end."""
    lane = {"prefetch": (-0.38, 0.22), "beside": (0.36, 0.2), "wait": (-0.1, 0.44)}  # (offset, height) from the row
    for b in bars:
        off, h = lane.get(b.kind, (-0.1, 0.44))
        start = b.start_ms if b.kind != "prefetch" or b.start_ms >= 0 else b.start_ms + total  # wrap round
        style = dict(edgecolor="#888888", linestyle=":", linewidth=1) if b.kind == "wait" else \
            dict(edgecolor="white", linewidth=0.5)
        end = start + b.ms
        pieces = [(start, b.ms)] if end <= total + 1e-9 else [(start, total - start), (0.0, end - total)]
        ax.broken_barh(pieces, (y[b.device] + off, h), facecolors=COLORS[b.kind],
                       hatch="///" if b.kind == "prefetch" else None, **style)
        if b.label and b.ms > 0.045 * total:
            ax.text(start + b.ms / 2, y[b.device] + off + h / 2, b.label, ha="center", va="center",
                    fontsize=8, color="white")


def _draw_rounds(ax, plan: dict, bars: list[Bar], n: int) -> None:
    """A line where each round starts (the head's send), and the predicted TPOT."""
    starts = sorted({b.start_ms for b in bars if b.kind == "link" and b.device == 0} | {0.0})
    for r, s in enumerate(starts if plan["k"] > 1 else []):
        ax.axvline(s, color="#BBBBBB", linewidth=0.8, zorder=0)
        ax.text(s, n - 0.45, f" round {r + 1}", fontsize=8, color="#666666", va="bottom")
    ax.axvline(plan["predicted_tpot_ms"], color="#C44E52", linestyle="--", linewidth=1.5)
    ax.text(plan["predicted_tpot_ms"], -0.75, f"predicted TPOT {plan['predicted_tpot_ms']:.0f} ms ",
            color="#C44E52", ha="right", va="bottom", fontsize=9, fontweight="bold")


def _label_devices(ax, plan: dict, devices: list[dict], y: dict[int, int], worst: int) -> None:
    """Device names on the left (the bottleneck in red), their per-token totals on the right."""
    ax.set_yticks([y[i] for i in range(len(devices))])
    ax.set_yticklabels([f"{d['name']} ({d['role']})" for d in devices])
    ax.get_yticklabels()[worst].set(color="#C44E52", fontweight="bold")
    for i, d in enumerate(devices):
        if d["role"] == "removed":
            note = "removed from the ring"
        else:
            ahead = d["disk_ms"] - d["inline_ms"]
            disk = f"disk {d['disk_ms']:.0f} ({ahead:.0f} prefetched) · " if d["disk_ms"] else ""
            note = (f"{d['window']}×{plan['k']} layers: compute {d['compute_ms']:.0f} · {disk}"
                    f"link {d['link_ms']:.0f} ms")
            note += "   ← bottleneck" if i == worst else ""
        ax.annotate(note, (1.005, y[i]), xycoords=("axes fraction", "data"), va="center", fontsize=8,
                    color="#C44E52" if i == worst else "#333333")


def _legend(ax, bars: list[Bar], n: int) -> None:
    """The kinds of bar drawn, below the axis."""
    from matplotlib.patches import Patch

    kinds = [kd for kd in KINDS if any(b.kind == kd for b in bars)]
    ax.legend(handles=[Patch(facecolor=COLORS[kd], hatch="///" if kd == "prefetch" else None,
                             edgecolor="#888888" if kd == "wait" else "white",
                             linestyle=":" if kd == "wait" else "-", label=LEGEND[kd]) for kd in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.16 - 0.1 / n), ncol=min(len(kinds), 4), frameon=False,
              fontsize=8)
