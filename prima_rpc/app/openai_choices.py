"""OpenAI's choices from the head's events: text, logprobs and tool calls, for whole answers and stream chunks; and
the n requests of one call merged into one stream of (choice index, event)."""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from prima_rpc.client import Finished, Token
from prima_rpc.request import GenerateRequest, ToolCall, ToolCallDelta


def seeded(request: GenerateRequest, i: int) -> GenerateRequest:
    """Choice i's request: its own seed (seed + i) so n seeded choices differ and each is reproducible."""
    return request if request.seed is None else replace(request, seed=(request.seed + i) % 2**64)


async def merged(requests: list[GenerateRequest],
                 stream: Callable[[GenerateRequest], AsyncIterator[Token | Finished]]) -> AsyncIterator[tuple]:
    """(choice index, event) of every request, as they come; the first failure ends them all (each pump's
    stream is closed by its cancellation, which cancels its call on the ring)."""
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def pump(i: int, request: GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(stream(request)) as events:
                async for event in events:
                    queue.put_nowait((i, event))
            queue.put_nowait((i, end))
        except Exception as exc:  # handed to the reader below, which raises it
            queue.put_nowait((i, exc))

    pumps = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(requests)]
    try:
        left = len(requests)
        while left:
            i, event = await queue.get()
            if event is end:
                left -= 1
            elif isinstance(event, Exception):
                raise event
            else:
                yield i, event
    finally:
        for p in pumps:
            p.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def token_logprob(t: Token) -> dict:
    """Chat's logprobs entry of one token."""
    return {"token": t.token, "logprob": t.logprob, "bytes": list(t.token.encode()),
            "top_logprobs": [{"token": s, "logprob": lp, "bytes": list(s.encode())} for _, s, lp in t.top_logprobs]}


def completion_logprobs(tokens: list[Token], offset: int = 0) -> dict:
    """Completions' logprobs object of some tokens (offset: of the first in the text)."""
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{s: lp for _, s, lp in t.top_logprobs} for t in tokens], "text_offset": offsets}


def tool_calls_json(calls: tuple[ToolCall, ...], delta: bool, start: int = 0) -> list[dict]:
    """Whole calls, as a message's tool_calls or (delta: with their index, from `start`) a chunk's."""
    return [{**({"index": i} if delta else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls, start)]


def call_deltas_json(deltas: tuple[ToolCallDelta, ...]) -> list[dict]:
    """A chunk's delta.tool_calls as OpenAI streams them: a call's index, id, type and name first (arguments ""),
    then pieces of its arguments under its index."""
    return [{"index": d.index, "id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
            if d.name else {"index": d.index, "function": {"arguments": d.arguments}} for d in deltas]


def calls_choice(index: int, calls: list[dict]) -> dict:
    """A stream chunk's choice that carries tool calls."""
    return {"index": index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}


@dataclass
class Answer:
    """One choice's events so far."""

    tokens: list[Token] = field(default_factory=list)
    done: Finished | None = None

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens)


def whole_choice(chat: bool, index: int, a: Answer, logprobs: bool) -> dict:
    """A choice of a whole answer."""
    done = a.done
    lp = None
    if logprobs:
        lp = {"content": [token_logprob(t) for t in a.tokens]} if chat else completion_logprobs(a.tokens)
    if not chat:
        return {"index": index, "text": a.text, "logprobs": lp, "finish_reason": done.finish_reason}
    message = {"role": "assistant", "content": a.text or (None if done.tool_calls else "")}
    if done.tool_calls:
        message["tool_calls"] = tool_calls_json(done.tool_calls, delta=False)
    return {"index": index, "message": message, "logprobs": lp, "finish_reason": done.finish_reason}


def chunk_choice(chat: bool, index: int, token: Token | None = None, done: Finished | None = None,
                 logprobs: bool = False, offset: int = 0) -> dict:
    """A stream chunk's choice: one token's text (and logprobs), or the end (its finish reason)."""
    lp = None
    if token is not None and logprobs:
        lp = {"content": [token_logprob(token)]} if chat else completion_logprobs([token], offset)
    text = token.text if token is not None else None
    finish = done.finish_reason if done is not None else None
    if not chat:
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
    delta = {"content": text} if text is not None else {}
    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}


class ChoiceStream:
    """One streamed choice's chunks from the head's events: its text (and logprobs), its calls as they are
    generated, then the calls that were not streamed (whole) and its end."""

    def __init__(self, chat: bool, index: int, logprobs: bool):
        self.chat, self.index, self.logprobs = chat, index, logprobs
        self.offset = 0  # completions' text offset
        self.calls = 0  # calls streamed so far (the first of Finished's that are not)

    def choices(self, event: Token | Finished) -> list[dict]:
        if isinstance(event, Token):
            out = []
            if event.text or self.logprobs:
                out.append(chunk_choice(self.chat, self.index, event, None, self.logprobs, self.offset))
                self.offset += len(event.text)
            if self.chat and event.tool_calls:
                out.append(calls_choice(self.index, call_deltas_json(event.tool_calls)))
                self.calls += sum(1 for d in event.tool_calls if d.name)
            return out
        rest = event.tool_calls[self.calls:] if self.chat else ()
        out = [calls_choice(self.index, tool_calls_json(rest, True, self.calls))] if rest else []
        return out + [chunk_choice(self.chat, self.index, None, event)]
