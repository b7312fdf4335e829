"""Check a ratio on your own texts before deploying it: ``lukv check`` from Python.

    python examples/check_ratio.py                                   # SmolLM2 on two Wikipedia excerpts
    python examples/check_ratio.py --text a.txt b.txt --questions questions.txt
    python examples/check_ratio.py --text a.txt --questions questions.txt --answers answers.txt  # + accuracy
    python examples/check_ratio.py --smoke                           # a tiny random model: checks the code runs

For each text the full cache answers every question; each allocator at each ratio then answers through
its own compressed cache (question-agnostic, as in deployment). The table gives how often the answers agree
with the full cache's and the excess NLL of the full cache's answers; the last line recommends the highest
ratio that keeps agreement at or above ``--tolerance``, or says that none does and what to try (on
SmolLM2-135M even 0.25 changes some 12-token answers: a small model's greedy answers are fragile, which is
what the check is for). The same from the shell:
``lukv check smollm2 --text a.txt b.txt --questions questions.txt --ratios 0.5 0.8 0.9`` (docs/check.md).

Agreement is not correctness: a full cache that answers wrongly makes a compressed cache that answers
rightly "disagree". With reference answers (``--answers``, one per question line, or ``question<TAB>answer``
lines) the table also gives the accuracy of the full and compressed caches and recommends on it.
"""

from __future__ import annotations

import argparse
import atexit
import shutil
import tempfile
from pathlib import Path

from lukv_cache.cli import main as lukv

# questions any text can answer, so that every text file shares the one questions file
QUESTIONS = [
    "What is the text about?",
    "Which year does the text mention first?",
    "Which places does the text name?",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny random model and synthetic texts")
    parser.add_argument("--text", nargs="+", help="your text files, each a context (default: two articles)")
    parser.add_argument("--questions", help="your questions, one per line (with --text)")
    parser.add_argument("--answers", help="their reference answers, one per line: accuracy too")
    parser.add_argument("--ratios", nargs="+", default=["0.25", "0.5", "0.8"], help="fractions evicted")
    parser.add_argument("--max-new-tokens", default="12", help="answer tokens compared per question")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="lukv-check-"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    options = ["--ratios", *args.ratios]
    if args.smoke:
        import _tiny

        model = _tiny.save(str(work / "tiny-model"))  # a model folder, like 'smollm2' or a Hub id
        texts = [_tiny.text(500, seed) for seed in (1, 2)]
        options += ["--allocators", "uniform", "global", "--max-new-tokens", "4", "--quiet"]
    else:
        from lukv_cache.texts import wikipedia_articles

        model = "smollm2"
        texts = [article.text[:3000] for article in wikipedia_articles()[:2]]  # two articles' openings
        options += ["--max-new-tokens", args.max_new_tokens]
    if args.text is None:  # write the example texts and questions as a user's files would be
        args.text = []
        for i, text in enumerate(texts):
            args.text.append(str(work / f"text{i}.txt"))
            Path(args.text[-1]).write_text(text, encoding="utf-8")
        args.questions = str(work / "questions.txt")
        Path(args.questions).write_text("\n".join(QUESTIONS) + "\n", encoding="utf-8")
    if args.answers:
        options += ["--answers", args.answers]
    return lukv(["check", model, "--text", *args.text, "--questions", args.questions, *options])


if __name__ == "__main__":
    raise SystemExit(main())
