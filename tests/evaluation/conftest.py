"""Fixtures for the demo / benchmark tests: everything is built in code, nothing is downloaded."""

from __future__ import annotations

import pytest
from demo_helpers import byte_tokenizer, synthetic_articles, tiny_llama


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def articles():
    return synthetic_articles()
