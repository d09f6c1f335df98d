"""Where an assignment's weights come from: the node's own store, an earlier run's cache, or the ring (fetched
from the head first, nodes/ring/fetch.py); and how many of a store's units are on this disk."""

from collections.abc import Callable
from pathlib import Path

from nodes.engine.store import LayerStore
from nodes.ring import fetch
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows


def units_of(windows: Windows) -> list[str]:
    """The store units a node with `windows` loads."""
    return (["embed", "head"] if windows.head else []) + [f"layer.{i}" for a, b in windows.ranges for i in range(a, b)]


def count_units(store: LayerStore | None) -> int:
    """Units of `store` whose files are on disk (0 without one, or for a manifest-only store)."""
    if store is None or store.manifest.manifest_only:
        return 0
    units = store.manifest.units()
    return len(units) - len(fetch.needed_units(store, units))


async def store_for(windows: Windows, model_id: str, store: LayerStore | None, cache: Path | None,
                    sources: list[str], token: str | None, progress: Callable[..., None], log,
                    fetched: Callable[[int], None]) -> LayerStore | None:
    """The store to load `windows` from when `store` lacks their units: an earlier run's in `cache`, else one
    fetched from `sources` (the head first) into it, its manifest and tokenizer too. None: keep `store` (it
    holds them, or holds another model for check_assignment to refuse, or there is no cache to fetch into).
    fetched(bytes) counts what came over the ring, a failed fetch's bytes too."""
    units = units_of(windows)
    if store is not None and (store.model_id != model_id or not fetch.needed_units(store, units)):
        return None
    if cache is None:
        return None  # check_assignment says what is missing
    try:  # what an earlier run fetched
        cached = LayerStore(fetch.cache_dir(cache, model_id))
        if cached.model_id == model_id and not fetch.needed_units(cached, units):
            return cached
    except StoreError:
        pass
    fetcher = fetch.Fetcher(cache, model_id, sources, token,
                            lambda done, total, unit: progress(done, total, unit, True))
    log.info("fetching weights", units=len(units), sources=fetcher.sources)
    try:
        store = await fetcher.store(units, windows.head)
    finally:
        fetched(fetcher.fetched)
        await fetcher.close()
    log.info("fetched weights", bytes=fetcher.fetched, cache=str(store.root))
    return store
