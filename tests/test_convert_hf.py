"""Unquantized Hugging Face checkpoints are quantized on the way exactly as `mlx_lm.convert` would."""

import json

import numpy as np
import pytest

from moepack.archs import get_architecture
from moepack.convert import convert
from moepack.layout.reader import PackedModel
from moepack.source.checkpoint import open_checkpoint
from moepack.source.safetensors_file import SafetensorsFile
from moepack.testing.fixtures import write_hf_checkpoint


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next", "qwen3_moe"])
def test_hf_source_matches_mlx_lm_convert(arch, tmp_path):
    pytest.importorskip("mlx_lm")
    from mlx_lm.convert import convert as mlx_convert

    hf = write_hf_checkpoint(tmp_path / "hf", arch=arch, seed=2)
    ref_dir = tmp_path / "mlx"
    mlx_convert(hf_path=str(hf), mlx_path=str(ref_dir), quantize=True, q_group_size=64, q_bits=4)
    out = tmp_path / "ours"
    m = convert(str(hf), out, progress=False)
    assert {e.method for e in m.layers} == {"quantize"}

    ref = open_checkpoint(str(ref_dir))
    a = get_architecture(arch)
    ours = SafetensorsFile(out / "model.safetensors")
    ref_dense = [n for n in ref.tensor_names if a.expert_layer_of(n) is None]
    assert sorted(ours.tensors) == sorted(ref_dense)
    for n in ref_dense:
        ti, ri = ours.info(n), ref.info(n)
        assert (ti.dtype, ti.shape) == (ri.dtype, ri.shape), n
        assert ours.read_bytes(n) == ref.read(n).tobytes(), n

    with PackedModel(out) as pm:
        for entry in m.layers:
            L = entry.layer
            for e in range(m.moe.num_experts):
                arrays = pm.expert_arrays(L, pm.read_record(L, e))
                for p in ("gate", "up", "down"):
                    for part in ("weight", "scales", "biases"):
                        np.testing.assert_array_equal(arrays[f"{p}.{part}"],
                                                      ref.read(a.expert_name(L, p, part))[e], err_msg=f"{L} {e} {p} {part}")
    qref = json.loads((ref_dir / "config.json").read_text())["quantization"]
    qours = json.loads((out / "config.json").read_text())["quantization"]
    assert qours == qref
    ref.close()
