"""End-to-end profile building on a tiny random model."""

import dataclasses

import numpy as np
import pytest
import torch

import lukv_cache.profiling.build as build_module
from lukv_cache import build_profile
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiles.profile import Profile
from lukv_cache.profiling import build_profiles
from lukv_cache.profiling.kvzap_options import KVzapTraining
from lukv_cache.profiling.result_store import ResultStore


def test_end_to_end_build_gives_a_valid_profile(tiny_model, byte_tokenizer, tiny_calibration, tmp_path):
    profile = build_profile(
        tiny_model,
        byte_tokenizer,
        "keydiff",
        tiny_calibration,
        k_max=4,
        model_id="org/tiny",
        cache_dir=tmp_path / "cache",
        show_progress=False,
    )
    assert profile.evict_ratio.shape == (99, 2, 2)
    assert profile.evict_ratio.min() >= 0 and profile.evict_ratio.max() <= 1 - 0.01 + 1e-6
    # every question keeps round((1 - rho) * N) tokens, so the average over heads is rho
    np.testing.assert_allclose(profile.evict_ratio.mean(axis=(1, 2)), profile.grid, atol=0.01)
    assert (profile.model_id, profile.scorer, profile.window, profile.k_max) == ("org/tiny", "keydiff", 1, 4)
    assert profile.head_dim == 16 and "tiny.jsonl" in profile.calibration and profile.extra["questions"] == 3
    saved = Profile.load(profile.save(tmp_path / "keydiff.safetensors"))
    np.testing.assert_array_equal(saved.evict_ratio, profile.evict_ratio)


def test_several_scorers_share_one_oracle_pass(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch
):
    calls = []
    real = build_module.oracle_importances
    monkeypatch.setattr(
        build_module,
        "oracle_importances",
        lambda m, s, questions, **k: calls.append(len(questions)) or real(m, s, questions, **k),
    )
    profiles = build_profiles(
        tiny_model,
        byte_tokenizer,
        ["keydiff", "snapkv", "knorm"],
        tiny_calibration,
        k_max=3,
        model_id="org/tiny",
        cache_dir=False,
        show_progress=False,
    )
    assert sorted(profiles) == ["keydiff", "knorm", "snapkv"] and calls == [3]  # one batch of 3 questions
    assert profiles["snapkv"].window == 32 and profiles["snapkv"].scorer_params == {"kernel_size": 5}
    assert not np.allclose(profiles["keydiff"].evict_ratio, profiles["knorm"].evict_ratio)


