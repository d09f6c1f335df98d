"""GGUF types kept in quantized stores: Q4_K blocks as int4 groups (within float16's rounding of their scale
products), the other types as int8 rows, a mixed file's matrices in the format its types need layer by layer and part
by part (a Q4_K_M file's Q6_K attn_v makes wqkv's v rows int8 in its own layers only), streamed and split like any
other store; stores written before per-layer formats still load; the CLI's per-type lines, summary line and store
name."""

import json

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from nodes.engine.formats import weight_format
from nodes.engine.kernels.q4 import Q4Rows
from nodes.engine.model import Layer
from nodes.engine.quant import Int4, Int8, Rows, machine_layout, pack_int4
from nodes.engine.shard import Shard
from nodes.engine.store import LayerStore
from nodes.generation.reference import ReferenceModel
from prima_rpc.app import ring
from prima_rpc.spec.manifest import StoreError
from prima_rpc.spec.windows import Windows
from tests.ctl import ctl_here
from tests.rings import collect, greedy_reference, local_ring
from tests.shards import ring_step
from tools.bench.make_gguf import TOKENIZER_KEYS, random_blocks
from tools.default_model import default_gguf
from tools.gguf_types import int4_blocks, q4k_int4
from tools.import_gguf import import_gguf, unpermute

Q = GGMLQuantizationType
U = 2.0 ** -24  # float32's unit round-off


def q4k_blocks(rng: np.random.Generator, n: int, k: int, tiny: bool = False) -> np.ndarray:
    """Random Q4_K super-blocks uint8 [n, k/256 * 144]: float16 d and dmin (some below float16's normal range
    with `tiny`), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles."""
    b = n * k // 256
    low = 1e-7 if tiny else 1e-4
    d = rng.uniform(low, 1e-3, (b, 1)).astype(np.float16).view(np.uint8)
    dmin = rng.uniform(low, 4e-3, (b, 1)).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (b, 140), dtype=np.uint8)
    return np.concatenate([d, dmin, rest], axis=1).reshape(n, -1)


