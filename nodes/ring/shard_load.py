"""How a node builds the shard of an assignment: its KV dtype and context (its own flags, else the plan's), its
stream buffer in bytes, and where its cached prefixes are also kept on disk."""

from nodes.engine.formats import weight_format
from nodes.engine.fused import layer_bytes
from nodes.engine.kv_dtype import KVDtype, kv_dtype
from nodes.engine.prefix_disk import PrefixDisk
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.ring.config import NodeConfig
from prima_rpc.spec.windows import Windows


def kv_choice(cfg: NodeConfig, planned_dtype: str, planned_ctx: int) -> tuple[KVDtype, int]:
    """The KV dtype and context a node loads with: its own flags where given, else the plan's (float and the default
    context where neither says)."""
    name = cfg.kv_dtype if cfg.kv_dtype != "auto" else planned_dtype or "float"
    return kv_dtype(name), cfg.ctx or planned_ctx


def prefix_disk(cfg: NodeConfig, store: LayerStore, kv_name: str, log) -> PrefixDisk | None:
    """Where a new shard copies its cached prefixes (prima-node --prefix-disk; None: off); kv_name: how its KV
    caches store rows (files of another are not used)."""
    if cfg.prefix_dir is None or cfg.prefix_disk <= 0:
        return None
    try:
        return PrefixDisk(cfg.prefix_dir, cfg.prefix_disk, store.model_id, kv_name, log)
    except OSError as exc:  # an unwritable folder costs the copies, not the node
        log.warning("prefixes are not copied to disk", directory=str(cfg.prefix_dir), error=str(exc))
        return None


def new_shard(cfg: NodeConfig, store: LayerStore, windows: Windows, dtype, progress, budget: int | None,
              buffer_layers: float, kv: tuple[str, int], log) -> Shard:
    """The shard of `windows` (on the compute thread: it reads weights); kv: the plan's (KV dtype, context)."""
    buffer = int(buffer_layers * layer_bytes(store.config, dtype, weight_format(store.manifest)))
    kv_type, ctx = kv_choice(cfg, *kv)
    # the KV rows' dtype names the prefix files: float KV in float32 and bfloat16 differ too
    kv_name = kv_type.name if kv_type.name != "float" else str(dtype).removeprefix("torch.")
    return Shard(store, windows, dtype, progress, budget=budget, buffer=buffer, log=log, kv_dtype=kv_type, ctx=ctx,
                 disk=prefix_disk(cfg, store, kv_name, log))
