"""Backend parity helpers for the tests: the same tiny packed model through two backends."""

from __future__ import annotations

import os

import numpy as np

from ..runtime.model import load_model


def greedy_logits(path: str | os.PathLike, backend: str, prompt, n_decode: int = 2):
    """(logits, tokens, kernels) of the prompt's prefill and `n_decode` greedy decode steps through `backend`:
    the logits of each forward call, the greedy tokens fed back, and the model's kernel module (on the GPU
    backends it holds the launch log and the CPU-fallback count)."""
    with load_model(path, backend=backend) as m:
        cache = m.new_cache()
        logits = [m.forward(np.asarray(prompt), cache)]
        tokens = []
        for _ in range(n_decode):
            tokens.append(int(logits[-1][-1].argmax()))
            logits.append(m.forward(np.array([tokens[-1]]), cache))
        kernels = m.K
    return logits, tokens, kernels
