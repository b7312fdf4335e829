"""Fixtures for the demo / benchmark tests: everything is built in code, nothing is downloaded."""

from __future__ import annotations

import pytest
import torch
from demo_helpers import byte_tokenizer, synthetic_articles, tiny_llama


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # The CPUs are shared; one thread is much faster than two for tiny models.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer():
    return byte_tokenizer()


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def articles():
    return synthetic_articles()
