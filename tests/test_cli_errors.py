"""Every CLI mistake a user can make prints one ``error:`` line and exits 2: no traceback, no half file."""

from __future__ import annotations

import numpy as np
import pytest

from lukv_cache.cli import main
from lukv_cache.profiles import Profile
from lukv_cache.testing import array_profile


def _profile(tmp_path) -> str:
    ratios = np.stack([np.full((2, 2), 0.2), np.full((2, 2), 0.6)])
    return str(array_profile([0.25, 0.75], ratios, model_id="org/m").save(tmp_path / "p.safetensors"))


def _curve(tmp_path) -> str:
    path = tmp_path / "curve.npy"
    np.save(path, np.full((99, 2, 2), 0.5, dtype=np.float32))
    return str(path)


CASES = {
    "convert-out-is-a-folder": lambda t: [
        "convert",
        _curve(t),
        "--model",
        "org/m",
        "--scorer",
        "keydiff",
        "--out",
        str(t),
    ],
    "convert-bad-head-dim": lambda t: [
        "convert",
        _curve(t),
        "--model",
        "org/m",
        "--scorer",
        "keydiff",
        "--head-dim",
        "-3",
    ],
    "pull-out-is-a-folder": lambda t: ["pull", "org/m", "--local-dir", str(_mirror(t)), "--out", str(t)],
    "show-png-unwritable": lambda t: ["show", _profile(t), "--png", str(t / "p.safetensors" / "x.png")],
    "build-cache-dir-is-a-file": lambda t: [
        "build",
        "smollm2",
        "--out",
        str(t / "o"),
        "--cache-dir",
        _profile(t),
    ],
    "build-unknown-scorer": lambda t: ["build", "smollm2", "--out", str(t / "o"), "--scorer", "h2o"],
    "demo-ratio-out-of-range": lambda t: ["demo", "--ratios", "1.5"],
    "demo-model-missing": lambda t: ["demo", "--model", str(t / "nonexistent")],
    "list-local-dir-is-a-file": lambda t: ["list", "--local-dir", _profile(t)],
    "pull-local-dir-missing": lambda t: ["pull", "org/m", "--local-dir", str(t / "none")],  # issue 54, item 9
    "pull-local-dir-is-a-file": lambda t: ["pull", "org/m", "--local-dir", _profile(t)],
    "pull-model-id-too-long": lambda t: ["pull", "x" * 300, "--local-dir", str(t)],  # item 8: an OSError 36
    "check-model-folder-missing": lambda t: ["check", "./no-such-model", "--ratios", "0.5"],
    "check-model-absolute-folder-missing": lambda t: ["check", str(t / "no-such-model")],
    "check-model-is-a-file": lambda t: ["check", _profile(t)],
    "build-model-folder-missing": lambda t: ["build", "~/no-such-model-lukv", "--out", str(t / "o")],
    "show-model-folder-missing": lambda t: ["show", _profile(t), "--model", "./no-such-model"],
    "bench-model-folder-missing": lambda t: ["bench", "--model", "../no-such-model"],
    "check-ratio-out-of-range": lambda t: ["check", "smollm2", "--ratios", "2"],
    "check-text-missing": lambda t: ["check", "smollm2", "--text", str(t / "none.txt"), "--questions", "q"],
    "bench-ratio-out-of-range": lambda t: ["bench", "--ratios", "0.5,1.5"],
    "bench-memory-out-of-range": lambda t: ["bench", "--memory", "0"],
    "bench-memory-with-kv-bits": lambda t: ["bench", "--memory", "0.1", "--kv-bits", "4"],
    "bench-split-without-memory": lambda t: ["bench", "--split", "ratio", "--ratios", "0.5"],
    "ruler-split-without-memory": lambda t: ["ruler", "smollm2", "--split", "global_first"],
    "check-memory-out-of-range": lambda t: ["check", "smollm2", "--memory", "1.5"],
    "check-memory-with-kv-bits": lambda t: ["check", "smollm2", "--memory", "0.1", "--kv-bits", "8"],
    "check-memory-with-ratios": lambda t: ["check", "smollm2", "--memory", "0.1", "--ratios", "0.5"],
    # every count of `lukv bench`, `lukv demo`, `lukv build` and `lukv show` (issue 54, item 5)
    "bench-needles-negative": lambda t: ["bench", "--needles", "-1"],  # ran without end
    "bench-needles-zero": lambda t: ["bench", "--needles", "0"],  # a traceback
    "bench-needles-beyond-the-keys": lambda t: ["bench", "--needles", "901"],
    "bench-continuation-tokens-zero": lambda t: ["bench", "--continuation-tokens", "0"],  # a traceback
    "bench-continuation-tokens-one": lambda t: ["bench", "--continuation-tokens", "1"],
    "bench-samples-zero": lambda t: ["bench", "--samples", "0"],
    "bench-context-tokens-too-few": lambda t: ["bench", "--context-tokens", "10"],
    "bench-profiles-missing": lambda t: ["bench", "--profiles", str(t / "none")],
    "bench-profiles-is-a-file": lambda t: ["bench", "--profiles", _profile(t)],
    "check-profiles-missing": lambda t: [
        "check",
        "smollm2",
        "--ratios",
        "0.5",
        "--profiles",
        str(t / "none"),
    ],
    "demo-facts-zero": lambda t: ["demo", "--facts", "0"],
    "demo-context-tokens-zero": lambda t: ["demo", "--context-tokens", "0"],
    "demo-profiles-missing": lambda t: ["demo", "--profiles", str(t / "none")],
    "build-k-max-zero": lambda t: ["build", "smollm2", "--out", str(t / "o"), "--k-max", "0"],
    "build-max-questions-zero": lambda t: ["build", "smollm2", "--out", str(t / "o"), "--max-questions", "0"],
    "build-negative-sink": lambda t: ["build", "smollm2", "--out", str(t / "o"), "--sink", "-1"],
    "build-negative-window": lambda t: ["build", "smollm2", "--out", str(t / "o"), "--window", "-2"],
    "build-min-keep-out-of-range": lambda t: ["build", "smollm2", "--out", str(t / "o"), "--min-keep", "1.5"],
    "show-ratio-out-of-range": lambda t: ["show", _profile(t), "--ratio", "1.5"],
    "show-max-questions-zero": lambda t: ["show", _profile(t), "--model", "smollm2", "--max-questions", "0"],
}