def test_interrupted_build_resumes_from_cached_questions(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch
):
    calls = []
    real = build_module.oracle_importances

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user stops the build during the third question
        return real(*args, **kwargs)

    kwargs = dict(k_max=3, model_id="org/tiny", cache_dir=tmp_path / "cache", show_progress=False)
    monkeypatch.setattr(build_module, "ORACLE_BATCH_BYTES", 1)  # a batch per question
    monkeypatch.setattr(build_module, "oracle_importances", flaky)
    with pytest.raises(KeyboardInterrupt):
        build_profile(tiny_model, byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    resumed = build_profile(tiny_model, byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    assert len(calls) == 4  # only the third question was decoded again
    monkeypatch.setattr(build_module, "oracle_importances", real)
    fresh = build_profile(
        tiny_model, byte_tokenizer, "keydiff", tiny_calibration, **{**kwargs, "cache_dir": False}
    )
    np.testing.assert_array_equal(resumed.evict_ratio, fresh.evict_ratio)


def test_cached_results_of_another_model_are_not_reused(
    make_tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    kwargs = dict(k_max=3, model_id="org/tiny", cache_dir=tmp_path / "cache", show_progress=False)
    a = build_profile(make_tiny_model(seed=0), byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    b = build_profile(make_tiny_model(seed=5), byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    assert not np.array_equal(a.evict_ratio, b.evict_ratio)
    assert len(list((tmp_path / "cache").iterdir())) == 2


def test_build_is_deterministic_with_a_seeded_question_subset(
    tiny_model, byte_tokenizer, tmp_path, calibration_writer
):
    path = calibration_writer(tmp_path / "six.jsonl", n_questions=6)
    kwargs = dict(k_max=2, model_id="org/tiny", cache_dir=False, show_progress=False, max_questions=2, seed=3)
    a = build_profile(tiny_model, byte_tokenizer, "knorm", path, **kwargs)
    b = build_profile(tiny_model, byte_tokenizer, "knorm", path, **kwargs)
    np.testing.assert_array_equal(a.evict_ratio, b.evict_ratio)
    assert (
        a.extra["question_indices"] == b.extra["question_indices"] and len(a.extra["question_indices"]) == 2
    )


def test_settings_and_keywords_are_one_set_of_options(
    tiny_model, byte_tokenizer, tmp_path, calibration_writer
):
    from lukv_cache.profiling import BuildSettings

    path = calibration_writer(tmp_path / "six.jsonl", n_questions=6)
    settings = BuildSettings(
        k_max=2, model_id="org/tiny", cache_dir=False, show_progress=False, max_questions=2
    )
    by_keywords = build_profile(tiny_model, byte_tokenizer, "knorm", path, **dataclasses.asdict(settings))
    by_settings = build_profile(tiny_model, byte_tokenizer, "knorm", path, settings=settings)
    np.testing.assert_array_equal(by_settings.evict_ratio, by_keywords.evict_ratio)
    # a keyword wins over the settings' field
    other = build_profile(tiny_model, byte_tokenizer, "knorm", path, settings=settings, model_id="org/other")
    assert (other.model_id, by_settings.model_id) == ("org/other", "org/tiny")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kmax=2), "no option 'kmax'; its options are BuildSettings' fields: k_max, aggregate"),
        (dict(scope="heads"), "scope must be 'all' or 'layer'"),
        (dict(sink=-1), "sink and window must be >= 0"),
    ],
)
def test_an_unknown_or_bad_build_option_is_refused_before_any_work(options, message, byte_tokenizer):
    with pytest.raises(ConfigurationError, match=message):
        build_profile(None, byte_tokenizer, "keydiff", **options)  # no model needed to refuse


def test_model_without_name_needs_model_id(tiny_model, byte_tokenizer, tiny_calibration):
    with pytest.raises(ConfigurationError, match="model_id"):
        build_profile(
            tiny_model, byte_tokenizer, "keydiff", tiny_calibration, cache_dir=False, show_progress=False
        )


def test_context_too_long_for_the_model_raises(make_tiny_model, byte_tokenizer, tmp_path, calibration_writer):
    path = calibration_writer(tmp_path / "long.jsonl", context="x" * 600)
    with pytest.raises(ConfigurationError, match="positions"):
        build_profile(make_tiny_model(), byte_tokenizer, "keydiff", path, model_id="o/t", cache_dir=False)


def test_sliding_window_layers_keep_the_global_ratio(byte_tokenizer, tiny_calibration):
    from lukv_cache.testing import BYTE_VOCAB, tiny_model

    # layer 0 slides over 16 tokens, layer 1 is full
    model = tiny_model("gemma2", attn="eager", vocab_size=BYTE_VOCAB, num_hidden_layers=2, sliding_window=16)
    profile = build_profile(
        model,
        byte_tokenizer,
        "keydiff",
        tiny_calibration,
        k_max=2,
        model_id="org/gemma",
        cache_dir=False,
        show_progress=False,
    )
    np.testing.assert_allclose(profile.evict_ratio[:, 0], np.repeat(profile.grid[:, None], 2, axis=1))
    np.testing.assert_allclose(profile.evict_ratio[:, 1].mean(axis=1), profile.grid, atol=0.02)


def test_a_profile_across_layer_kinds_shares_one_budget(byte_tokenizer, tiny_calibration):
    """sliding="compress": the sliding layer's heads are optimised too, over the window they hold; the kept
    tokens over both kinds are the ratio's, each head counted by its own number of evictable tokens."""
    from lukv_cache.testing import BYTE_VOCAB, tiny_model

    model = tiny_model("gemma2", attn="eager", vocab_size=BYTE_VOCAB, num_hidden_layers=2, sliding_window=16)
    kwargs = dict(k_max=2, model_id="org/gemma", cache_dir=False, show_progress=False, memory_table=False)
    profile = build_profile(model, byte_tokenizer, "keydiff", tiny_calibration, sliding="compress", **kwargs)
    assert profile.extra["sliding"] == "compress"
    t = profile.extra["context_tokens"]
    n = np.array([16 - 1 - profile.sink - profile.window, t - profile.sink - profile.window], dtype=float)
    kept = ((1 - profile.evict_ratio) * n[None, :, None]).sum(axis=(1, 2))  # averaged over questions
    low = profile.grid <= 0.9  # above, each head's one kept token is more than the ratio leaves
    np.testing.assert_allclose(kept[low], (1 - profile.grid[low]) * 2 * n.sum(), rtol=0.02, atol=1.0)
    assert not np.allclose(profile.evict_ratio[:, 0], profile.grid[:, None], atol=0.02)
    keep = build_profile(model, byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    assert keep.extra["sliding"] == "keep"
    np.testing.assert_allclose(keep.evict_ratio[:, 0], np.repeat(keep.grid[:, None], 2, axis=1))


def test_a_kvzip_profile_builds_from_the_caches_own_reconstruction_scores(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    from lukv_cache.profiling import prefill_scores

    profile = build_profile(
        tiny_model,
        byte_tokenizer,
        "kvzip",
        tiny_calibration,
        k_max=4,
        cache_dir=tmp_path,
        show_progress=False,
        model_id="org/tiny",
    )
    assert profile.scorer == "kvzip" and profile.scorer_params["reconstruction"]["chunk_size"] == 2048
    assert profile.evict_ratio.shape == (99, 2, 2)
    # the ranking it was solved with is the cache's own: the same scores prefill_scores returns
    run_scores = build_module.prepare_run(tiny_model, byte_tokenizer, tiny_calibration, cache_dir=tmp_path)
    from lukv_cache.scorers import get_scorer

    cached = run_scores.scores(get_scorer("kvzip"))
    direct = prefill_scores(tiny_model, run_scores.context_ids, "kvzip", tokenizer=byte_tokenizer)
    for layer, scores in cached.items():
        np.testing.assert_allclose(scores, direct[layer][0].numpy(), rtol=1e-5, atol=1e-7)


def test_a_cached_oracle_without_importance_or_with_nan_is_recomputed(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path
):
    from safetensors.numpy import load_file, save_file

    kwargs = dict(k_max=3, model_id="org/tiny", cache_dir=tmp_path, show_progress=False)
    first = build_profile(tiny_model, byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    oracles = sorted(tmp_path.rglob("oracle-*.safetensors"))
    assert oracles
    broken = load_file(oracles[0])
    save_file({"importance": np.full_like(broken["importance"], np.nan)}, oracles[0])
    save_file({"answer": broken["answer"]}, oracles[1])  # no importance at all
    again = build_profile(tiny_model, byte_tokenizer, "keydiff", tiny_calibration, **kwargs)
    np.testing.assert_allclose(again.evict_ratio, first.evict_ratio)
    assert np.isfinite(load_file(oracles[0])["importance"]).all() and "importance" in load_file(oracles[1])


def test_stale_temporary_files_of_a_dead_build_are_removed_on_the_next_run(tmp_path):
    import os

    store_dir = tmp_path / "store"
    store_dir.mkdir()
    dead = store_dir / ".oracle-x.safetensors.999999999.tmp"  # no such process
    alive = store_dir / f".oracle-y.safetensors.{os.getpid()}.tmp"  # a running build's
    dead.write_bytes(b"half")
    alive.write_bytes(b"half")
    ResultStore(store_dir)
    assert not dead.exists() and alive.exists()


def test_a_kvzap_build_learns_its_surrogate_stores_it_and_resumes(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch
):
    """`lukv build --scorer kvzap` end to end on a tiny model: the surrogate is trained (KVzip targets
    from the news corpus), stored in the profile, read back by from_pretrained; a second build reuses the
    cached targets (no repeat pass runs again)."""
    from lukv_cache import LUKVCache
    from lukv_cache.profiling import kvzap

    tiny_model.config.name_or_path = "org/tiny"
    kwargs = dict(scorer="kvzap", calibration=tiny_calibration, cache_dir=tmp_path / "c", show_progress=False)
    training = KVzapTraining(
        documents=((2, 64), (1, 96)), corpora=("news", "python_docs"), length="interactions"
    )
    profile = build_profile(tiny_model, byte_tokenizer, kvzap=training, **kwargs)
    assert profile.scorer == "kvzap" and profile.window == 32 and profile.surrogate is not None
    assert profile.surrogate.layers == [0, 1] and profile.surrogate.family == "mlp"  # the default
    assert profile.surrogate.hidden_weight.shape[1] == 128
    assert not list((tmp_path / "c").glob("kvzap-rows-*"))  # the MLP's rows waited on disk, then went
    assert profile.surrogate.features == "keys_prerope_values+window_attention+log_length+interactions"
    assert profile.surrogate.meta["corpus"] == "news, python_docs: 2 x 64 + 1 x 96 tokens (3 documents)"
    path = profile.save(tmp_path / "kvzap.safetensors")
    cache = LUKVCache.from_pretrained(path, ratio=0.5)
    with torch.no_grad():
        tiny_model(torch.randint(3, 128, (1, 90)), past_key_values=cache)
    assert cache.is_compressed

    def no_repeat_pass(*args, **kwargs):
        raise AssertionError("the targets were cached")

    monkeypatch.setattr(kvzap, "kvzip_targets", no_repeat_pass)
    again = build_profile(tiny_model, byte_tokenizer, kvzap=training, **kwargs)
    assert torch.equal(again.surrogate.weight, profile.surrogate.weight)
    assert again.surrogate.meta["target"] == "kvzip"  # the default
    # KVzip+'s scores are another target: cached apart, so the cached KVzip ones are not reused
    with pytest.raises(AssertionError, match="were cached"):
        build_profile(
            tiny_model, byte_tokenizer, kvzap=dataclasses.replace(training, target="kvzip_plus"), **kwargs
        )


def test_lukv_build_reads_kvzap_document_groups_corpora_and_family(capsys):
    from lukv_cache.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(
        [
            "build",
            "smollm2",
            "--out",
            "p/",
            "--scorer",
            "kvzap",
            "--kvzap-documents",
            "48x1024",
            "8X4096",
            "16",
        ]
        + ["--kvzap-corpus", "news", "python_docs", "--kvzap-family", "mlp", "--kvzap-length", "log"]
        + ["--no-kvzap-window-attention", "--kvzap-hidden", "128", "--kvzap-target", "kvzip_plus"]
    )
    assert args.kvzap_documents == [(48, 1024), (8, 4096), (16, 1024)]
    assert args.kvzap_corpus == ["news", "python_docs"] and args.kvzap_family == "mlp"
    assert args.kvzap_length == "log" and args.kvzap_window_attention is False and args.kvzap_hidden == 128
    assert args.kvzap_target == "kvzip_plus"
    assert parser.parse_args(["build", "smollm2", "--out", "p/"]).kvzap_window_attention is True
    assert KVzapTraining(length="log", window_attention=False).features == "keys_prerope_values+log_length"
    with pytest.raises(ConfigurationError, match="needs length='interactions'"):
        KVzapTraining(length="log")  # the window attention (on by default) comes with the interactions
    for bad in (["--kvzap-documents", "8x"], ["--kvzap-documents", "0x1024"], ["--kvzap-family", "tree"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["build", "smollm2", "--out", "p/", *bad])
    assert "kvzap" in capsys.readouterr().err
    with pytest.raises(ConfigurationError, match=r"\(count, tokens\) pairs"):
        KVzapTraining(documents=((8, 2),))
    with pytest.raises(ConfigurationError, match="distinct names"):
        KVzapTraining(corpora=("news", "novels"))


def test_a_kvzap_build_refuses_training_options_of_another_type(tiny_model, byte_tokenizer, tiny_calibration):
    with pytest.raises(ConfigurationError, match="kvzap must be a KVzapTraining, got int"):
        build_profile(
            tiny_model,
            byte_tokenizer,
            scorer="kvzap",
            calibration=tiny_calibration,
            show_progress=False,
            kvzap=48,
        )


def test_a_kvzap_build_sweeps_spill_folders_no_live_build_owns():
    """An interrupted build's row folders (<cache-dir>/kvzap-rows-*) go at the next build, unless the
    build named in them still runs; folders of the release before (no pid in the name) count as stale."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from lukv_cache.profiling.spills import spill_folder

    root = Path(tempfile.mkdtemp())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = [root / "kvzap-rows-ab12cd_e", root / f"kvzap-rows-{dead.pid}-x1y2z3"]
    live = root / f"kvzap-rows-{os.getpid()}-q9w8e7"
    for folder in (*stale, live):
        folder.mkdir()
        (folder / "0.x").write_bytes(b"\0" * 64)
    with spill_folder(root) as folder:
        assert folder.parent == root and folder.name.startswith(f"kvzap-rows-{os.getpid()}-")
        assert not any(p.exists() for p in stale) and live.exists()
    assert not folder.exists() and live.exists()


def test_a_kvzap_build_stopped_by_sigterm_removes_its_spill_folder(tmp_path):
    import signal
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from lukv_cache.profiling.spills import spill_folder\n"
        "with spill_folder(Path(sys.argv[1])) as folder:\n"
        "    (folder / '0.x').write_bytes(b'rows')\n"
        "    print(folder, flush=True)\n"
        "    time.sleep(120)\n"
    )
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        folder = Path(child.stdout.readline().strip())
        assert folder.is_dir()
        child.send_signal(signal.SIGTERM)
        assert child.wait(timeout=60) == -signal.SIGTERM  # still dies of the signal
    finally:
        child.kill()
    assert not folder.exists() and not list(tmp_path.glob("kvzap-rows-*"))


def test_prefill_runs_once_and_the_oracle_continues_it(
    tiny_model, byte_tokenizer, tiny_calibration, tmp_path, monkeypatch
):
    run = build_module.prepare_run(tiny_model, byte_tokenizer, tiny_calibration, k_max=3, cache_dir=tmp_path)
    calls = []
    real = build_module.prefill_context
    monkeypatch.setattr(build_module, "prefill_context", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    run.prefill()
    assert run.prefill_seconds > 0
    run.prefill()
    run.oracle(0)  # decoded from the context prefilled above
    assert len(calls) == 1


@pytest.mark.parametrize("scorer", ["keydiff", "snapkv", "expected_attention", "knorm"])
def test_scores_replayed_from_the_oracle_prefill_equal_a_prefill_of_their_own(tiny_model, scorer):
    from lukv_cache.profiling.oracle import prefill_context
    from lukv_cache.profiling.scores import prefill_scores, replayed_scores

    ids = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    state = prefill_context(tiny_model, ids, queries=build_module.RECORDED_QUERIES)
    replayed = replayed_scores(
        state.recorded(tiny_model.config._attn_implementation), scorer, tiny_model.config
    )
    own = prefill_scores(tiny_model, ids, scorer)
    assert len(replayed) == len(own) and all(s is not None for s in own)
    for a, b in zip(replayed, own, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_build_prefills_the_calibration_context_once_for_the_oracle_and_every_scorer(
    tiny_model, byte_tokenizer, tiny_calibration
):
    run = build_module.prepare_run(tiny_model, byte_tokenizer, tiny_calibration, k_max=3, cache_dir=False)
    contexts = []
    hook = tiny_model.register_forward_pre_hook(
        lambda module, args, kwargs: (
            contexts.append(1)
            if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] == run.context_len
            else None
        ),
        with_kwargs=True,
    )
    try:
        build_profiles(
            tiny_model,
            byte_tokenizer,
            ["keydiff", "snapkv"],
            tiny_calibration,
            k_max=3,
            model_id="org/tiny",
            cache_dir=False,
            show_progress=False,
            memory_table=False,
        )
    finally:
        hook.remove()
    assert contexts == [1]
