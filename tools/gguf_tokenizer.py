"""Build a Hugging Face `tokenizers` tokenizer from the vocabulary embedded in a GGUF file."""

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from prima_rpc.spec.manifest import StoreError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED = 1, 2, 3, 4  # llama.cpp token types (CONTROL: <|im_start|> and such)

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


def build_tokenizer(model: str, pre: str, tokens: list[str], token_types: list[int], merges: list[str],
                    scores: list[float] | None = None, add_prefix: bool = True) -> Tokenizer:
    """A `tokenizers` tokenizer of a GGUF vocabulary: byte-level BPE ('gpt2') or SentencePiece BPE ('llama')."""
    user = [t for t, ty in zip(tokens, token_types) if ty == USER_DEFINED]
    if model == "llama":
        tok = sentencepiece_bpe(tokens, scores or [0.0] * len(tokens), token_types, add_prefix)
        # user-defined pieces are whole tokens wherever they occur (those with spaces, '▁', come from merges)
        tok.add_tokens([AddedToken(t, normalized=False) for t in user if "▁" not in t])
    elif model == "gpt2":
        tok = byte_level_bpe(pre, tokens, merges)
        # the converter's user-defined tokens are the HF added tokens not marked special (Qwen3's <think>): whole
        tok.add_tokens([AddedToken(t, normalized=False) for t in user])
    else:
        raise StoreError(f"GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE and "
                         "'llama' SentencePiece BPE)")
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(tokens, token_types) if ty == CONTROL]
    tok.add_special_tokens(specials)
    return tok


def byte_level_bpe(pre: str, tokens: list[str], merges: list[str]) -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in ("llama-bpe", "llama3")))
    if pre == "qwen2":  # Qwen2's tokenizer.json composes text (NFC) before splitting; llama.cpp does not, HF does
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_bpe(tokens: list[str], scores: list[float], token_types: list[int], add_prefix: bool) -> Tokenizer:
    """SentencePiece's BPE as llama.cpp runs it: pieces merge pairwise, the best-scored merged piece first; text
    llama.cpp cannot cover falls back to <0xNN> byte tokens; spaces are '▁'."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    mergeable = [i for i, ty in enumerate(token_types) if ty in (NORMAL, USER_DEFINED)]
    merges = sorted(((scores[i], vocab[tokens[i][:k]], vocab[tokens[i][k:]], tokens[i][:k], tokens[i][k:])
                     for i in mergeable for k in range(1, len(tokens[i]))
                     if tokens[i][:k] in vocab and tokens[i][k:] in vocab), key=lambda m: (-m[0], m[1], m[2]))
    unk = next((t for t, ty in zip(tokens, token_types) if ty == UNKNOWN), None)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=unk,
                               byte_fallback=True, fuse_unk=True))
    # spaces become '▁'; with add_prefix one goes in front of every run of text, after each special or user-defined
    # token too (llama.cpp's llama-vocab.cpp: "prefix with space if previous is special")
    steps = [normalizers.Prepend("▁")] if add_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    strip = [decoders.Strip(" ", 1, 0)] if add_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok
