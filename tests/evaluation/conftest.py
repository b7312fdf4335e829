"""Fixtures for the demo / benchmark tests: everything is built in code, nothing is downloaded."""

from __future__ import annotations

import pytest
from demo_helpers import byte_tokenizer, synthetic_articles, tiny_llama

from lukv_cache.evaluation import cli as evaluation_cli


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def articles():
    return synthetic_articles()


@pytest.fixture
def no_weights(monkeypatch):
    """Loading the weights fails the test: every refusal that uses it must come before it."""

    def load_model(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the input was checked")

    monkeypatch.setattr(evaluation_cli, "load_model", load_model)
