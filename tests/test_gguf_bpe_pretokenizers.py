"""Byte-level BPE vocabularies of Llama 3 ('llama-bpe') and Qwen2 ('qwen2', also Qwen2.5 and Qwen3) from a GGUF encode
and decode as the Hugging Face tokenizers they came from. The reference tokenizers are built here with `tokenizers`
from the families' own tokenizer.json settings (written out again here, not taken from tools/), trained on a small
corpus, and written into a GGUF as llama.cpp's converter writes one; the project reads it back (tools/import_gguf.py).
"""

import json

import pytest
from gguf import GGUFReader, GGUFWriter, TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tools.import_gguf import tokenizer_json

# The Split regexes of Meta-Llama-3's and Qwen2's tokenizer.json: Llama 3 keeps digits in runs of up to three, Qwen2
# splits every digit.
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# family -> (tokenizer.ggml.pre, split, ignore_merges, NFC normalizer, control tokens, user-defined tokens)
FAMILIES = {
    "llama3": ("llama-bpe", LLAMA3, True, False, ["<|begin_of_text|>", "<|eot_id|>"], []),
    "qwen2": ("qwen2", QWEN2, False, True, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ["<think>", "</think>"]),
}
CORPUS = ("I'm sure they'll say we've done it. Don't you think it's 12345678 or 2024? She'd go, we'd see.\n"
          "WE'LL SEE, THEY'RE HERE, I'M DONE.\n"
          "naïve café résumé 日本語のテキスト 🙂🙂 emoji!\n\n  Indented   text\twith tabs...\n"
          "def f(x):\n    return x*2 # comment\r\nprices: $3.50, 1,000,000; (a+b)=c?!\n") * 30
PROBES = ["12345678", "I'm don't WE'LL THEY'RE it's", "\n\n  x", "naïve 日本語 🙂", "nai\u0308ve",  # decomposed ï
          "Hello, world!!! ...  (a+b) = $3.50?", "   trailing   ", "\r\n\r\nline\n", "tab\there", " zyx", "zyxw",
          "x\u00a0y\u3000z", "<|im_start|>user\nHi<|im_end|>", "<think>why</think>1 2", "<|eot_id|>12 345"]
UNREACHABLE = "Ġzyx"  # a vocabulary entry no merge leads to: only ignore_merges encodes " zyx" as one token


def split_bytes(split: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def reference(family: str) -> Tokenizer:
    """The family's Hugging Face tokenizer with its special and added tokens. Both vocabularies are trained on
    CORPUS split as Llama 3 splits it, so that Qwen2's too has tokens of several digits, which a wrong split would
    reach."""
    _, split, ignore_merges, nfc, control, user = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = split_bytes(LLAMA3)
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    spec = json.loads(tok.to_str())
    spec["model"]["vocab"][UNREACHABLE] = len(spec["model"]["vocab"])
    spec["model"]["ignore_merges"] = ignore_merges
    tok = Tokenizer.from_str(json.dumps(spec))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = split_bytes(split)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, normalized=False) for t in user])
    return tok


def write_gguf(path, family: str, tok: Tokenizer):
    """The vocabulary as llama.cpp's converter writes it: tokens by id, their types, merges as 'a b'."""
    pre, *_, control, user = FAMILIES[family]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    types = [TokenType.CONTROL if t in control else TokenType.USER_DEFINED if t in user else TokenType.NORMAL
             for t in tokens]
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    w = GGUFWriter(path, "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab[control[-1]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(the reference tokenizer, the project's tokenizer of its GGUF)."""
    family = request.param
    ref = reference(family)
    gguf = write_gguf(tmp_path_factory.mktemp("bpe") / f"{family}.gguf", family, ref)
    return family, ref, Tokenizer.from_str(tokenizer_json(GGUFReader(gguf)).decode())


@pytest.mark.parametrize("text", PROBES)
def test_a_gguf_vocabulary_encodes_and_decodes_as_its_hugging_face_tokenizer(pair, text):
    _, ref, ours = pair
    want = ref.encode(text, add_special_tokens=False)
    got = ours.encode(text, add_special_tokens=False)
    assert got.tokens == want.tokens, text
    assert got.ids == want.ids, text
    assert ours.decode(got.ids, skip_special_tokens=False) == ref.decode(want.ids, skip_special_tokens=False)
    assert ours.decode(got.ids) == ref.decode(want.ids)


def test_the_probes_tell_the_families_apart(pair):
    """The probes are ones on which the settings differ: digit runs split by the family's regex; ' zyx' whole only
    under ignore_merges; the decomposed ï composed only under NFC; added tokens whole."""
    family, ref, _ = pair
    tokens = {text: ref.encode(text, add_special_tokens=False).tokens for text in PROBES}
    assert tokens["12345678"] == (["123", "456", "78"] if family == "llama3" else list("12345678"))
    assert (tokens[" zyx"] == [UNREACHABLE]) == (family == "llama3")
    assert (tokens["nai\u0308ve"] == tokens["naïve 日本語 🙂"][:len(tokens["nai\u0308ve"])]) == (family == "qwen2")
    if family == "qwen2":
        assert tokens["<think>why</think>1 2"][0] == "<think>" and tokens["<|im_start|>user\nHi<|im_end|>"][0] == \
            "<|im_start|>"
