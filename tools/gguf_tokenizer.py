"""Build a Hugging Face `tokenizers` tokenizer from the vocabulary embedded in a GGUF file."""

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from prima_rpc.spec.manifest import StoreError

CONTROL = 3  # llama.cpp token type of special tokens such as <|im_start|>

# llama.cpp's pre-tokenizer splits by `tokenizer.ggml.pre`; the GPT-2 regex is the byte-level default.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":  # SmolLM's own tokenizer.json: single digits, then GPT-2 byte level
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}.get(pre)
    if split:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    return byte_level


def build_tokenizer(model: str, pre: str, tokens: list[str], token_types: list[int],
                    merges: list[str]) -> Tokenizer:
    if model != "gpt2":
        raise StoreError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3")))
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, token_types) if ty == CONTROL]
    tok.add_special_tokens(specials)
    return tok
