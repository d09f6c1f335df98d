"""Text in and out: the store's tokenizer, its chat template, and streaming detokenisation."""

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from nodes.generation import tool_calls
from prima_rpc.request import GenerateRequest
from prima_rpc.spec.manifest import Manifest, StoreError


class PromptError(ValueError):
    """A prompt that cannot be turned into tokens (empty, too long, bad chat)."""


def no_template(what: str) -> PromptError:
    """The error of a chat feature a model without a chat template cannot have, and the ways it can be used."""
    return PromptError(f"this model has no chat template, so {what}; send a raw prompt (prima-ctl --raw, or POST "
                       "/v1/completions), or import the model again with --chat-template FILE")


def plain_text(messages: list[dict]) -> str:
    """A chat as one text for a model without a chat template (a base model): each answer continues the text
    before it, and each new message starts a line of its own, so the model continues the whole conversation."""
    text = ""
    for m in messages:
        joint = "" if not text or m.get("role") == "assistant" else "\n"
        text += joint + m.get("content", "")
    return text


def _raise(message: str):
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    """Today's date as Llama 3.x templates print it (transformers gives templates the same function)."""
    return datetime.now().strftime(fmt)


class TextCodec:
    def __init__(self, manifest: Manifest, tokenizer_path: Path | None):
        if tokenizer_path is None or not tokenizer_path.is_file():
            raise StoreError(f"the store has no tokenizer file ({tokenizer_path})")
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self.manifest = manifest
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals.update(raise_exception=_raise, strftime_now=_strftime_now)
        self.template = env.from_string(manifest.chat_template) if manifest.chat_template else None

    @property
    def plain(self) -> bool:
        """Whether chats are plain completion: the model has no chat template (a base model)."""
        return self.template is None

    @property
    def tool_family(self) -> str:
        """The tool-call markup of this model's chat template (nodes/generation/tool_calls.py)."""
        return tool_calls.family(self.manifest.chat_template)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, variables: dict | None = None) -> str:
        """messages as transformers passes them (tool calls and results included); tools: OpenAI's JSON, for
        templates that render them; variables: a request's chat_template_kwargs (Qwen3's enable_thinking), as
        transformers' apply_chat_template(**kwargs) passes them."""
        for m in messages:
            if m.get("role") not in ("system", "user", "assistant", "tool") or not isinstance(m.get("content"), str):
                raise PromptError(f"bad chat message {str(m)[:80]}: role system|user|assistant|tool and text content")
        if self.template is None:  # a base model: plain completion of the conversation's text
            if tools:
                raise no_template("it cannot call tools")
            if variables:
                raise no_template("it takes no chat_template_kwargs")
            return plain_text(messages)
        bos = self.token_text(self.manifest.bos_token_id)
        eos = self.token_text(self.manifest.eos_token_ids[0] if self.manifest.eos_token_ids else None)
        try:
            return self.template.render(**(variables or {}), messages=messages, add_generation_prompt=True,
                                        bos_token=bos, eos_token=eos, **({"tools": tools} if tools else {}))
        except TemplateError as exc:
            raise PromptError(f"chat template failed: {exc}") from None

    def token_text(self, token_id: int | None) -> str:
        if token_id is None or token_id < 0:
            return ""
        return self.tokenizer.id_to_token(token_id) or ""

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos = self.manifest.bos_token_id
        # Chat templates that write {{ bos_token }} themselves must not get a second one.
        if self.manifest.add_bos and bos is not None and bos >= 0 and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def prompt_ids(self, prompt: str = "", messages: list[dict] | None = None, raw: bool = False,
                   variables: dict | None = None) -> list[int]:
        if messages:
            text = self.chat_prompt(messages, variables=variables)
        elif not prompt:
            raise PromptError("the prompt is empty")
        else:
            text = prompt if raw else self.chat_prompt([{"role": "user", "content": prompt}], variables=variables)
        return self.encode(text)

    def request_ids(self, request: GenerateRequest) -> list[int]:
        """A request's prompt tokens: its chat (with its tools, through the template where it renders them, else
        in the generic prompt of tool_calls.py) or its prompt."""
        tools = request.tools if request.tool_choice != "none" else ()
        if not request.messages and not tools:
            return self.prompt_ids(request.prompt, raw=request.raw, variables=request.template_kwargs())
        if request.raw:
            raise PromptError("tools need the chat template; raw prompts cannot carry them")
        if tools and self.template is None:
            raise no_template("it cannot call tools")
        messages = request.messages or (tool_calls.Message("user", request.prompt),)
        native = tool_calls.speaks_tools(self.manifest.chat_template)
        chat = tool_calls.template_messages(messages, tools, native)
        if not chat:
            raise PromptError("the prompt is empty")
        return self.encode(self.chat_prompt(chat, tool_calls.openai_tools(tools) if native and tools else None,
                                            request.template_kwargs()))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class StreamDecoder:
    """Turns tokens into text pieces as they arrive, never splitting a UTF-8 character."""

    codec: TextCodec
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # tokens before `prefix` can no longer change the text
    read: int = 0  # tokens up to `read` have been handed out as text

    def push(self, token_id: int) -> str:
        # Decode a short window only (TGI's method): context tokens [prefix, read) plus the new ones.
        self.ids.append(token_id)
        before = self.codec.decode(self.ids[self.prefix:self.read])
        after = self.codec.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
