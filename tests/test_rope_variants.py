"""The rope scalings real models use (YaRN, LongRoPE, linear, dynamic NTK) and partial rotary embeddings, on tiny
random models written by transformers: imported from the Hugging Face directory and from a GGUF written by
llama.cpp's converter, they give transformers' greedy tokens and logits; positions cross each scaling's bands."""

import pytest
import torch
import transformers

from nodes.generation.reference import ReferenceModel
from prima_rpc.spec.manifest import read_manifest
from tests.arch_models import ATOL, PROMPT, greedy, write_model
from tests.llama_convert import convert
from tools.import_gguf import import_gguf
from tools.import_hf import import_hf

STEPS = 8  # positions 0 .. 17: past every original length below
ROTARY = 12  # Phi-4-mini's partial_rotary_factor 0.75 of a 16-wide head
VARIANTS = {  # name -> (family, config beyond the family's, what the store's rope_scaling says)
    "yarn": ("qwen3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8}),
             "yarn"),
    "linear": ("qwen3", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "linear"),
    # the base grows past max_position_embeddings = 12, a decode step at a time
    "dynamic": ("qwen3", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=12),
                "dynamic"),
    # the prompt is longer than the original 8 positions: transformers uses the long factors from its prefill on
    # (test_longrope_short_factors: the short ones)
    "longrope-partial": ("phi3", dict(
        partial_rotary_factor=ROTARY / 16, original_max_position_embeddings=8, rope_scaling={
            "rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
            "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]}), "longrope"),
    "partial": ("phi3", dict(partial_rotary_factor=0.5), None),
}
FROM_GGUF = ("yarn", "linear", "longrope-partial", "partial")  # llama.cpp's converter writes no dynamic NTK


def generated(hf_dir, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """transformers' float32 greedy tokens and the logits of each step [steps, V], as generate computes them (its
    LongRoPE and dynamic frequencies follow the step's last position)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits)


@pytest.fixture(scope="module")
def variant(smol_store, tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            family, extra, _ = VARIANTS[name]
            hf = write_model(family, smol_store / "tokenizer.json", tmp_path_factory.mktemp(name) / "hf",
                             chat_template=read_manifest(smol_store)[0].chat_template, **extra)
            made[name] = (hf, *generated(hf, PROMPT, STEPS))
        return made[name]
    return get


def check(store, ids: list[int], logits: torch.Tensor) -> None:
    got, rows = greedy(ReferenceModel(store), PROMPT, STEPS)
    assert got == ids
    assert (rows[len(PROMPT) - 1:] - logits).abs().max() < ATOL


@pytest.mark.parametrize("name", list(VARIANTS))
def test_hf_import_equals_transformers(variant, name, tmp_path):
    hf, ids, logits = variant(name)
    store = import_hf(hf, tmp_path / "store")
    cfg = read_manifest(store)[0].config
    assert (cfg.rope_scaling or {}).get("type") == VARIANTS[name][2]
    assert cfg.rotary_dim == (ROTARY if name == "longrope-partial" else 8 if name == "partial" else None)
    check(store, ids, logits)


@pytest.mark.slow
@pytest.mark.parametrize("name", FROM_GGUF)
def test_gguf_import_equals_transformers(variant, name, tmp_path):
    hf, ids, logits = variant(name)
    store = import_gguf(convert(hf, tmp_path / f"{name}.gguf"), tmp_path / "store")
    check(store, ids, logits)
    # the same rope as the HF import reads (factors as float32 in the GGUF)
    got, want = (read_manifest(s)[0].config for s in (store, import_hf(hf, tmp_path / "hf-store")))
    assert (got.rotary_dim, got.max_seq_len, (got.rope_scaling or {}).get("type")) == \
        (want.rotary_dim, want.max_seq_len, (want.rope_scaling or {}).get("type"))


def test_longrope_short_factors_within_the_original_context(variant, tmp_path):
    """A store whose context stays within the original length uses LongRoPE's short factors, as transformers does
    on sequences that short (its rotary embedding's own cos/sin)."""
    from dataclasses import replace

    from nodes.engine.rope import Rope

    hf = variant("longrope-partial")[0]
    cfg = read_manifest(import_hf(hf, tmp_path / "store"))[0].config
    rope = Rope(replace(cfg, max_seq_len=8), 8, torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(8)[None])
    assert rope.cos.shape == (8, ROTARY)
    assert torch.allclose(rope.cos, cos[0], atol=1e-6) and torch.allclose(rope.sin, sin[0], atol=1e-6)
    long = Rope(cfg, cfg.max_seq_len, torch.float32)  # 256 positions: past the original 8, the long factors
    assert not torch.allclose(long.cos[:8], cos[0], atol=1e-3)


def test_every_scaling_a_manifest_names_has_its_maths():
    from dataclasses import replace

    from nodes.engine.rope import SCALINGS
    from prima_rpc.spec.manifest import ROPE_SCALINGS, StoreError
    from prima_rpc.spec.shapes import PRESETS

    assert set(SCALINGS) == {"default", *ROPE_SCALINGS}
    with pytest.raises(StoreError, match="rope scaling 'ntk-by-parts' is not supported; supported: linear"):
        replace(PRESETS["tiny"], rope_scaling={"type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(StoreError, match="rotary_dim 7 must be even"):
        replace(PRESETS["tiny"], rotary_dim=7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["longrope-partial", "dynamic"])
def test_a_ring_with_a_relay_equals_the_single_process(variant, name, tmp_path):
    """Three nodes, two holding layers, one relaying: each node's tables are the single process's (a dynamic
    row's base depends on its position only, not on how the ring's frames cut the sequence)."""
    from tests.rings import collect, greedy_reference, local_ring

    store = import_hf(variant(name)[0], tmp_path / "store")
    prompt = "The capital of France is"  # raw: 5 tokens and 10 more cross the dynamic model's original 12
    expected = greedy_reference(store, [prompt], 10, raw=True)[prompt]
    with local_ring(store, 3, tmp_path / "logs", [1, 0, 1]) as local:
        assert collect(local.addresses[0], prompt, 10, raw=True)[0] == expected
