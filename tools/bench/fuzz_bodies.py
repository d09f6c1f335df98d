"""Hostile HTTP bodies for every dialect of the HTTP API (hypothesis strategies): each field of a valid request
kept, dropped, given a wrong type, unicode, a huge number, a deep nesting, or a schema or tool that cannot work;
now and then no object at all, bytes that are no JSON, a nesting past any parser's depth or a body over the limit."""

import json

from hypothesis import strategies as st

PATHS = {"openai-chat": "/v1/chat/completions", "openai-completions": "/v1/completions",
         "anthropic": "/v1/messages", "ollama-chat": "/api/chat", "ollama-generate": "/api/generate"}
HUGE = st.sampled_from([2**31, 2**63, 2**64 + 1, 10**30, -(2**63), -1, 0, 1e308, float("inf"), float("nan")])
NUMBERS = st.one_of(st.integers(-5, 40), HUGE, st.floats(allow_nan=True, allow_infinity=True))
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["", "\x00", "\ud800".encode("utf-16", "surrogatepass")
                                                        .decode("utf-16", "replace"), "é" * 300, "🙂" * 50,
                                                        "<|im_start|>", "{{ raise }}", "\u202e\u200b"]))
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                    max_leaves=12)
ODD_NAMES = st.one_of(st.sampled_from(["", " ", "a" * 5000, "../../etc/passwd", "名前", "get weather", "f\x00",
                                       "1abc", "-", "__proto__"]), st.text(max_size=30))
BAD_SCHEMAS = st.sampled_from([
    {"type": "integer", "minimum": 5, "maximum": 1}, {"enum": []}, {"not": {}}, False, {"type": "nonsense"},
    {"$ref": "#/definitions/missing"}, {"type": "string", "pattern": "(("}, {"allOf": [{"type": "string"},
                                                                                      {"type": "integer"}]},
    {"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#"}}}, {"type": "array", "minItems": 10**9},
    {"type": "string", "minLength": 10**6}, "a schema", [], {"anyOf": []},
])
GOOD_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _field(good):
    """A field's value: valid, or any hostile one."""
    return st.one_of(good, good, JSON, SCALARS, st.lists(JSON, max_size=3))


def _tool(name):
    fn = st.fixed_dictionaries({"name": name, "description": TEXT,
                                "parameters": st.one_of(st.just(GOOD_SCHEMA), BAD_SCHEMAS, JSON)})
    return st.one_of(st.fixed_dictionaries({"type": st.just("function"), "function": fn}), JSON)


def _anthropic_tool(name):
    return st.one_of(st.fixed_dictionaries({"name": name, "description": TEXT,
                                            "input_schema": st.one_of(st.just(GOOD_SCHEMA), BAD_SCHEMAS, JSON)}), JSON)


def _messages(roles, content=None):
    content = content or st.one_of(TEXT, JSON, st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                               "text": TEXT}), max_size=3))
    message = st.one_of(st.fixed_dictionaries({"role": st.sampled_from(roles), "content": content}), JSON)
    return st.one_of(st.lists(message, min_size=1, max_size=4), JSON)


FIELDS: dict[str, dict] = {}  # each dialect's fields and their strategies


def _body(fields: dict, dialect: str = ""):
    """An object with each field either absent or drawn from its strategy (plus a stray key now and then)."""
    if dialect:
        FIELDS[dialect] = fields
    return st.fixed_dictionaries({}, optional={**fields, "stray": JSON})


COMMON = {"model": _field(st.just("m")), "stream": _field(st.booleans()), "temperature": _field(st.just(0.0)),
          "top_p": _field(st.just(1.0)), "seed": _field(st.integers(0, 9)), "stop": _field(st.lists(TEXT, max_size=5))}
MAX = _field(st.integers(1, 6))
ROLES = ["system", "user", "assistant", "tool", "developer", "bot", ""]
FORMAT = st.one_of(st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
    {"name": ODD_NAMES, "schema": st.one_of(BAD_SCHEMAS, st.just(GOOD_SCHEMA), JSON)})}),
    st.fixed_dictionaries({"type": st.sampled_from(["json_object", "text", "xml", ""])}), JSON)

