from demo_helpers import tiny_profile

from lukv_cache.cli import main
from lukv_cache.evaluation.check.formatting import format_check
from lukv_cache.evaluation.check.inputs import read_contexts
from lukv_cache.evaluation.check.run import check
from lukv_cache.profiles import save_to_local_dir


def test_check_compares_every_allocator_and_ratio_with_the_full_cache(model, tokenizer, tmp_path):
    save_to_local_dir(tiny_profile(model), tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("The ferry to Kestrel Quay leaves at nine. The harbour master is called Ada. " * 8)
    questions = tmp_path / "q.txt"
    questions.write_text("When does the ferry leave?\nWho is the harbour master?\n")
    contexts = read_contexts(texts=[text], questions=questions)
    report = check(
        model, tokenizer, contexts, ratios=(0.0, 0.5, 0.95), allocators=("uniform", "profile"), max_new_tokens=4,
        profiles_dir=tmp_path, show_progress=False,
    )  # fmt: skip
    assert [(r.allocator, r.ratio) for r in report.rows] == [
        ("uniform", 0.0), ("uniform", 0.5), ("uniform", 0.95), ("profile", 0.0), ("profile", 0.5), ("profile", 0.95),
    ]  # fmt: skip
    ratio_zero = report.rows[0]
    assert ratio_zero.agree == ratio_zero.asked == 2  # keeping everything answers exactly like the full cache
    assert max(abs(x) for x in ratio_zero.excess_nll) < 1e-4
    assert report.safe_ratio("uniform") is not None
    text = format_check(report)
    assert "agreement" in text and "excess NLL" in text and "uniform: agreement >= 90%" in text


def test_check_reads_the_calibration_format_and_refuses_nothing_to_check(tmp_path, capsys):
    contexts = read_contexts(calibration=["expository"])
    assert len(contexts) == 1 and len(contexts[0][1]) == 20
    assert main(["check", "smollm2", "--ratios", "0.5"]) == 2
    assert "Nothing to check" in capsys.readouterr().err
