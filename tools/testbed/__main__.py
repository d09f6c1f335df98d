"""python -m tools.testbed up PRESET --model DIR | down | load DEVICE ... | link DEVICE ... | presets | show.
Every failure is one line `error: ...` on stderr and exit status 2 (docs/testbed.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from prima_rpc.app.local_ring import LaunchError
from tools.testbed import bed
from tools.testbed.cgroups import LimitError
from tools.testbed.home import HomeError, load_home, parse_size, preset_names
from tools.testbed.netns import NetnsError


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.testbed", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--base-port", type=int, default=bed.DEFAULT_BASE, help="names the testbed (default 17000)")
    u = sub.add_parser("up", parents=[base], help="start one prima-node per device inside its limits")
    u.add_argument("preset", help=f"a preset ({', '.join(preset_names())}) or a home file")
    u.add_argument("--model", type=Path, required=True, help="the layer store every device reads")
    u.add_argument("--draft", type=Path, help="the head's draft model")
    u.add_argument("--json", action="store_true", help="print the devices as JSON")
    u.add_argument("--allow-unlimited", action="store_true", help="run even where a limit cannot be enforced")
    u.add_argument("--fetch", action="store_true", help="only the head has the model; the others fetch their "
                                                        "windows from it over the links")
    u.add_argument("--node-arg", action="append", default=[], help="an extra prima-node argument (repeatable)")
    sub.add_parser("down", parents=[base], help="stop the nodes, remove every group and namespace")
    ld = sub.add_parser("load", parents=[base], help="an owner's load inside one device's limits")
    ld.add_argument("device")
    what = ld.add_mutually_exclusive_group(required=True)
    what.add_argument("--cpu", type=float, help="the owner's fraction of the device's CPU share (0-1)")
    what.add_argument("--memory", type=parse_size, help="bytes to touch and hold, e.g. 200MiB")
    ld.add_argument("--seconds", type=float, required=True)
    lk = sub.add_parser("link", parents=[base], help="a fault on one device's link")
    lk.add_argument("device")
    fault = lk.add_mutually_exclusive_group(required=True)
    fault.add_argument("--cut", action="store_true", help="hold every byte for --seconds")
    fault.add_argument("--spike-ms", type=float, help="extra one-way latency for --seconds")
    lk.add_argument("--seconds", type=float, required=True)
    sub.add_parser("presets", help="the presets and their limits")
    sh = sub.add_parser("show", parents=[base], help="the running testbed: devices, processes, memory")
    sh.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def presets() -> None:
    for name in preset_names():
        home = load_home(name)
        print(f"{name}: {home.about}")
        for d in home.devices:
            print(f"  {d.name:<6} cpu {d.cpu:.3f} core  RAM {d.memory_bytes / 2**20:.0f} MiB  disk {d.disk_mbps:g} MB/s"
                  f"  link {d.latency_ms:g} ms +-{d.jitter_ms:g}, {d.mbps:g} Mbps"
                  + (f"  cores {list(d.cores)}" if d.cores else ""))


def link(base: int, device: str, cut: bool, spike_ms: float | None, seconds: float) -> None:
    state = bed.read_state(base)
    if state is None:
        raise bed.BedError(f"no testbed is up on base port {base}")
    if device not in {d["name"] for d in state["devices"]}:
        raise bed.BedError(f"no device {device!r}")
    if not 0 < seconds <= 3600:
        raise bed.BedError(f"--seconds must be in (0, 3600], got {seconds}")
    until = time.time() + seconds
    spec = {"cut_until": until} if cut else {"extra_ms": spike_ms, "extra_until": until}
    path = Path(state["run_dir"]) / f"{device}.ctl"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec))
    tmp.replace(path)


def show(base: int, as_json: bool) -> None:
    from tools.testbed import cgroups

    state = bed.read_state(base)
    if state is None:
        raise bed.BedError(f"no testbed is up on base port {base}")
    rows = bed.record(state)
    tree = cgroups.Tree.detect()
    for d, s in zip(rows["devices"], state["devices"]):
        d["alive"] = bed._alive(d["pid"], "nodes.ring.main")
        if not state.get("unlimited"):
            d["memory"] = cgroups.DeviceGroups(tree, s["group"]).memory_usage()
    if as_json:
        print(json.dumps(rows))
        return
    print(f"head {rows['head']}")
    for d in rows["devices"]:
        mem = d.get("memory", {})
        print(f"  {d['name']:<6} {d['address']:<18} pid {d['pid']} {'up' if d['alive'] else 'DOWN'}"
              + (f"  memory {mem['usage'] / 2**20:.0f}/{mem['limit'] / 2**20:.0f} MiB, peak {mem['peak'] / 2**20:.0f}"
                 if mem else ""))


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    try:
        if args.command == "up":
            home = load_home(args.preset)
            if not (args.model / "manifest.json").is_file():
                raise bed.BedError(f"--model {args.model} is not a layer store (no manifest.json)")
            got = bed.up(home, args.model.resolve(), base=args.base_port, draft=args.draft,
                         allow_unlimited=args.allow_unlimited, fetch=args.fetch, node_args=args.node_arg)
            if args.json:
                print(json.dumps(got))
            else:
                print(f"{home.name}: {len(got['devices'])} devices up, head {got['head']}")
                for d in got["devices"]:
                    print(f"  {d['name']:<6} {d['address']:<18} pid {d['pid']}")
                print(f"stop it: python -m tools.testbed down --base-port {args.base_port}")
        elif args.command == "down":
            bed.down(args.base_port)
        elif args.command == "load":
            from tools.testbed.load import run_load

            run_load(args.base_port, args.device, args.seconds, cpu=args.cpu, memory=args.memory)
        elif args.command == "link":
            link(args.base_port, args.device, args.cut, args.spike_ms, args.seconds)
        elif args.command == "presets":
            presets()
        elif args.command == "show":
            show(args.base_port, args.json)
    except (bed.BedError, HomeError, OSError, LaunchError, LimitError, NetnsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
