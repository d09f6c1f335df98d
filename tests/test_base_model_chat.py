"""A model without a chat template (a base model) still chats: plain completion of the conversation's text, in the
codec, `prima-ctl chat` and the page; a family's template where the GGUF lacks one but the family is certain;
`import --chat-template FILE`; the errors that are still right name --raw and /v1/completions."""

import json

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from jinja2.sandbox import ImmutableSandboxedEnvironment

from nodes.generation.text import PromptError, TextCodec
from prima_rpc.app import ring
from prima_rpc.request import GenerateRequest, Tool
from prima_rpc.spec.manifest import read_manifest
from tests.ctl import assert_one_line_error, ctl, ctl_here
from tests.gguf_files import small_gguf
from tests.rings import local_ring
from tools.chat_templates import GEMMA
from tools.import_gguf import gguf_chat_template
from tools.synth import synth


@pytest.fixture(scope="module")
def base_store(tmp_path_factory):
    return synth(tmp_path_factory.mktemp("stores") / "base", "tiny", seed=4, chat_template=None)


def codec(store) -> TextCodec:
    manifest, _ = read_manifest(store)
    return TextCodec(manifest, store / manifest.tokenizer)


def test_a_chat_with_a_base_model_is_the_conversation_as_one_text(base_store):
    c = codec(base_store)
    assert c.prompt_ids("Once upon a time") == c.encode("Once upon a time")
    chat = [{"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": " there was a cat."},
            {"role": "user", "content": "The end."}]
    assert c.chat_prompt(chat) == "Once upon a time there was a cat.\nThe end."


@pytest.mark.parametrize("request_", [
    GenerateRequest(prompt="hi", tools=(Tool("weather"),)),
    GenerateRequest(prompt="hi", chat_template_kwargs='{"enable_thinking": false}'),
], ids=["tools", "template-vars"])
def test_what_needs_a_template_names_raw_and_completions(base_store, request_):
    with pytest.raises(PromptError) as err:
        codec(base_store).request_ids(request_)
    assert "no chat template" in str(err.value) and "--raw" in str(err.value)
    assert "/v1/completions" in str(err.value) and "--chat-template" in str(err.value)


def metadata_gguf(path, arch: str, name: str, tokens: list[str]):
    """A GGUF's metadata only: what gguf_chat_template reads."""
    w = GGUFWriter(path, arch)
    w.add_name(name)
    w.add_token_list(tokens)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


GEMMA_TOKENS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "a"]


@pytest.mark.parametrize("arch, name, tokens, template", [
    ("gemma3", "Gemma 3 270m It", GEMMA_TOKENS, GEMMA),  # chat-tuned, the family's tokens: its template
    ("gemma3", "Gemma 3 270m", GEMMA_TOKENS, ""),  # the base model shares the tokens: none
    ("gemma3", "Gemma 3 270m It", ["<pad>", "<eos>", "a"], ""),  # tokens not the family's: uncertain
    ("llama", "Some Instruct", ["<s>", "</s>", "a"], ""),  # a llama without Llama 3's turn tokens
], ids=["gemma-it", "gemma-base", "no-turn-tokens", "llama-unknown"])
def test_a_familys_template_only_where_the_family_is_certain(tmp_path, arch, name, tokens, template):
    src = metadata_gguf(tmp_path / "model.gguf", arch, name, tokens)
    assert gguf_chat_template(GGUFReader(src), src) == template


def test_the_gemma_template_writes_gemmas_turns():
    text = ImmutableSandboxedEnvironment().from_string(GEMMA).render(
        messages=[{"role": "user", "content": "Hi "}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Bye"}], add_generation_prompt=True, bos_token="<bos>")
    assert text == ("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_import_takes_a_chat_template_file(tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    src = small_gguf(tmp_path / "base.gguf")
    res = ctl_here("import", str(src), str(tmp_path / "store"), "--chat-template", str(template))
    assert res.returncode == 0, res.stderr
    manifest = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert manifest["chat_template"] == template.read_text()
    assert codec(tmp_path / "store").chat_prompt([{"role": "user", "content": "hi"}]) == "[hi]"
    plain = ctl_here("import", str(src), str(tmp_path / "plain"))
    assert plain.returncode == 0 and not json.loads((tmp_path / "plain" / "manifest.json").read_text())["chat_template"]


@pytest.mark.parametrize("text, message", [("{% for %}", "not a Jinja template (line 1"), ("", "the file is empty")])
def test_a_bad_chat_template_file_is_one_line(tmp_path, text, message):
    template = tmp_path / "chat.jinja"
    template.write_text(text)
    res = ctl("import", str(tmp_path / "missing.gguf"), str(tmp_path / "store"), "--chat-template", str(template))
    assert_one_line_error(res, f"--chat-template {template}: {message}")
    assert not (tmp_path / "store").exists()


@pytest.mark.slow  # a ring of two node processes
def test_chat_and_the_page_say_a_base_model_continues_text(base_store, tmp_path):
    from tests.test_web_page import fetch

    with local_ring(base_store, 2, tmp_path / "logs", windows=[4, 4]) as local:
        head = local.addresses[0]
        assert ring.plain_chat(head)
        res = ctl("--node", head, "chat", "--max-tokens", "4", "--temperature", "0", stdin=b"Once upon\n")
        assert res.returncode == 0, res.stderr
        assert "no chat template" in res.stderr and "plain completion" in res.stderr
        assert res.stdout.count("model> ") == 1
        [(status, _, body)] = fetch(head, [("GET", "/api/ring", {})])
        assert status == 200 and json.loads(body)["plain_chat"] is True