BODIES = {
    "openai-chat": _body({**COMMON, "messages": _messages(ROLES), "max_tokens": MAX, "max_completion_tokens": MAX,
                          "n": _field(st.integers(1, 2)), "logprobs": _field(st.booleans()),
                          "top_logprobs": _field(st.integers(0, 3)), "response_format": FORMAT,
                          "tools": st.one_of(st.lists(_tool(ODD_NAMES), max_size=3), JSON),
                          "tool_choice": _field(st.sampled_from(["auto", "none", "required"])),
                          "stream_options": JSON}, "openai-chat"),
    "openai-completions": _body({**COMMON, "prompt": _field(TEXT), "max_tokens": MAX, "n": _field(st.integers(1, 2)),
                                 "logprobs": _field(st.integers(0, 3)), "echo": _field(st.booleans()),
                                 "suffix": JSON}, "openai-completions"),
    "anthropic": _body({**COMMON, "messages": _messages(["user", "assistant", "system", ""]), "max_tokens": MAX,
                        "system": _field(TEXT), "top_k": _field(st.integers(0, 9)),
                        "stop_sequences": _field(st.lists(TEXT, max_size=4)),
                        "tools": st.one_of(st.lists(_anthropic_tool(ODD_NAMES), max_size=3), JSON),
                        "tool_choice": JSON, "metadata": JSON}, "anthropic"),
    "ollama-chat": _body({"model": _field(st.just("m")), "messages": _messages(ROLES), "stream": _field(st.booleans()),
                          "format": st.one_of(st.just("json"), BAD_SCHEMAS, JSON),
                          "options": st.one_of(_body({"num_predict": MAX, "temperature": _field(st.just(0.0)),
                                                      "seed": _field(st.integers(0, 9)), "top_k": JSON,
                                                      "stop": JSON, "num_ctx": NUMBERS}), JSON),
                          "tools": st.one_of(st.lists(_tool(ODD_NAMES), max_size=3), JSON), "keep_alive": JSON},
                         "ollama-chat"),
    "ollama-generate": _body({"model": _field(st.just("m")), "prompt": _field(TEXT), "system": _field(TEXT),
                              "raw": _field(st.booleans()), "stream": _field(st.booleans()),
                              "format": st.one_of(st.just("json"), BAD_SCHEMAS, JSON), "template": JSON,
                              "options": st.one_of(_body({"num_predict": MAX}), JSON), "images": JSON},
                             "ollama-generate"),
}


def _encode(value) -> bytes:
    return json.dumps(value, allow_nan=True, ensure_ascii=False).encode("utf-8", "surrogatepass")


# Whole bodies no dialect accepts: JSON that is no object, bytes that are no JSON or no UTF-8, nesting far past
# the parser's recursion limit, and one over the size limit.
WHOLE = st.one_of(st.builds(_encode, st.one_of(SCALARS, st.lists(JSON, max_size=3))), st.binary(max_size=64),
                  st.integers(1, 100_000).map(lambda d: b"[" * d + b"]" * d),
                  st.integers(1, 100_000).map(lambda d: b'{"a":' * d + b"1" + b"}" * d),
                  st.just(b'{"model": "' + b"x" * (5 << 20) + b'"}'), st.just(b"\xff\xfe{}"))


# A valid request of each dialect: greedy, a few tokens (the ring answers it in a moment).
VALID = {
    "openai-chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "openai-completions": {"model": "m", "prompt": "hello", "max_tokens": 4},
    "anthropic": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "ollama-chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": False,
                    "options": {"num_predict": 4}},
    "ollama-generate": {"model": "m", "prompt": "hello", "stream": False, "options": {"num_predict": 4}},
}


def _one_field_changed(dialect: str):
    """The dialect's valid request with one field set to a value of its strategy (odd or valid), or dropped."""
    fields = FIELDS[dialect]
    change = st.sampled_from(sorted(fields)).flatmap(lambda k: st.tuples(st.just(k), st.one_of(fields[k], st.just(
        _DROP))))
    return change.map(lambda kv: {k: v for k, v in {**VALID[dialect], kv[0]: kv[1]}.items() if v is not _DROP})


_DROP = object()


def requests():
    """(dialect, body bytes): a valid request with one field changed, an object of hostile fields, or a hostile
    whole body."""
    dialect = st.sampled_from(sorted(PATHS))
    one = dialect.flatmap(lambda d: st.tuples(st.just(d), _one_field_changed(d).map(_encode)))
    shaped = dialect.flatmap(lambda d: st.tuples(st.just(d), BODIES[d].map(_encode)))
    return st.one_of(one, one, one, shaped, shaped, st.tuples(dialect, WHOLE))
