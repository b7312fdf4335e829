"""Streamed oracle importance against a direct eager computation."""

import numpy as np
import pytest
import torch

from lukv_cache.profiling.oracle import oracle_importance, oracle_importances, prefill_context
from lukv_cache.testing import tiny_model


def _direct_oracle(model, context, question, answer, layers=None):
    """I[l,h,j] from the full eager attention weights of context + question + answer: the max over steps."""
    return _direct_steps(model, context, question, answer, layers).max(axis=0)


def test_streamed_oracle_matches_direct_eager_computation(tiny_model):
    model = tiny_model
    context, question = torch.randint(0, 128, (1, 48)), torch.randint(0, 128, (1, 6))
    state = prefill_context(model, context)
    importance, answer = oracle_importance(model, state, question, k_max=7)
    assert len(answer) == 7 and importance.shape == (2, 2, 48)
    expected = _direct_oracle(model, context, question, answer)
    np.testing.assert_allclose(importance, expected, rtol=1e-4, atol=1e-9)
    assert importance.max() > 0


def test_oracle_with_logit_softcap_and_sliding_layers_matches_eager_on_full_layers():
    # layer 0 slides over 16 tokens, layer 1 is full; both softcap their logits
    model = tiny_model("gemma2", attn="eager", num_hidden_layers=2, sliding_window=16)
    context, question = torch.randint(0, 128, (1, 40)), torch.randint(0, 128, (1, 5))
    importance, answer = oracle_importance(model, prefill_context(model, context), question, k_max=4)
    assert not importance[0].any()  # a sliding layer is never compressed: nothing recorded
    expected = _direct_oracle(model, context, question, answer, layers=[1])
    np.testing.assert_allclose(importance[1], expected[1], rtol=1e-4, atol=1e-9)


def test_sliding_layers_recorded_over_their_window_match_eager():
    """sliding=True: a sliding layer's importance is its newest query's eager attention over the context
    tokens still in its window at that step (zero before it), times the same value norms as a full layer."""
    model = tiny_model("gemma2", attn="eager", num_hidden_layers=2, sliding_window=16)
    context, question = torch.randint(0, 128, (1, 40)), torch.randint(0, 128, (1, 5))
    state = prefill_context(model, context)
    importance, answer = oracle_importance(model, state, question, k_max=6, sliding=True)
    plain, same = oracle_importance(model, state, question, k_max=6)
    assert answer == same
    np.testing.assert_array_equal(importance[1], plain[1])  # the full layer: as before
    t, q = 40, 5
    first = t + q - 16  # the first question token's window: 15 keys before it
    assert not importance[0, :, :first].any() and importance[0, :, first:].min() > 0
    eager = type(model)(model.config)
    eager.load_state_dict(model.state_dict())
    full = torch.cat([context, question, torch.tensor([answer[:-1]])], dim=1)
    with torch.no_grad():
        attn = eager.eval()(full, output_attentions=True).attentions[0][0, :, t + q - 1 :, :t]  # [Hq, K, T]
    contrib = attn * state.value_norms[0][:, None, :]
    hkv = model.config.num_key_value_heads
    expected = contrib.view(hkv, -1, *contrib.shape[1:]).amax(dim=1).amax(dim=1).numpy()
    np.testing.assert_allclose(importance[0], expected, rtol=1e-4, atol=1e-9)


def test_sliding_layers_under_sdpa_masks_match_eager():
    """Gemma-3 (no softcap): the oracle's sdpa path reads transformers' sliding-window masks; a question of
    several tokens gets a real mask there, whose last row must be the newest query's."""
    model = tiny_model("gemma3", num_hidden_layers=3, sliding_window=16)
    context, question = torch.randint(0, 128, (1, 40)), torch.randint(0, 128, (1, 6))
    state = prefill_context(model, context)
    importance, answer = oracle_importance(model, state, question, k_max=5, sliding=True)
    t, q = 40, 6
    eager = type(model)(model.config)
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    full = torch.cat([context, question, torch.tensor([answer[:-1]])], dim=1)
    with torch.no_grad():
        attentions = eager.eval()(full, output_attentions=True).attentions
    hkv = model.config.num_key_value_heads
    for layer in range(3):
        attn = attentions[layer][0, :, t + q - 1 :, :t]  # [Hq, K, T]
        contrib = attn * state.value_norms[layer][:, None, :]
        expected = contrib.view(hkv, -1, *contrib.shape[1:]).amax(dim=1).amax(dim=1).numpy()
        np.testing.assert_allclose(importance[layer], expected, rtol=1e-4, atol=1e-9)
    assert not importance[0, :, : t + q - 16].any() and importance[1, :, :10].any()  # sliding / full


