"""A member's standby copy of the head's units (tokenizer, embedding, output head, the head's windows), kept on its
disk and fetched in the background over the ring, so that losing the head loses no weights; and whether a node's
disk holds a complete copy (the survivors' new head is the first member in ring order with one)."""

import asyncio
from pathlib import Path

from nodes.engine.store import LayerStore
from nodes.ring import fetch, weights
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows

FETCH_ERRORS = (StoreError, OSError, ValueError)  # a copy that cannot be fetched now: status says so


class Standby:
    """What the last assignment said of the head (its windows, the ring) and this node's copy of its units."""

    def __init__(self, cache: Path | None, token: str | None):
        self.cache, self.token = cache, token
        self.asked = False  # the head named this node its standby
        self.head_windows: Windows | None = None
        self.ring: list[str] = []  # every member in ring order, the head first
        self.model_id = ""
        self.error = ""  # why the last fetch of the copy failed
        self._task: asyncio.Task | None = None

    def set(self, ring: list[str], head_windows: Windows | None, model_id: str, asked: bool) -> None:
        self.ring, self.head_windows, self.model_id, self.asked = list(ring), head_windows, model_id, asked

    def holds_copy(self, store: LayerStore | None) -> bool:
        """Whether this node's store, or its cache of the ring's model, holds every unit a new head needs."""
        if self.head_windows is None or not self.model_id:
            return False
        stores = (store if store is not None and store.model_id == self.model_id else None, self._cached())
        return any(self._complete(s) for s in stores if s is not None)

    def _complete(self, store: LayerStore) -> bool:
        tokenizer = store.tokenizer_path()
        return (not store.manifest.manifest_only and (tokenizer is None or tokenizer.is_file())
                and not fetch.needed_units(store, weights.units_of(self.head_windows)))

    def _cached(self) -> LayerStore | None:
        if self.cache is None:
            return None
        try:
            return LayerStore(fetch.cache_dir(self.cache, self.model_id))
        except StoreError:
            return None

    def keep(self, store: LayerStore | None, sources: list[str], log) -> None:
        """As the standby: fetch what the copy lacks from `sources` (the head first) into the cache, in the
        background (the node serves on)."""
        if self.asked and not self.holds_copy(store) and self.cache is not None:
            self._task = asyncio.get_running_loop().create_task(self._fetch(self.model_id, sources, log),
                                                                name="standby")

    async def _fetch(self, model_id: str, sources: list[str], log) -> None:
        units = weights.units_of(self.head_windows)
        try:
            fetcher = fetch.Fetcher(self.cache, model_id, sources, self.token)
            try:
                log.info("fetching the standby copy of the head's units", units=len(units))
                await fetcher.store(units, head=True)
            finally:
                await fetcher.close()
            self.error = ""
            log.info("standby copy complete", bytes=fetcher.fetched)
        except FETCH_ERRORS as exc:
            self.error = f"standby copy: {exc}"
            log.warning("standby copy not fetched", error=str(exc))

    async def stop(self) -> None:
        """Before another assignment: a fetch under way stops (its .part files resume next time)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
