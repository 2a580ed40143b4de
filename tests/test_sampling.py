"""Sampling, checked by hand on small distributions."""

import numpy as np
import pytest

from moepack.errors import MoepackError
from moepack.runtime.sampling import filter_top_k, filter_top_p, make_sampler, probabilities, sample


def _logits(p):
    return np.log(np.asarray(p, dtype=np.float64))


@pytest.mark.parametrize("seed", range(5))
def test_temperature_zero_is_argmax(seed):
    logits = np.random.default_rng(seed).normal(size=300).astype(np.float32)
    pick = make_sampler(temperature=0.0, top_p=0.5, top_k=7, seed=seed)
    assert pick(logits) == int(np.argmax(logits))


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_is_argmax(seed):
    logits = np.random.default_rng(seed).normal(size=300)
    pick = make_sampler(temperature=2.0, top_k=1, seed=seed)
    assert all(pick(logits) == int(np.argmax(logits)) for _ in range(20))


def test_greedy_ties_go_to_the_lower_id():
    assert sample(np.array([0.0, 3.0, 3.0, 1.0])) == 1
    assert sample(np.array([0.0, 3.0, 3.0, 1.0]), temperature=1.0, top_k=1) == 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    # binary fractions, so the cumulative sums 0.5, 0.75, 0.875, 1.0 are exact
    p = np.array([0.125, 0.5, 0.125, 0.25])  # by probability: id 1 (0.5), id 3 (0.25), then ids 0 and 2
    assert np.flatnonzero(filter_top_p(p, 0.5)).tolist() == [1]  # 0.5 >= 0.5: one token is enough
    assert np.flatnonzero(filter_top_p(p, 0.51)).tolist() == [1, 3]
    assert np.flatnonzero(filter_top_p(p, 0.75)).tolist() == [1, 3]  # 0.5 + 0.25 reaches 0.75 exactly
    assert np.flatnonzero(filter_top_p(p, 0.76)).tolist() == [0, 1, 3]  # the tie 0/2 goes to the lower id
    assert np.flatnonzero(filter_top_p(p, 1.0)).tolist() == [0, 1, 2, 3]


def test_probabilities_renormalise_after_filters():
    p = [0.5, 0.3, 0.15, 0.05]
    q = probabilities(_logits(p), temperature=1.0, top_p=0.6)  # 0.5 < 0.6 <= 0.8: ids 0 and 1
    np.testing.assert_allclose(q, [0.5 / 0.8, 0.3 / 0.8, 0, 0], rtol=1e-12)
    q = probabilities(_logits(p), temperature=1.0, top_k=3)
    np.testing.assert_allclose(q, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0], rtol=1e-12)
    # temperature 0.5 squares the probabilities before normalising: 0.25, 0.09, 0.0225, 0.0025
    q = probabilities(_logits(p), temperature=0.5)
    np.testing.assert_allclose(q, np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365, rtol=1e-12)
    assert filter_top_k(np.array([0.1, 0.6, 0.3]), 2).tolist() == [0.0, 0.6, 0.3]


def test_samples_follow_the_filtered_distribution():
    p = [0.5, 0.3, 0.15, 0.05]
    pick = make_sampler(temperature=1.0, top_p=0.6, seed=0)
    draws = np.bincount([pick(_logits(p)) for _ in range(4000)], minlength=4)
    assert draws[2] == draws[3] == 0
    assert abs(draws[0] / 4000 - 0.625) < 0.03


def test_same_seed_same_tokens():
    logits = np.random.default_rng(1).normal(size=(40, 200))
    a = make_sampler(temperature=1.0, top_p=0.9, top_k=50, seed=123)
    b = make_sampler(temperature=1.0, top_p=0.9, top_k=50, seed=123)
    c = make_sampler(temperature=1.0, top_p=0.9, top_k=50, seed=124)
    ta, tb, tc = ([s(row) for row in logits] for s in (a, b, c))
    assert ta == tb
    assert ta != tc


def test_a_generator_continues_its_stream():
    logits = np.random.default_rng(2).normal(size=(10, 50))
    one = make_sampler(temperature=1.0, seed=7)
    whole = [one(r) for r in logits]
    rng = np.random.default_rng(7)
    halves = [make_sampler(temperature=1.0, seed=rng)(r) for r in logits]
    assert halves == whole


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                dict(temperature=float("nan"))])
def test_bad_settings_are_refused(kw):
    with pytest.raises(MoepackError):
        make_sampler(**kw)
