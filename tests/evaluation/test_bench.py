import json

import pytest
import torch
from demo_helpers import tiny_profile

from lukv_cache import LUKVCache
from lukv_cache.errors import ProfileNotFoundError
from lukv_cache.evaluation.methods import Method, build_methods, make_cache
from lukv_cache.evaluation.prefill import SharedPrefill
from lukv_cache.evaluation.report import write_results
from lukv_cache.evaluation.runner import BenchSettings, run_benchmark
from lukv_cache.profiles import save_to_local_dir


def _next_logits(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits


@pytest.mark.parametrize(
    "method",
    [
        Method("uniform", "keydiff", 0.5),
        Method("adakv", "snapkv", 0.8),
        Method("pyramid", "expected_attention", 0.25),
        Method("uniform", "knorm", 0.9),
    ],
    ids=lambda m: m.name,
)
def test_replayed_shared_prefill_equals_a_real_prefill(model, method):
    torch.manual_seed(1)
    context = torch.randint(0, 256, (1, 160))
    question = torch.randint(0, 256, (1, 7))
    shared = SharedPrefill.record(model, context, n_queries=64)

    real = make_cache(method, model)
    with torch.no_grad():
        real_logits = model(input_ids=context, past_key_values=real, use_cache=True).logits[:, -1]
    replayed = shared.cache_for(method, model)

    assert torch.equal(replayed.stored_tokens(), real.stored_tokens())
    assert replayed.memory_bytes() == real.memory_bytes()
    assert torch.allclose(shared.last_logits, real_logits, atol=1e-5)
    assert torch.allclose(
        _next_logits(model, replayed, question), _next_logits(model, real, question), atol=1e-5
    )


@pytest.mark.parametrize("allocator", ["global", "uniform"])
def test_replayed_kvzip_with_shared_scores_equals_a_real_kvzip_prefill(model, tokenizer, allocator):
    torch.manual_seed(2)
    context = torch.randint(0, 256, (1, 120))
    question = torch.randint(0, 256, (1, 5))
    method = Method(allocator, "kvzip", 0.8)
    shared = SharedPrefill.record(model, context, n_queries=2)
    scores = shared.reconstruction_scores(model, tokenizer, "kvzip", context)
    replayed = shared.cache_for(method, model, scores=scores)
    real = make_cache(method, model)
    real.prefill(model, context, tokenizer=tokenizer)
    assert torch.equal(replayed.stored_tokens(), real.stored_tokens())
    assert torch.allclose(
        _next_logits(model, replayed, question), _next_logits(model, real, question), atol=1e-5
    )


def test_full_method_replay_holds_the_whole_context(model):
    context = torch.randint(0, 256, (1, 90))
    cache = SharedPrefill.record(model, context, n_queries=2).cache_for(Method("full"), model)
    assert cache.get_seq_length() == 90
    assert all(layer.keys.shape[-2] == 90 for layer in cache.layers)


def test_the_full_method_is_the_models_own_cache_with_its_windows():
    """A sliding-window model's full cache holds each window only, as generate's own cache does (built
    without the config every layer held the whole context: a Gemma's bytes counted about 1.7x at 1k)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from lukv_cache.testing import prompt, tiny_model

    gemma = tiny_model("gemma3")  # windows of 8 on layers 0 and 2
    cache = make_cache(Method("full"), gemma)
    with torch.no_grad():
        gemma(prompt(1, 30), past_key_values=cache)
    assert [type(layer) is DynamicSlidingWindowLayer for layer in cache.layers] == [True, False, True]
    assert [layer.keys.shape[-2] for layer in cache.layers] == [7, 30, 7]


def test_recording_restores_the_attention_implementation(model):
    SharedPrefill.record(model, torch.randint(0, 256, (1, 40)), n_queries=8)
    assert model.config._attn_implementation == "sdpa"


def test_profile_method_without_a_profile_file_raises_profile_not_found(model, tmp_path):
    with pytest.raises(ProfileNotFoundError, match="lukv build"):
        make_cache(Method("profile", "keydiff", 0.8), model, tmp_path)


def test_profile_method_uses_the_local_profile_budgets(model, tmp_path):
    save_to_local_dir(tiny_profile(model), tmp_path)
    cache = make_cache(Method("profile", "keydiff", 0.5), model, tmp_path)
    assert isinstance(cache, LUKVCache) and cache.allocator_name == "profile"
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (1, 200)), past_key_values=cache, use_cache=True)
    stored = cache.stored_tokens()[:, 0]  # [layers, heads]
    assert (stored[:, 0] < stored[:, 1]).all()  # the tilted profile gives head 0 fewer tokens


def test_build_methods_puts_the_full_cache_first():
    names = [m.name for m in build_methods(["uniform", "adakv"], ["keydiff"], [0.5, 0.8])]
    assert names == [
        "full",
        "uniform/keydiff@0.5",
        "uniform/keydiff@0.8",
        "adakv/keydiff@0.5",
        "adakv/keydiff@0.8",
    ]


def test_benchmark_writes_markdown_json_and_plot_with_counts_and_errors(model, tokenizer, articles, tmp_path):
    save_to_local_dir(tiny_profile(model), tmp_path / "profiles")
    settings = BenchSettings(
        tasks=("niah_multikey", "continuation"),
        samples=2,
        context_tokens=200,
        ratios=(0.5,),
        scorers=("keydiff", "snapkv"),
        allocators=("uniform", "profile", "hybrid"),
        needles=2,
        continuation_tokens=8,
        profiles_dir=str(tmp_path / "profiles"),
    )
    results = run_benchmark(model, tokenizer, settings, articles=articles, log=None)
    results.command = "lukv bench --samples 2"
    paths = write_results(results, tmp_path / "out", "smoke")

    data = json.loads(paths["json"].read_text())
    assert data["command"] == "lukv bench --samples 2"
    assert set(data["skipped"]) == {"profile/snapkv@0.5", "hybrid/snapkv@0.5"}  # no snapkv profile
    rows = {(r["task"], r["method"]): r for r in data["results"]}
    assert set(rows) == {
        (t, m)
        for t in settings.tasks
        for m in (
            "full",
            "uniform/keydiff@0.5",
            "uniform/snapkv@0.5",
            "profile/keydiff@0.5",
            "hybrid/keydiff@0.5",
        )
    }
    multikey = rows[("niah_multikey", "uniform/keydiff@0.5")]
    assert multikey["n_samples"] == 2 and multikey["n_questions"] == 4
    assert multikey["ci95"][0] <= multikey["mean"] <= multikey["ci95"][1]
    assert multikey["kv_bytes_mean"] < rows[("niah_multikey", "full")]["kv_bytes_mean"]
    assert rows[("continuation", "full")]["excess_nll"]["mean"] == 0.0
    assert "excess_nll" in rows[("continuation", "profile/keydiff@0.5")]
    hybrid = rows[("niah_multikey", "hybrid/keydiff@0.5")]  # same memory as the profile it spreads
    assert hybrid["kv_bytes_mean"] == rows[("niah_multikey", "profile/keydiff@0.5")]["kv_bytes_mean"]

    markdown = paths["md"].read_text()
    assert "Command: `lukv bench --samples 2`" in markdown
    assert "| uniform | keydiff |" in markdown and "| profile | keydiff |" in markdown
    assert paths["png"].stat().st_size > 1000
