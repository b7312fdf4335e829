"""``lukv build <model>`` without ``--out`` writes into the local profile folder ``from_pretrained`` reads
(``$LUKV_PROFILE_DIR``), so the README's command runs as written and its profile is used at once."""

from lukv_cache import LUKVCache
from lukv_cache.cli import main
from lukv_cache.profiling import cli as profiling_cli


def test_build_without_out_writes_the_profile_from_pretrained_reads(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {"weights": "random"})
    )
    mirror = tmp_path / "mirror"
    monkeypatch.setenv("LUKV_PROFILE_DIR", str(mirror))
    args = ["build", "tiny", "--scorer", "keydiff", "--k-max", "2", "--calibration", str(tiny_calibration)]
    args += ["--model-id", "org/tiny", "--cache-dir", str(tmp_path / "c"), "--quiet"]
    assert main(args) == 0
    written = mirror / "org" / "tiny" / "keydiff.safetensors"
    assert written.is_file() and (mirror / "index.json").is_file()
    assert "reads it from $LUKV_PROFILE_DIR" in capsys.readouterr().out
    cache = LUKVCache.from_pretrained("org/tiny", ratio=0.8, scorer="keydiff")
    assert cache.profile.source == str(written) and cache.allocator_name == "profile"


def test_build_without_out_or_env_writes_under_the_lukv_cache(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {"weights": "random"})
    )
    monkeypatch.delenv("LUKV_PROFILE_DIR", raising=False)
    monkeypatch.setenv("LUKV_CACHE_DIR", str(tmp_path / "lc"))
    args = ["build", "tiny", "--k-max", "2", "--calibration", str(tiny_calibration), "--model-id", "org/tiny"]
    assert main([*args, "--cache-dir", str(tmp_path / "c"), "--quiet"]) == 0
    assert (tmp_path / "lc" / "profiles" / "org" / "tiny" / "keydiff.safetensors").is_file()
    assert f"LUKV_PROFILE_DIR={tmp_path / 'lc' / 'profiles'}" in capsys.readouterr().out
