"""Diagnostics: text summary, plots, loss decomposition, and the `lukv build` / `lukv show` commands."""

import numpy as np
import pytest

import lukv_cache.profiling.cli as profiling_cli
from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiling import build_profile
from lukv_cache.profiling.diagnostics import (
    METHODS,
    loss_decomposition,
    plot_curves,
    plot_heatmap,
    plot_loss_decomposition,
    profile_correlation,
    profile_summary,
)
from lukv_cache.testing import array_profile


def _profile():
    grid = np.array([0.2, 0.5, 0.8], dtype=np.float32)
    ratios = np.stack([np.full((3, 2), g) for g in grid]).astype(np.float32)
    ratios[:, 0, 0] -= 0.1
    ratios[:, 0, 1] += 0.1
    return array_profile(grid, ratios)


def test_summary_names_the_least_and_most_kept_heads():
    text = profile_summary(_profile(), [0.5])
    assert "org/tiny / keydiff" in text
    assert "min 0.400 (layer 0 head 1)" in text and "max 0.600 (layer 0 head 0)" in text


def test_heatmap_and_curves_render_to_png(tmp_path):
    plot_heatmap(_profile(), [0.5, 0.8]).savefig(tmp_path / "h.png")
    plot_curves(_profile()).savefig(tmp_path / "c.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "c.png").stat().st_size > 0


def test_missing_matplotlib_raises_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ConfigurationError, match="pip install"):
        plot_curves(_profile())


def test_loss_decomposition_floor_is_shared_and_lukv_beats_uniform_on_its_calibration(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    cache = tmp_path / "cache"
    profile = build_profile(
        tiny_model,
        byte_tokenizer,
        "keydiff",
        tiny_calibration,
        k_max=3,
        model_id="org/tiny",
        cache_dir=cache,
        show_progress=False,
    )
    d = loss_decomposition(tiny_model, byte_tokenizer, profile, tiny_calibration, ratio=0.8, cache_dir=cache)
    assert d.methods == METHODS and d.floor.shape == (len(METHODS), 2, 2)
    assert np.all(d.gap >= -1e-12) and np.all(d.floor >= 0)
    loss = (d.floor + d.gap).sum(axis=(1, 2))
    # LU-KV minimises the (relaxed) loss on exactly these questions; integer rounding aside it must win
    assert loss[0] <= loss[1] + 1e-6
    assert "uniform" in d.table()
    plot_loss_decomposition(d).savefig(tmp_path / "loss.png")


def test_lukv_build_and_show_commands(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(
        profiling_cli, "_load_model", lambda name: (tiny_model, byte_tokenizer, {"weights": "random"})
    )
    out = tmp_path / "profiles"
    code = main(
        [
            "build",
            "tiny",
            "--scorer",
            "keydiff",
            "--scorer",
            "knorm",
            "--out",
            str(out),
            "--k-max",
            "2",
            "--calibration",
            str(tiny_calibration),
            "--model-id",
            "org/tiny",
            "--cache-dir",
            str(tmp_path / "c"),
            "--quiet",
        ]
    )
    assert code == 0 and sorted(p.name for p in out.iterdir()) == ["keydiff.safetensors", "knorm.safetensors"]
    assert Profile.load(out / "knorm.safetensors").extra["weights"] == "random"
    assert (
        main(
            [
                "show",
                str(out / "keydiff.safetensors"),
                "--ratio",
                "0.8",
                "0.9",
                "--png",
                str(tmp_path / "p.png"),
            ]
        )
        == 0
    )
    shown = capsys.readouterr().out
    assert "ratio 0.80" in shown and "ratio 0.90" in shown and (tmp_path / "p-curves.png").exists()
    args = ["show", str(out / "knorm.safetensors"), "--ratio", "0.5", "--model", "tiny"]
    assert main([*args, "--calibration", str(tiny_calibration), "--cache-dir", str(tmp_path / "c")]) == 0
    assert "adakv" in capsys.readouterr().out


def test_lukv_build_with_two_scorers_and_one_file_is_an_error(tmp_path, capsys):
    assert (
        main(
            [
                "build",
                "x",
                "--scorer",
                "keydiff",
                "--scorer",
                "knorm",
                "--out",
                str(tmp_path / "a.safetensors"),
            ]
        )
        == 2
    )
    assert "folder" in capsys.readouterr().err


def test_profile_correlation_is_one_for_itself_and_minus_one_for_a_mirror():
    a = _profile()
    mirror = array_profile(a.grid, 2 * a.grid[:, None, None] - a.evict_ratio)
    assert profile_correlation(a, a, [0.5]) == {0.5: pytest.approx(1.0)}
    assert profile_correlation(a, mirror, [0.5])[0.5] == pytest.approx(-1.0)


def test_the_eviction_loss_ranks_the_oracle_allocation_above_random_ones(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    """The proxy of profile ablations (evicted oracle mass at a fixed total budget) must prefer budgets
    solved from the oracle itself to random budgets of the same total, on every question."""
    from lukv_cache.profiling.build import prepare_run
    from lukv_cache.profiling.diagnostics import head_losses
    from lukv_cache.profiling.solver import greedy_keep_counts, scorer_order_gains

    run = prepare_run(tiny_model, byte_tokenizer, tiny_calibration, k_max=3, cache_dir=tmp_path)
    rng = np.random.default_rng(0)
    for index in range(len(run.selected)):
        importance = run.oracle(index).astype(np.float64)  # [L, H, T]
        scores = importance + 1e-12 * rng.random(importance.shape)  # the oracle's own ranking
        layers, heads, t = importance.shape
        gains = scorer_order_gains(importance, scores).reshape(layers * heads, t)
        keep = greedy_keep_counts(gains, [0.7], 0.0)[0].reshape(layers, heads)
        oracle_loss = head_losses(importance, scores, keep)[0].sum()
        for _ in range(20):  # random budgets of the same total
            split = rng.multinomial(int(keep.sum()), np.full(layers * heads, 1 / (layers * heads)))
            random_keep = np.minimum(split, t).reshape(layers, heads)
            assert oracle_loss <= head_losses(importance, scores, random_keep)[0].sum() + 1e-12
