"""The tiny Qwen3-MoE, Qwen2-MoE and Mixtral models transformers writes, on a 3-node ring (k = 2): with every expert
resident, and with budgets that hold a quarter of each node's experts, greedy tokens equal the single process."""

import pytest
import torch

from nodes.engine.fused import expert_bytes, head_bytes, kv_bytes, layer_bytes
from nodes.engine.prefetch import KV_RESERVE_TOKENS
from prima_rpc.app import ring
from prima_rpc.spec.manifest import read_manifest
from tests.arch_models import MOE_FAMILIES, write_model
from tests.rings import collect, collect_all, greedy_reference, local_ring
from tools.import_hf import import_hf

PROMPTS = ["The capital of France is", "one two three", "a"]
TOKENS = 8
WINDOWS = [1, 1, 1]  # six layers: each node two, k = 2


def quarter_budget(cfg, layers: int, head: bool) -> int:
    """A node's budget for its layers' dense parts, its KV reserve (and head) and a quarter of its experts."""
    one = expert_bytes(cfg, torch.float32)
    dense = layer_bytes(cfg, torch.float32) - cfg.n_experts * one
    fixed = (head_bytes(cfg, torch.float32) if head else 0) + kv_bytes(cfg, torch.float32, layers,
                                                                      min(KV_RESERVE_TOKENS, cfg.max_seq_len))
    return fixed + layers * dense + layers * cfg.n_experts // 4 * one


@pytest.mark.slow
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_a_three_node_ring_resident_and_with_a_quarter_of_the_experts_equals_the_single_process(
        smol_store, family, tmp_path):
    hf = write_model(family, smol_store / "tokenizer.json", tmp_path / "hf", num_hidden_layers=6)
    store = import_hf(hf, tmp_path / "store")
    expected = greedy_reference(store, PROMPTS, TOKENS, raw=True)  # no chat template
    with local_ring(store, 3, tmp_path / "logs", WINDOWS) as local:
        assert [tokens for tokens, _ in collect_all(local.addresses[0], PROMPTS, TOKENS, raw=True)] == \
            [expected[p] for p in PROMPTS]
    cfg = read_manifest(store)[0].config
    budgets = [["--mem-budget", str(quarter_budget(cfg, 2, head=m == 0))] for m in range(3)]
    with local_ring(store, 3, tmp_path / "logs-quarter", WINDOWS, extra_args=budgets) as local:
        loaded = [info.stats.disk_read_bytes for _, info in ring.walk(local.addresses[0])]
        assert collect(local.addresses[0], PROMPTS[0], TOKENS, raw=True)[0] == expected[PROMPTS[0]]
        assert [tokens for tokens, _ in collect_all(local.addresses[0], PROMPTS, TOKENS, raw=True)] == \
            [expected[p] for p in PROMPTS]
        infos = [info for _, info in ring.walk(local.addresses[0])]
        # every node read missing experts while decoding, and held no more than its budget
        assert all(info.stats.disk_read_bytes > before for info, before in zip(infos, loaded, strict=True))
        assert all(info.stats.resident_bytes <= int(b[1]) for info, b in zip(infos, budgets, strict=True))
