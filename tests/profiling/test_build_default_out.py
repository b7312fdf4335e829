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


def test_build_sliding_compress_profile_sets_each_window_head_budget(
    byte_tokenizer, tiny_calibration, tmp_path, monkeypatch
):
    """``lukv build --sliding compress``: the profile's sliding rows are its own, and a cache under
    ``sliding="compress"`` with the ``profile`` allocator keeps in each sliding head what its row says."""
    import numpy as np
    import torch

    from lukv_cache.profiles import Profile
    from lukv_cache.testing import BYTE_VOCAB, tiny_model

    model = tiny_model("gemma2", attn="eager", vocab_size=BYTE_VOCAB, num_hidden_layers=2, sliding_window=16)
    monkeypatch.setattr(profiling_cli, "_load_model", lambda name: (model, byte_tokenizer, {}))
    out = tmp_path / "span.safetensors"
    args = ["build", "tiny", "--k-max", "2", "--calibration", str(tiny_calibration), "--model-id", "org/g"]
    args += [
        "--sliding",
        "compress",
        "--no-memory-table",
        "--out",
        str(out),
        "--cache-dir",
        str(tmp_path / "c"),
    ]
    assert main([*args, "--quiet"]) == 0
    profile = Profile.load(out)
    assert profile.extra["sliding"] == "compress"
    row = profile.at(0.8)  # [layers, kv heads]
    assert abs(row[0] - 0.8).max() * (16 - 1 - profile.sink - profile.window) > 0.99  # not 0.8
    cache = LUKVCache(
        0.8,
        scorer="keydiff",
        allocator="profile",
        allocator_kwargs={"profile": profile},
        sliding="compress",
        sink=profile.sink,
        window=profile.window,
        config=model.config,
    )
    with torch.no_grad():
        model(torch.randint(0, BYTE_VOCAB, (1, 60)), past_key_values=cache, use_cache=True)
    n = 16 - 1 - profile.sink - profile.window  # the sliding layer's evictable tokens: its window's
    protected = profile.sink + profile.window
    for head in range(model.config.num_key_value_heads):
        kept = cache.layers[0].head_tokens(0, head)[0].numel() - protected
        assert abs(kept - (1 - row[0, head]) * n) < 0.6, (head, kept, row[0, head])
    assert not np.allclose(profile.evict_ratio[:, 0], profile.grid[:, None], atol=0.02)
