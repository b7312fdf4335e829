"""``lukv check`` worth waiting for: one scoring per allocator shared by its ratios, agreement from one
teacher-forced forward that matches greedy decoding, a progress line with an ETA, the answers side by side,
a legend and a last line that recommends a ratio or says what to try."""

from __future__ import annotations

import pytest
import torch
from demo_helpers import tiny_profile

from lukv_cache.cli import main
from lukv_cache.evaluation.check.formatting import format_check
from lukv_cache.evaluation.check.inputs import read_contexts
from lukv_cache.evaluation.check.report import CheckReport, CheckRow
from lukv_cache.evaluation.check.run import check
from lukv_cache.evaluation.methods import Method
from lukv_cache.evaluation.prefill import SharedPrefill
from lukv_cache.profiles import save_to_local_dir

TEXT = "The ferry to Kestrel Quay leaves at nine. The harbour master is called Ada. " * 8
QUESTIONS = "When does the ferry leave?\nWho is the harbour master?\n"


def _next_logits(model, cache, ids):
    with torch.no_grad():
        return model(input_ids=ids, past_key_values=cache, use_cache=True).logits


@pytest.mark.parametrize("allocator", ["uniform", "adakv", "pyramid", "global", "profile"])
def test_a_ratio_compressed_from_shared_scores_equals_one_scored_again(model, tmp_path, allocator):
    save_to_local_dir(tiny_profile(model), tmp_path)
    torch.manual_seed(3)
    context, question = torch.randint(0, 256, (1, 150)), torch.randint(0, 256, (1, 6))
    shared = SharedPrefill.record(model, context, n_queries=64)
    _, scores = shared.scored_cache(Method(allocator, "keydiff", 0.5), model, None, tmp_path)
    assert sorted(scores) == list(range(model.config.num_hidden_layers))
    from_scores, same = shared.scored_cache(
        Method(allocator, "keydiff", 0.8), model, None, tmp_path, scores=scores
    )
    scored_again = shared.cache_for(Method(allocator, "keydiff", 0.8), model, tmp_path)
    assert same is scores
    assert torch.equal(from_scores.stored_tokens(), scored_again.stored_tokens())
    assert torch.allclose(
        _next_logits(model, from_scores, question), _next_logits(model, scored_again, question), atol=1e-5
    )


@pytest.fixture
def contexts(tmp_path):
    text, questions = tmp_path / "notes.txt", tmp_path / "q.txt"
    text.write_text(TEXT)
    questions.write_text(QUESTIONS)
    return read_contexts(texts=[text], questions=questions)


def test_agreement_from_one_forward_is_what_greedy_decoding_gives(model, tokenizer, contexts, tmp_path):
    save_to_local_dir(tiny_profile(model), tmp_path)
    report = check(
        model, tokenizer, contexts, ratios=(0.0, 0.5, 0.95), allocators=("uniform", "profile"), max_new_tokens=6,
        profiles_dir=tmp_path, show_progress=False, show_answers=True,
    )  # fmt: skip
    assert len(report.answers) == 2
    marks = []
    for answers in report.answers:
        assert set(answers.compressed) == {r.name for r in report.rows}
        for text, agrees in answers.compressed.values():
            assert agrees == (text == answers.full), (answers.question, answers.full, text)
            marks.append(agrees)
    assert sum(r.agree for r in report.rows) == sum(marks)
    assert report.rows[0].agree == 2  # ratio 0 keeps everything


def test_progress_line_shows_the_eta(model, tokenizer, contexts, capsys):
    check(model, tokenizer, contexts, ratios=(0.5,), allocators=("uniform",), max_new_tokens=2)
    err = capsys.readouterr().err
    assert "lukv check" in err and "ETA" in err and "100%" in err


def _report(agreements: dict[tuple[str, float], float], tolerance: float = 0.9) -> CheckReport:
    rows = []
    for (allocator, ratio), agreement in agreements.items():
        agree = round(agreement * 10)
        rows.append(
            CheckRow(allocator, ratio, agree=agree, asked=10, excess_nll=[-0.01 * ratio, 0.2 * ratio])
        )
    return CheckReport("keydiff", rows, contexts=2, questions=5, tolerance=tolerance)


