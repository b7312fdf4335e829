"""Tiny stand-ins for a real model, its tokenizer, its text and its profile, built in code: nothing downloaded.

What the test suite, the docstring examples and the examples' ``--smoke`` runs share, and what a contributor
uses to try a new scorer or allocator in seconds::

    >>> from lukv_cache import LUKVCache
    >>> from lukv_cache.testing import curve_profile, prompt, tiny_model
    >>> tiny = tiny_model()                        # seeded random Llama: 2 layers, 4 query / 2 KV heads
    >>> cache = LUKVCache(0.5, allocator="profile", allocator_kwargs={"profile": curve_profile(2, 2)})
    >>> _ = tiny(prompt(length=40), past_key_values=cache)
    >>> cache.stored_tokens()[:, 0].tolist()       # tokens each (layer, KV head) keeps of 40: its own budget
    [[29, 25], [20, 16]]

Every model is seeded (two calls give the same weights) and random: its text is gibberish, so these check
that code runs and what it keeps, never what a model says. Each builder passes unknown keywords through
unchanged (``tiny_model(num_hidden_layers=4)``, ``curve_profile(..., window=8)``), so a caller still says
what it sets.
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .errors import UnknownNameError
from .profiles import Profile

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

    from .scorers.kvzap import Surrogate

VOCAB = 128  # the models' vocabulary unless told otherwise (byte_tokenizer() needs BYTE_VOCAB)
BYTE_VOCAB = 257  # byte_tokenizer(): 256 bytes and an end-of-text token
PAD = 0
PROFILE_MODEL_ID = "org/tiny"
PROFILE_SCORER = "keydiff"
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")
# Gemma's local layers slide over 8 tokens unless told otherwise: shorter than the tests' prompts, so the
# window really slides.
SLIDING = 8

_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=PAD,
    bos_token_id=1,
    eos_token_id=None,  # random models must not stop early: runs that are compared have the same length
)
WORDS = (  # what prose() is made of
    "river mountain city people history language music science water light north south early later small "
    "large ancient modern famous common harbour ferry market"
).split()


def tiny_config(arch: str = "llama", vocab_size: int = VOCAB, **overrides: Any) -> PretrainedConfig:
    """The config of a tiny model of family ``arch`` (one of ``ARCHS``): 2 layers (Gemma: 3, sliding /
    full / sliding), 4 query heads, 2 KV heads, head_dim 16 (Qwen2 and Phi-3: their own, 16 as well),
    hidden size 64. ``overrides`` are config fields and win over these."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
    )

    fields = dict(_SHAPE, vocab_size=vocab_size)
    if arch in ("llama", "qwen3"):
        fields["head_dim"] = 16
    elif arch == "mistral":
        fields.update(head_dim=16, sliding_window=None)
    elif arch in ("gemma2", "gemma3"):
        fields.update(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=SLIDING)
        fields["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention"]
    elif arch not in ("qwen2", "phi3"):
        raise UnknownNameError(
            f"Unknown tiny architecture {arch!r}. Known tiny architectures: {', '.join(ARCHS)}.",
            kind="tiny architecture",
            name=arch,
            known=ARCHS,
        )
    classes = {
        "llama": LlamaConfig,
        "mistral": MistralConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "phi3": Phi3Config,
        "gemma2": Gemma2Config,
        "gemma3": Gemma3TextConfig,
    }
    fields.update(overrides)
    if "layer_types" in fields and "num_hidden_layers" in overrides and "layer_types" not in overrides:
        kinds = ("sliding_attention", "full_attention")
        fields["layer_types"] = [kinds[i % 2] for i in range(fields["num_hidden_layers"])]
    return classes[arch](**fields)


def tiny_model(
    arch: str = "llama",
    *,
    seed: int = 0,
    attn: str = "sdpa",
    dtype: torch.dtype = torch.float32,
    name_or_path: str | None = None,
    config: PretrainedConfig | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A seeded tiny random causal LM of ``tiny_config(arch, **overrides)`` (or of ``config``), in eval mode,
    with attention ``attn``. Its generation config pads with the config's pad id and never stops at an end
    token; ``name_or_path`` is the model id a profile for it names."""
    from transformers import AutoModelForCausalLM

    config = config if config is not None else tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    if name_or_path is not None:
        model.config.name_or_path = name_or_path
    return model


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real fast tokenizer built in code: every byte is one token (GPT-2's byte alphabet, no merges), plus
    an end-of-text token; ``BYTE_VOCAB`` (257) ids, so pair it with ``tiny_model(vocab_size=BYTE_VOCAB)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: i for i, symbol in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>")


def prose(chars: int = 1500, seed: int = 0) -> str:
    """Seeded synthetic prose of ``chars`` characters (one token a character with ``byte_tokenizer()``)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while sum(map(len, sentences)) < chars:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12))).capitalize() + ".")
    return " ".join(sentences)[:chars]


