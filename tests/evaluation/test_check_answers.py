"""``lukv check`` with reference answers: accuracy of the full and compressed caches next to agreement, and
the recommendation on accuracy (a full cache that answers wrongly no longer vetoes a compressed cache that
answers rightly)."""

from __future__ import annotations

import pytest

from lukv_cache.cli import main
from lukv_cache.errors import ConfigurationError
from lukv_cache.evaluation.check.formatting import format_check
from lukv_cache.evaluation.check.grading import is_correct
from lukv_cache.evaluation.check.inputs import read_contexts
from lukv_cache.evaluation.check.report import CheckReport, CheckRow
from lukv_cache.evaluation.check.run import check

TEXT = "The ferry to Kestrel Quay leaves at nine. The harbour master is called Ada. " * 8


def test_matching_ignores_case_punctuation_and_accents_and_needs_whole_words():
    assert is_correct("  The ferry leaves at NINE o'clock. ", "nine")
    assert is_correct("Her name is Zoë.", "zoe")
    assert is_correct("It costs 210,000 pounds", "210,000")
    assert not is_correct("It leaves at ninety", "nine")
    assert is_correct("the harbour master", "Ada|harbour master")
    assert not is_correct("", "nine")


def _report(full_correct: int, rows: dict[tuple[str, float], tuple[int, int]]) -> CheckReport:
    """Three graded questions; ``rows``: (allocator, ratio) -> (agree, correct)."""
    made = [
        CheckRow(a, r, agree=agree, asked=3, excess_nll=[0.1 * r], correct=correct, graded=3)
        for (a, r), (agree, correct) in rows.items()
    ]
    return CheckReport("keydiff", made, 1, 3, 0.9, full_correct=full_correct, graded=3)


def test_a_wrong_full_cache_no_longer_vetoes_compressed_caches_that_answer_rightly():
    # issue 33: the full cache got 1 of 3 right, the compressed caches all 3: agreement 0-33%
    report = _report(1, {("uniform", 0.5): (1, 3), ("uniform", 0.8): (0, 3), ("adakv", 0.5): (1, 2)})
    text = format_check(report)
    last = text.splitlines()[-1]
    assert last.startswith("Recommended: ratio 0.8 with allocator uniform"), last
    assert "accuracy 100% against the full cache's 33%" in last
    lines = text.splitlines()
    assert any(line.startswith("allocator") and "accuracy" in line for line in lines)
    assert any(line.startswith("full cache") and line.rstrip().endswith("33%") for line in lines)
    assert "uniform: accuracy >= 90% of the full cache's 33% up to ratio 0.8." in text
    # without answers the same agreements recommend nothing
    plain = CheckReport(
        "keydiff",
        [CheckRow(r.allocator, r.ratio, r.agree, r.asked, r.excess_nll) for r in report.rows],
        1,
        3,
        0.9,
    )
    assert format_check(plain).splitlines()[-1].startswith("Recommended: none.")


def test_a_ratio_that_loses_accuracy_is_not_recommended():
    report = _report(3, {("uniform", 0.5): (3, 3), ("uniform", 0.8): (1, 1)})
    assert report.recommended().ratio == 0.5
    assert "up to ratio 0.5" in format_check(report)


def test_a_full_cache_with_no_right_answer_falls_back_to_agreement():
    report = _report(0, {("uniform", 0.5): (3, 0), ("uniform", 0.8): (0, 0)})
    assert not report.by_accuracy and report.recommended().ratio == 0.5
    assert "accuracy cannot tell" in format_check(report)


def test_answers_file_and_tab_lines_are_read_and_misaligned_files_refused(tmp_path):
    text, questions, answers = tmp_path / "t.txt", tmp_path / "q.txt", tmp_path / "a.txt"
    text.write_text(TEXT)
    questions.write_text("When does the ferry leave?\nWho is the harbour master?\n")
    answers.write_text("nine\n\n")
    assert read_contexts(texts=[text], questions=questions, answers=answers) == [
        (TEXT, ["When does the ferry leave?", "Who is the harbour master?"], ["nine", None])
    ]
    questions.write_text("When does the ferry leave?\tnine\nWho is the harbour master?\tAda\n")
    assert read_contexts(texts=[text], questions=questions)[0][2] == ["nine", "Ada"]
    with pytest.raises(ConfigurationError, match="use one or the other"):
        read_contexts(texts=[text], questions=questions, answers=answers)
    questions.write_text("When does the ferry leave?\n")
    answers.write_text("nine\nAda\n")
    with pytest.raises(ConfigurationError, match="2 line.*1 question"):
        read_contexts(texts=[text], questions=questions, answers=answers)


def test_check_measures_the_accuracy_of_the_full_and_compressed_caches(model, tokenizer):
    questions = ["When does the ferry leave?", "Who is the harbour master?"]
    plain = check(model, tokenizer, [(TEXT, questions)], ratios=(0.0, 0.9), allocators=("uniform",),
                  max_new_tokens=4, show_progress=False, show_answers=True)  # fmt: skip
    full = [a.full for a in plain.answers]
    # the reference answers: the full cache's own first answer (right), and a word no answer contains (wrong)
    refs = [full[0] or "x", "zzzqqq"]
    graded = check(model, tokenizer, [(TEXT, questions)], ratios=(0.0, 0.9), allocators=("uniform",),
                   max_new_tokens=4, show_progress=False, answers=[refs])  # fmt: skip
    assert graded.graded == 2
    assert graded.full_correct == int(is_correct(full[0], refs[0]))
    zero, high = graded.rows
    assert (zero.graded, zero.correct) == (2, graded.full_correct)  # ratio 0 answers as the full cache
    shown = {q: a.compressed["uniform 0.9"][0] for q, a in zip(questions, plain.answers)}
    assert high.correct == sum(is_correct(shown[q], r) for q, r in zip(questions, refs))
    assert [(r.agree, r.excess_nll) for r in graded.rows] == [(r.agree, r.excess_nll) for r in plain.rows]
    with pytest.raises(ConfigurationError, match="2 question.*1 answer"):
        check(model, tokenizer, [(TEXT, questions)], answers=[["nine"]], show_progress=False)


def test_lukv_check_answers_prints_accuracy(tmp_path, capsys):
    from demo_helpers import byte_tokenizer, tiny_llama

    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    text, questions, answers = tmp_path / "notes.txt", tmp_path / "q.txt", tmp_path / "a.txt"
    text.write_text(TEXT)
    questions.write_text("When does the ferry leave?\nWho is the harbour master?\n")
    answers.write_text("nine\nAda\n")
    argv = [
        "check",
        str(folder),
        "--text",
        str(text),
        "--questions",
        str(questions),
        "--answers",
        str(answers),
    ]
    assert (
        main([*argv, "--ratios", "0.5", "--allocators", "uniform", "--max-new-tokens", "3", "--quiet"]) == 0
    )
    out = capsys.readouterr().out
    assert "2 with a reference answer" in out and "accuracy" in out and "full cache" in out
    assert out.strip().splitlines()[-1].startswith("Recommended: ")
