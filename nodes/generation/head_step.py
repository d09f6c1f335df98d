"""The head's own work on a step of a request, besides the ring: the embedding and the logits, each handed through
the compute thread, then sampling and detokenising. The profiler's token probe (nodes/profiling/frame.py) runs
this same code, so what it measures is what the head does."""

from collections.abc import Callable
from concurrent.futures import Executor

import torch

from nodes.generation.state import Generation, TokenOut
from nodes.jobs import run_job


async def embed(pool: Executor, embed_ids: Callable[[list[int]], torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Embeddings [len(ids), H] of a step's tokens, computed on the compute thread."""
    return await run_job(pool, embed_ids, ids)


async def next_tokens(gen: Generation, pool: Executor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                      hidden: torch.Tensor, draft: list[int], logits: torch.Tensor | None = None) -> list[TokenOut]:
    """The tokens a step's answer gives `gen`: hidden [T, H] after all layers, its last len(draft) + 1 rows
    projected each alone by logits_of (hidden [t, H] -> logits [V] of its last row) on the compute thread, as the
    verification reads them; logits [V]: a plain step's, already projected with its batch's."""
    if draft:
        return await run_job(pool, gen.accept_draft, RowLogits(logits_of, hidden, len(draft) + 1), draft)
    if logits is None:
        logits = await run_job(pool, logits_of, hidden)
    return [gen.accept(logits)]


class RowLogits:
    """Logits of the last `rows` positions of hidden [T, H], row i ([V]) projected alone exactly as a plain step
    projects it, when first read: the verification stops at the first rejected draft token, and the rows after it
    (an lm-head product each, 1 ms on SmolLM2) are never computed."""

    def __init__(self, logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, rows: int):
        self.logits_of, self.hidden, self.first = logits_of, hidden, hidden.shape[0] - rows
        self.projected = 0  # rows computed so far

    def __getitem__(self, i: int) -> torch.Tensor:
        self.projected += 1
        return self.logits_of(self.hidden[:self.first + i + 1])