def test_the_last_line_recommends_the_highest_safe_ratio_and_the_legend_explains_the_columns():
    report = _report(
        {("uniform", 0.5): 1.0, ("uniform", 0.8): 0.7, ("profile", 0.5): 1.0, ("profile", 0.8): 0.9}
    )
    text = format_check(report)
    last = text.splitlines()[-1]
    assert last.startswith("Recommended: ratio 0.8 with allocator profile") and "90%" in last
    assert "agreement: " in text and "excess NLL: " in text and "Below zero" in text
    assert "uniform: agreement >= 90% up to ratio 0.5." in text


def test_when_no_ratio_meets_the_tolerance_the_last_line_says_so_and_what_to_try():
    report = _report({("uniform", 0.5): 0.4, ("uniform", 0.8): 0.1, ("adakv", 0.5): 0.6})
    text = format_check(report)
    last = text.splitlines()[-1]
    assert last.startswith("Recommended: none.") and "(--ratios 0.25)" in last and "--scorer" in last
    assert "adakv: no ratio checked keeps agreement >= 90% (best 60% at 0.5)." in text


def test_lukv_check_show_answers_prints_both_answers_then_the_recommendation(tmp_path, capsys):
    from demo_helpers import byte_tokenizer, tiny_llama

    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    text, questions = tmp_path / "notes.txt", tmp_path / "q.txt"
    text.write_text(TEXT)
    questions.write_text(QUESTIONS)
    argv = ["check", str(folder), "--text", str(text), "--questions", str(questions), "--ratios", "0.5"]
    assert main([*argv, "--allocators", "uniform", "--max-new-tokens", "3", "--show-answers", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "Context 1: When does the ferry leave?" in out and "full cache" in out and "uniform 0.5" in out
    assert out.strip().splitlines()[-1].startswith("Recommended: ")


class _Scripted:
    """A stand-in model whose next-token predictions are fixed: ``predict[i]`` after the i-th fed token."""

    def __init__(self, predict, vocab=8):
        self.predict, self.vocab, self.fed = predict, vocab, None

    def __call__(self, input_ids, past_key_values, use_cache, logits_to_keep):
        self.fed = input_ids[0].tolist()
        logits = torch.zeros(1, len(self.predict), self.vocab)
        logits[0, torch.arange(len(self.predict)), torch.tensor(self.predict)] = 5.0
        return type("Out", (), {"logits": logits[:, -logits_to_keep:]})()


def test_one_teacher_forced_forward_gives_each_greedy_step_the_stop_and_the_nll():
    from lukv_cache.evaluation.check.run import _STOP, _predictions

    prompt = torch.tensor([[1, 2]])
    model = _Scripted([9 % 8, 5, 6, 0])  # after 1: ?, after 2: 5, after 5: 6, after 6: a stop
    predicted, nll = _predictions(model, None, prompt, [5, 6], stops=[0, 7], max_new_tokens=4)
    assert model.fed == [1, 2, 5, 6] and predicted == [5, 6, _STOP]
    expected = torch.nn.functional.cross_entropy(torch.full((2, 8), 0.0).index_put_(
        (torch.arange(2), torch.tensor([5, 6])), torch.tensor(5.0)), torch.tensor([5, 6]))  # fmt: skip
    assert nll == pytest.approx(float(expected))
    # an answer that ran to max_new_tokens: decoding stopped on the length, what follows is not compared
    predicted, _ = _predictions(model, None, prompt, [5, 6], stops=[0], max_new_tokens=2)
    assert predicted == [5, 6]
    # an empty answer (the full cache stopped at once): only the stop is compared, its NLL is 0
    predicted, nll = _predictions(_Scripted([3, 7]), None, prompt, [], stops=[0, 7], max_new_tokens=4)
    assert predicted == [_STOP] and nll == 0.0