def prompt(batch: int = 1, length: int = 24, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    """Seeded random token ids ``[batch, length]`` in [3, vocab): no pad, bos or eos id inside the text."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=generator)


def left_padded(lengths: tuple[int, ...] = (24, 17, 11), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch: ``input_ids`` and ``attention_mask`` with rows of the given real lengths."""
    width = max(lengths)
    ids = prompt(len(lengths), width, seed)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, : width - n] = PAD
        mask[row, width - n :] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------- profiles


def array_profile(
    grid: Any, evict: Any, model_id: str = PROFILE_MODEL_ID, scorer: str = PROFILE_SCORER, **fields: Any
) -> Profile:
    """A profile of exactly these curves: ``grid`` [G] and ``evict`` [G, L, H], both as float32."""
    grid = np.asarray(grid, dtype=np.float32)
    return Profile(grid, np.asarray(evict, dtype=np.float32), model_id=model_id, scorer=scorer, **fields)


def flat_profile(layers: int, heads: int, grid: Any = (0.25, 0.5, 0.75), **fields: Any) -> Profile:
    """Every head evicts the global ratio at every grid point (asks for exactly the uniform total)."""
    grid = np.asarray(grid, dtype=np.float32)
    return array_profile(grid, np.repeat(grid, layers * heads).reshape(-1, layers, heads), **fields)


def curve_profile(
    layers: int, heads: int, grid: Any = (0.25, 0.5, 0.75), spread: float = 0.2, **fields: Any
) -> Profile:
    """Uneven heads: (layer, head) i of n evicts the global ratio plus ``linspace(-spread, spread, n)[i]``,
    clipped to [0, 1]."""
    grid = np.asarray(grid, dtype=np.float32)
    offsets = np.linspace(-spread, spread, layers * heads, dtype=np.float32).reshape(layers, heads)
    return array_profile(grid, np.clip(grid[:, None, None] + offsets[None], 0.0, 1.0), **fields)


def with_gains(profile: Profile, knots: int = 8) -> Profile:
    """``profile`` with a crafted score-to-gain table of its shape (format version 2): every head's knots span
    [-1, 1] and its gains rise with the score, steeper in later heads and layers (uneven heads), so the
    ``calibrated`` allocator can read it."""
    layers, heads = profile.num_layers, profile.num_kv_heads
    scale = 1.0 + np.arange(layers * heads, dtype=np.float32).reshape(layers, heads, 1) / 2
    gain_scores = np.broadcast_to(np.linspace(-1.0, 1.0, knots, dtype=np.float32), (layers, heads, knots))
    gain_values = np.linspace(0.0, 1.0, knots, dtype=np.float32) * scale
    return dataclasses.replace(profile, gain_scores=gain_scores.copy(), gain_values=gain_values)


def random_surrogate(
    layers: int = 2,
    kv_heads: int = 2,
    head_dim: int = 16,
    *,
    scale: float = 1.0,
    bias: bool = True,
    seed: int = 0,
) -> Surrogate:
    """A seeded random kvzap surrogate for a model of ``layers`` layers of ``kv_heads`` KV heads of ``head_dim``,
    on the richest feature set (keys, values, the window attention, the length and their products: every input
    a surrogate can read). Weights ``scale * N(0, 1)``, then the biases ``N(0, 1)`` unless ``bias`` is False,
    from one generator seeded with ``seed``. Its scores mean nothing; ``kvzap_scorer(random_surrogate())``
    scores as a trained one would be called.

    >>> random_surrogate(layers=3).weight.shape  # [layers, KV heads, inputs]
    torch.Size([3, 2, 133])
    """
    from .scorers.kvzap import WINDOW_FEATURES, FeatureSet, Surrogate

    surrogate = Surrogate.zeros(
        layers, kv_heads, FeatureSet.named(WINDOW_FEATURES).inputs(kv_heads, head_dim)
    )
    surrogate.features, surrogate.layers = WINDOW_FEATURES, list(range(layers))
    generator = torch.Generator().manual_seed(seed)
    surrogate.weight.copy_(scale * torch.randn(surrogate.weight.shape, generator=generator))
    if bias:
        surrogate.bias.copy_(torch.randn(surrogate.bias.shape, generator=generator))
    return surrogate
