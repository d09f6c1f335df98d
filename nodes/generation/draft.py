"""A draft model for speculative decoding: a small store of the target's tokenizer, run greedily with a KV
cache of its own for one request."""

import hashlib
import json
from pathlib import Path

import grpc

from nodes.errors import Rejected
from nodes.generation.reference import ReferenceModel
from nodes.generation.text import TextCodec
from prima_rpc.spec.manifest import StoreError


def check_draft(draft: TextCodec, target: TextCodec, where: Path | str) -> None:
    """A draft model must share the target's tokenizer (its ids are the target's ids): ValueError naming both."""
    dv, tv = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if dv != tv:
        differ = (f"{len(dv)} vs {len(tv)} tokens" if len(dv) != len(tv)
                  else f"{sum(tv.get(t) != i for t, i in dv.items())} of {len(tv)} tokens differ")
        raise ValueError(f"the draft model {draft.manifest.name} ({where}) does not share the tokenizer of "
                         f"{target.manifest.name}: {differ}")


def load_draft(store: Path, target: TextCodec, dtype=None):
    """The ReferenceModel of a draft store, checked against the target's tokenizer. A store that is missing,
    broken or of another tokenizer: Rejected (FAILED_PRECONDITION), the request's error, not the node's."""
    try:
        model = ReferenceModel(store, dtype=dtype)
        check_draft(model.codec, target, store)
    except (StoreError, ValueError) as exc:
        raise Rejected(grpc.StatusCode.FAILED_PRECONDITION, str(exc)) from None
    return model


class DraftModel:
    """Greedy drafts from a small model of the same tokenizer (a ReferenceModel of any store), with its own KV
    cache for one request. Rows it wrote for drafts the target rejected are overwritten like the target's."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.fed: list[int] = []  # ids whose keys and values sit in the cache at positions 0..len-1

    def draft(self, context: list[int], n: int) -> list[int]:
        need = len(context) + n
        if self.cache is None or need > self.cache.capacity:  # grown in steps, then filled again from 0
            self.cache = self.model.new_cache(min(self.model.cfg.max_seq_len, 2 * need + 64))
            self.fed = []
        n = min(n, self.cache.capacity - len(context))
        valid = 0
        while valid < min(len(self.fed), len(context) - 1) and self.fed[valid] == context[valid]:
            valid += 1
        ids, pos, out = context[valid:], valid, []
        for _ in range(n):
            token = int(self.model.step(ids, pos, self.cache).argmax())
            out.append(token)
            pos += len(ids)
            ids = [token]
        if out:
            self.fed = context + out[:-1]
        return out


def vocab_fingerprint(codec: TextCodec) -> str:
    """sha256 of a tokenizer's vocabulary (token -> id): equal exactly when a draft may serve a target."""
    return hashlib.sha256(json.dumps(sorted(codec.tokenizer.get_vocab().items())).encode()).hexdigest()
