import os

import pytest

# numba compiles on first use; keep its cache inside the venv-independent tmp so test runs share it
os.environ.setdefault("NUMBA_CACHE_DIR", os.path.join(os.path.dirname(__file__), "..", ".numba-cache"))


@pytest.fixture(scope="session")
def mlx_ckpt(tmp_path_factory):
    """A small qwen3_5_moe MLX 4-bit checkpoint written by our own writer (2 shards)."""
    from moepack.testing.fixtures import write_mlx_checkpoint

    return write_mlx_checkpoint(tmp_path_factory.mktemp("src") / "q35", arch="qwen3_5_moe", bits=4, seed=1)
