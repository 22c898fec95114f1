"""GGUF reading: round trips through make_tiny_llama, agreement with gguf-py's GGUFReader, llama
hyper-parameters and tensor checks, targeted malformed files, and a fuzzer over mutated files."""
import math
import pickle
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT

from lazyggml import quants
from lazyggml.gguf_io import GGUFError, TensorInfo, read_gguf
from lazyggml.models.hparams import HParams, check_tensors, tensor_shapes
from lazyggml.testing import make_tiny_llama, make_tiny_model, q4_k_m_type
from lazyggml.tokenizer import Tokenizer
from lazyggml.types import Type


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return read_gguf(make_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


# --- a byte-level GGUF builder, for files gguf-py's writer refuses to write ------------------------

def _str(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key, vtype, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _tensor(name, ne, ttype, offset) -> bytes:
    return (_str(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
            + struct.pack("<IQ", ttype, offset))


def build(kvs=(), tensors=(), data=b"", *, magic=b"GGUF", version=3, n_tensors=None, n_kv=None,
          alignment=32) -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % alignment) + data


F32_1x32 = _tensor("t", [32], Type.F32, 0)


def read_bytes(tmp_path, data: bytes, name="f.gguf"):
    p = tmp_path / name
    p.write_bytes(data)
    return read_gguf(p)


# --- valid files --------------------------------------------------------------------------------

def test_minimal_file(tmp_path):
    f = read_bytes(tmp_path, build([_kv("a.s", VT.STRING, _str("hé"))], [F32_1x32], bytes(128)))
    assert f.version == 3 and f.alignment == 32 and f.metadata == {"a.s": "hé"}
    assert read_bytes(tmp_path, build(version=2), "v2.gguf").version == 2  # same layout as v3
    assert f.kv_types == {"a.s": (VT.STRING, None)}
    t = f.tensors["t"]
    assert (t.type, t.ne, t.nbytes, t.offset) == (Type.F32, (32,), 128, f.data_offset)
    assert f.tensor_data("t").tobytes() == bytes(128)


def test_round_trip_metadata_and_layout(tiny):
    m = tiny.metadata
    assert m["general.architecture"] == "llama" and m["general.file_type"] == 15
    assert (m["llama.embedding_length"], m["llama.block_count"], m["llama.context_length"]) == (64, 2, 128)
    assert m["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert len(m["tokenizer.ggml.tokens"]) == 256 == m["llama.vocab_size"]
    assert tiny.kv_types["tokenizer.ggml.scores"] == (VT.ARRAY, VT.FLOAT32)
    assert tiny.kv_types["llama.block_count"] == (VT.UINT32, None)
    # the Q4_K_M mix, with llama-quantize's fallbacks for 64-wide rows
    types = {n: t.type for n, t in tiny.tensors.items()}
    assert types["blk.0.attn_norm.weight"] == Type.F32
    assert types["blk.0.attn_q.weight"] == Type.Q5_0 and types["output.weight"] == Type.Q8_0
    for name, t in tiny.tensors.items():
        assert t.offset % 32 == 0 and t.offset >= tiny.data_offset
        assert tiny.tensor_data(name).size == t.nbytes


def test_q4_k_m_types_at_k_quant_sizes():
    n_layer = 8  # use_more_bits: i < n/8, i >= 7n/8 or (i - n/8) % 3 == 2, so layers 0, 3, 6, 7
    got = {i: q4_k_m_type(f"blk.{i}.ffn_down.weight", (512, 256), n_layer) for i in range(n_layer)}
    more = [i for i, t in got.items() if t == Type.Q6_K]
    assert more == [0, 3, 6, 7] and all(got[i] == Type.Q4_K for i in (1, 2, 4, 5))
    assert q4_k_m_type("blk.0.attn_q.weight", (256, 256), 8) == Type.Q4_K
    assert q4_k_m_type("output.weight", (256, 1000), 8) == Type.Q6_K
    assert q4_k_m_type("token_embd.weight", (256, 1000), 8) == Type.Q4_K
    assert q4_k_m_type("token_embd.weight", (256, 1000), 8, tied_output=True) == Type.Q6_K
    assert q4_k_m_type("output_norm.weight", (256,), 8) == Type.F32
    assert q4_k_m_type("blk.0.attn_q.weight", (48, 48), 8) == Type.F16  # neither 256 nor 32 divides 48


def test_data_is_what_was_written(tmp_path):
    """Same seed, same floats: the F32 file holds the weights; the Q4_K_M file must hold exactly
    their quantization, and gguf-py's dequantizer must agree with ours."""
    kw = dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300)
    fq = read_gguf(make_tiny_llama(tmp_path / "q.gguf", **kw))
    ff = read_gguf(make_tiny_llama(tmp_path / "f.gguf", types={"*": "f32"}, **kw))
    seen = set()
    for name, tq in fq.tensors.items():
        tf = ff.tensors[name]
        assert tf.type == Type.F32 and tf.ne == tq.ne
        x = ff.tensor_data(name).view(np.float32).reshape(-1, tq.ne[0])
        raw = fq.tensor_data(name)
        assert raw.tobytes() == quants.quantize(tq.type, x).tobytes(), name
        ours = quants.dequantize(tq.type, raw, tq.ne[0])
        theirs = gguf.quants.dequantize(raw.reshape(x.shape[0], -1), gguf.GGMLQuantizationType(tq.type))
        np.testing.assert_array_equal(ours, theirs.reshape(ours.shape))
        np.testing.assert_allclose(ours, x, atol=0.15 * np.abs(x).max())
        seen.add(tq.type)
    assert seen == {Type.F32, Type.Q4_K, Type.Q6_K}


def test_agrees_with_gguf_reader(tmp_path):
    p = make_tiny_llama(tmp_path / "g.gguf", vocab="gpt2", n_vocab=400, tie_output=True)
    ours = read_gguf(p)
    ref = gguf.GGUFReader(p)
    ref_meta = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert ref_meta.keys() == ours.metadata.keys()
    for k, v in ref_meta.items():
        assert ours.metadata[k] == pytest.approx(v) if isinstance(v, float) else ours.metadata[k] == v, k
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ne == tuple(int(n) for n in t.shape)
        assert (info.type, info.offset, info.nbytes) == (Type(t.tensor_type), t.data_offset, t.n_bytes)
        assert ours.tensor_data(t.name).tobytes() == t.data.tobytes()


def test_make_tiny_llama_is_deterministic_and_fast(tmp_path):
    make_tiny_llama(tmp_path / "warm.gguf")  # loads the cached quantization kernels
    t0 = time.perf_counter()
    a = make_tiny_llama(tmp_path / "a.gguf", seed=3)
    elapsed = time.perf_counter() - t0
    b = make_tiny_llama(tmp_path / "b.gguf", seed=3)
    c = make_tiny_llama(tmp_path / "c.gguf", seed=4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert elapsed < 1.0


def test_types_patterns(tmp_path):
    f = read_gguf(make_tiny_llama(tmp_path / "t.gguf", types={"blk.*.ffn_*.weight": Type.Q8_0,
                                                               "*norm*": "f16"}))
    assert f.tensors["blk.1.ffn_down.weight"].type == Type.Q8_0
    assert f.tensors["blk.1.ffn_norm.weight"].type == Type.Q8_0  # first matching pattern wins
    assert f.tensors["output_norm.weight"].type == Type.F16
    assert f.tensors["blk.0.attn_k.weight"].type == Type.Q5_0    # unmatched: the Q4_K_M default
    assert "general.file_type" not in f.metadata
    with pytest.raises(ValueError, match="block size 256"):
        make_tiny_llama(tmp_path / "bad.gguf", types={"*": "q4_K"})
    with pytest.raises(ValueError, match="too small"):
        make_tiny_llama(tmp_path / "bad.gguf", n_vocab=100)


# --- llama hyper-parameters and tensors -------------------------------------------------------------

def test_hparams(tiny):
    hp = HParams.from_metadata(tiny.metadata, tiny.path)
    assert (hp.n_vocab, hp.n_ctx_train, hp.n_embd, hp.n_layer, hp.n_ff) == (256, 128, 64, 2, 128)
    assert (hp.n_head, hp.n_head_kv, hp.n_gqa, hp.n_embd_head_k, hp.n_rot) == (4, 2, 2, 16, 16)
    assert (hp.n_embd_k_gqa, hp.n_embd_v_gqa) == (32, 32)
    assert hp.rope_freq_base == 10000.0 and hp.rope_scaling_type == "linear" and hp.rope_freq_scale == 1.0
    assert hp.n_ctx_orig_yarn == 128 and hp.f_norm_rms_eps == pytest.approx(1e-5)
    found = check_tensors(hp, tiny.tensors, tiny.path)
    assert found.keys() == set(tiny.tensors) and found["output.weight"].name == "output.weight"


def test_hparams_optional_keys(tiny):
    m = dict(tiny.metadata)
    del m["llama.attention.head_count_kv"], m["llama.rope.dimension_count"], m["llama.vocab_size"]
    m.update({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
              "llama.rope.scaling.original_context_length": 64, "llama.rope.freq_base": 5e5,
              "llama.attention.head_count": [4, 4]})
    hp = HParams.from_metadata(m)
    assert hp.n_head_kv == 4 and hp.n_rot == 16 and hp.n_vocab == 256
    assert (hp.rope_scaling_type, hp.rope_freq_scale, hp.n_ctx_orig_yarn, hp.rope_freq_base) == \
        ("yarn", 0.25, 64, 5e5)
    del m["llama.rope.scaling.factor"]
    m["llama.rope.scale_linear"] = 2.0  # the old key name
    assert HParams.from_metadata(m).rope_freq_scale == 0.5


@pytest.mark.parametrize("change, field, message", [
    ({"general.architecture": "gpt2"}, "general.architecture",
     "unsupported architecture 'gpt2'; lazyggml runs gemma3, llama, phi3, qwen2, qwen3, qwen3moe"),
    ({"llama.block_count": None}, "llama.block_count", "required key is missing"),
    ({"llama.block_count": "2"}, "llama.block_count", "expected a int"),
    ({"llama.block_count": 0}, "llama.block_count", "out of range"),
    ({"llama.embedding_length": True}, "llama.embedding_length", "expected a int"),
    ({"llama.attention.head_count_kv": 3}, "llama.attention.head_count_kv", "cannot be shared"),
    ({"llama.attention.head_count": [4, 2]}, "llama.attention.head_count", "differ"),
    ({"llama.attention.head_count": [4]}, "llama.attention.head_count", "per-layer values for 2"),
    ({"llama.rope.dimension_count": 8}, "llama.rope.dimension_count", "must equal the head size"),
    ({"llama.rope.scaling.type": "ntk"}, "llama.rope.scaling.type", "unknown rope scaling"),
    ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "layer_norm_rms_epsilon", "positive"),
    ({"llama.rope.freq_base": float("nan")}, "llama.rope.freq_base", "finite"),
    ({"llama.expert_count": 8}, "llama.expert_used_count", "required key is missing"),
    ({"llama.expert_count": 2, "llama.expert_used_count": 3}, "llama.expert_used_count", "3 experts used of 2"),
    ({"llama.expert_count": -1}, "llama.expert_count", "out of range"),
    ({"llama.vocab_size": 300}, "llama.vocab_size", "disagrees"),
    ({"llama.vocab_size": None, "tokenizer.ggml.tokens": None}, "llama.vocab_size", "missing"),
    ({"llama.embedding_length": 66}, "llama.attention.head_count", "not a multiple"),
])
def test_hparams_errors(tiny, change, field, message):
    m = dict(tiny.metadata)
    for k, v in change.items():
        if v is None:
            m.pop(k, None)
        else:
            m[k] = v
    with pytest.raises(GGUFError, match=message) as e:
        HParams.from_metadata(m, "model.gguf")
    assert e.value.field.endswith(field) and e.value.path == "model.gguf"
    assert str(e.value).startswith("model.gguf: ")


#: arch -> (make_tiny_model keywords, head size, a tensor of its own, another family's (name, ne))
FAMILY_TENSORS = {
    "qwen2": ({}, 16, "blk.1.attn_k.bias", ("blk.0.attn_q_norm.weight", (16,))),
    "qwen3": (dict(head_dim=32), 32, "blk.1.attn_k_norm.weight", ("blk.0.attn_q.bias", (128,))),
    "gemma3": (dict(head_dim=32, n_swa=8), 32, "blk.1.post_ffw_norm.weight", ("blk.0.attn_q.bias", (128,))),
    "phi3": (dict(rope_factors_ctx=64), 16, "blk.1.attn_qkv.weight", ("blk.0.attn_q.weight", (64, 64))),
}


@pytest.mark.parametrize("arch", list(FAMILY_TENSORS))
def test_family_tensors_are_checked(tmp_path, arch):
    """A family's own tensors are required (Qwen2's Q/K/V biases, Qwen3's per-head norms, Gemma 3's
    post-norms, Phi-3's fused QKV) and another family's are refused, each error naming the tensor;
    Phi-3's LongRoPE factors are optional, of n_rot / 2 entries."""
    kw, head, own, (other, other_ne) = FAMILY_TENSORS[arch]
    path = make_tiny_model(tmp_path / "m.gguf", arch=arch, n_layer=2, n_embd=64, n_head=4, n_head_kv=2,
                           n_ff=128, n_vocab=300, **kw)
    f = read_gguf(path)
    hp = HParams.from_metadata(f.metadata, f.path)
    assert hp.arch == arch and (hp.n_embd_head_k, hp.n_rot) == (head, head)
    found = check_tensors(hp, f.tensors, f.path)
    assert found["output.weight"] is f.tensors["output.weight"]
    with pytest.raises(GGUFError, match="required tensor is missing") as e:
        check_tensors(hp, {n: t for n, t in f.tensors.items() if n != own})
    assert e.value.field == f"tensor '{own}'"
    with pytest.raises(GGUFError, match=f"unexpected tensor for a 2-layer {arch} model"):
        check_tensors(hp, {**f.tensors, other: _info(other, other_ne)})
    if arch == "phi3":
        assert found["rope_factors_long.weight"].ne == (8,)
        check_tensors(hp, {n: t for n, t in f.tensors.items() if not n.startswith("rope_factors")})
        with pytest.raises(GGUFError, match=r"rope_factors_short.weight'.*has shape \[16\]"):
            check_tensors(hp, {**f.tensors, "rope_factors_short.weight": _info("rope_factors_short.weight", (16,))})


def test_gemma3_and_phi3_hparams(tmp_path):
    """Gemma 3's sliding window: which layers slide (a period, 6 by default, whose last layer is
    global; or per-layer flags), the queries' scale (1/sqrt(head size), but 1/sqrt(n_embd/n_head) at
    62 layers, as llama.cpp); without a window every layer is global. Phi-3's attention factor.
    Bad values are GGUFErrors naming the key."""
    path = make_tiny_model(tmp_path / "g.gguf", arch="gemma3", n_layer=7, n_embd=64, n_head=4, n_head_kv=2,
                           n_ff=128, n_vocab=300, head_dim=32, n_swa=8)
    meta = read_gguf(path).metadata
    hp = HParams.from_metadata(meta)
    assert hp.n_swa == 8 and hp.swa_layers == (True,) * 5 + (False, True)
    assert hp.f_attention_scale == pytest.approx(1 / 32 ** 0.5) and hp.rope_freq_base_swa == 10000.0
    assert HParams.from_metadata({**meta, "gemma3.attention.sliding_window_pattern": 3}).swa_layers == \
        (True, True, False) * 2 + (True,)
    flags = [True, False] * 3 + [False]
    assert HParams.from_metadata({**meta, "gemma3.attention.sliding_window_pattern": flags}).swa_layers == \
        tuple(flags)
    no_window = HParams.from_metadata({k: v for k, v in meta.items() if k != "gemma3.attention.sliding_window"})
    assert no_window.swa_layers == () and not no_window.is_swa(0)
    big = {**meta, "gemma3.block_count": 62}
    assert HParams.from_metadata(big).f_attention_scale == pytest.approx(1 / 16 ** 0.5)   # n_embd / n_head
    for key, bad, msg in [("gemma3.attention.sliding_window", -1, "out of range"),
                          ("gemma3.attention.sliding_window", 2.5, "expected a int"),
                          ("gemma3.attention.sliding_window_pattern", [True] * 3, "expected 7 per-layer flags"),
                          ("gemma3.attention.sliding_window_pattern", "6", "expected a int")]:
        with pytest.raises(GGUFError, match=msg) as e:
            HParams.from_metadata({**meta, key: bad})
        assert e.value.field == key
    no_window_meta = {k: v for k, v in meta.items() if k != "gemma3.attention.sliding_window"}
    with pytest.raises(GGUFError, match="soft-capping is not supported"):   # llama.cpp's non-SWA gemma3 graph caps
        HParams.from_metadata({**no_window_meta, "gemma3.final_logit_softcapping": 30.0})
    path = make_tiny_model(tmp_path / "p.gguf", arch="phi3", n_layer=1, n_embd=64, n_head=4, n_head_kv=2,
                           n_ff=128, n_vocab=300, n_ctx=256, rope_factors_ctx=64)
    meta = read_gguf(path).metadata
    hp = HParams.from_metadata(meta)
    assert hp.n_ctx_orig_yarn == 64 and hp.rope_attn_factor == pytest.approx((1 + math.log(4) / math.log(64)) ** 0.5)
    assert hp.swa_layers == () and hp.f_attention_scale == 0.0
    with pytest.raises(GGUFError, match="not a finite positive number") as e:
        HParams.from_metadata({**meta, "phi3.rope.scaling.attn_factor": 0.0})
    assert e.value.field == "phi3.rope.scaling.attn_factor"


def test_experts_are_refused_where_the_family_has_none_and_required_where_it_needs_them(tmp_path):
    qwen2 = read_gguf(make_tiny_model(tmp_path / "q2.gguf", arch="qwen2", n_vocab=300))
    with pytest.raises(GGUFError, match="mixture-of-experts qwen2 models are not supported"):
        HParams.from_metadata({**qwen2.metadata, "qwen2.expert_count": 8, "qwen2.expert_used_count": 2})
    moe = read_gguf(make_tiny_model(tmp_path / "moe.gguf", arch="qwen3moe", n_vocab=300, n_expert=4,
                                    n_expert_used=2, n_ff_exp=64))
    hp = HParams.from_metadata(moe.metadata)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp) == (4, 2, 64)
    assert check_tensors(hp, moe.tensors)["blk.1.ffn_down_exps.weight"].ne == (64, 64, 4)
    with pytest.raises(GGUFError, match="required key is missing or 0 for a qwen3moe model"):
        HParams.from_metadata({k: v for k, v in moe.metadata.items() if k != "qwen3moe.expert_count"})
    mixtral = read_gguf(make_tiny_model(tmp_path / "mx.gguf", n_vocab=300, n_expert=4, n_expert_used=1))
    hp = HParams.from_metadata(mixtral.metadata)
    assert hp.n_ff_exp == hp.n_ff == 128 and "blk.0.ffn_gate.weight" not in check_tensors(hp, mixtral.tensors)


def _info(name, ne, t=Type.F32):
    return TensorInfo(name, t, tuple(ne), 0, 0)


def test_check_tensors_contradictions(tiny):
    hp = HParams.from_metadata(tiny.metadata)
    # metadata that contradicts the file: a wider feed-forward
    wider = HParams.from_metadata({**tiny.metadata, "llama.feed_forward_length": 256})
    with pytest.raises(GGUFError, match=r"blk.0.ffn_gate.weight.*has shape \[64, 128\].*\[64, 256\]"):
        check_tensors(wider, tiny.tensors, tiny.path)
    required, optional = tensor_shapes(hp)
    good = {n: _info(n, ne) for n, ne in required.items()}
    found = check_tensors(hp, good)
    assert found["output.weight"].name == "token_embd.weight"  # tied output
    with pytest.raises(GGUFError, match="required tensor is missing"):
        check_tensors(hp, {n: t for n, t in good.items() if n != "blk.1.attn_v.weight"})
    with pytest.raises(GGUFError, match="unexpected tensor"):
        check_tensors(hp, {**good, "blk.2.attn_q.weight": _info("blk.2.attn_q.weight", (64, 64))})
    with pytest.raises(GGUFError, match="cannot hold a weight"):
        check_tensors(hp, {**good, "output.weight": _info("output.weight", (64, 256), Type.I32)})
    rope = {**good, "rope_freqs.weight": _info("rope_freqs.weight", (hp.n_rot // 2,))}
    assert "rope_freqs.weight" in check_tensors(hp, rope)


# --- targeted malformed files -------------------------------------------------------------------

U32 = struct.Struct("<I").pack
U64 = struct.Struct("<Q").pack
CASES = {
    "empty": (b"", "magic"),
    "wrong magic": (build(magic=b"GGML"), "magic"),
    "truncated header": (b"GGUF" + U32(3) + U64(0), "kv count"),
    "version 1": (build(version=1), "version"),
    "big-endian": (build(version=3 << 24), "version"),
    "absurd tensor count": (build(n_tensors=2**63), "tensor count"),
    "absurd kv count": (build(n_kv=2**64 - 1), "kv count"),
    "kv count past the end": (build([_kv("a", VT.UINT8, b"\1" * 14)], n_kv=2, alignment=1), "kv[1] key"),
    "absurd key length": (build([U64(2**62) + b"k"]), "kv[0] key"),
    "invalid utf-8 key": (build([_kv(b"\xff\xfe", VT.UINT8, b"\1")]), "kv[0] key"),
    "unknown value type": (build([_kv("a", 99, b"")]), "a"),
    "absurd string length": (build([_kv("a", VT.STRING, U64(2**40) + b"xy")]), "a"),
    "absurd array length": (build([_kv("a", VT.ARRAY, U32(VT.UINT32) + U64(2**61))]), "a"),
    "absurd string array": (build([_kv("a", VT.ARRAY, U32(VT.STRING) + U64(2**40))]), "a"),
    "nested array": (build([_kv("a", VT.ARRAY, U32(VT.ARRAY) + U64(1))]), "a (array element type)"),
    "truncated array": (build([_kv("a", VT.ARRAY, U32(VT.STRING) + U64(2) + _str("x") + U64(5) + b"ab")],
                              alignment=1), "a[1]"),
    "duplicate key": (build([_kv("a", VT.UINT8, b"\1"), _kv("a", VT.UINT8, b"\2")]), "a"),
    "alignment type": (build([_kv("general.alignment", VT.UINT64, U64(32))]), "general.alignment"),
    "alignment value": (build([_kv("general.alignment", VT.UINT32, U32(48))]), "general.alignment"),
    "unknown tensor type": (build(tensors=[_tensor("t", [32], 16, 0)], data=bytes(64)), "tensor 't' type"),
    "five dims": (build(tensors=[_tensor("t", [1] * 5, 0, 0)], data=bytes(64)), "tensor 't' dims count"),
    "no dims": (build(tensors=[_tensor("t", [], 0, 0)], data=bytes(64)), "tensor 't' dims count"),
    "zero dim": (build(tensors=[_tensor("t", [32, 0], 0, 0)], data=bytes(64)), "tensor 't' ne[1]"),
    "negative dim": (build(tensors=[_tensor("t", [2**64 - 1], 0, 0)], data=bytes(64)), "tensor 't' ne[0]"),
    "partial block": (build(tensors=[_tensor("t", [100], Type.Q4_K, 0)], data=bytes(256)), "tensor 't' ne[0]"),
    "misaligned offset": (build(tensors=[_tensor("t", [8], 0, 4)], data=bytes(64)), "tensor 't' offset"),
    "data outside": (build(tensors=[_tensor("t", [32], 0, 0)], data=bytes(100)), "tensor 't' data"),
    "huge tensor": (build(tensors=[_tensor("t", [2**62, 2**62], 0, 0)], data=bytes(64)), "tensor 't' data"),
    "overlap": (build(tensors=[_tensor("a", [32], 0, 0), _tensor("b", [32], 0, 96)], data=bytes(256)),
                "tensor 'b' data"),
    "duplicate tensor": (build(tensors=[F32_1x32, _tensor("t", [32], 0, 128)], data=bytes(256)), "tensor 't'"),
    "long name": (build(tensors=[_tensor("x" * 64, [32], 0, 0)], data=bytes(128)), "tensor 'xxx"),
    "tensor infos past the end": (build(n_tensors=1), "tensor count"),
}


@pytest.mark.parametrize("case", CASES)
def test_malformed_files(tmp_path, case):
    data, field = CASES[case]
    with pytest.raises(GGUFError) as e:
        read_bytes(tmp_path, data)
    assert e.value.field.startswith(field), str(e.value)
    assert str(tmp_path) in str(e.value)


def test_error_pickles():
    e = pickle.loads(pickle.dumps(GGUFError("m.gguf", "llama.block_count", "required key is missing")))
    assert (e.path, e.field, str(e)) == ("m.gguf", "llama.block_count",
                                         "m.gguf: llama.block_count: required key is missing")


def test_absurd_sizes_allocate_nothing(tmp_path):
    """Counts and lengths are checked against the file size before anything is allocated."""
    for key in ("absurd tensor count", "absurd kv count", "absurd array length", "absurd string array",
                "absurd string length", "huge tensor"):
        p = tmp_path / "f.gguf"
        p.write_bytes(CASES[key][0])
        tracemalloc.start()
        with pytest.raises(GGUFError):
            read_gguf(p)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert peak < 1 << 20, (key, peak)


# --- fuzzing ------------------------------------------------------------------------------------

def _load_everything(path):
    """What a model loader does with a file; only GGUFError may come out."""
    f = read_gguf(path)
    for name, info in f.tensors.items():
        assert f.tensor_data(name).size == info.nbytes
    hp = HParams.from_metadata(f.metadata, f.path)
    check_tensors(hp, f.tensors, f.path)
    tok = Tokenizer(f.metadata, f.path)
    ids = tok.tokenize("Hello wörld, 世界 😀\n", parse_special=True)
    tok.detokenize(ids, unparse_special=True)


def _mutations(base: bytes, header_end: int, rng, n: int):
    """``n`` mutated copies of ``base``: truncations, byte flips, huge values written over
    header fields, wrong magic/version, inserted and deleted bytes."""
    big = [2**64 - 1, 2**63, 2**62 + 1, 2**32 - 1, 2**31, len(base), len(base) + 1, 0]
    fixed = [b"GGUX" + base[4:], base[:4] + U32(1) + base[8:], base[:4] + U32(4) + base[8:],
             base[:4] + U32(3 << 24) + base[8:], base[:8] + U64(2**63) + base[16:],
             base[:16] + U64(2**63) + base[24:], base[:8] + U64(0) + base[16:], base[:16] + U64(0) + base[24:]]
    yield from fixed
    for i in range(n - len(fixed)):
        kind = i % 6
        data = bytearray(base)
        if kind == 0:    # truncation, mostly inside the header
            cut = int(rng.integers(0, header_end if i % 12 else len(base)))
            yield bytes(data[:cut])
            continue
        pos = int(rng.integers(0, header_end - 8))
        if kind == 1:    # flipped bytes
            for _ in range(int(rng.integers(1, 4))):
                data[int(rng.integers(0, header_end))] ^= int(rng.integers(1, 256))
        elif kind == 2:  # a huge 64-bit value over whatever field is there
            data[pos:pos + 8] = U64(big[int(rng.integers(0, len(big)))])
        elif kind == 3:  # a huge or random 32-bit value (value types, dims counts, type ids)
            data[pos:pos + 4] = U32(int(rng.choice([2**32 - 1, 2**31, int(rng.integers(0, 64))])))
        elif kind == 4:  # bytes inserted: everything after shifts
            data[pos:pos] = bytes(rng.integers(0, 256, int(rng.integers(1, 9)), dtype=np.uint8))
        else:            # bytes deleted
            del data[pos:pos + int(rng.integers(1, 9))]
        yield bytes(data)


@pytest.mark.parametrize("vocab", ["llama", "gpt2"])
def test_fuzz_only_gguf_errors(tmp_path, vocab):
    base_path = make_tiny_llama(tmp_path / "base.gguf", n_layer=1, n_embd=32, n_head=2, n_head_kv=1,
                                n_ff=32, vocab=vocab)
    base = base_path.read_bytes()
    _load_everything(base_path)
    header_end = read_gguf(base_path).data_offset
    rng = np.random.default_rng(1234 if vocab == "llama" else 4321)
    outcomes = {"GGUFError": 0, "loaded": 0}
    t0 = time.perf_counter()
    for i, data in enumerate(_mutations(base, header_end, rng, 1100)):
        p = tmp_path / f"case{i}.gguf"  # a fresh file: never rewrite a file that may be mapped
        p.write_bytes(data)
        t = time.perf_counter()
        try:
            _load_everything(p)
            outcomes["loaded"] += 1
        except GGUFError as e:
            assert str(p) in str(e)
            outcomes["GGUFError"] += 1
        assert time.perf_counter() - t < 1.0, f"case {i} took too long"
        p.unlink()
    assert sum(outcomes.values()) == 1100
    assert outcomes["GGUFError"] > 500, outcomes  # most mutations of the header must be caught
    assert time.perf_counter() - t0 < 45
