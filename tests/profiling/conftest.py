"""Fixtures: a tiny random Llama and a byte tokenizer (``lukv_cache.testing``'s), so profiling tests run in
seconds without the Hub."""

import json

import pytest

from lukv_cache import testing


def tiny_llama(seed=0, layers=2):
    """A tiny Llama with a vocabulary for byte_tokenizer()."""
    return testing.tiny_model(
        seed=seed, vocab_size=testing.BYTE_VOCAB, num_hidden_layers=layers, pad_token_id=None
    )


def write_calibration(path, context="The quick brown fox jumps over the lazy dog. " * 3, n_questions=3):
    with open(path, "w", encoding="utf-8") as f:
        f.write(json.dumps({"type": "context", "title": "Tiny", "text": context}) + "\n")
        for i in range(n_questions):
            f.write(json.dumps({"type": "question", "text": f"What does the fox do {i}?"}) + "\n")
    return path


@pytest.fixture
def tiny_model():
    return tiny_llama()


@pytest.fixture
def make_tiny_model():
    return tiny_llama


@pytest.fixture
def byte_tokenizer():
    return testing.byte_tokenizer()


@pytest.fixture
def tiny_calibration(tmp_path):
    return write_calibration(tmp_path / "tiny.jsonl")


@pytest.fixture
def calibration_writer():
    return write_calibration
