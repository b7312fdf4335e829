"""RULER's scoring against hand-made predictions (RULER's and kvpress's definitions, not lm-eval's), and
kvpress's split of an input into context / question / answer prefix. No optional package needed."""

from __future__ import annotations

import pytest

from lukv_cache.evaluation.ruler.prompt import prompt_ids, split_input
from lukv_cache.evaluation.ruler.scoring import postprocess, score, string_match_all, string_match_part
from lukv_cache.testing import byte_tokenizer


@pytest.mark.parametrize(
    ("task", "prediction", "references", "expected"),
    [
        ("niah_single_1", " The special magic number is 1234567.", ["1234567"], 100.0),
        ("niah_single_1", "1234568", ["1234567"], 0.0),
        # string_match_all: the share of the references found
        (
            "niah_multivalue",
            "1111111, 2222222 and 3333333",
            ["1111111", "2222222", "3333333", "4444444"],
            75.0,
        ),
        ("vt", "VAR ABCDE, VAR FGHIJ", ["ABCDE", "FGHIJ", "KLMNO"], 200 / 3),
        ("cwe", "1. Apple 2. pear", ["apple", "PEAR", "plum", "fig"], 50.0),  # case-insensitive
        ("fwe", "", ["abc", "def", "ghi"], 0.0),
        # string_match_part: 100 if any reference is found (lm-eval's would score the best partial overlap)
        ("qa_1", "It was Denver Broncos", ["Denver Broncos", "Broncos", "the Broncos of Denver"], 100.0),
        ("qa_2", "Carolina", ["Denver Broncos", "Broncos"], 0.0),
        ("qa_2", "broncos!", ["Denver Broncos", "Broncos"], 100.0),
    ],
)
def test_score_matches_rulers_metrics(task, prediction, references, expected):
    assert score(task, prediction, references) == pytest.approx(expected)


def test_control_characters_become_newlines_and_edges_are_stripped():
    assert postprocess("\t 12\x0034\x1f56 \n") == "12\n34\n56"
    assert postprocess(None) == ""
    # a reference split by a control character is not found
    assert score("niah_single_1", "12\x0034567", ["1234567"]) == 0.0


def test_match_all_and_match_part_differ_on_partial_answers():
    refs = ["alpha", "beta"]
    assert string_match_all("alpha", refs) == 50.0
    assert string_match_part("alpha", refs) == 100.0


def test_a_sample_without_references_scores_zero():
    assert score("cwe", "anything", []) == 0.0


def test_split_follows_kvpress_patterns():
    text = (
        "Some special magic numbers are hidden within the following text. A: One of the special magic numbers "
        "for x is: 1.\nWhat are all the special magic numbers for x mentioned in the provided text? The special "
        "magic numbers for x mentioned in the provided text are"
    )
    context, question, prefix = split_input("niah_multivalue", text)
    assert context.endswith("is: 1.\n") and question.startswith("What are all the special magic")
    assert question.endswith("text? ") and prefix.startswith("The special magic numbers for x")
    assert context + question + prefix == text
    # qa: the question starts at the last instruction, after the documents
    qa = "Answer the question based on the given documents. Docs\n\nAnswer the question based on the given documents. Q? Answer:"
    context, question, prefix = split_input("qa_1", qa)
    assert context == "Answer the question based on the given documents. Docs\n\n" and prefix == "Answer:"


def test_prompt_without_chat_template_appends_a_newline_before_the_answer_prefix():
    from lukv_cache.evaluation.ruler.prompt import Sample

    tokenizer = byte_tokenizer()
    sample = Sample("vt", 0, "ctx ", "Question: q? ", "Answer:", ["A"], 30, 100)
    context, question = prompt_ids(tokenizer, sample)
    assert tokenizer.decode(context) == "ctx "
    assert tokenizer.decode(question) == "Question: q? \nAnswer:"
