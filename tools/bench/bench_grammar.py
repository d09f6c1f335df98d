"""The grammar's cost per token at the head vs the time per output token (TPOT), on SmolLM2, side by side in one run.

Runs the single-process reference (the head's own Generation: the same mask code the ring's head runs) on a
json_schema request at temperature 1, timing separately each token's forward and its grammar work (llguidance's
mask, applied to the logits, and its advance). With --compare, also the mask of xgrammar and outlines-core (when
importable; neither is a dependency) on a fixed JSON document, which is how llguidance was chosen.

    python -m tools.bench.bench_grammar [--answers 8] [--tokens 48] [--compare]
"""

import argparse
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "kind": {"enum": ["person", "robot", "animal"]}},
    "required": ["name", "age", "tags", "kind"], "additionalProperties": False}
THREADS = 2


def head_cost(answers: int, tokens: int) -> dict:
    from nodes.generation.reference import ReferenceModel
    from nodes.generation.speculate import SpeculateParams
    from nodes.generation.state import Generation, generate_params
    from prima_rpc.request import GenerateRequest, Message
    from tools.default_model import ensure_default_store

    torch.set_num_threads(THREADS)
    model = ReferenceModel(ensure_default_store())
    forward, grammar, made = [], [], 0
    for seed in range(answers):
        request = GenerateRequest(messages=(Message("user", "Describe someone as JSON."),), max_tokens=tokens,
                                  temperature=1.0, seed=seed, response_format="json_schema",
                                  json_schema=json.dumps(SCHEMA))
        params = generate_params(request, SpeculateParams("off"))
        gen = Generation(model.codec.request_ids(request), params, model.codec, model.store.manifest.eos_token_ids,
                         model.cfg.max_seq_len, None, model.cfg.vocab)
        cache = model.new_cache(gen.capacity)
        c = gen.constraint
        while not gen.done:
            ids, pos = gen.pending()
            t0 = time.perf_counter()
            logits = model.step(ids, pos, cache)
            t1 = time.perf_counter()
            masked = c.mask(logits)  # timed alone here; accept() below repeats it, with the advance
            t2 = time.perf_counter()
            gen.accept(logits)
            t3 = time.perf_counter()
            if len(gen.tokens) > 1:  # decode steps only (the first is the prompt's prefill)
                forward.append(t1 - t0)
                grammar.append(t2 - t1)
            del masked, t3
        json.loads(gen.text)
        made += 1
    tpot, mask = statistics.median(forward), statistics.median(grammar)
    return {"answers": made, "decode steps": len(forward), "forward ms (median)": round(tpot * 1e3, 2),
            "grammar mask ms (median)": round(mask * 1e3, 3), "grammar p90 ms": round(sorted(grammar)[
                int(0.9 * len(grammar))] * 1e3, 3), "grammar / TPOT %": round(100 * mask / tpot, 2)}


def compare() -> dict:
    """Per-token mask time of each library on one schema-valid document (tokenized as the tokenizer does)."""
    from tokenizers import Tokenizer

    from tools.default_model import ensure_default_store

    path = ensure_default_store() / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    doc = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines"], "kind": "person"},
                     separators=(",", ":"))
    ids, vocab, out = tok.encode(doc, add_special_tokens=False).ids, tok.get_vocab_size(), {}
    import llguidance
    import llguidance.torch as lt
    m = llguidance.LLMatcher(llguidance.LLTokenizer(tok.to_str(), eos_token=2),
                             llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    mask = lt.allocate_token_bitmask(1, vocab)
    out["llguidance"] = _timed(ids, lambda: lt.fill_next_token_bitmask(m, mask), m.consume_token)
    try:
        import xgrammar as xg
        from transformers import PreTrainedTokenizerFast
        info = xg.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=str(path)),
                                                 vocab_size=vocab, stop_token_ids=[2])
        xm = xg.GrammarMatcher(xg.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False))
        xmask = xg.allocate_token_bitmask(1, vocab)
        out["xgrammar"] = _timed(ids, lambda: xm.fill_next_token_bitmask(xmask), xm.accept_token)
    except ImportError:
        out["xgrammar"] = "not installed"
    return out


def _timed(ids: list[int], fill, consume) -> str:
    times = []
    for i in ids:
        t0 = time.perf_counter()
        fill()
        times.append(time.perf_counter() - t0)
        consume(i)
    times.sort()
    return f"median {times[len(times) // 2] * 1e6:.0f} us, p90 {times[int(0.9 * len(times))] * 1e6:.0f} us"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--compare", action="store_true")
    args = ap.parse_args()
    print(json.dumps(head_cost(args.answers, args.tokens), indent=1))
    if args.compare:
        print(json.dumps(compare(), indent=1))


if __name__ == "__main__":
    main()
