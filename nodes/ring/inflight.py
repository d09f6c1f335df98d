"""Speculative windows in flight round the ring: while one verify window goes round, the head sends the next,
drafted on the assumption that every window before it is accepted, up to `depth` windows in the ring at once.

The drafted tokens form one chain: window 1 is the last accepted token and its drafts, each later window holds
only drafted tokens, and the last row of a window checks the first token of the window after it. Windows come
back in the order they went (head_requests.HeadRequest), and each is verified as it comes: while every token
it checks is accepted the chain goes on (its rows yield no token of the target's own, the next window's do);
at the first rejection the target's own token is emitted and every later window is cancelled: their answers
are dropped at the head when they come back, and drafting starts again from the accepted prefix.

Nothing is left half-written on the nodes: a node computes a request's frames for the same layers in the order
they came (batching.gather takes one frame a request), so a cancelled window wrote its KV rows before the
restarting window reaches that node, at positions past the accepted prefix; attention reads only rows below a
frame's own end, and the chain from the accepted prefix writes each row again before any frame reads it.
Sampling draws each position from its own generator (sampling.Sampler), so a seeded request gives the very
tokens it gives without speculation, whatever the depth.
"""

import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nodes.generation.head_step import RowLogits
from nodes.generation.state import Generation, TokenOut
from nodes.jobs import run_job
from nodes.ring.head_requests import HeadRequest, Window


@dataclass
class _Flight:
    ids: list[int]  # the window's tokens, at positions [pos, pos + len(ids))
    pos: int
    window: Window  # its answer


def ahead(gen: Generation) -> bool:
    """Whether the request decodes with more than one window in flight."""
    return gen.spec.on and gen.params.speculate.depth > 1 and not gen.params.shapes_logits


async def decode_ahead(head, req: HeadRequest, request_id: str, gen: Generation) -> AsyncIterator[TokenOut]:
    """The request's tokens, from windows in flight, until it is done."""
    node, depth = head.node, gen.params.speculate.depth
    chain: deque[_Flight] = deque()
    try:
        while not gen.done:
            while len(chain) < depth and (flight := await _next_window(head, req, request_id, gen, chain)):
                chain.append(flight)
            start = time.perf_counter()
            oldest = chain.popleft()
            hidden = await head.answer(req, request_id, oldest.window)
            draft = oldest.ids[1:] + (chain[0].ids[:1] if chain else [])  # what its rows check
            logits = [oldest.window.logits] if oldest.window.logits is not None else \
                RowLogits(node.shard.logits, hidden, len(oldest.ids))
            outs = await run_job(node.pool, gen.accept_draft, logits, draft, len(oldest.ids))
            if chain and [o.token_id for o in outs] != draft:  # a rejection (or the end): the rest are void
                req.cancel_after(oldest.window)
                _cancel(chain)
            node.stats.last_token_ms = (time.perf_counter() - start) * 1e3 / max(1, len(outs))
            for out in outs:
                yield out
    finally:
        _cancel(chain)


async def _next_window(head, req: HeadRequest, request_id: str, gen: Generation,
                       chain: deque[_Flight]) -> _Flight | None:
    """The next window of the chain, sent; None when there is nothing to send (the drafter proposes nothing
    past the windows in flight, or the request may emit no more)."""
    if not chain:
        ids, pos = gen.pending()
        ids = ids + await draft_for(head, gen, [])
    else:
        drafted = chain[0].ids[1:] + [t for f in list(chain)[1:] for t in f.ids]
        ids, pos = await draft_for(head, gen, drafted), chain[-1].pos + len(chain[-1].ids)
        if not ids:
            return None
    window = await head.send_window(req, request_id, ids, pos, gen.capacity, len(ids))
    gen.trips += 1
    return _Flight(ids, pos, window)


async def draft_for(head, gen: Generation, drafted: list[int] = ()) -> list[int]:
    """Drafts that follow the accepted tokens and `drafted`: a draft model runs on the compute thread, a member's
    (nodes/ring/drafts.py) is asked over the network, prompt lookup runs here."""
    model = gen.spec.draft_model
    if getattr(model, "remote", False):
        context, n = gen.draft_ask(drafted)
        return await model.draft_async(context, n) if n else []
    if model is not None:
        return await run_job(head.node.pool, gen.draft, drafted)
    return gen.draft(drafted)


def _cancel(chain: deque[_Flight]) -> None:
    """Windows whose verification is void: their answers are dropped when they come back."""
    for flight in chain:
        flight.window.waiter.cancel()
    chain.clear()