def test_oracle_answer_is_the_greedy_generation(make_tiny_model):
    model = make_tiny_model(seed=1)
    context, question = torch.randint(0, 128, (1, 30)), torch.randint(0, 128, (1, 4))
    _, answer = oracle_importance(model, prefill_context(model, context), question, k_max=5)
    generated = model.generate(
        torch.cat([context, question], 1), max_new_tokens=5, do_sample=False, pad_token_id=0
    )
    assert answer == generated[0, 34:].tolist()


def test_oracle_leaves_the_model_attention_implementation_unchanged(tiny_model):
    model = tiny_model
    before = model.config._attn_implementation
    oracle_importance(
        model, prefill_context(model, torch.randint(0, 128, (1, 20))), torch.ones(1, 2).long(), k_max=2
    )
    assert model.config._attn_implementation == before


def test_context_cache_is_not_modified_by_a_question(tiny_model):
    model = tiny_model
    state = prefill_context(model, torch.randint(0, 128, (1, 20)))
    first, _ = oracle_importance(model, state, torch.tensor([[5, 6, 7]]), k_max=3)
    assert state.cache.get_seq_length() == 20
    again, _ = oracle_importance(model, state, torch.tensor([[5, 6, 7]]), k_max=3)
    np.testing.assert_array_equal(first, again)


