"""The real Metal executor (PyObjC, Apple's compiler, the GPU): run on a Mac, skipped everywhere else.

What no Linux run shows: Apple's compiler accepts every kernel and each matches the numpy reference (what
`moepack selftest` checks), a page-aligned buffer (the expert reader's) is handed to the GPU without a copy,
and whole tiny models give the numpy backend's logits and greedy tokens. REL_TOL as in test_metal_backend
(the kernels compute in float32 with IEEE semantics, fast math off, like the emulator and the PTX path).
"""

from __future__ import annotations

import numpy as np
import pytest

from moepack.runtime.metal import executor_metal

_OK, _WHY = executor_metal.available()
if not _OK:
    pytest.skip(_WHY, allow_module_level=True)

from moepack.convert import convert  # noqa: E402
from moepack.runtime.metal.selftest import run_selftest  # noqa: E402
from moepack.testing.fixtures import write_mlx_checkpoint  # noqa: E402
from moepack.testing.parity import greedy_logits  # noqa: E402

REL_TOL = 1e-4
PROMPT = np.array([1, 37, 200, 5, 88, 410, 17, 3])


@pytest.fixture(scope="module")
def executor():
    return executor_metal.MetalExecutor()


def test_every_kernel_compiles_and_matches_numpy(executor):
    results = run_selftest(executor)
    failed = [(r.op, r.max_rel_err, r.error) for r in results if not r.ok]
    assert results and not failed


def test_page_aligned_arrays_reach_the_gpu_without_a_copy(executor):
    info = executor.describe()
    assert info["unified_memory"] and info["nocopy_in_place"] and executor.nocopy_in_place


@pytest.mark.parametrize("arch,bits", [("qwen3_5_moe", 4), ("qwen3_5_moe", 2), ("qwen3_moe", 4)])
def test_tiny_model_on_the_gpu_matches_numpy(tmp_path, arch, bits):
    packed = tmp_path / "packed"
    convert(write_mlx_checkpoint(tmp_path / "src", arch=arch, bits=4, seed=2), packed, bits=bits, progress=False)
    ref, ref_toks, _ = greedy_logits(packed, "numpy", PROMPT)
    got, got_toks, kernels = greedy_logits(packed, "metal", PROMPT)
    for a, b in zip(got, ref):
        assert a.shape == b.shape and np.abs(a - b).max() / np.abs(b).max() < REL_TOL
    assert got_toks == ref_toks and kernels.cpu_fallbacks == 0
