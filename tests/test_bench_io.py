"""`moepack bench-io`: the JSON holds every cell the table claims (each dimension asked for, numbers that
agree with each other), the recommendation is a measured cell and is saved, and `moepack run --io auto` uses it
(same tokens as pread)."""

import json

import pytest

from moepack.cli import main
from moepack.convert import convert
from moepack.iobench import HALF_MODES, MODES, Cell, recommend, recommended_io, save_recommendation, synthetic_plan, table
from moepack.layout.reader import PackedModel
from moepack.runtime.io import ExpertReader, planned_io
from moepack.testing.fixtures import write_mlx_checkpoint


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEPACK_CACHE", str(tmp_path / "cache"))


def cli(capsys, *args):
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchio")
    src = write_mlx_checkpoint(root / "src", arch="qwen3_5_moe", bits=4, seed=2)
    convert(str(src), root / "p4", progress=False)
    return root / "p4"


def test_synthetic_plan_uses_real_record_sizes():
    assert synthetic_plan(0.02, 2) == (1, 16, 3_932_160)  # at least 16 records
    assert synthetic_plan(1.0, 4) == (1, 141, 7_077_888)
    assert synthetic_plan(3.0, 2) == (2, 512, 3_932_160)  # 762 records: two layers of 512


def test_bench_io_json_has_every_cell_it_claims(capsys):
    code, out, err = cli(capsys, "bench-io", "--synthetic", "0.02", "--threads", "2,1", "--split", "1,2",
                         "--experts", "4", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["record_size"] == 3_932_160 and res["experts"] == 4 and res["threads"] == [1, 2]
    cells = res["cells"]
    key = {(c["group"], c["mode"], c["state"], c["threads"], c["split"], c["align"]) for c in cells}
    assert len(key) == len(cells)  # no cell twice
    want = {("threads", m, s, t, 1, 2 << 20) for m in MODES for s in ("cold", "warm") for t in (1, 2)}
    want |= {("split", m, s, 2, 2, 2 << 20) for m in ("pread", "hybrid", "direct") for s in ("cold", "warm")}
    want |= {("align", m, "warm", 1, 1, a) for m in ("pread", "mmap", "hybrid") for a in (16 << 10, 2 << 20)}
    want |= {("half", m, "half", 2, 1, 2 << 20) for m in ("pread", "mmap", "hybrid", "mapped")}
    assert key == want
    drops = res["cache_drop_works"]
    for c in cells:
        assert c["experts"] == 4 and c["bytes"] == 4 * 3_932_160
        assert c["gb_s"] == pytest.approx(c["bytes"] / c["seconds"] / 1e9)
        assert c["ms_per_expert"] == pytest.approx(c["seconds"] * 1e3 / 4)
        if c["io_used"] in ("hybrid", "mapped"):
            assert c["probe_us"] > 0 and 0 <= c["copied_fraction"] <= 1
            assert c["mincore_us"] is None or c["mincore_us"] > 0
        else:
            assert c["probe_us"] is None and c["mincore_us"] is None and c["copied_fraction"] is None
        if c["io_used"] == "mapped":
            assert 0 <= c["in_place_fraction"] <= 1
        else:
            assert c["in_place_fraction"] is None
        if c["state"] == "warm":
            assert c["resident_before"] == 1.0
            if c["io_used"] == "hybrid":
                assert c["copied_fraction"] == 1.0
            if c["io_used"] == "mapped":  # every record handed over in place: nothing copied
                assert c["in_place_fraction"] == 1.0 and c["copied_fraction"] == 0.0
        if drops and c["state"] == "cold" and c["io_used"] == "mapped":
            assert c["in_place_fraction"] == 0.0
        if drops and c["state"] == "cold":
            assert c["resident_before"] < 0.05
        if drops and c["state"] == "half":
            assert c["resident_before"] == 0.5  # records 0 and 2 of the 4 warmed (without readahead)
            if c["io_used"] == "hybrid":
                assert c["copied_fraction"] >= 0.5
            if c["io_used"] == "mapped":  # the two warmed records in place, the other two read
                assert c["in_place_fraction"] == 0.5
    rec = res["recommendation"]
    assert (rec["io"], rec["threads"], rec["split"]) in {(c["mode"], c["threads"], c["split"]) for c in cells}
    assert res["raw_direct"]["gb_s"] > 0
    saved = json.loads(open(res["saved_to"]).read())
    (dev_rec,) = saved["devices"].values()
    assert (dev_rec["io"], dev_rec["split"]) == (rec["io"], rec["split"]) and dev_rec["synthetic"] is True
    assert "models" not in saved  # a synthetic file is no model
    # the table has one row per cell, with the JSON's numbers
    rows = table(res).splitlines()[2:-1]
    rows = [r for r in rows if not r.startswith("warning")]
    assert len(rows) == len(cells)
    for r, c in zip(rows, cells):
        f = r.split()
        assert f[:5] == [c["group"], c["mode"], c["state"], str(c["threads"]), str(c["split"])]
        assert float(f[6]) == pytest.approx(c["gb_s"], abs=0.006)


def test_recommend_weighs_warm_and_cold_by_the_resident_fraction():
    def cell(mode, state, gbs, t=1):
        return Cell("threads", mode, mode, state, t, 1, 2 << 20, 1, 1, 1 / gbs / 1e9, gbs, 1.0, 0.0)

    cells = [cell("pread", "cold", 1.0), cell("pread", "warm", 5.0), cell("mmap", "cold", 0.5),
             cell("mmap", "warm", 9.0), cell("direct", "cold", 1.5), cell("direct", "warm", 1.5)]
    assert recommend(cells, 0.0)["io"] == "direct"  # all cold: 1/1.5 beats 1/1.0
    assert recommend(cells, 1.0)["io"] == "mmap"  # all warm: 1/9
    assert recommend(cells, 0.5)["io"] == "pread"  # 0.5/5 + 0.5/1 = 0.6 < direct 0.667 < mmap 1.056


def test_run_io_auto_uses_the_saved_recommendation(capsys, tiny):
    ids = "1,37,200,5,88"
    code, out, err = cli(capsys, "run", tiny, "--prompt-ids", ids, "--max-tokens", "4", "--json", "--io", "auto",
                         "--backend", "numpy")
    assert code == 0, err
    base = json.loads(out)
    assert base["stats"]["io"] == "mapped"  # nothing saved yet: the CPU backends' default
    assert planned_io(tiny, "auto", "numpy") == "mapped" and planned_io(tiny, "auto", "cuda") == "pread"
    assert planned_io(tiny, "direct:2", "numpy") == "direct"
    with PackedModel(tiny) as pm:
        save_recommendation(pm, {"io": "hybrid", "threads": 2, "split": 2}, synthetic=False)
        assert recommended_io(pm)["source"] == "model"
        with ExpertReader(pm, io="auto") as r:
            assert (r.io, r.threads, r.split) == ("hybrid", 2, 2)
        with ExpertReader(pm, io="auto:3") as r:  # an explicit --split wins
            assert (r.io, r.split) == ("hybrid", 3)
        save_recommendation(pm, {"io": "carrier-pigeon", "threads": 2, "split": 2}, synthetic=False)
        with ExpertReader(pm, io="auto") as r:  # a broken entry is ignored: pread
            assert r.io == "pread" and r.auto is None
        save_recommendation(pm, {"io": "hybrid", "threads": 2, "split": 2}, synthetic=False)
    code, out, err = cli(capsys, "run", tiny, "--prompt-ids", ids, "--max-tokens", "4", "--json", "--io", "auto",
                         "--backend", "numpy")
    assert code == 0, err
    got = json.loads(out)
    assert got["stats"]["io"] == "hybrid"
    assert planned_io(tiny, "auto", "numpy") == planned_io(str(tiny), "auto:2", "cuda") == "hybrid"
    assert got["tokens"] == base["tokens"]
    code, out, err = cli(capsys, "run", tiny, "--prompt-ids", ids, "--max-tokens", "4", "--json", "--io", "mmap",
                         "--split", "4", "--backend", "numpy")
    assert code == 0, err
    assert json.loads(out)["tokens"] == base["tokens"]


def test_bench_io_user_mistakes(capsys, tmp_path):
    for args, words in [((), ["nothing to benchmark", "--synthetic"]),
                        (("--synthetic", "0"), ["above 0"]),
                        ((tmp_path,), ["moepack.json"])]:
        code, out, err = cli(capsys, "bench-io", *args)
        assert code != 0 and "Traceback" not in err
        assert err.startswith("error: ") and "hint: " in err, err
        for w in words:
            assert w in err, (w, err)
    code, out, err = cli(capsys, "bench-io", "--synthetic", "1", "--threads", "0,2")
    assert code != 0 and "positive integers" in err


def test_help_has_examples(capsys):
    for cmd in ("bench-io", "trace"):
        code, out, err = cli(capsys, cmd, "--help")
        assert code == 0 and "Examples:" in out and f"moepack {cmd}" in out
    code, out, err = cli(capsys, "run", "--help")
    assert "hybrid" in out and "--split" in out


def test_bench_io_on_a_packed_model_saves_for_that_model(capsys, tiny):
    code, out, err = cli(capsys, "bench-io", tiny, "--threads", "1", "--split", "1", "--experts", "3", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert len(res["cells"]) == len(MODES) * 2 + 6 + len(HALF_MODES)  # no split cells: only split 1 asked for
    saved = json.loads(open(res["saved_to"]).read())
    rec = saved["models"][str(tiny.resolve())]
    assert (rec["io"], rec["threads"], rec["split"]) == tuple(res["recommendation"][k] for k in ("io", "threads", "split"))
    assert "devices" not in saved  # tiny records say nothing about the disk
    with PackedModel(tiny) as pm:
        assert recommended_io(pm)["io"] == rec["io"]


def test_auto_reads_in_place_only_when_the_experts_fit_in_memory(monkeypatch, tiny):
    import moepack.runtime.io as rio

    monkeypatch.setattr(rio, "available_ram", lambda: 10**12)
    assert rio.default_io("cpu", 10**9) == "mapped" and rio.default_io("numpy", None) == "mapped"
    assert rio.default_io("cuda", 1) == rio.default_io("metal", 1) == "pread"  # GPU decode wants record rows
    monkeypatch.setattr(rio, "available_ram", lambda: 10**9)
    assert rio.default_io("cpu", 8 * 10**8) == "mapped" and rio.default_io("cpu", 9 * 10**8) == "pread"
    with PackedModel(tiny) as pm:  # nothing saved for it (own cache): the size decides
        need = pm.manifest.expert_bytes_total
        monkeypatch.setattr(rio, "available_ram", lambda: need)  # fits, but not with 20% to spare
        assert planned_io(tiny, "auto", "cpu") == "pread"
        with ExpertReader(pm, io="auto", auto_default=rio.default_io("cpu", need)) as r:
            assert r.io == "pread" and r.auto is None
        monkeypatch.setattr(rio, "available_ram", lambda: 2 * need)
        assert planned_io(tiny, "auto", "cpu") == "mapped"
