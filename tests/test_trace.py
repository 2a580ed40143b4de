"""`moepack trace`: the analysis on a routing sequence worked out by hand, the recorder, and one end-to-end run
on a tiny packed model (its routing counted against the runtime's own per-layer counters, its tokens equal to
`moepack run`'s)."""

import json

import pytest

from moepack.cli import main
from moepack.convert import convert
from moepack.testing.fixtures import write_mlx_checkpoint
from moepack.trace import (RoutingRecorder, analyse, consecutive_overlap, default_capacities, expert_frequency,
                           lru_hit_rate)

# two layers, five tokens, 8 experts, K = 2
ROUTING = [
    {0: [0, 1], 5: [6, 7]},
    {0: [1, 2], 5: [6, 7]},
    {0: [0, 2], 5: [6, 7]},
    {0: [0, 3], 5: [6, 7]},
    {0: [0, 3], 5: [6, 7]},
]


def test_frequency_by_hand():
    f = expert_frequency(ROUTING, 8)
    assert f[0].tolist() == [4, 2, 2, 2, 0, 0, 0, 0]
    assert f[5].tolist() == [0, 0, 0, 0, 0, 0, 5, 5]


def test_overlap_by_hand():
    # layer 0: t1 shares {1}, t2 {2}, t3 {0}, t4 {0, 3} -> (1/2 + 1/2 + 1/2 + 2/2) / 4
    assert consecutive_overlap(ROUTING) == {0: 0.625, 5: 1.0}
    assert consecutive_overlap(ROUTING[:1]) == {0: None, 5: None}


def test_lru_by_hand():
    layer0 = [t[0] for t in ROUTING]
    # capacity 2: t0 miss 0, miss 1 [0 1]; t1 hit 1, miss 2 evicts 0 [1 2]; t2 miss 0 evicts 1, hit 2 [0 2];
    # t3 hit 0, miss 3 evicts 2 [0 3]; t4 hit 0, hit 3 -> 5 hits of 10
    assert lru_hit_rate(layer0, 2) == 0.5
    assert lru_hit_rate(layer0, 1) == 0.1  # only t1's 1 hits
    assert lru_hit_rate(layer0, 4) == 0.6  # only the 4 first sightings miss
    layer5 = [t[5] for t in ROUTING]
    assert lru_hit_rate(layer5, 2) == 0.8
    assert lru_hit_rate(layer5, 1) == 0.0  # 6 and 7 evict each other every token: overlap 1, hit rate 0
    assert lru_hit_rate([], 4) == 0.0


def test_analyse_by_hand():
    assert default_capacities(512) == [32, 64, 128, 256]
    assert default_capacities(8) == [1, 2, 4]
    res = analyse(ROUTING, 8)
    assert res["tokens"] == 5 and res["capacities"] == [1, 2, 4]
    l0, l5 = res["layers"]
    assert (l0["layer"], l0["distinct_experts"], l0["lookups"]) == (0, 4, 10)
    assert l0["top_experts"] == [[0, 4], [1, 2], [2, 2], [3, 2]]
    assert l0["lru_hit_rate"] == {"1": 0.1, "2": 0.5, "4": 0.6}
    assert l5["lru_hit_rate"] == {"1": 0.0, "2": 0.8, "4": 0.8}
    assert res["mean_overlap"] == pytest.approx((0.625 + 1.0) / 2)
    assert res["mean_lru_hit_rate"]["2"] == pytest.approx(0.65)
    json.dumps(res)  # JSON-ready


def test_recorder_merges_requests_of_one_token():
    rec = RoutingRecorder()
    rec(0, [3, 1])  # before any next_token(): opens the first token
    rec(0, [2])  # a second prefill batch of the same layer
    rec(1, [0])
    rec.next_token()
    rec(0, [1])
    assert rec.routing == [{0: [1, 2, 3], 1: [0]}, {0: [1]}]


# ------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=2)
    convert(str(src), root / "p4", progress=False)
    return root / "p4"


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_trace_end_to_end(capsys, tiny, tmp_path):
    ids = "1,37,200,5,88,410"
    png = tmp_path / "trace.png"
    code, out, err = cli(capsys, "trace", tiny, "--prompt-ids", ids, "--max-tokens", "5", "--json", "--backend",
                         "numpy", "--plot", png)
    assert code == 0, err
    res = json.loads(out)
    code, out, err = cli(capsys, "run", tiny, "--prompt-ids", ids, "--max-tokens", "5", "--json", "--backend", "numpy")
    assert code == 0, err
    run = json.loads(out)
    assert res["generated"] == run["tokens"]  # tracing (one token per forward call) changes nothing
    n_gen = len(res["generated"])
    assert res["tokens"] == 6 + n_gen - 1  # every prompt token, then each generated token fed back but the last
    K = res["experts_per_token"]
    assert len(res["layers"]) == 4
    for x in res["layers"]:
        assert sum(x["frequency"]) == x["lookups"] == res["tokens"] * K  # each token: K distinct experts
        assert x["distinct_experts"] == sum(1 for c in x["frequency"] if c)
        assert all(0 <= v <= 1 for v in x["lru_hit_rate"].values())
    # the routing the recorder saw is what the runtime read (its own per-layer counters)
    assert sum(x["lookups"] for x in res["layers"]) == res["experts_read"]
    for r in res["residency"]:  # just read through the page cache: resident (tiny files on a real disk)
        assert 0 < r["resident_fraction"] <= 1 and r["used_resident_fraction"] is not None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    code, out, err = cli(capsys, "trace", tiny, "--prompt-ids", ids, "--max-tokens", "2", "--backend", "numpy")
    assert code == 0 and "LRU1" in out and "overlap" in out and len(out.splitlines()) == 2 + 4 + 2


def test_trace_user_mistakes(capsys, tiny):
    code, out, err = cli(capsys, "trace", tiny, "--prompt-ids", "1", "--plot", "x.jpg")
    assert code != 0 and "PNG" in err and "hint: " in err
    code, out, err = cli(capsys, "trace", tiny, "--backend", "numpy")
    assert code != 0 and "--prompt" in err and "Traceback" not in err
    code, out, err = cli(capsys, "trace", tiny, "--prompt-ids", "99999", "--backend", "numpy")
    assert code != 0 and "vocabulary" in err
