"""Tool calls read while they are generated: each call's id and name once its JSON names them, then its arguments'
text piece by piece (a small state machine over the growing text, on tool_calls.py's formats)."""

import json
import re
from dataclasses import dataclass

from nodes.generation import tool_calls
from prima_rpc.request import ToolCall, ToolCallDelta

WS = " \t\n\r"
STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
HEADER = ("{", "name key", ":", "name", ",", "arguments key", ":")  # a call's JSON up to its arguments' object


class NotACall(ValueError):
    """The JSON at a call's start is no call of any family's ({"name": str, "arguments" | "parameters": {...}})."""


def header(text: str, i: int) -> tuple[str, int] | None:
    """(the call's name, where its arguments' object starts) of the call object at text[i:]; None while the text
    stops before that. NotACall: it is something else."""
    name = ""
    for want in HEADER:
        while i < len(text) and text[i] in WS:
            i += 1
        if i >= len(text):
            return None
        if len(want) == 1:
            if text[i] != want:
                raise NotACall(f"expected {want!r} at {i}, got {text[i]!r}")
            i += 1
            continue
        m = STRING.match(text, i)
        if m is None:
            if text[i] != '"':
                raise NotACall(f"expected a string at {i}, got {text[i]!r}")
            return None  # the string goes on in the next piece
        value, i = json.loads(m.group()), m.end()
        if want == "name":
            name = value
        elif value != "name" if want == "name key" else value not in tool_calls.ARG_KEYS:
            raise NotACall(f"unexpected key {value!r}")
    while i < len(text) and text[i] in WS:
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        raise NotACall(f"arguments are not an object at {i}")
    return name, i


@dataclass
class Streamed:
    """One call as streamed so far."""

    id: str
    name: str
    arguments: str = ""
    closed: bool = False  # its arguments' object is complete


class CallStream:
    """Feed it the held text of an answer's tool calls as it grows (the whole text each time); it returns what
    each feed adds to the calls. A call that is not in a known shape (say its arguments before its name) ends the
    streaming: it and every later call are only in finish()'s whole calls, so streamed indices stay theirs."""

    def __init__(self):
        self.calls: list[Streamed] = []
        self.pos = 0  # how far the text has been read
        self.in_args = False
        self.depth, self.in_string, self.escape = 0, False, False  # inside the arguments' JSON
        self.dead = False

    def feed(self, text: str) -> list[ToolCallDelta]:
        out: list[ToolCallDelta] = []
        while not self.dead:
            if self.in_args:
                end = self._scan(text)
                stop = len(text) if end is None else end
                if stop > self.pos:
                    piece, self.pos = text[self.pos:stop], stop
                    self.calls[-1].arguments += piece
                    out.append(ToolCallDelta(len(self.calls) - 1, arguments=piece))
                if end is None:
                    return out
                self.calls[-1].closed, self.in_args = True, False
                continue
            starts = tool_calls.call_starts(text)
            m = starts.search(text, self.pos) if starts is not None else None
            if m is None:
                return out
            try:
                found = header(text, m.end())
            except NotACall:
                self.dead = True
                return out
            if found is None:
                return out
            name, self.pos = found
            self.calls.append(Streamed(tool_calls.new_id(), name))
            self.in_args, self.depth = True, 0
            out.append(ToolCallDelta(len(self.calls) - 1, self.calls[-1].id, name))
        return out

    def _scan(self, text: str) -> int | None:
        """Read the arguments' JSON on from self.pos: the index just after its closing brace, None if not yet."""
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None

    def finish(self, text: str) -> tuple[str, list[ToolCall], bool]:
        """(content, calls, whether they are complete) of the whole held text: parse's calls under the ids already
        streamed; when parse finds none but calls were streamed (cut by max_tokens), those as they stand, never
        content."""
        content, calls = tool_calls.parse(text)
        if calls:
            return content, [c._replace(id=self.calls[i].id) if i < len(self.calls) and self.calls[i].name == c.name
                             else c for i, c in enumerate(calls)], True
        if self.calls:
            return "", [ToolCall(c.id, c.name, c.arguments) for c in self.calls], all(c.closed for c in self.calls)
        return text, [], False
