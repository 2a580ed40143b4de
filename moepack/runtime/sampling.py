"""Choosing the next token from logits: greedy, or temperature + top-k + top-p sampling with a seeded
numpy Generator.

    pick = make_sampler(temperature=0.7, top_p=0.9, top_k=50, seed=0)
    token = pick(logits[-1])

Order of the filters (as transformers' and mlx-lm's samplers): logits / temperature -> softmax -> keep the
``top_k`` most likely -> keep the smallest set whose probability sums to at least ``top_p`` -> renormalise
-> draw. Ties in probability are broken towards the lower token id, so results do not depend on sort
stability. ``temperature == 0`` is greedy (argmax, lowest id on ties) and ignores the rest.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..errors import MoepackError


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    if not np.isfinite(temperature) or temperature < 0:
        raise MoepackError(f"--temperature must be >= 0, got {temperature}", hint="0 is greedy decoding")
    if not 0 < top_p <= 1:
        raise MoepackError(f"--top-p must be in (0, 1], got {top_p}", hint="1 turns top-p filtering off")
    if top_k < 0:
        raise MoepackError(f"--top-k must be >= 0, got {top_k}", hint="0 turns top-k filtering off")


def _order(p: np.ndarray) -> np.ndarray:
    """Indices by descending probability, ties to the lower index."""
    return np.lexsort((np.arange(p.size), -p))


def filter_top_k(p: np.ndarray, k: int) -> np.ndarray:
    """Zero all but the k most likely entries of the distribution `p` [V] (not renormalised); k=0: keep all."""
    if k <= 0 or k >= p.size:
        return p
    out = np.zeros_like(p)
    keep = _order(p)[:k]
    out[keep] = p[keep]
    return out


def filter_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """Keep the smallest set of most likely entries whose sum reaches `top_p` of the total (nucleus)."""
    if top_p >= 1.0:
        return p
    order = _order(p)
    cum = np.cumsum(p[order], dtype=np.float64)
    # entry i stays if the mass before it is still short of top_p: the smallest prefix with cum >= top_p
    n = int(np.searchsorted(cum, top_p * cum[-1], side="left")) + 1
    out = np.zeros_like(p)
    keep = order[: min(n, p.size)]
    out[keep] = p[keep]
    return out


def probabilities(logits: np.ndarray, *, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> np.ndarray:
    """The distribution sampling draws from: float64 [V], summing to 1."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    if temperature <= 0:
        p = np.zeros_like(x)
        p[greedy(x)] = 1.0
        return p
    x = x / temperature
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    p = filter_top_p(filter_top_k(p, top_k), top_p)
    return p / p.sum()


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(np.asarray(logits).reshape(-1)))


def sample(logits: np.ndarray, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
           rng: np.random.Generator | None = None) -> int:
    """One token id from logits [V]."""
    if temperature <= 0 or top_k == 1:
        return greedy(logits)
    p = probabilities(logits, temperature=temperature, top_p=top_p, top_k=top_k)
    rng = rng if rng is not None else np.random.default_rng()
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    i = min(i, p.size - 1)
    while p[i] == 0 and i > 0:  # float round-off at the top end: step back onto a kept token
        i -= 1
    return i


def make_sampler(*, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | np.random.Generator | None = None) -> Callable[[np.ndarray], int]:
    """logits [V] -> token id; one seeded Generator for the whole run, so a seed fixes every draw (pass a
    Generator to continue its stream, e.g. over the turns of a chat)."""
    check_sampling(temperature, top_p, top_k)
    rng = np.random.default_rng(seed)

    def pick(logits: np.ndarray) -> int:
        return sample(logits, temperature=temperature, top_p=top_p, top_k=top_k, rng=rng)

    return pick