def test_mean_aggregate_is_the_mean_over_decode_steps_of_the_direct_computation(tiny_model):
    model = tiny_model
    context, question = torch.randint(0, 128, (1, 40)), torch.randint(0, 128, (1, 5))
    state = prefill_context(model, context)
    mean, answer = oracle_importance(model, state, question, k_max=6, aggregate="mean")
    peak, same_answer = oracle_importance(model, state, question, k_max=6)
    assert answer == same_answer
    eager_rows = _direct_steps(model, context, question, answer)  # [K, L, H_kv, T]
    np.testing.assert_allclose(peak, eager_rows.max(0), rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(mean, eager_rows.mean(0), rtol=1e-4, atol=1e-9)
    assert (mean <= peak + 1e-9).all() and (mean < peak - 1e-7).any()


def _direct_steps(model, context, question, answer, layers=None):
    """Per decode step k, from one eager forward of context + question + answer with its attention weights:
    max over the GQA group of A[k] * ||v W_O|| / Z, ``[K, L, H_kv, T]`` (zero for layers not listed)."""
    eager = type(model)(model.config)
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    t, q = context.shape[1], question.shape[1]
    full = torch.cat([context, question, torch.tensor([answer[:-1]])], dim=1)
    with torch.no_grad():
        out = eager.eval()(full, output_attentions=True, use_cache=True)
    cfg = model.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    steps = np.zeros((len(answer), cfg.num_hidden_layers, hkv, t), dtype=np.float32)
    for layer in range(cfg.num_hidden_layers) if layers is None else layers:
        attn = out.attentions[layer][0, :, t + q - 1 : t + q - 1 + len(answer), :t]  # [Hq, K, T]
        values = out.past_key_values.layers[layer].values[0, :, :t]
        w_o = eager.model.layers[layer].self_attn.o_proj.weight
        norms = torch.stack(
            [(values[h // (hq // hkv)] @ w_o[:, h * d : (h + 1) * d].T).norm(dim=-1) for h in range(hq)]
        )
        contrib = attn * (norms / norms.sum())[:, None]  # [Hq, K, T]
        steps[:, layer] = (
            contrib.view(hkv, hq // hkv, len(answer), t).amax(dim=1).transpose(0, 1).detach().numpy()
        )
    return steps


def test_unknown_aggregate_is_a_configuration_error(tiny_model):
    import pytest

    from lukv_cache.errors import ConfigurationError

    state = prefill_context(tiny_model, torch.randint(0, 128, (1, 12)))
    with pytest.raises(ConfigurationError, match="aggregate"):
        oracle_importance(tiny_model, state, torch.tensor([[5, 6]]), k_max=2, aggregate="sum")


def test_softcap_oracle_reads_a_causal_context_prefill():
    """Two full layers in a row: the second one's context keys come from the first one's prefill output,
    which must be causal although the eager (softcap) path never gets sdpa's is_causal shortcut."""
    model = tiny_model(
        "gemma2", seed=1, attn="eager", layer_types=["sliding_attention", "full_attention", "full_attention"]
    )
    context, question = torch.randint(0, 128, (1, 32)), torch.randint(0, 128, (1, 5))
    importance, answer = oracle_importance(model, prefill_context(model, context), question, k_max=4)
    expected = _direct_oracle(model, context, question, answer, layers=[1, 2])
    np.testing.assert_allclose(importance[1:], expected[1:], rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize(
    "family, options, sliding, aggregate",
    [
        ("llama", {}, False, "max"),
        ("llama", {}, False, "mean"),
        ("gemma2", dict(attn="eager", num_hidden_layers=2, sliding_window=16), True, "max"),
        ("gemma3", dict(num_hidden_layers=3, sliding_window=16), True, "max"),
        # the window holds the whole context when a question starts, and slides past it while answering
        ("gemma3", dict(num_hidden_layers=3, sliding_window=48), False, "max"),
    ],
)
def test_a_question_batch_equals_one_question_at_a_time(family, options, sliding, aggregate):
    """Questions of different lengths, one stopping early at the end-of-sequence token: decoded as one
    batch (padded, the context shared) they get the answers and importances they get alone."""
    model = tiny_model(family, seed=2, **options)
    context = torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    questions = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 5)]
    state = prefill_context(model, context)
    kw = dict(k_max=6, sliding=sliding, aggregate=aggregate)
    free = oracle_importance(model, state, questions[1], **kw)[1]
    stop = next(k for k in range(1, len(free)) if free[k] not in free[:k])  # a token new at step `stop`
    alone = [oracle_importance(model, state, q, eos_token_id=free[stop], **kw) for q in questions]
    batch = oracle_importances(model, state, questions, eos_token_id=free[stop], **kw)
    assert len(alone[1][1]) == stop + 1 < 6 and len({len(answer) for _, answer in alone}) > 1
    for (importance, answer), (batched, batched_answer) in zip(alone, batch, strict=True):
        assert batched_answer == answer
        np.testing.assert_allclose(batched, importance, rtol=1e-5, atol=1e-9)
        assert importance.any()
    assert state.cache.get_seq_length() == 40  # the context is left as it was


def test_an_answered_question_leaves_the_batch():
    """Its importance is final once it is answered: the next steps decode the other questions only (with
    the answers and importances each gets alone: above)."""
    model = tiny_model("llama", seed=2)
    state = prefill_context(model, torch.randint(0, 128, (1, 40), generator=torch.Generator().manual_seed(0)))
    questions = [torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 8, 5)]
    free = oracle_importance(model, state, questions[1], k_max=6)[1]
    stop = next(k for k in range(1, len(free)) if free[k] not in free[:k])
    rows: list[int] = []

    def note(module, args, kwargs):
        rows.append((args[0] if args else kwargs["hidden_states"]).shape[0])

    hook = model.model.layers[0].register_forward_pre_hook(note, with_kwargs=True)
    try:
        batch = oracle_importances(model, state, questions, eos_token_id=free[stop], k_max=6)
    finally:
        hook.remove()
    lengths = [len(answer) for _, answer in batch]
    assert lengths[1] == stop + 1 < 6 == max(lengths)
    # one forward per answer token: the whole batch until the second question's last, then the rest
    assert rows == [3 - sum(length <= step for length in lengths) for step in range(6)]
    assert rows[-1] < 3


def test_a_sliding_layer_is_recorded_while_its_window_holds_the_whole_context():
    """sliding=False: a sliding layer whose window still holds every token so far (a context shorter than
    the window) is recorded as a full layer is, step by step, until the decode slides past the context's
    first token."""
    model = tiny_model("gemma3", num_hidden_layers=3, sliding_window=48)
    assert model.config.layer_types[0] == "sliding_attention"
    t, q = 40, 6
    context, question = torch.randint(0, 128, (1, t)), torch.randint(0, 128, (1, q))
    state = prefill_context(model, context)
    importance, answer = oracle_importance(model, state, question, k_max=8)
    eager = type(model)(model.config)
    eager.load_state_dict(model.state_dict())
    eager.set_attn_implementation("eager")
    full = torch.cat([context, question, torch.tensor([answer[:-1]])], dim=1)
    with torch.no_grad():
        attn = eager.eval()(full, output_attentions=True).attentions[0][0, :, t + q - 1 :, :t]  # [Hq, K, T]
    contrib = attn * state.value_norms[0][:, None, :]
    hkv = model.config.num_key_value_heads
    steps = contrib.view(hkv, -1, *contrib.shape[1:]).amax(dim=1).transpose(0, 1).numpy()  # [K, H_kv, T]
    # the query producing answer token k sits at position t + q - 1 + k and follows t + q - 1 + k tokens
    # (the question's step: t); the window holds them all while that is at most 47
    held = [k for k in range(len(answer)) if (t if k == 0 else t + q - 1 + k) <= 47]
    assert 0 < len(held) < len(answer)
    np.testing.assert_allclose(importance[0], steps[held].max(0), rtol=1e-4, atol=1e-9)
