"""The CLI: --help everywhere, one-line errors with a hint and no traceback, JSON outputs."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moepack.cli import COMMANDS, main
from moepack.layout.constants import MANIFEST_NAME


def run(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_help_for_every_command(capsys, cmd):
    code, out, _ = run(capsys, cmd, "--help")
    assert code == 0
    assert "Example" in out and cmd in out


def test_top_level_help_imports_no_numba():
    code = ("import sys; from moepack.cli import main; main(['--help']); "
            "bad = [m for m in ('numba', 'numpy', 'mlx') if m in sys.modules]; assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _assert_clean_error(code, err, *words):
    assert code != 0
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if line]
    assert lines[0].startswith("error: ")
    assert any(line.startswith("hint: ") for line in lines)
    for w in words:
        assert w in err, (w, err)


def test_convert_json_and_inspect_and_verify(capsys, mlx_ckpt, tmp_path):
    out = tmp_path / "p2"
    code, stdout, _ = run(capsys, "convert", str(mlx_ckpt), str(out), "--bits", "2", "--json")
    assert code == 0
    res = json.loads(stdout)
    assert res["inspect"]["bits"] == {"2": res["inspect"]["bits"]["2"]}
    code, stdout, _ = run(capsys, "verify", str(out), "--json")
    assert code == 0 and json.loads(stdout)["ok"] is True
    code, stdout, _ = run(capsys, "inspect", str(out), "-k", "4", "--json")
    info = json.loads(stdout)
    assert info["k"] == 4
    assert info["bytes_per_token"] == 4 * info["moe_layers"] * max(info["record_sizes"].values())
    code, stdout, _ = run(capsys, "inspect", str(out))
    assert code == 0 and "read per token" in stdout


def test_verify_rmse_json_matches_manifest(capsys, mlx_ckpt, tmp_path):
    out = tmp_path / "p2"
    assert run(capsys, "convert", str(mlx_ckpt), str(out), "--bits", "2", "-q")[0] == 0
    js = tmp_path / "rmse.json"
    code, stdout, _ = run(capsys, "verify-rmse", str(out), "--json", str(js), "-q")
    assert code == 0 and "mean" in stdout
    res = json.loads(js.read_text())
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    assert set(res) == {"layers", "overall"}
    for r, m in zip(res["layers"], manifest["rmse"]["layers"]):
        assert set(r) == {"layer", "bits", "gate", "up", "down", "max_abs"}
        assert set(r["max_abs"]) == {"gate", "up", "down"}
        for p in ("gate", "up", "down"):
            assert r[p] == pytest.approx(m[p], rel=1e-9)
            assert r["max_abs"][p] == pytest.approx(m["max_abs"][p], rel=1e-9)
    assert set(res["overall"]) == {"gate", "up", "down"}


def test_verify_rmse_of_repack_is_zero(capsys, mlx_ckpt, tmp_path):
    out = tmp_path / "p4"
    assert run(capsys, "convert", str(mlx_ckpt), str(out), "-q")[0] == 0
    code, stdout, _ = run(capsys, "verify-rmse", str(out), "--json", "-")
    res = json.loads(stdout)
    assert all(r[p] == 0.0 and r["max_abs"][p] == 0.0 for r in res["layers"] for p in ("gate", "up", "down"))


def test_verify_names_corrupt_and_missing_files(capsys, mlx_ckpt, tmp_path):
    out = tmp_path / "p"
    assert run(capsys, "convert", str(mlx_ckpt), str(out), "-q")[0] == 0
    layer_files = sorted((out / "packed_experts").iterdir())
    data = bytearray(layer_files[1].read_bytes())
    rs = json.loads((out / MANIFEST_NAME).read_text())["record_layouts"]["q4.g64"]["record_size"]
    data[5 * rs + 7] ^= 1  # one bit of expert 5
    layer_files[1].write_bytes(bytes(data))
    with open(layer_files[2], "r+b") as f:
        f.truncate(rs * 3)
    (out / "tokenizer.json").unlink()
    code, stdout, _ = run(capsys, "verify", str(out), "-q")
    assert code == 1
    assert f"{layer_files[1].name}: 1 record(s) fail their checksum (experts 5)" in stdout
    assert f"{layer_files[2].name}: {rs * 3} bytes, expected" in stdout
    assert "tokenizer.json: missing" in stdout


def test_not_a_packed_model(capsys, tmp_path):
    code, _, err = run(capsys, "verify", str(tmp_path))
    _assert_clean_error(code, err, "moepack.json")
    code, _, err = run(capsys, "inspect", str(tmp_path / "nope"))
    _assert_clean_error(code, err, "no such folder")


def _no_packed_model(out: Path):
    assert not (out / MANIFEST_NAME).exists()


def test_bad_sources_give_one_line_errors(capsys, mlx_ckpt, tmp_path):
    # unknown architecture
    bad = tmp_path / "bad_arch"
    shutil.copytree(mlx_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model_type"] = "llama"
    (bad / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "convert", str(bad), str(tmp_path / "o1"))
    _assert_clean_error(code, err, "llama", "qwen3_5_moe")
    _no_packed_model(tmp_path / "o1")

    # missing shard
    miss = tmp_path / "missing"
    shutil.copytree(mlx_ckpt, miss)
    shard = sorted(miss.glob("*.safetensors"))[-1]
    shard.unlink()
    code, _, err = run(capsys, "convert", str(miss), str(tmp_path / "o2"))
    _assert_clean_error(code, err, shard.name)
    _no_packed_model(tmp_path / "o2")

    # truncated shard
    trunc = tmp_path / "trunc"
    shutil.copytree(mlx_ckpt, trunc)
    shard = sorted(trunc.glob("*.safetensors"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 1000)
    code, _, err = run(capsys, "convert", str(trunc), str(tmp_path / "o3"))
    _assert_clean_error(code, err, shard.name)
    _no_packed_model(tmp_path / "o3")

    # a path that does not exist and is not a repo id
    code, _, err = run(capsys, "convert", str(tmp_path / "nothing"), str(tmp_path / "o4"))
    _assert_clean_error(code, err)
    _no_packed_model(tmp_path / "o4")

    # unsupported bits go through click's own message
    code, _, err = run(capsys, "convert", str(mlx_ckpt), str(tmp_path / "o5"), "--bits", "5")
    assert code == 2 and "Traceback" not in err


def test_wrong_expert_shape(capsys, tmp_path):
    from moepack.testing.fixtures import write_mlx_checkpoint

    src = write_mlx_checkpoint(tmp_path / "s", arch="qwen3_moe", bits=4, seed=3)
    cfg = json.loads((src / "config.json").read_text())
    cfg["moe_intermediate_size"] = cfg["moe_intermediate_size"] * 2  # config no longer matches tensors
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "convert", str(src), str(tmp_path / "o"))
    _assert_clean_error(code, err, "expected")
    _no_packed_model(tmp_path / "o")


def test_not_enough_disk(capsys, mlx_ckpt, tmp_path, monkeypatch):
    import moepack.convert as conv

    class Usage:
        total = used = 10**12
        free = 1000

    monkeypatch.setattr(conv.shutil, "disk_usage", lambda p: Usage)
    code, _, err = run(capsys, "convert", str(mlx_ckpt), str(tmp_path / "o"))
    _assert_clean_error(code, err, "disk space")
    _no_packed_model(tmp_path / "o")


def test_output_of_another_conversion(capsys, mlx_ckpt, tmp_path, monkeypatch):
    import moepack.convert as conv

    out = tmp_path / "o"
    real = conv._convert_layer
    n = {"i": 0}

    def dying(*a, **k):
        n["i"] += 1
        if n["i"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(conv, "_convert_layer", dying)
    code, _, err = run(capsys, "convert", str(mlx_ckpt), str(out), "-q")
    assert code == 130 and "re-run the same command to resume" in err
    monkeypatch.setattr(conv, "_convert_layer", real)
    code, _, err = run(capsys, "convert", str(mlx_ckpt), str(out), "--bits", "2", "-q")
    _assert_clean_error(code, err, "other settings")
    _no_packed_model(out)
    assert run(capsys, "convert", str(mlx_ckpt), str(out), "-q")[0] == 0  # same args resume


def test_console_script_has_no_traceback(tmp_path):
    exe = Path(sys.executable).with_name("moepack")
    if not exe.exists():
        pytest.skip("console script not installed (package not pip-installed)")
    r = subprocess.run([str(exe), "verify", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_verify_rmse_plot(capsys, mlx_ckpt, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "p2"
    assert run(capsys, "convert", str(mlx_ckpt), str(out), "--bits", "2", "-q")[0] == 0
    png = tmp_path / "rmse.png"
    assert run(capsys, "verify-rmse", str(out), "--plot", str(png), "-q")[0] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000


def test_group_size_that_does_not_divide(capsys, tmp_path):
    from moepack.testing.fixtures import write_hf_checkpoint

    hf = write_hf_checkpoint(tmp_path / "hf", arch="qwen3_moe", seed=1)
    code, _, err = run(capsys, "convert", str(hf), str(tmp_path / "o"), "--group-size", "48")
    _assert_clean_error(code, err, "group size 48")
    _no_packed_model(tmp_path / "o")