def q6k_blocks(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Random Q6_K super-blocks uint8 [n, k/256 * 210]: 128 + 64 bytes of 6-bit values, 16 int8 scales, float16 d."""
    b = n * k // 256
    body = rng.integers(0, 256, (b, 192), dtype=np.uint8)
    scales = rng.integers(-60, 60, (b, 16), dtype=np.int8).view(np.uint8)
    d = rng.uniform(1e-5, 5e-5, (b, 1)).astype(np.float16).view(np.uint8)
    return np.concatenate([body, scales, d], axis=1).reshape(n, -1)


# float16 scales at a block's start: Q5_K's d and dmin (then 12 bytes of 6-bit scales and mins, 32 of high bits, 128 of
# nibbles), IQ4_XS's d (then 2 + 4 bytes of 6-bit scales, 128 of nibbles), IQ4_NL's d (then 16 bytes of nibbles)
HEAD_SCALES = {"Q5_K": 2, "IQ4_XS": 1, "IQ4_NL": 1}


def scaled_blocks(rng: np.random.Generator, n: int, k: int, kind: str) -> np.ndarray:
    """Random blocks of `kind` (HEAD_SCALES) uint8 [n, k/weights a block * its bytes]: small float16 scales, the
    rest random bytes (gguf.quants can de-quantize these types but not write them)."""
    size, nbytes = GGML_QUANT_SIZES[Q[kind]]
    b, heads = n * k // size, HEAD_SCALES[kind]
    d = rng.uniform(1e-5, 1e-3, (b, heads)).astype(np.float16).view(np.uint8)
    rest = rng.integers(0, 256, (b, nbytes - 2 * heads), dtype=np.uint8)
    return np.concatenate([d, rest], axis=1).reshape(n, -1)


@pytest.mark.parametrize("tiny", [False, True], ids=["normal", "subnormal-scales"])
def test_q4k_weights_the_kernel_sees_are_ggufs_within_the_float16_rounding_of_the_scales(tiny):
    """Q4_K's w = D q - M per sub-block of 32 (D = d sc, M = dmin mn, exact in float32 as gguf computes them) goes
    to the int4 kernel as scale D16 and zero M16' + 8 D16 (D16, M16' = float16 of D and -M). With float32
    activations the kernel's weight is fl((q - 8) D16 + fl(M16' + 8 D16)), so it differs from gguf's fl(q D - M)
    by at most q |D16 - D| + |M16' + M| + u (|zero| + |seen| + |ref|), u = 2^-24: float16 rounds each of D and M
    once (relative 2^-11; 2^-25 absolute under 2^-14)."""
    n, k = 96, 512
    blocks = q4k_blocks(np.random.default_rng(1), n, k, tiny)
    ref = torch.from_numpy(dequantize(blocks, Q.Q4_K))  # [N, K]
    q, dm = q4k_int4(blocks, n, k)
    w = Int4.from_dm(pack_int4(q, machine_layout()), dm, torch.float32, machine_layout())
    seen = w.mm(torch.eye(k)).t()  # [N, K]: through the kernel itself
    assert torch.equal(w.rows(torch.arange(n)), seen)
    # D and M exactly, from gguf's own de-quantization of two values of each sub-block (q = 0: -M; q = 15 ...)
    raw = torch.from_numpy(blocks).view(n * k // 256, 144)
    from gguf.quants import Q4_K
    sc, mn = (torch.from_numpy(x.astype(np.float32)) for x in Q4_K.get_scale_min(raw[:, 4:16].numpy()))
    d = raw[:, 0:2].contiguous().view(torch.float16).float()
    dmin = raw[:, 2:4].contiguous().view(torch.float16).float()
    exact_d, exact_m = (d * sc).reshape(n, k // 32), (dmin * mn).reshape(n, k // 32)  # [N, G]
    d16, m16 = dm[..., 0].t().float(), dm[..., 1].t().float()  # [N, G]
    assert torch.equal(d16, exact_d.half().float()) and torch.equal(m16, (-exact_m).half().float())
    zero = (m16 + 8 * d16).repeat_interleave(32, dim=1)
    bound = (q.float() * (d16 - exact_d).abs().repeat_interleave(32, dim=1)
             + (m16 + exact_m).abs().repeat_interleave(32, dim=1) + U * (zero.abs() + seen.abs() + ref.abs()))
    err = (seen - ref).abs()
    assert (err <= bound).all(), (err - bound).max()
    assert err.max() > 0  # the bound is not vacuous: float16 does round some of these products
    relative = 2.0 ** -11 * (q.float() * exact_d.repeat_interleave(32, 1) + exact_m.repeat_interleave(32, 1))
    if not tiny:  # in float16's normal range the rounding is relative
        assert (err <= relative + U * (zero.abs() + seen.abs() + ref.abs())).all()


def test_q4k_rows_must_be_whole_super_blocks():
    with pytest.raises(ValueError, match="Q4_K rows of 576 values"):
        int4_blocks("Q4_K", np.zeros((2, 576 // 32 * 18), np.uint8), 2, 576)


# ------------------------------------------------------------------ a file of mixed types

H, FF, HEADS, KV, LAYERS = 256, 512, 4, 2, 2
SHAPES = {"attn_q": (H, H), "attn_k": (KV * H // HEADS, H), "attn_v": (KV * H // HEADS, H), "attn_output": (H, H),
          "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}
# Q4_K_M's mix on an 8B-like shape: Q4_K, with a Q6_K attn_v in some layers, a Q8_0 embedding; beside them in layer
# 1's int8 matrices a Q4_K attn_q and the main types of Q5_K_M, IQ4_XS and IQ4_NL files
TYPES = {0: {}, 1: {"attn_k": "IQ4_XS", "attn_v": "Q6_K", "ffn_gate": "IQ4_NL", "ffn_up": "Q5_0", "ffn_down": "Q5_K"}}


def mixed_gguf(path, types=TYPES, base: str = "Q4_K"):
    src = GGUFReader(default_gguf())
    vocab = len(src.fields["tokenizer.ggml.tokens"].contents())
    w = GGUFWriter(path, "llama")
    for add, value in (("name", "mixed"), ("block_count", len(types)), ("embedding_length", H), ("context_length", 256),
                       ("feed_forward_length", FF), ("head_count", HEADS), ("head_count_kv", KV)):
        getattr(w, f"add_{add}")(value)
    for key in TOKENIZER_KEYS:
        f = src.fields.get(key)
        if f is not None:
            w.add_key_value(key, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    rng = np.random.default_rng(0)

    def add(name: str, kind: str, n: int, k: int) -> None:
        if kind == "Q4_K":
            w.add_tensor(name, q4k_blocks(rng, n, k), raw_dtype=Q.Q4_K)
        elif kind == "Q6_K":
            w.add_tensor(name, q6k_blocks(rng, n, k), raw_dtype=Q.Q6_K)
        elif kind in HEAD_SCALES:
            w.add_tensor(name, scaled_blocks(rng, n, k, kind), raw_dtype=Q[kind])
        else:
            w.add_tensor(name, quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, Q[kind]),
                         raw_dtype=Q[kind])

    w.add_tensor("token_embd.weight", random_blocks(rng, vocab, H, "Q8_0"), raw_dtype=Q.Q8_0)
    for b in range(len(types)):
        w.add_tensor(f"blk.{b}.attn_norm.weight", rng.uniform(0.5, 1.5, H).astype(np.float32))
        w.add_tensor(f"blk.{b}.ffn_norm.weight", rng.uniform(0.5, 1.5, H).astype(np.float32))
        for name, (n, k) in SHAPES.items():
            add(f"blk.{b}.{name}.weight", types[b].get(name, base), n, k)
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    path = mixed_gguf(d / "mixed.Q4_K_M.gguf")
    lines = []
    store = import_gguf(path, d / "store", log=lines.append)
    return path, store, lines


PARTS = {"wqkv": ["attn_q", "attn_k", "attn_v"], "wo": ["attn_output"], "w_gate_up": ["ffn_gate", "ffn_up"],
         "w_down": ["ffn_down"]}
LAYER_WEIGHTS = {"wqkv": (H + 2 * KV * H // HEADS) * H, "wo": H * H, "w_gate_up": 2 * FF * H, "w_down": FF * H}


def test_a_mixed_file_keeps_q4k_as_int4_and_the_others_as_int8_layer_by_layer(mixed):
    path, store, lines = mixed
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["dtype"] == "int4" and manifest["name"] == "store"  # the directory's name, not general.name
    # attn_k and attn_v (wqkv's k and v rows), ffn_gate and ffn_up (all of w_gate_up) and ffn_down are int8 types in
    # layer 1: int8 there only; its Q4_K attn_q stays int4 beside them
    assert manifest["quant"]["int8_layers"] == [[], ["wk", "wv", "w_gate_up", "w_down"]]
    assert "int8_matrices" not in manifest["quant"]
    assert manifest["files"]["embed"]["format"] == "int8"
    per_layer = sum(LAYER_WEIGHTS.values())
    int8_weights = per_layer - 2 * H * H  # layer 1: all but wq and wo
    assert manifest["bits_per_weight"] == pytest.approx((5 * per_layer + 5 * 2 * H * H + 8 * int8_weights)
                                                        / (2 * per_layer))
    assert lines == ["Q8_0: 1 tensor, 12.6M weights -> int8 rows (nearest)",  # most weights first
                     "Q4_K: 9 tensors, 0.7M weights -> int4 (its blocks as they are)",
                     "IQ4_NL: 1 tensor, 0.1M weights -> int8 rows (nearest)",
                     "Q5_0: 1 tensor, 0.1M weights -> int8 rows (nearest)",
                     "Q5_K: 1 tensor, 0.1M weights -> int8 rows (nearest)",
                     "IQ4_XS: 1 tensor, 0.0M weights -> int8 rows (nearest)",
                     "Q6_K: 1 tensor, 0.0M weights -> int8 rows (nearest)"]
    tensors = {t.name: t for t in GGUFReader(path).tensors}
    store_ = LayerStore(store)
    fmt = weight_format(store_.manifest)
    for i in range(LAYERS):
        layer = Layer.from_unit(store_.load(f"layer.{i}"), torch.float32, fmt.layer(i))
        for name, gnames in PARTS.items():
            weight, row = getattr(layer, name), 0
            seen = weight.rows(torch.arange(weight.shape[0]))
            for g in gnames:  # each GGUF tensor's rows, in the piece that holds them
                t = tensors[f"blk.{i}.{g}.weight"]
                ref = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type)))
                ref = unpermute(ref, {"attn_q": HEADS, "attn_k": KV}[g]) if g in ("attn_q", "attn_k") else ref
                rows = slice(row, row + ref.shape[0])
                piece, at = piece_at(weight, row)
                if t.tensor_type.name == "Q4_K":  # kept: float16 scale products (the test above)
                    assert isinstance(piece, Int4 | Q4Rows)
                    assert ((seen[rows] - ref).abs() <= 2.0 ** -10 * ref.abs().amax()).all()
                else:  # int8 rows: half a step of each row's scale
                    assert isinstance(piece, Int8)
                    scale = piece.scale[at:at + ref.shape[0], None]
                    assert ((seen[rows] - ref).abs() <= 0.501 * scale).all()
                row += ref.shape[0]
    assert isinstance(layer.wqkv, Rows) and [p.shape[0] for p in layer.wqkv.pieces] == [H, 2 * KV * H // HEADS]


def piece_at(weight, row: int):
    """The piece of `weight` (a quant.Rows, or one matrix) that holds `row`, and the row's index in it."""
    for piece in weight.pieces if isinstance(weight, Rows) else (weight,):
        if row < piece.shape[0]:
            return piece, row
        row -= piece.shape[0]
    raise IndexError(row)


