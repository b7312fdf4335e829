"""Fixtures: a tiny random Llama and a byte tokenizer, so profiling tests run in seconds without the Hub."""

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


class ByteTokenizer:
    """Just what build_profile uses from a tokenizer: __call__(...).input_ids, encode() (KVzip's repeat
    prompt) and eos_token_id. No chat template."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return self(text, add_special_tokens=add_special_tokens).input_ids[0].tolist()

    def __call__(self, text, return_tensors="pt", add_special_tokens=True):
        ids = [1] * add_special_tokens + [2 + b % 120 for b in text.encode()]

        class _Out:
            input_ids = torch.tensor([ids])

        return _Out()


def tiny_llama(seed=0, layers=2):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    return LlamaForCausalLM(config).eval()


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
    return ByteTokenizer()


@pytest.fixture
def tiny_calibration(tmp_path):
    return write_calibration(tmp_path / "tiny.jsonl")


@pytest.fixture
def calibration_writer():
    return write_calibration
