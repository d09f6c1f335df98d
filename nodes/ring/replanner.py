"""The head's live re-plan: every few seconds, each node's per-token time over the last seconds beside what the plan
assumed of it; when one drifts for long enough (nodes/ring/replan.py decides), scale that device's compute in its
profile by measured / assumed, solve Halda again (every device keeps a layer), and move the windows when the gain
beats the cost of moving.

The profiles are the nodes' own (Control.Profile, cached on each node; fetched while the ring is idle, before
any drift can be acted on). What the plan assumed of a node is the cost model's per-token time for its windows,
calibrated once per node by what it measured on its first settled seconds (the model's error is the node's own,
not the owner's load). Windows move through the members' re-plan path: requests in flight replay on the new
ring, so none is lost and greedy tokens are unchanged.
"""

import asyncio
import json
import time

import grpc

from nodes.ring import replan
from nodes.ring.recovery import Replan
from prima_rpc.control import AioControl
from prima_rpc.spec.profiles import DeviceProfile
from prima_rpc.spec.windows import layer_ranges
from prima_rpc.v1 import prima_pb2 as pb

ROUND_S = 2.0  # a sample's length: per-token times over the last 2 s
MIN_FRAMES = 4  # decode computes a sample needs to count
KEEP = 50  # re-plans the head remembers (status shows them)


