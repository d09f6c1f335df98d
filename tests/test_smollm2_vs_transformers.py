"""The reference on the imported SmolLM2 store equals Hugging Face transformers on the same GGUF.

Tolerance: last-position logits within 1e-3 absolute (observed ~5e-5; both de-quantise Q4_1 to the
same float32 values, and only summation order differs).
"""

import pytest
import torch

from nodes.generation.reference import ReferenceModel
from nodes.generation.state import GenerateParams
from tools.default_model import default_gguf

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in two sentences.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
]
TOKENS = 32
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    gguf = default_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return tok, model.eval()


@pytest.fixture(scope="module")
def ref(smol_store):
    return ReferenceModel(smol_store)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_same_prompt_tokens_and_greedy_tokens(hf, ref, prompt):
    tok, model = hf
    theirs_prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
    ours_prompt = ref.codec.prompt_ids(prompt)
    assert ours_prompt == list(theirs_prompt)

    ours = [t.token_id for t in ref.generate_ids(ours_prompt, GenerateParams(max_tokens=TOKENS))]
    with torch.no_grad():
        out = model.generate(torch.tensor([ours_prompt]), max_new_tokens=TOKENS, do_sample=False)
    theirs = out[0, len(ours_prompt):].tolist()
    assert ours == theirs


def test_last_position_logits_within_tolerance(hf, ref):
    _, model = hf
    ids = ref.codec.prompt_ids(PROMPTS[0])
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0, -1]
    ours = ref.step(ids, 0, ref.new_cache(len(ids)))
    assert (ours - theirs).abs().max().item() < 1e-3
    assert ours.argmax() == theirs.argmax()


def test_chat_answer_is_coherent_english(ref):
    text = "".join(t.text for t in ref.generate("What is the capital of France?", GenerateParams(max_tokens=24)))
    assert "Paris" in text