def test_each_layer_takes_the_bytes_of_its_own_formats(mixed):
    """On disk, in the memory plan and in the stream buffer: an int4 layer's matrices are ~5/8 of an int8 one's; layer
    1's wqkv is its int4 q rows and its int8 k and v rows."""
    store = LayerStore(mixed[1])
    kv_rows = 2 * KV * H // HEADS
    expected = {0: {u: 5 * w // 8 for u, w in LAYER_WEIGHTS.items()},  # int4: half a byte and (d, m) per 32
                1: {u: w + 4 * (w // H if u != "w_down" else H) if u != "wo" else 5 * w // 8
                    for u, w in LAYER_WEIGHTS.items()}}  # int8: a byte, and a float32 scale per row
    expected[1]["wqkv"] = 5 * H * H // 8 + kv_rows * H + 4 * kv_rows
    for i in range(LAYERS):
        spans = store.layout(f"layer.{i}")
        on_disk = {u: sum(s.stop - s.start for n, s in spans.items() if n.startswith(f"{u}.")) for u in PARTS}
        assert on_disk == expected[i]
    shard = Shard(store, Windows(((0, 2),), LAYERS, False), torch.float32, budget=1)  # both stream
    try:
        assert {i: shard.plan.unit_bytes[i] for i in range(LAYERS)} == expected  # all multiples of 64: as aligned
        assert shard.plan.buffer == 2 * sum(expected[1].values())  # the default: two of the largest layers
        assert shard.plan.streamed_bytes == sum(sum(u.values()) for u in expected.values())
        for i in range(LAYERS):
            parts = shard.prefetcher.scratch(i)
            assert {u: sum(t.numel() * t.element_size() for t in p.values()) for u, p in parts.items()} == expected[i]
    finally:
        shard.close()


@pytest.mark.parametrize("ranges", [[[(0, 2)]], [[(1, 2)], [(0, 1)]]], ids=["1node", "2nodes"])
def test_a_mixed_store_streams_and_splits_as_its_single_process(mixed, ranges):
    """Layers of different formats stream through one buffer, each laid out in its own formats."""
    store = mixed[1]
    ref = ReferenceModel(store)
    shards = [Shard(LayerStore(store), Windows(tuple(r), LAYERS, i == 0), ref.dtype, budget=1)
              for i, r in enumerate(ranges)]
    try:
        ids = ref.codec.prompt_ids("The quick brown fox")
        cache, pos = ref.new_cache(len(ids) + 4), 0
        caches = [s.cache_for("r", 0, len(ids) + 4, len(ids)) for s in shards]
        for _ in range(4):
            expected = ref.step(ids, pos, cache)
            assert torch.equal(ring_step(shards, caches, ids, pos), expected)
            pos, ids = pos + len(ids), [int(expected.argmax())]
        assert all(s.plan.streamed for s in shards)
    finally:
        for s in shards:
            s.close()


# llama.cpp's Q4_K_M on an 8B shape: Q6_K attn_v and ffn_down in every other layer here (16 of Llama-3-8B's 32)
Q4_K_M = {i: {"attn_v": "Q6_K", "ffn_down": "Q6_K"} if i % 2 else {} for i in range(4)}


@pytest.mark.slow
def test_a_ring_over_mixed_layers_equals_its_single_process(tmp_path):
    """Two prima-node processes, each holding an int4 layer and one whose wqkv's v rows and w_down are int8, every
    layer streamed (a one-byte budget, raised to the plan's minimum), and the same store all resident."""
    store = import_gguf(mixed_gguf(tmp_path / "q4km.gguf", Q4_K_M), tmp_path / "store")
    assert json.loads((store / "manifest.json").read_text())["quant"]["int8_layers"] == \
        [[], ["wv", "w_down"], [], ["wv", "w_down"]]
    prompt = "The quick brown fox"
    expected = greedy_reference(store, [prompt], 8)[prompt]
    for extra in ([["--mem-budget", "1"]] * 2, None):
        with local_ring(store, 2, tmp_path / "logs", [2, 2], extra_args=extra) as local:
            assert collect(local.addresses[0], prompt, 8)[0] == expected
            if extra:
                assert all(info.stats.disk_read_bytes > 0 for _, info in ring.walk(local.addresses[0]))


@pytest.mark.slow  # imports a GGUF more than once
def test_a_store_of_one_format_per_matrix_still_loads(mixed, tmp_path, monkeypatch):
    """Stores written before per-layer formats name the int8 matrices once, for every layer (quant.int8_matrices):
    layer 0's Q4_K wqkv is int8 there too. They load, stream and split as they did."""
    import tools.import_gguf as importer

    monkeypatch.setattr(importer, "file_dtype", lambda g: ("int4", (("wqkv", "w_gate_up", "w_down"),) * LAYERS))
    store = import_gguf(mixed[0], tmp_path / "old")
    quant = json.loads((store / "manifest.json").read_text())["quant"]
    assert quant["int8_matrices"] == ["wqkv", "w_gate_up", "w_down"] and "int8_layers" not in quant
    fmt = weight_format(LayerStore(store).manifest)
    assert all(fmt.layer(i).matrix("wqkv").name == "int8" and fmt.layer(i).matrix("wo").name == "int4"
               for i in range(LAYERS))
    ref = ReferenceModel(store)
    assert isinstance(ref.layers[0].wqkv, Int8)
    shards = [Shard(LayerStore(store), Windows(((1, 2),), LAYERS, True), ref.dtype, budget=1),
              Shard(LayerStore(store), Windows(((0, 1),), LAYERS, False), ref.dtype, budget=1)]
    try:
        ids = ref.codec.prompt_ids("The quick brown fox")
        cache, caches = ref.new_cache(len(ids) + 2), [s.cache_for("r", 0, len(ids) + 2, len(ids)) for s in shards]
        assert torch.equal(ring_step(shards, caches, ids, 0), ref.step(ids, 0, cache))
    finally:
        for s in shards:
            s.close()


def test_a_manifest_whose_layers_do_not_match_its_formats_is_refused(mixed, tmp_path):
    import shutil

    store = shutil.copytree(mixed[1], tmp_path / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["quant"]["int8_layers"] = [[]]  # one layer listed, the store has two
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"quant.int8_layers lists 1 layers for 2"):
        weight_format(LayerStore(store).manifest)


@pytest.mark.parametrize("quant", [{"int8_layers": 3}, {"int8_layers": [[], ["wqkv", "attn_v"]]},
                                   {"int8_layers": [[], [7]]}, {"int8_matrices": "wqkv"}])
def test_a_manifest_naming_bad_int8_matrices_is_refused_in_one_line(mixed, tmp_path, quant):
    import shutil

    store = shutil.copytree(mixed[1], tmp_path / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["quant"] = {k: v for k, v in manifest["quant"].items() if k not in ("int8_layers", "int8_matrices")}
    manifest["quant"].update(quant)
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StoreError, match=r"store .*: quant\.int8_(layers|matrices)"):
        weight_format(LayerStore(store).manifest)


def test_dtype_still_overrides_the_files_types(mixed, tmp_path):
    path = mixed[0]
    store = import_gguf(path, tmp_path / "i4", dtype="int4", name="forced")
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["name"] == "forced" and not {"int8_matrices", "int8_layers"} & manifest["quant"].keys()
    assert all(f["format"] == "int4" for f in manifest["files"]["layers"])


@pytest.mark.slow
def test_a_q4k_file_of_whole_super_blocks_only_is_all_int4(tmp_path):
    store = import_gguf(mixed_gguf(tmp_path / "q4k.gguf", {0: {}, 1: {}}), tmp_path / "s")
    manifest = json.loads((store / "manifest.json").read_text())
    assert manifest["dtype"] == "int4" and not {"int8_matrices", "int8_layers"} & manifest["quant"].keys()
    assert manifest["bits_per_weight"] == 5.0


@pytest.mark.slow  # a process of its own
def test_import_prints_what_each_type_became_and_one_summary_line(mixed, tmp_path):
    res = ctl_here("import", str(mixed[0]), str(tmp_path / "kitchen"), "--name", "Kitchen model")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[1].startswith("Q4_K: 9 tensors") and lines[-1] == str(tmp_path / "kitchen")
    size = sum(f.stat().st_size for f in (tmp_path / "kitchen").iterdir()) / 1e6
    assert lines[-2].startswith(f"made 'Kitchen model': int4, {size:.1f} MB (")
    assert lines[-2].endswith(" s") and " bits/weight), in " in lines[-2]
    assert json.loads((tmp_path / "kitchen" / "manifest.json").read_text())["name"] == "Kitchen model"
    res = ctl_here("import", str(mixed[0]), str(tmp_path / "pantry"))
    assert json.loads((tmp_path / "pantry" / "manifest.json").read_text())["name"] == "pantry"


@pytest.mark.slow  # imports a GGUF more than once
def test_a_gguf_of_an_unknown_tensor_type_names_the_file_and_the_type(mixed, tmp_path):
    """A type code gguf does not know (a newer llama.cpp's): one line naming the file and the code."""
    data = bytearray(mixed[0].read_bytes())
    reader = GGUFReader(mixed[0])
    t = reader.tensors[0]
    # the tensor info's type field: after its name, n_dims and dims (uint64 each)
    at = data.index(t.name.encode()) + len(t.name) + 4 + 8 * len(t.shape)
    assert int.from_bytes(data[at:at + 4], "little") == t.tensor_type
    data[at:at + 4] = (99).to_bytes(4, "little")
    bad = tmp_path / "future.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=r"future\.gguf: a tensor of GGUF type 99, unknown to the gguf package") as err:
        import_gguf(bad, tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
