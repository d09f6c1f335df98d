"""What Control.Assign asks of a node, as the two values it is: the layers and how to run them (Assignment), and
the ring they run in (Place). Node.assign takes both; the head's re-plan builds them for its own share."""

from dataclasses import dataclass

from prima_rpc.spec.windows import Windows


@dataclass(frozen=True)
class Assignment:
    windows: Windows
    model_id: str  # the ring's model fingerprint
    epoch: int = 0  # frames of another epoch (an older ring) are dropped from now on
    replan: bool = False  # the head re-plans after losing a node: in-flight KV caches are dropped (they replay)
    buffer_layers: float = 0.0  # the plan's stream buffer in layers, used if the budget streams (0: the default)
    max_batch: int = 0  # the plan's batch limit (0: the node's default)
    micro_batches: int = 0  # (the head) batches in flight round the ring (0: one)
    predicted: tuple[float, float] = (0.0, 0.0)  # the plan's (per-token ms here, ring TPOT ms) for status; 0: none
    kv: tuple[str, int] = ("", 0)  # the plan's (KV dtype of this node, context of the ring); ("", 0): the node's own


@dataclass(frozen=True)
class Place:
    ring: tuple[str, ...] = ()  # every member in ring order, the head's first (it watches them; members fail over)
    head_address: str = ""  # (members) the ring's head, as the ring dials it
    head_windows: tuple[tuple[int, int], ...] = ()  # (members) the head's windows
    standby: bool = False  # (members) keep a disk copy of the head's units, to take over should it be lost