@pytest.mark.parametrize("model", ["./no-such-model", "../x/no-such-model", "~/no-such-model", "a/b/c"])
def test_a_path_like_model_that_does_not_exist_says_no_such_folder(model, capsys):
    assert main(["check", model, "--ratios", "0.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"error: {model}: no such folder. Give a local model folder, a Hub id (org/name) or a packaged "
        "model: 'smollm2', 'qwen2.5-coder-0.5b', 'gemma3-270m'."
    )
    assert "Repo id" not in err


def test_a_hub_id_is_not_taken_for_a_folder():
    from lukv_cache.cli.prechecks import _path_like

    assert not _path_like("org/model") and not _path_like("smollm2")
    assert _path_like("./model") and _path_like("/abs/model") and _path_like("~/m") and _path_like("org/m/")


def _mirror(tmp_path):
    from lukv_cache.profiles import save_to_local_dir

    save_to_local_dir(Profile.load(_profile(tmp_path)), tmp_path / "mirror")
    return tmp_path / "mirror"


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_mistake_prints_one_error_line_and_exits_2(case, tmp_path, capsys):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code = main(CASES[case](tmp_path))
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    if case.startswith("convert"):
        assert not list(tmp_path.rglob("*.safetensors")), "a half-made or unreadable file was written"
    del before


@pytest.mark.parametrize("name", ["out.v2", "heatmap.plot"])
def test_show_png_with_a_suffix_matplotlib_cannot_write_is_one_error_line(name, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["show", _profile(tmp_path), "--png", str(tmp_path / name)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --png") and "end the name in .png" in err and "\n" not in err
    assert not list(tmp_path.glob("*.v2")) and not list(tmp_path.glob("*.plot"))


def test_show_png_given_a_folder_is_refused_and_writes_nothing(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "plots").mkdir()
    assert main(["show", _profile(tmp_path), "--png", str(tmp_path / "plots")]) == 2
    assert "is a folder; give a file name" in capsys.readouterr().err
    assert not list(tmp_path.glob("plots*.png"))


def test_show_png_without_a_suffix_writes_a_png_and_says_so(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert main(["show", _profile(tmp_path), "--png", str(tmp_path / "heatmap")]) == 0
    err = capsys.readouterr().err
    assert (tmp_path / "heatmap.png").is_file() and (tmp_path / "heatmap-curves.png").is_file()
    assert f"wrote {tmp_path / 'heatmap.png'} and {tmp_path / 'heatmap-curves.png'}" in err


def test_convert_a_curve_claiming_petabytes_is_one_error_line(tmp_path, capsys):
    import io

    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = (10**6, 10**6, 1000)
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    (tmp_path / "curve.npy").write_bytes(buf.getvalue() + b"\0" * 64)
    code = main(["convert", str(tmp_path / "curve.npy"), "--model", "org/m", "--scorer", "keydiff"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("error: ") and "truncated or damaged" in err and "\n" not in err


@pytest.mark.parametrize(
    "argv, allowed",
    [
        (
            ["bench", "--needles", "-1"],
            "--needles (needles per retrieval context, sentences quoted per recall "
            "context) must be an integer in [1, 900], got -1.",
        ),
        (
            ["bench", "--continuation-tokens", "0"],
            "--continuation-tokens (teacher-forced tokens after each "
            "continuation context) must be an integer of at least 2, got 0.",
        ),
        (
            ["bench", "--samples", "0"],
            "--samples (contexts per task) must be an integer of at least 1, got 0.",
        ),
        (
            ["build", "smollm2", "--sink", "-1"],
            "--sink (protected first tokens) must be a non-negative integer, got -1.",
        ),
    ],
)
def test_a_count_out_of_range_says_what_is_allowed(argv, allowed, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == f"error: {allowed}"


@pytest.mark.parametrize("case", ["bench-split-without-memory", "ruler-split-without-memory"])
def test_split_without_a_memory_budget_says_so(case, tmp_path, capsys):
    assert main(CASES[case](tmp_path)) == 2
    assert "no --memory is given" in capsys.readouterr().err
