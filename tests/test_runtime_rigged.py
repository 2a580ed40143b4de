"""Runtime pieces whose answers can be worked out by hand: a rigged MoE block, the expert reader, the dense
weights. No mlx needed.

The rigged MoE layer (D = I = 64, E = 8 experts, k = 2, every quantized row one group of 64 with
scale = 1.0 (bf16 0x3F80) and bias = 0, so a weight equals its integer code):

* router (8-bit) codes: expert 3 reads x0 with weight 2, expert 5 reads x0 with 1, expert 6 reads x2 with 2,
  expert 1 reads x2 with 1; everything else 0.
* expert e (4-bit): gate row 0 = e * x1, up row 0 = x1, down row 2 = h0; so with x1 = 1 its output is
  silu(e) in dim 2 and 0 elsewhere.

Token A = (ln 3, 1, 0, ...): logits 2 ln 3 (expert 3), ln 3 (expert 5), 0 (six others); softmax = 9/18, 3/18,
1/18 each; top-2 = {3, 5}, renormalised 9/12 = 0.75 and 3/12 = 0.25:
    y[2] = 0.75 silu(3) + 0.25 silu(5) = 0.75 * 2.8577223 + 0.25 * 4.9665356 = 3.3849256
Token B = (0, 1, ln 3, 0, ...): top-2 = {6, 1} with 0.75 / 0.25:
    y[2] = 0.75 silu(6) + 0.25 silu(1) = 0.75 * 5.9851646 + 0.25 * 0.7310586 = 4.6716381
Without renormalisation token A gets 9/18 and 3/18: 0.5 * 2.8577223 + 4.9665356 / 6 = 2.2566171.
A shared expert (gate row 0 = 2 * x1, up row 0 = x1, down row 3 = h0) behind a zero shared_expert_gate
(sigmoid(0) = 0.5) adds y[3] = 0.5 silu(2) = 0.5 * 1.7615942 = 0.8807971 to every token.
Tokens A, B, A route to experts {1, 3, 5, 6}: four records read, each once.
"""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest

from moepack.archs.base import MoeShape
from moepack.errors import MoepackError, ShapeError
from moepack.layout.manifest import LayerEntry, Manifest
from moepack.layout.reader import PackedModel
from moepack.layout.record import record_layout
from moepack.quant.affine_ref import pack
from moepack.runtime import kernels_ref
from moepack.runtime.io import ExpertReader
from moepack.runtime.model import load_kernels
from moepack.runtime.models.common import GLU, Ctx, MoeBlock
from moepack.runtime.weights import DenseWeights, FloatLinear, QLinear
from moepack.source.safetensors_file import write_safetensors

D = I = 64
E = 8
ONE, ZERO = 0x3F80, 0x0000  # bf16 1.0 and 0.0
LN3 = math.log(3.0)


def silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


