"""`moepack convert` end to end on tiny checkpoints built in the test."""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from moepack.archs import get_architecture
from moepack.convert import convert
from moepack.errors import OutputError
from moepack.layout.constants import MANIFEST_NAME, STATE_NAME
from moepack.layout.manifest import load_manifest
from moepack.layout.reader import PackedModel
from moepack.source.checkpoint import open_checkpoint
from moepack.source.safetensors_file import SafetensorsFile


def _tree_bytes(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_4bit_repack_records_equal_source_bytes(mlx_ckpt, tmp_path):
    out = tmp_path / "p4"
    m = convert(str(mlx_ckpt), out, progress=False)
    ckpt = open_checkpoint(str(mlx_ckpt))
    arch = get_architecture(m.model_type)
    E = m.moe.num_experts
    with PackedModel(out) as pm:
        assert [e.method for e in m.layers] == ["repack"] * len(m.layers)
        for entry in m.layers:
            L = entry.layer
            stacked = {(p, part): ckpt.read(arch.expert_name(L, p, part))
                       for p in ("gate", "up", "down") for part in ("weight", "scales", "biases")}
            for e in (0, E // 2, E - 1):
                rec = pm.read_record(L, e)
                arrays = pm.expert_arrays(L, rec)
                for (p, part), arr in stacked.items():
                    np.testing.assert_array_equal(arrays[f"{p}.{part}"], arr[e])
                # the record is the concatenation of the source slices, then zero padding
                payload = b"".join(stacked[(p, part)][e].tobytes()
                                   for p in ("gate", "up", "down") for part in ("weight", "scales", "biases"))
                assert rec.tobytes() == payload + bytes(len(rec) - len(payload))
    assert m.rmse is None
    assert not (out / STATE_NAME).exists()
    ckpt.close()


def test_dense_tensors_copied_untouched(mlx_ckpt, tmp_path):
    out = tmp_path / "p4"
    convert(str(mlx_ckpt), out, progress=False)
    src = open_checkpoint(str(mlx_ckpt))
    arch = get_architecture(src.config["model_type"])
    dense = SafetensorsFile(out / "model.safetensors")
    want = [n for n in src.tensor_names if arch.expert_layer_of(n) is None]
    assert sorted(dense.tensors) == sorted(want)
    for n in want:
        assert dense.read_bytes(n) == src.read(n).tobytes(), n
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / f).read_bytes() == (Path(mlx_ckpt) / f).read_bytes()
    src.close()


def test_dense_loads_in_mlx(mlx_ckpt, tmp_path):
    mx = pytest.importorskip("mlx.core")
    out = tmp_path / "p4"
    convert(str(mlx_ckpt), out, progress=False)
    w = mx.load(str(out / "model.safetensors"))
    src = open_checkpoint(str(mlx_ckpt))
    name = next(n for n in w if n.endswith("embed_tokens.scales"))
    assert w[name].dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(w[name].view(mx.uint16)), src.read(name))


def test_2bit_records_match_reference_requant(mlx_ckpt, tmp_path):
    from moepack.quant.requant import requantize_minmax_ref

    out = tmp_path / "p2"
    m = convert(str(mlx_ckpt), out, bits=2, progress=False)
    assert {e.bits for e in m.layers} == {2}
    assert set(m.record_layouts) == {"q2.g64"}
    src = open_checkpoint(str(mlx_ckpt))
    arch = get_architecture(m.model_type)
    L = m.layers[-1].layer
    with PackedModel(out) as pm:
        arrays = pm.expert_arrays(L, pm.read_record(L, 3))
        for p in ("gate", "up", "down"):
            w, s, b = (src.read(arch.expert_name(L, p, part))[3:4] for part in ("weight", "scales", "biases"))
            rw, rs, rb = requantize_minmax_ref(w, s, b, 4, 2, 64)
            np.testing.assert_array_equal(arrays[f"{p}.weight"], rw[0])
            np.testing.assert_array_equal(arrays[f"{p}.scales"], rs[0])
            np.testing.assert_array_equal(arrays[f"{p}.biases"], rb[0])
    assert m.rmse is not None and len(m.rmse["layers"]) == len(m.layers)
    assert all(0 < r["gate"] < 1 for r in m.rmse["layers"])
    src.close()


def test_layer_bits_keeps_chosen_layers(mlx_ckpt, tmp_path):
    out = tmp_path / "mixed"
    m = convert(str(mlx_ckpt), out, bits=2, layer_bits="0=4", progress=False)
    bits = {e.layer: e.bits for e in m.layers}
    assert bits[0] == 4 and all(b == 2 for L, b in bits.items() if L != 0)
    assert json.loads((out / MANIFEST_NAME).read_text())["bits_per_layer"]["0"] == 4
    assert m.layer(0).method == "repack"