class Replanner:
    """Held by the head; `round` runs beside the members' watch (Node.run)."""

    def __init__(self, node, members, requests, settings: replan.Settings = replan.Settings()):
        self.node, self.members, self.requests, self.settings = node, members, requests, settings
        self.watch = replan.Watch()
        self.profiles: dict[str, DeviceProfile] = {}  # by address, as measured
        self.manifest: dict | None = None
        self.scale: dict[str, float] = {}  # address -> compute factor the plans assume now (1: as profiled)
        self.calib: dict[str, float] = {}  # address -> measured / cost model, on its first settled samples
        self.first: dict[str, list[float]] = {}  # address -> its first samples, until calibrated
        self.counters: dict[str, tuple[int, float, int]] = {}  # address -> (epoch, decode_s, decode_frames)
        self.predicted: dict[str, float] = {}  # address -> the cost model's ms a token for its windows now
        self.tpot_ms = 0.0  # the cost model's TPOT for the windows now
        self.priced_epoch = -1
        self.settled: set[str] = set()  # nodes whose first sample since the epoch was skipped (warm-up)
        self.records: list[pb.Replan] = []
        self.state = "off"

    def reset(self) -> None:
        """A new plan from prima-ctl start: scales, calibrations and drifts start over (the re-plans stay listed)."""
        self.scale = {a: 1.0 for a in self.scale}
        self.calib, self.first, self.counters = {}, {}, {}
        self.watch, self.priced_epoch = replan.Watch(), -1

    # ------------------------------------------------------------------ the loop

    async def round(self) -> None:
        await asyncio.sleep(ROUND_S)
        node = self.node
        if not node.cfg.replan:
            self.state = "off"
            return
        if node.fetching or self.members.lock.locked() or node.windows is None or not self.members.head:
            return
        ring = [self.members.head, *self.members.members]
        if set(self.profiles) != set(ring):
            if self.requests.by_id:  # profiles are taken while the ring is idle (a profile measures the cores)
                return
            self.state = "profiling"
            if not await self._profile(ring):
                return
        self.state = "watching"
        infos = [node.info(), *await self.members.infos()]
        if any(i is None or i.epoch != node.epoch for i in infos):
            return  # a member is lost or being assigned: recovery's business
        if node.epoch != self.priced_epoch and not self._price(ring, infos):
            return
        samples = self._samples(ring, infos)
        before = self.watch.direction
        self.watch, act = replan.step(self.watch, samples, time.monotonic(), self.settings)
        if self.watch.direction != before:
            node.log.info("live re-plan: drifts", drifting=self.watch.direction,
                          drift={x.address: round(x.drift, 2) for x in samples if x.drift is not None})
        if act is not None:
            self.state = "replanning"
            try:
                await self._act(act, ring, infos)
            finally:
                self.state = "watching"

    async def _profile(self, ring: list[str]) -> bool:
        """Every node's profile (each node's cache: quick once `prima-ctl plan` or `start` profiled it)."""
        profiles, manifest = {}, None
        for address in ring:  # one at a time: profiles taken at once would measure each other
            try:
                async with AioControl(address, self.node.cfg.token) as peer:
                    reply = await peer.profile(False)
            except grpc.RpcError as exc:
                self.node.log.info("live re-plan waits for the nodes' profiles", node=address,
                                   error=exc.details() if hasattr(exc, "details") else str(exc))
                return False
            device = json.loads(reply.json)
            profiles[address] = DeviceProfile.from_json({**device, "name": address, "is_head": False})
            manifest = manifest or (json.loads(reply.manifest) if reply.manifest else None)
        if manifest is None:
            return False
        self.profiles, self.manifest = profiles, manifest
        self.scale = {a: self.scale.get(a, 1.0) for a in ring}
        self.priced_epoch = -1
        return True

    # ------------------------------------------------------------------ what the plan assumed, what was measured

    def devices(self, ring: list[str], infos: list[pb.NodeInfo]) -> tuple[DeviceProfile, ...]:
        """The ring's profiles as the planner should see them now: compute scaled by what was measured, memory
        capped by what each node may keep (its --max-memory, or what it gave back to its owner)."""
        out = []
        for i, (address, info) in enumerate(zip(ring, infos)):
            d = replan.scaled(self.profiles[address], self.scale[address])
            if info.max_memory:
                d = replan.with_memory(d, info.max_memory)
            out.append(DeviceProfile.from_json({**d.to_json(), "is_head": i == 0}))
        return tuple(out)

    def _price(self, ring: list[str], infos: list[pb.NodeInfo]) -> bool:
        """The cost model's per-node times for the windows the ring holds now (a new epoch)."""
        from nodes.engine.prefetch import KV_RESERVE_TOKENS
        from solver.applied import priced

        try:
            k, windows = held(infos, self.node.store.config.n_layers)
            plan = priced(self.devices(ring, infos), self.manifest, k, windows, KV_RESERVE_TOKENS)
        except ValueError as exc:
            self.node.log.info("live re-plan cannot price these windows", error=str(exc))
            return False
        self.predicted = {a: d["turn_ms"] for a, d in zip(ring, plan["devices"])}
        self.tpot_ms = plan["predicted_tpot_ms"]
        self.priced_epoch, self.settled = self.node.epoch, set()
        self.counters = {}
        return True

    def _samples(self, ring: list[str], infos: list[pb.NodeInfo]) -> list[replan.Sample]:
        samples = []
        for address, info in zip(ring, infos):
            measured = self._measured(address, info)
            if measured is not None and address not in self.settled:
                self.settled.add(address)  # its first sample since the assignment warms caches: not counted
                measured = None
            predicted = self.predicted.get(address, 0.0)
            if measured is not None and address not in self.calib:
                self.first.setdefault(address, []).append(measured)
                if (c := replan.calibration(self.first[address], predicted)) is not None:
                    self.calib[address] = c
                    self.node.log.info("live re-plan calibrated", node=address, measured_ms=self.first[address],
                                       predicted_ms=round(predicted, 2))
                measured = None  # a calibration sample is what the plan assumes: no drift
            assumed = predicted * self.calib.get(address, 0.0) or None
            samples.append(replan.Sample(address, measured, assumed, info.memory_low,
                                         scaled=self.scale.get(address, 1.0) > 1.0))
        return samples

    def _measured(self, address: str, info: pb.NodeInfo) -> float | None:
        """ms a token on this node since the last round (its one-token computes, k windows a token)."""
        s = info.stats
        last = self.counters.get(address)
        if last is None or last[0] != info.epoch:
            self.counters[address] = (info.epoch, s.decode_s, s.decode_frames)
            return None
        frames = s.decode_frames - last[2]
        if frames < MIN_FRAMES:  # a slow node: its sample spans rounds until it has enough
            return None
        self.counters[address] = (info.epoch, s.decode_s, s.decode_frames)
        return (s.decode_s - last[1]) / frames * len(info.windows) * 1e3

    # ------------------------------------------------------------------ acting

    async def _act(self, act: replan.Act, ring: list[str], infos: list[pb.NodeInfo]) -> None:
        from solver.strategies import plan_for

        started = time.monotonic()
        node = self.node
        self.scale[act.address] = replan.new_scale(self.scale[act.address], act)
        devices = self.devices(ring, infos)
        self.priced_epoch = -1  # the windows now are priced again with the new scale, applied or not
        old = self._price(ring, infos) and self.tpot_ms
        # Every device keeps at least a layer (Halda without device selection): one without any would measure
        # nothing, so the plan could not move back to it when its owner's load goes away.
        result = await asyncio.to_thread(plan_for, devices, self.manifest, "halda-noselect")
        if "infeasible" in result or not old:
            node.log.warning("live re-plan: no plan", node=act.address, reason=act.reason,
                             why=result.get("infeasible", "the windows now cannot be priced"))
            return
        new = result["predicted_tpot_ms"]
        sizes = [d["window"] for d in result["devices"]]
        cost = replan.move_cost_s(self._moved_bytes(infos, sizes), [d.disk_seq_read for d in devices])
        gain = replan.gain(old, new)
        if act.reason != "memory" and not replan.worth_it(old, new, cost):
            node.log.info("live re-plan not worth it", node=act.address, reason=act.reason, factor=act.factor,
                          tpot_ms=old, new_tpot_ms=new, move_s=cost)
            return
        plan = Replan(tuple((a, ring[(i + 1) % len(ring)]) for i, a in enumerate(ring)),
                      tuple(tuple(r) for r in layer_ranges(sizes, node.store.config.n_layers)))
        node.log.warning("a device drifted from the plan: re-planning live", node=act.address, reason=act.reason,
                         measured_ms=act.measured_ms, assumed_ms=act.assumed_ms, windows=sizes, tpot_ms=old,
                         new_tpot_ms=new, move_s=cost)
        await self.members.replan_to(plan, [d["turn_ms"] for d in result["devices"]], new,
                                     [float(d.get("buffer_layers", 0.0)) for d in result["devices"]])
        self.records = (self.records + [pb.Replan(at=time.time(), reason=act.reason, node=act.address,
                                                  assumed_ms=act.assumed_ms, measured_ms=act.measured_ms,
                                                  predicted_gain=gain, seconds=time.monotonic() - started)])[-KEEP:]

    def _moved_bytes(self, infos: list[pb.NodeInfo], sizes: list[int]) -> list[int]:
        """Bytes each node re-reads: all of its new windows where they change (a node loads its shard anew)."""
        layer = self.manifest_layer_bytes()
        n_layers = self.node.store.config.n_layers
        new = layer_ranges(sizes, n_layers)
        out = []
        for info, ranges in zip(infos, new):
            held = [(r.start, r.stop) for r in info.windows]
            out.append(0 if held == [tuple(r) for r in ranges] else sum(layer * (b - a) for a, b in ranges))
        return out

    def manifest_layer_bytes(self) -> int:
        from solver.model_profile import ModelProfile

        sizes = ModelProfile.from_json(self.manifest).layer_bytes
        return max(sizes) if sizes else 0


def held(infos: list[pb.NodeInfo], n_layers: int) -> tuple[int, list[int]]:
    """(k rounds, each node's window per round) of the windows the nodes hold, head first (a window may be 0, the
    head's too); ValueError when they are not laid out as a plan's."""
    windows = [i.windows[0].stop - i.windows[0].start if i.windows else 0 for i in infos]
    ranges = layer_ranges(windows, n_layers)
    if [[(r.start, r.stop) for r in i.windows] for i in infos] != [[tuple(r) for r in rs] for rs in ranges]:
        raise ValueError("the ring's windows are not laid out as a plan's")
    return n_layers // sum(windows), windows