def qlinear(codes: np.ndarray, bits: int) -> QLinear:
    """Weights equal to the integer codes: scale 1, bias 0, one group of 64 per row."""
    out, inp = codes.shape
    scales = np.full((out, inp // 64), ONE, dtype=np.uint16)
    return QLinear(pack(codes.astype(np.uint8), bits), scales, np.zeros_like(scales), bits, 64)


def expert_codes(e: int) -> dict[str, np.ndarray]:
    gate, up, down = np.zeros((I, D), np.uint8), np.zeros((I, D), np.uint8), np.zeros((D, I), np.uint8)
    gate[0, 1] = e  # g0 = e * x1
    up[0, 1] = 1  # u0 = x1
    down[2, 0] = 1  # y2 = h0 = silu(e * x1) * x1
    return {"gate": gate, "up": up, "down": down}


@pytest.fixture(scope="module")
def rigged(tmp_path_factory):
    """A one-layer packed model holding the eight rigged experts (manifest built in memory)."""
    root = tmp_path_factory.mktemp("rigged")
    shape = MoeShape(num_layers=1, num_experts=E, experts_per_token=2, hidden=D, moe_intermediate=I)
    layout = record_layout(shape, 4, 64)
    records = np.zeros((E, layout.record_size), dtype=np.uint8)
    for e in range(E):
        for proj, codes in expert_codes(e).items():
            q = qlinear(codes, 4)
            for part, arr in (("weight", q.w), ("scales", q.scales), ("biases", q.biases)):
                c = layout.component(f"{proj}.{part}")
                records[e, c.offset : c.offset + c.nbytes] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    (root / "packed_experts").mkdir()
    records.tofile(root / "packed_experts" / "layer_00.bin")
    manifest = Manifest(
        moepack_version="test", source={"type": "local", "path": "rigged"}, model_type="qwen3_moe", config={},
        moe=shape, quantization={}, record_layouts={layout.key: layout},
        layers=(LayerEntry(0, "packed_experts/layer_00.bin", layout.key, 4, "quantize"),),
        record_checksums={0: ("0" * 16,) * E}, dense_files=(), aux_files=(),
    )
    manifest.validate()
    pm = PackedModel(root, manifest=manifest)
    yield pm
    pm.close()


def rigged_block(norm_topk_prob=True, shared=False) -> MoeBlock:
    router = np.zeros((E, D), np.uint8)
    router[3, 0], router[5, 0], router[6, 2], router[1, 2] = 2, 1, 2, 1
    glu = gate = None
    if shared:
        codes = expert_codes(2)
        codes["down"] = np.zeros((D, I), np.uint8)
        codes["down"][3, 0] = 1  # the shared expert writes dim 3
        glu = GLU(*(qlinear(codes[p], 4) for p in ("gate", "up", "down")))
        gate = qlinear(np.zeros((1, D), np.uint8), 8)
    return MoeBlock(0, qlinear(router, 8), (4, 4, 4), 64, norm_topk_prob, glu, gate)


def tokens() -> np.ndarray:
    x = np.zeros((3, D), np.float32)
    x[:, 1] = 1.0
    x[0, 0] = x[2, 0] = LN3  # tokens A, C
    x[1, 2] = LN3  # token B
    return x


@pytest.mark.parametrize("expert_batch", [32, 1])  # 1: four requests alternating two buffer slots
def test_rigged_moe_block(rigged, expert_batch):
    with ExpertReader(rigged, threads=2) as reader:
        ctx = Ctx(K=kernels_ref, reader=reader, top_k=2, expert_batch=expert_batch)
        y = rigged_block()(ctx, tokens(), 0)
        assert reader.stats.reads == 4  # experts 1, 3, 5, 6 once each, though 3 and 5 serve two tokens
        assert reader.stats.requests == (1 if expert_batch == 32 else 4)
        assert reader.stats.bytes_read == 4 * rigged.layout(0).record_size
    a = 0.75 * silu(3) + 0.25 * silu(5)  # 3.3849256
    b = 0.75 * silu(6) + 0.25 * silu(1)  # 4.6716381
    want = np.zeros((3, D), np.float32)
    want[:, 2] = [a, b, a]
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)
    assert ctx.times[0].experts_read == 4


def test_rigged_moe_block_without_renormalisation_and_with_shared_expert(rigged):
    with ExpertReader(rigged) as reader:
        ctx = Ctx(K=kernels_ref, reader=reader, top_k=2)
        y = rigged_block(norm_topk_prob=False, shared=True)(ctx, tokens()[:1], 0)
    want = np.zeros((1, D), np.float32)
    want[0, 2] = 0.5 * silu(3) + silu(5) / 6  # 2.2566171
    want[0, 3] = 0.5 * silu(2)  # 0.8807971
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-7)


def test_router_topk_by_hand():
    logits = np.array([[0, 0, 0, 2 * LN3, 0, LN3, 0, 0]], np.float32)
    idx, w = kernels_ref.router_topk(logits, 2, True)
    assert idx.tolist() == [[3, 5]]
    np.testing.assert_allclose(w, [[0.75, 0.25]], rtol=1e-6)
    idx, w = kernels_ref.router_topk(logits, 3, False)  # a tie among the 1/18s: the lowest index wins
    assert idx.tolist() == [[3, 5, 0]]
    np.testing.assert_allclose(w, [[9 / 18, 3 / 18, 1 / 18]], rtol=1e-6)


# ------------------------------------------------------------------------------------------------ expert reader


