"""What the ring tests share: the single-process greedy reference, and one request streamed from a head."""

from pathlib import Path

from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from prima_rpc.client import Finished, PrimaClient, Token


def greedy_reference(store: Path, prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Each prompt's greedy token ids from the single process: what every ring must give."""
    model = ReferenceModel(store)
    return {p: [t.token_id for t in model.generate(p, GenerateParams(max_tokens=max_tokens))] for p in prompts}


async def stream(address: str, prompt: str, max_tokens: int, **kwargs) -> tuple[list[int], Finished | None]:
    """One request's token ids and its final event, from the head at `address`."""
    tokens, done = [], None
    async with PrimaClient(address) as client:
        async for event in client.generate(prompt, max_tokens=max_tokens, **kwargs):
            if isinstance(event, Token):
                tokens.append(event.token_id)
            else:
                done = event
    return tokens, done
