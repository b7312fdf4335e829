"""``lukv build --scorer kvzap`` refuses every ``--kvzap-*`` option (and combination) it cannot train with,
before the model's weights load: one ``error:`` line, exit code 2."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from lukv_cache import models
from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.profiling import cli as profiling_cli
from lukv_cache.profiling.kvzap_options import (
    MAX_HIDDEN,
    MIN_TOKENS,
    THRESHOLD_WINDOW,
    KVzapTraining,
    _shape,
)


@pytest.fixture
def no_weights(monkeypatch, tiny_model, byte_tokenizer):
    """The model's config and tokenizer are cheap and allowed; its weights are not."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the kvzap options were checked")

    monkeypatch.setattr(profiling_cli, "_load_model", load_model)
    monkeypatch.setattr(models, "load_config", lambda name: tiny_model.config)
    monkeypatch.setattr(models, "load_tokenizer", lambda name: byte_tokenizer)


@pytest.mark.parametrize(
    "options,message",
    [
        (["--kvzap-documents", "2x36"], f"at least {MIN_TOKENS}"),
        (["--kvzap-documents", "2x5"], f"at least {MIN_TOKENS}"),
        (["--kvzap-hidden", "1000000000"], f"at most {MAX_HIDDEN}"),
        (["--kvzap-hidden", "70000"], f"at most {MAX_HIDDEN}"),
        (["--kvzap-length", "log"], "needs length='interactions'"),  # the window attention's default
        (["--kvzap-documents", "5000x400"], "corpus holds"),
    ],
)
def test_bad_kvzap_options_are_refused_before_the_weights_load(
    options, message, tmp_path, no_weights, capsys
):
    args = ["build", "tiny", "--scorer", "kvzap", "--out", str(tmp_path / "o"), "--cache-dir", str(tmp_path)]
    assert main([*args, *options]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err


def test_the_shortest_documents_allowed_give_score_thresholds(tiny_model):
    """A document of MIN_TOKENS tokens still has one token between the sinks and the window for the
    thresholds' quantiles (one fewer and the build died after training: quantile of an empty tensor)."""
    import torch

    from lukv_cache.profiling.kvzap import score_thresholds, train_surrogate
    from lukv_cache.scorers.kvzip import RepeatPrompt

    model = tiny_model
    docs = [
        torch.randint(2, 120, (1, MIN_TOKENS), generator=torch.Generator().manual_seed(s)) for s in range(2)
    ]
    prompt = RepeatPrompt(first=(5, 6, 7), next=(8, 9), suffix=(10,))
    surrogate = train_surrogate(model, prompt, docs, family="linear")
    table = score_thresholds(model, surrogate, docs, [0.5], THRESHOLD_WINDOW)
    assert len(table["values"]) == 1
    KVzapTraining(documents=((2, MIN_TOKENS),))
    with pytest.raises(ConfigurationError, match=f"at least {MIN_TOKENS}"):
        KVzapTraining(documents=((2, MIN_TOKENS - 1),))


def test_the_options_limits_agree_with_the_scorer_and_the_profile_format(tiny_model):
    from lukv_cache.profiles.surrogate import _MAX_HIDDEN
    from lukv_cache.scorers.kvzap import FEATURE_SETS, KVZAP_WINDOW, base_features, input_size

    assert THRESHOLD_WINDOW == KVZAP_WINDOW and MAX_HIDDEN == _MAX_HIDDEN
    config = tiny_model.config
    for features in FEATURE_SETS:
        assert _shape(config, features) == (2, 2, input_size(features, base_features(features, 2, 16)))


def test_a_surrogate_too_big_for_memory_or_rows_too_big_for_the_disk_are_refused():
    big = LlamaConfig(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
    )
    training = KVzapTraining(hidden=MAX_HIDDEN)
    need = training.footprint(big)
    with pytest.raises(ConfigurationError, match="GiB of memory.*--kvzap-hidden"):
        training.check_for(big, memory=need["surrogate"])
    with pytest.raises(ConfigurationError, match="spills .* GiB"):
        KVzapTraining().check_for(big, free_disk=4 * 2**30, memory=2**50)
    KVzapTraining().check_for(big, free_disk=8 * 2**30, memory=2**50)  # 6.0 GiB of rows
    with pytest.raises(ConfigurationError, match="positions"):
        KVzapTraining().check_for(LlamaConfig(max_position_embeddings=16), memory=2**50)