@pytest.mark.parametrize("mode", ["pread", "direct", "mmap"])
def test_reader_modes_return_the_records(rigged, mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # 'direct' falls back on file systems without O_DIRECT
        with ExpertReader(rigged, io=mode, threads=3) as reader:
            got = reader.read(0, [5, 2, 7])
            assert reader.io in ("pread", mode)
    for e in (5, 2, 7):
        want = rigged.expert_arrays(0, rigged.read_record(0, e))
        assert got[e].keys() == want.keys()
        for name in want:
            assert np.array_equal(got[e][name], want[name]), (mode, e, name)
        assert got[e]["gate.weight"].ctypes.data % (2 * 1024 * 1024) == 0  # 2 MiB-aligned record buffers


def test_reader_buffer_lifetime(rigged):
    """Arrays from wait() stay valid until the next submit on the same slot; other slots leave them alone."""
    with ExpertReader(rigged) as reader:
        a = reader.submit(0, [3], slot=0).wait()[3]["gate.weight"]
        before = a.copy()
        reader.submit(0, [6], slot=1).wait()
        assert np.array_equal(a, before)
        reader.submit(0, [6], slot=0).wait()  # slot 0's buffer now holds expert 6
        assert np.array_equal(a, qlinear(expert_codes(6)["gate"], 4).w)
        # one buffer per slot, reused: a row of the largest record rounded up to 2 MiB (rows stay 2 MiB-aligned)
        row = -(-rigged.layout(0).record_size // (2 << 20)) * (2 << 20)
        assert reader.buffer_bytes() == 2 * row
        with pytest.raises(MoepackError):
            reader.submit(0, [1, 1])
        with pytest.raises(MoepackError):
            reader.submit(0, [E])


def test_reader_rejects_unknown_mode(rigged):
    with pytest.raises(MoepackError):
        ExpertReader(rigged, io="carrier-pigeon")


# ------------------------------------------------------------------------------------------------ dense weights


def _dense_folder(tmp_path, quantization):
    proj = qlinear(np.arange(4 * 64, dtype=np.uint8).reshape(4, 64) % 16, 4)  # [4, 64] at 4 bits
    router = qlinear(np.arange(2 * 64, dtype=np.uint8).reshape(2, 64), 8)  # [2, 64] at 8 bits
    t = [("m.proj.weight", "U32", proj.w.shape, proj.w), ("m.proj.scales", "BF16", proj.scales.shape, proj.scales),
         ("m.proj.biases", "BF16", proj.biases.shape, proj.biases),
         ("m.gate.weight", "U32", router.w.shape, router.w), ("m.gate.scales", "BF16", (2, 1), router.scales),
         ("m.gate.biases", "BF16", (2, 1), router.biases),
         ("m.norm.weight", "BF16", (3,), np.array([0x3F80, 0x4000, 0xBF00], np.uint16)),  # 1.0, 2.0, -0.5
         ("m.float.weight", "F32", (2, 3), np.arange(6, dtype=np.float32).reshape(2, 3))]
    write_safetensors(tmp_path / "model.safetensors", t)
    (tmp_path / "config.json").write_text(json.dumps({"quantization": quantization}))
    return tmp_path


def test_dense_weights(tmp_path):
    q = {"group_size": 64, "bits": 4, "mode": "affine", "m.gate": {"group_size": 64, "bits": 8}}
    with DenseWeights(_dense_folder(tmp_path, q)) as W:
        proj = W.linear("m.proj", 64)
        assert isinstance(proj, QLinear) and (proj.bits, proj.group_size, proj.in_features) == (4, 64, 64)
        assert not proj.w.flags.owndata and not proj.w.flags.writeable  # a view into the mapping
        assert proj.w.shape == (4, 8)
        gate = W.linear("m.gate")
        assert (gate.bits, gate.group_size, gate.out_features) == (8, 64, 2)
        np.testing.assert_array_equal(W.vector("m.norm.weight"), [1.0, 2.0, -0.5])
        f = W.linear("m.float")
        assert isinstance(f, FloatLinear) and f.rows_f32(slice(1, 2)).tolist() == [[3.0, 4.0, 5.0]]
        assert W.has("m.proj.scales") and not W.has("m.nothing")
        with pytest.raises(ShapeError):
            W.linear("m.proj", 128)  # config says 64 inputs at 4 bits
        with pytest.raises(MoepackError):
            W.linear("m.nothing")


def test_dense_weights_reject_a_wrong_quantization_block(tmp_path):
    with DenseWeights(_dense_folder(tmp_path, {"group_size": 64, "bits": 2})) as W:
        with pytest.raises(ShapeError):
            W.linear("m.proj")  # 8 words of 2-bit codes are 128 inputs, but the scales say one group of 64


def test_backends(monkeypatch):
    from moepack.runtime import model as model_mod

    assert load_kernels("numpy") is kernels_ref
    with pytest.raises(MoepackError):
        load_kernels("fortran")
    monkeypatch.setitem(model_mod.BACKENDS, "ghost", "kernels_ghost")
    with pytest.raises(MoepackError):
        load_kernels("ghost")


def test_glu_float_path_equals_quantized_path():
    """A GLU of float matrices (no expert_ffn fusion) gives what the fused quantized kernel gives."""
    codes = expert_codes(3)
    q = [qlinear(codes[p], 4) for p in ("gate", "up", "down")]
    f = [FloatLinear(codes[p].astype(np.float32), "F32") for p in ("gate", "up", "down")]
    x = tokens()
    fused, plain = GLU(*q), GLU(*f)
    assert fused._fused and not plain._fused
    np.testing.assert_allclose(plain(kernels_ref, x), fused(kernels_ref, x), rtol=1e-6)
    assert plain(kernels_ref, x)[0, 2] == pytest.approx(silu(3))
