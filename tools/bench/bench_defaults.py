"""Do the default sampling settings keep the default model out of loops? Ten everyday questions to SmolLM2 (the
single-process reference: the head's own Generation), each answer scored by its most repeated word 4-gram: how many
times the likeliest loop came round. The goal: no answer past 3. `--greedy` asks the same at temperature 0 (the
loops the defaults are there to avoid); `--seed` makes the sampled run reproducible.

    python -m tools.bench.bench_defaults [--max-tokens 256] [--greedy] [--seed 0] [--json]
"""

import argparse
import json
import time
from collections import Counter

from nodes.generation.reference import ReferenceModel
from nodes.generation.speculate import SpeculateParams
from nodes.generation.state import generate_params
from prima_rpc.request import GenerateRequest
from tools.importers import DEFAULT_DTYPE, ensure_default_store

QUESTIONS = (
    "What should I cook for dinner tonight?",
    "Which animals make good pets for a small flat?",
    "How do I get a red wine stain out of a carpet?",
    "Tell me a short story about a cat.",
    "What is a good way to start learning the guitar?",
    "How can I sleep better?",
    "Why is the sky blue?",
    "Plan a rainy Saturday for two children.",
    "What are the planets of the solar system?",
    "Write a polite note to a neighbour about a noisy party.",
)
GOAL = 3  # the most times one 4-gram may come round in an answer


def most_repeated(text: str, n: int = 4) -> tuple[int, str]:
    """(count, the n-gram) of the word n-gram that occurs most often in `text` (0 for a text under n words)."""
    words = text.lower().split()
    grams = Counter(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    if not grams:
        return 0, ""
    gram, count = grams.most_common(1)[0]
    return count, " ".join(gram)


def ask(model: ReferenceModel, question: str, max_tokens: int, temperature: float | None, seed: int) -> dict:
    request = GenerateRequest(question, max_tokens=max_tokens, temperature=temperature, seed=seed)
    params = generate_params(request, SpeculateParams("off"))
    start = time.perf_counter()
    outs = list(model.generate_ids(model.codec.request_ids(request), params))
    text = "".join(o.text for o in outs)
    count, gram = most_repeated(text)
    return {"question": question, "tokens": len(outs), "seconds": time.perf_counter() - start,
            "most_repeated_4gram": gram, "repeats": count, "text": text}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-tokens", type=int, default=256, help="per answer (the page's and chat's limit)")
    p.add_argument("--greedy", action="store_true", help="temperature 0 instead of the defaults")
    p.add_argument("--seed", type=int, default=0, help="question i is seeded seed + i")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    model = ReferenceModel(ensure_default_store(dtype=DEFAULT_DTYPE))
    temperature = 0.0 if args.greedy else None
    if not args.json:
        print(f"SmolLM2 ({DEFAULT_DTYPE}), {'greedy' if args.greedy else 'default'} sampling, {args.max_tokens} "
              "tokens at most an answer", flush=True)
    answers = []
    for i, q in enumerate(QUESTIONS):
        answers.append(a := ask(model, q, args.max_tokens, temperature, args.seed + i))
        if not args.json:
            print(f"{a['repeats']:3d}x {a['most_repeated_4gram']!r:40.40} {a['tokens']:4d} tokens  {q}", flush=True)
    worst = max(a["repeats"] for a in answers)
    result = {"sampling": "greedy" if args.greedy else "defaults", "max_tokens": args.max_tokens,
              "worst_repeats": worst, "goal": GOAL, "met": worst <= GOAL,
              "looping_answers": sum(a["repeats"] > GOAL for a in answers), "answers": answers}
    if args.json:
        print(json.dumps(result))
        return
    print(f"worst: {worst} repeats of one 4-gram (goal <= {GOAL}: {'met' if result['met'] else 'missed'}); "
          f"{result['looping_answers']} of {len(answers)} answers past it")


if __name__ == "__main__":
    main()
