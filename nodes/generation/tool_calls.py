"""Tool calls in text: each model family's markup, the generic prompt for templates without tools, and parsing the
model's output back into calls (by family: Hermes/Qwen `<tool_call>`, Llama 3.x JSON, Mistral `[TOOL_CALLS]`)."""

import json
import re
import uuid

from prima_rpc.request import Message, Tool, ToolCall

# family -> (the text that opens a call, what opens its JSON, the key of its arguments, what closes it)
MARKUP = {
    "hermes": ("<tool_call>", '<tool_call>\n{"name": ', "arguments", "}\n</tool_call>"),
    "llama3": ('{"name"', '{"name": ', "parameters", "}"),
    "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{"name": ', "arguments", "}]"),
}
GENERIC = "hermes"  # templates without tools get Hermes' markup, explained in a system prompt (generic_prompt)
OPENERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
ARG_KEYS = ("arguments", "parameters")  # Hermes and Mistral name a call's arguments so, Llama 3.x the other way
# Where each call's JSON object begins, by what the answer opens with (parse's rules, for a text still growing):
# Hermes' objects inside <tool_call> tags, Mistral's items of one list, Llama 3.x's objects separated by ";".
CALL_STARTS = (
    ("<tool_call>", re.compile(r"<tool_call>\s*(?=\{)")),
    ("[TOOL_CALLS]", re.compile(r"(?:\A\s*\[TOOL_CALLS\]\s*\[|,)\s*(?=\{)")),
    ("[", re.compile(r"(?:\A\s*\[|,)\s*(?=\{)")),
    ("<|python_tag|>", re.compile(r"(?:\A\s*<\|python_tag\|>|;)\s*(?=\{)")),
    ("{", re.compile(r"(?:\A|;)\s*(?=\{)")),
)


def family(template: str | None) -> str:
    """The tool-call family a chat template speaks, read off the markup it writes; GENERIC for one without tools."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return "hermes" if "<tool_call>" in template else GENERIC


def speaks_tools(template: str | None) -> bool:
    """Whether the template renders `tools` itself (else the generic system prompt describes them)."""
    return bool(template) and "tools" in template and "tool_call" in template


def openai_tools(tools: tuple[Tool, ...]) -> list[dict]:
    """The tools as chat templates take them (transformers' convention: OpenAI's JSON)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": parameters(t)}} for t in tools]


def parameters(tool: Tool) -> dict:
    return json.loads(tool.parameters) if tool.parameters else {"type": "object"}


def call_schema(tool: Tool, key: str = "arguments") -> dict:
    """A JSON Schema of one call of `tool`: {"name": its name, key: its arguments}."""
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: parameters(tool)},
            "required": ["name", key], "additionalProperties": False}


def generic_prompt(tools: tuple[Tool, ...]) -> str:
    """The system prompt that offers tools to a model whose template does not (Hermes' wording and markup)."""
    specs = "\n".join(json.dumps(t) for t in openai_tools(tools))
    return ("You may call one or more functions to assist with the user query. The functions you may call are:\n"
            f"<tools>\n{specs}\n</tools>\n"
            "To call a function, answer with its name and arguments as a JSON object inside tags:\n"
            '<tool_call>\n{"name": "<function-name>", "arguments": <arguments-object>}\n</tool_call>')


def template_messages(messages: tuple[Message, ...], tools: tuple[Tool, ...], native: bool) -> list[dict]:
    """The chat as a template takes it: with `native` templates, tool calls and tool results as transformers
    passes them; otherwise the generic system prompt, calls written as Hermes markup, results as user turns."""
    out = []
    for m in messages:
        d: dict = {"role": m.role, "content": m.content}
        if native:
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.name, "arguments": json.loads(c.arguments or "{}")}} for c in m.tool_calls]
            if m.role == "tool":
                d.update(tool_call_id=m.tool_call_id, name=m.name)
        elif m.tool_calls:
            calls = "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments or "{}"}}}'
                              "\n</tool_call>" for c in m.tool_calls)
            d["content"] = "\n".join(p for p in (m.content, calls) if p)
        elif m.role == "tool":
            d = {"role": "user", "content": f"<tool_response>\n{m.content}\n</tool_response>"}
        out.append(d)
    if tools and not native:
        prompt = generic_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """(the content before the calls, the calls) of a model's answer in any family's markup; ([text], []) when it
    holds no well-formed call."""
    calls: list[ToolCall] = []
    start = text.find("<tool_call>")
    if start >= 0:
        for body in CALL_RE.findall(text[start:]):
            calls += _calls(_json(body), "arguments")
        return (text[:start].rstrip(), calls) if calls else (text, [])
    stripped = text.strip()
    if stripped.startswith("[TOOL_CALLS]"):
        calls = _calls(_json(stripped.removeprefix("[TOOL_CALLS]")), "arguments")
    elif stripped.startswith("<|python_tag|>") or stripped.startswith("{"):
        body = stripped.removeprefix("<|python_tag|>")
        for value in _separated(body):  # Llama 3.x may answer several calls separated by semicolons
            calls += _calls(value, "parameters")
    elif stripped.startswith("[{"):
        calls = _calls(_json(stripped), "arguments")  # Mistral with [TOOL_CALLS] decoded away as special
    return ("", calls) if calls else (text, [])


def call_starts(text: str) -> re.Pattern | None:
    """The pattern of where calls begin in an answer that opens with `text` (None: no family's, or too short yet)."""
    lead = text.lstrip()
    if "<tool_call>" in text:
        return CALL_STARTS[0][1]
    return next((pattern for opener, pattern in CALL_STARTS[1:] if lead.startswith(opener)), None)


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def opens_call(text: str) -> int:
    """Where the first call in `text` may begin (len(text): nowhere yet); used to hold back streamed text."""
    hits = [i for i in (text.find(m) for m in OPENERS) if i >= 0]
    lead = len(text) - len(text.lstrip())
    if text[lead:lead + 1] in ("{", "["):  # a bare JSON answer (Llama 3.x, Mistral) may be a call
        hits.append(lead)
    return min(hits, default=len(text))


def partial_marker(text: str) -> int:
    """How many of the last characters of `text` may begin a call's markup (to hold until the next piece)."""
    return max((n for m in OPENERS for n in range(1, len(m)) if text.endswith(m[:n])), default=0)


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _separated(text: str) -> list:
    """The JSON values of a ";"-separated text, up to the first that does not parse (a ";" in a string is kept)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            value, i = decoder.raw_decode(text, len(text) - len(text[i:].lstrip()))
        except ValueError:
            break
        values.append(value)
        rest = text[i:].lstrip()
        if not rest.startswith(";"):
            break
        i = len(text) - len(rest) + 1
    return values


def _calls(value, key: str) -> list[ToolCall]:
    """The well-formed calls in a decoded value: {"name": str, key: object} or a list of them."""
    items = value if isinstance(value, list) else [value]
    out = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
            return []
        args = item.get(key, item.get(ARG_KEYS[0], item.get(ARG_KEYS[1], {})))
        if not isinstance(args, dict):
            return []
        out.append(ToolCall(new_id(), item["name"], json.dumps(args)))
    return out