def test_interrupted_conversion_resumes_bit_identical(mlx_ckpt, tmp_path, monkeypatch):
    import moepack.convert as conv

    clean = tmp_path / "clean"
    convert(str(mlx_ckpt), clean, bits=2, progress=False)

    out = tmp_path / "resumed"
    real = conv._convert_layer
    calls = {"n": 0}

    def dying(plan, *a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as if Ctrl-C landed during the third layer
        return real(plan, *a, **k)

    monkeypatch.setattr(conv, "_convert_layer", dying)
    with pytest.raises(KeyboardInterrupt):
        convert(str(mlx_ckpt), out, bits=2, progress=False)
    assert not (out / MANIFEST_NAME).exists() and (out / STATE_NAME).exists()
    state = json.loads((out / STATE_NAME).read_text())
    assert len(state["layers"]) == 2

    # damage one finished layer: the resume must notice and redo it, and reuse the other
    first, second = sorted(state["layers"], key=int)[:2]
    f = out / state["layers"][first]["file"]
    data = bytearray(f.read_bytes())
    data[100] ^= 0xFF
    f.write_bytes(bytes(data))

    redone = []

    def counting(plan, *a, **k):
        redone.append(plan.experts.layer)
        return real(plan, *a, **k)

    monkeypatch.setattr(conv, "_convert_layer", counting)
    convert(str(mlx_ckpt), out, bits=2, progress=False)
    assert int(first) in redone and int(second) not in redone
    a, b = _tree_bytes(clean), _tree_bytes(out)
    assert a.keys() == b.keys()
    for k in a:
        if k == MANIFEST_NAME:
            continue
        assert a[k] == b[k], k
    ma, mb = json.loads(a[MANIFEST_NAME]), json.loads(b[MANIFEST_NAME])
    assert ma["checksums"] == mb["checksums"] and ma["rmse"] == mb["rmse"]


def test_refuses_existing_packed_model_and_other_conversion(mlx_ckpt, tmp_path):
    out = tmp_path / "p"
    convert(str(mlx_ckpt), out, progress=False)
    with pytest.raises(OutputError):
        convert(str(mlx_ckpt), out, progress=False)
    # --force replaces it
    convert(str(mlx_ckpt), out, bits=2, force=True, progress=False)
    assert load_manifest(out).layers[0].bits == 2


def test_refuses_unrelated_nonempty_folder_even_with_force(mlx_ckpt, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    for force in (False, True):
        with pytest.raises(OutputError):
            convert(str(mlx_ckpt), out, force=force, progress=False)
    assert (out / "notes.txt").read_text() == "precious"


def test_workers_do_not_change_bytes(mlx_ckpt, tmp_path):
    a, b = tmp_path / "w1", tmp_path / "w3"
    convert(str(mlx_ckpt), a, bits=2, workers=1, progress=False)
    convert(str(mlx_ckpt), b, bits=2, workers=3, progress=False)
    ta, tb = _tree_bytes(a), _tree_bytes(b)
    ta.pop(MANIFEST_NAME), tb.pop(MANIFEST_NAME)
    assert ta == tb
    assert os.path.getsize(a / "packed_experts" / "layer_00.bin") % 16384 == 0


def test_qwen397_shapes_layer_file_is_flash_moe_layout(tmp_path):
    """Real 397B expert shapes (D=4096, I=1024), few experts: records need no padding and the layer file is
    exactly Flash-MoE's: expert after expert, each gate w/s/b, up w/s/b, down w/s/b, no header."""
    from moepack.testing.fixtures import write_mlx_checkpoint

    src = write_mlx_checkpoint(tmp_path / "s", arch="qwen3_moe", bits=4, seed=5, num_hidden_layers=1, num_experts=3,
                               hidden_size=4096, moe_intermediate_size=1024, intermediate_size=1024,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=512, shards=1)
    m = convert(str(src), tmp_path / "p", progress=False)
    lay = m.layout_of(0)
    assert lay.record_size == 7_077_888
    assert [c.offset for c in lay.components] == [0, 2_097_152, 2_228_224, 2_359_296, 4_456_448, 4_587_520,
                                                 4_718_592, 6_815_744, 6_946_816]
    ck = open_checkpoint(str(src))
    arch = get_architecture("qwen3_moe")
    parts = [ck.read(arch.expert_name(0, p, part)) for p in ("gate", "up", "down") for part in ("weight", "scales", "biases")]
    flash = b"".join(t[e].tobytes() for e in range(3) for t in parts)
    assert (tmp_path / "p" / "packed_experts" / "layer_00.bin").read_bytes() == flash
    ck.close()


def test_convert_from_hub_repo_id_offline(mlx_ckpt, tmp_path):
    """A repo id resolves through huggingface_hub's real cache code path (HF_HUB_OFFLINE=1)."""
    import hashlib
    import subprocess
    import sys

    from test_checkpoint import _hub_repo

    cache = tmp_path / "hub"
    commit = hashlib.sha1(b"moepack-convert").hexdigest()
    _hub_repo(cache, "tiny-org/tiny-q35", Path(mlx_ckpt), commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(HF_HUB_CACHE=str(cache), HF_HOME=str(tmp_path / "hf-home"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "p"
    r = subprocess.run([sys.executable, "-m", "moepack", "convert", "tiny-org/tiny-q35", str(out), "-q"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    m = load_manifest(out)
    assert m.source == {"type": "hub", "repo_id": "tiny-org/tiny-q35", "revision": commit}
    r = subprocess.run([sys.executable, "-m", "moepack", "convert", "tiny-org/absent", str(tmp_path / "q")],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
    assert not (tmp_path / "q" / MANIFEST_NAME).exists()
