"""The LU-KV / kvpress curve converter and the ``lukv pull | push | list | convert`` commands."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lukv_cache.cli import build_parser
from lukv_cache.errors import ProfileFormatError
from lukv_cache.profiles import KVPRESS_GRID, Profile, convert_curve, list_profiles

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REPO = "lukv-test/profiles"


def _curve(layers: int = 3, kv_heads: int = 2) -> np.ndarray:
    rng = np.random.default_rng(0)
    base = np.linspace(0.01, 0.99, 99)[:, None, None]
    return np.clip(base + rng.normal(0, 0.02, (99, layers, kv_heads)), 0, 1).astype(np.float32)


def _run(*argv: str) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


# ------------------------------------------------------------------------------------------ converter


def test_convert_curve_keeps_values_on_the_kvpress_grid(tmp_path):
    curve = _curve()
    np.save(tmp_path / "curve.npy", curve)
    profile = convert_curve(tmp_path / "curve.npy", MODEL, "expected_attention", calibration="LU-KV release")
    np.testing.assert_array_equal(profile.evict_ratio, curve)
    np.testing.assert_allclose(profile.grid, np.arange(1, 100) / 100, atol=1e-7)
    np.testing.assert_array_equal(profile.grid, KVPRESS_GRID)
    np.testing.assert_allclose(profile.at(0.5), curve[49], atol=1e-6)  # rho = 0.50 is row 49
    assert (profile.model_id, profile.scorer, profile.num_layers, profile.num_kv_heads) == (
        MODEL,
        "expected_attention",
        3,
        2,
    )
    assert profile.extra["converted_from"] == "curve.npy"


def test_converted_curve_round_trips_through_a_file(tmp_path):
    np.save(
        tmp_path / "curve.npy", _curve().astype(np.float64)
    )  # float64 curves are accepted and stored float32
    path = convert_curve(tmp_path / "curve.npy", MODEL, "keydiff").save(tmp_path / "keydiff.safetensors")
    loaded = Profile.load(path)
    assert loaded.evict_ratio.dtype == np.float32 and loaded.window == 1


def test_snapkv_curve_gets_snapkv_window(tmp_path):
    np.save(tmp_path / "curve.npy", _curve())
    assert convert_curve(tmp_path / "curve.npy", MODEL, "snapkv").window == 32


def test_npy_that_needs_pickle_raises_format_error(tmp_path):
    objects = np.empty(2, dtype=object)
    objects[0], objects[1] = {"a": 1}, [1, 2]
    np.save(tmp_path / "evil.npy", objects, allow_pickle=True)
    with pytest.raises(ProfileFormatError, match="pickled .object. array, which is never loaded"):
        convert_curve(tmp_path / "evil.npy", MODEL, "keydiff")


def test_curve_of_wrong_shape_raises_format_error(tmp_path):
    np.save(tmp_path / "curve.npy", _curve()[:50])
    with pytest.raises(ProfileFormatError, match=r"shape \[99, layers, KV heads\].*got \[50, 3, 2\]"):
        convert_curve(tmp_path / "curve.npy", MODEL, "keydiff")


def test_curve_with_ratio_above_one_raises_format_error(tmp_path):
    np.save(tmp_path / "curve.npy", _curve() * 2)
    with pytest.raises(ProfileFormatError, match=r"curve.npy.*must lie in \[0, 1\]"):
        convert_curve(tmp_path / "curve.npy", MODEL, "keydiff")


def test_truncated_npy_raises_format_error(tmp_path):
    np.save(tmp_path / "curve.npy", _curve())
    data = (tmp_path / "curve.npy").read_bytes()
    (tmp_path / "curve.npy").write_bytes(data[: len(data) // 2])
    with pytest.raises(ProfileFormatError, match="truncated or damaged"):
        convert_curve(tmp_path / "curve.npy", MODEL, "keydiff")


def test_npz_archive_raises_format_error(tmp_path):
    np.savez(tmp_path / "curves.npz", curve=_curve())
    with pytest.raises(ProfileFormatError, match="npz archive"):
        convert_curve(tmp_path / "curves.npz", MODEL, "keydiff")


# ------------------------------------------------------------------------------------------ commands


def test_cli_convert_writes_a_profile(tmp_path, capsys):
    np.save(tmp_path / "curve.npy", _curve())
    out = tmp_path / "ea.safetensors"
    assert (
        _run(
            "convert",
            str(tmp_path / "curve.npy"),
            "--model",
            MODEL,
            "--scorer",
            "expected_attention",
            "--out",
            str(out),
        )
        == 0
    )
    assert Profile.load(out).scorer == "expected_attention"
    assert f"written to {out}" in capsys.readouterr().out


def test_cli_push_list_pull_round_trip(hub, hf_cache, tmp_path, profile, capsys):
    path = profile.save(tmp_path / "keydiff.safetensors")
    hub_args = ["--repo-id", REPO, "--endpoint", hub.url]
    assert _run("push", str(path), "--model-id", MODEL, *hub_args) == 0
    assert "published meta-llama/Llama-3.1-8B-Instruct / keydiff at commit" in capsys.readouterr().out

    assert _run("list", *hub_args, "--cache-dir", str(hf_cache)) == 0
    listing = capsys.readouterr().out
    assert "MODEL" in listing and MODEL in listing and "2 x 2" in listing

    assert _run("list", *hub_args, "--cache-dir", str(hf_cache), "--json", "--model-id", MODEL) == 0
    assert [e["scorer"] for e in json.loads(capsys.readouterr().out)] == ["keydiff"]

    out = tmp_path / "pulled.safetensors"
    assert _run("pull", MODEL, *hub_args, "--cache-dir", str(hf_cache), "--out", str(out)) == 0
    assert f"file: {hf_cache}" in capsys.readouterr().out
    np.testing.assert_array_equal(Profile.load(out).evict_ratio, profile.evict_ratio)


def test_cli_push_to_local_dir_updates_its_index(tmp_path, profile, capsys):
    path = profile.save(tmp_path / "keydiff.safetensors")
    mirror = tmp_path / "profiles_hub"
    assert _run("push", str(path), "--local-dir", str(mirror)) == 0
    assert [e["path"] for e in list_profiles(local_dir=mirror)] == ["org/tiny-llama/keydiff.safetensors"]
    assert _run("list", "--local-dir", str(mirror)) == 0
    assert "org/tiny-llama" in capsys.readouterr().out


def _claiming(path, shape, data: bytes = b"\0" * 64):
    """A .npy file whose header claims a float32 array of ``shape`` and holds ``data`` after it."""
    import io

    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.float32))
    header["shape"] = shape
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    path.write_bytes(buf.getvalue() + data)
    return path


@pytest.mark.parametrize("shape", [(10**6, 10**6, 1000), (99, 2, 2)])
def test_a_curve_whose_header_claims_more_than_the_file_holds_is_refused_before_allocating(tmp_path, shape):
    # 4 PB (or 1,584 bytes) claimed by a file of about 200 bytes: numpy would try to allocate the claim
    path = _claiming(tmp_path / "curve.npy", shape)
    assert path.stat().st_size < 300
    with pytest.raises(ProfileFormatError, match="truncated or damaged"):
        convert_curve(path, MODEL, "keydiff")
