"""The cache's options as one policy, declared and built: :class:`CompressionPolicy`, a frozen dataclass
whose fields are ``LUKVCache``'s compression options, each with its default, its doc and its check
(:func:`~.spec.option`), and the rules across options its :meth:`~CompressionPolicy.build` applies.

:meth:`CompressionPolicy.build` takes the options as given (numbers of any integer type, a scorer or
allocator by name, ``evict_ratio=`` beside ``allocator_kwargs=``), checks each through its field's check
(:mod:`.values`), refuses every combination that cannot hold with a
:class:`~lukv_cache.errors.ConfigurationError` naming the fix (in build, and in the rules below the class;
:func:`bounded_prompt`, :func:`default_ratio` and :func:`check_bits_fit` are also ``from_pretrained``'s and
the cache's), and returns the policy the cache and its layers read. Everything else that lists the options
reads the fields: the cache's signature (:func:`~.spec.option_signature`) and read-only properties
(:mod:`.surface`), its docstring's Args and docs/usage.md's table (:mod:`.docs`), ``from_pretrained`` (its
``**options``) and the saved-context file (:mod:`lukv_cache.cache.saved.options_json`). A subclass of the
policy adds an option with one field; a cache class names its policy in ``policy_class``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Self

import numpy as np
import torch

from ...allocation import Allocator, get_allocator
from ...errors import ConfigurationError
from ...scorers import Scorer
from ..storage.layer import FOLD_AT
from .spec import fields_of, option, option_signature, option_spec
from .values import (
    check_ratio,
    checked_allocator_options,
    checked_flag,
    checked_fraction,
    checked_kv_bits,
    checked_max_bytes,
    checked_memory,
    checked_ratio,
    checked_scorer,
    checked_sliding,
    checked_split,
    count,
)

SINK = 4  # the first tokens every head keeps, by default
RATIO = 0.5  # the fraction removed when nothing sets it (no ratio=, max_tokens=, decode_max_tokens= or table)
BUDGET_FOLD_AT = 8  # fold_interval under a memory budget: the dense decode room counts in its bytes
_MAX_TOKENS_LIMIT = 2**40  # far beyond any context; larger numbers are a mistake (None means no cap)


# ---------------------------------------------------------------------------------------------- the policy
@dataclass(frozen=True)
class CompressionPolicy:
    """What the cache keeps, shared by all its layers (a layer only stores; the cache decides): one field per
    option of ``LUKVCache``, each declared once with its default, doc and check (:func:`~.spec.option`).

    Build it with :meth:`build` (``LUKVCache.__init__`` does): the fields' defaults are the options as
    given (a scorer's name, ``window=None`` for the scorer's own), and the built policy holds them resolved
    (a :class:`~lukv_cache.scorers.Scorer`, an :class:`~lukv_cache.allocation.Allocator`, the window in
    tokens, the ratio a ``max_tokens`` bound or a table sets). Add an option with a field in a subclass, named
    by a cache subclass's ``policy_class``.

    >>> policy = CompressionPolicy.build(ratio=0.8, sink=2)
    >>> policy.ratio, policy.scorer.name, policy.window, CompressionPolicy.build(max_tokens=64).ratio
    (0.8, 'keydiff', 1, 0.0)
    """

    ratio: float = option(
        None,
        "Fraction of the prompt's evictable KV entries removed (0.8 keeps 20%; `None`: 0.5).",
        "``None`` is 0.5 unless ``max_tokens``, ``decode_max_tokens`` or ``evict_ratio`` sets the budget: the "
        "policy then holds 0.0 under ``max_tokens`` (each prompt gets its own ratio) and a table's mean "
        "under ``evict_ratio``.",
        check=checked_ratio,
        positional=True,
        kinds=(float, int),
        low=0,
    )
    scorer: Scorer = option(
        "keydiff",
        "How tokens are ranked: a registered scorer's name or a `Scorer`.",
        "The registered scorers: ``keydiff``, ``snapkv``, ``expected_attention``, ``knorm``, ``tova``, "
        "``streaming``, ``random``, ``kvzip``, ``kvzap`` (:mod:`lukv_cache.scorers`).",
        check=checked_scorer,
        positional=True,
        saved=False,  # its own entry: the name, its settings, a learned scorer's surrogate
    )
    allocator: Allocator = option(
        "uniform",
        "How the kept tokens are shared among layers and heads: a registered allocator's name.",
        "``uniform``, ``pyramid``, ``adakv``, ``global``, ``profile`` (needs ``evict_ratio`` or a ``profile``), "
        "``hybrid``, ... or any registered name; ``allocator_kwargs`` go to its factory.",
        positional=True,
        saved=False,  # its name, and its options under allocator_kwargs
    )
    max_tokens: int | None = option(
        None,
        "Instead of `ratio`, at most this many tokens per (full-attention layer, KV head) after the prompt.",
        "A hard bound: after the prompt's forward, each row holds at most this many tokens per (full-attention "
        "layer, KV head) on average, sinks and window included, whatever the prompt's length (each prompt gets "
        "its own ratio, budgets are trimmed if an allocator asks for more; a prompt that already fits is kept "
        "whole). At least ``sink + window``.",
        check=count(positive=True),
        kinds=(int, type(None)),
        low=1,
    )
    decode_max_tokens: int | None = option(
        None,
        "Bound the whole generation: at every fold, at most this many tokens per (layer, KV head).",
        "Every ``fold_interval`` tokens after the prompt, the budgets are applied again to everything the "
        "cache holds, so that each row keeps at most this many tokens per (full-attention layer, KV head) on "
        "average (sinks and window included), the allocator's budgets read at the ratio that total implies. "
        "Without ``ratio`` or ``max_tokens`` it bounds the prompt too (``max_tokens`` is this). Needs a scorer "
        "that decodes (not ``kvzip``).",
        check=count(positive=True),
        kinds=(int, type(None)),
        low=1,
    )
    sink: int = option(
        SINK,
        "First tokens of each row always kept (attention sinks).",
        check=count(),
        kinds=(int,),
        low=0,
    )
    window: int = option(
        None,
        "Last prompt tokens always kept, dense (None: the scorer's, 1; 32 for snapkv, kvzip and kvzap).",
        check=count(),
        kinds=(int,),
        low=0,
    )
    min_keep: float = option(
        0.01,
        "Every head keeps at least this fraction of its evictable tokens (and at least one).",
        check=checked_fraction,
        kinds=(float, int),
        low=0,
    )
    prefill_chunk_size: int | None = option(
        None,
        "Also compress multi-token forwards after the prompt once this many uncompressed tokens pile up.",
        "The prompt's chunks (every multi-token forward before the first decoded token, such as "
        "``generate(prefill_chunk_size=)``'s) are compressed without it; with it, also what is sent in chunks "
        "after the prompt (a question after ``cache.prefill``), which is otherwise appended whole.",
        check=count(positive=True),
        kinds=(int, type(None)),
        low=1,
    )
    fold_interval: int = option(
        None,
        f"The dense suffix of decoded tokens is folded into the ragged store every this many tokens (None: "
        f"{FOLD_AT}, {BUDGET_FOLD_AT} under `memory`/`max_bytes`).",
        "With ``decode_max_tokens`` it is evicted there. Under a memory budget the dense suffix is decode room "
        "that counts in the budget, so it folds sooner; a fold that must evict there evicts three folds' tokens "
        "deeper (at most 1/32 of what the bytes hold), so that the next three only append.",
        check=count(positive=True),
        kinds=(int,),
        low=1,
    )
    decode_window: int = option(
        None,
        "With `decode_max_tokens`, the recent tokens each head keeps at every fold (0 without it).",
        "Part of the bound. ``None``: a quarter of ``decode_max_tokens`` (at least ``window``); recent tokens "
        "matter most to the next ones, and a quarter measured best for kvzap and keydiff "
        "(``benchmarks/results/decode_window_tuning/``).",
        check=count(),
        kinds=(int,),
        low=0,
    )
    kv_bits: int | None = option(
        None,
        "Bits per entry of the stored keys and values (8 or 4), `None` at the model's precision (or what `memory` chose).",
        "Per token, groups of 32 channels with a 2-byte scale and zero each, bf16 or an fp16 model's fp16 "
        "(:mod:`lukv_cache.cache.storage.quant`); the protected window joins the store after the prompt's eviction "
        "(not under ``max_tokens``/``decode_max_tokens``), new tokens stay at full precision until the suffix "
        "folds. Scores are computed before quantization, so the prompt's eviction is the same for every "
        "``kv_bits``. A cache that evicts nothing (``ratio=0``) still quantizes: its logits are no longer the "
        "full cache's (on a tiny fp32 model about 1e-3 off at 8 bits, 1e-2 at 4).",
        check=checked_kv_bits,
    )
    memory: float | None = option(
        None,
        "Instead of `ratio`/`max_tokens`/`kv_bits`: a fraction of the full cache's bytes to fit after every forward.",
        "The cache chooses the bits (the model's precision, 8 or 4) and how many tokens to keep so that "
        "everything it holds (keys and values with their scales and zeros, positions, offsets, the decode room, "
        "kept queries and prefill scores: ``memory_bytes()``) fits, after every forward, ``memory`` times the "
        "bytes the model's own ``DynamicCache(config=model.config)`` holds for the tokens seen so far at the "
        "model's dtype, layer by layer (a sliding window at most its window, linear-attention states at their "
        "size; folds while "
        "decoding evict what no longer fits; ``memory=1.0`` is the whole cache, exactly "
        "``DynamicCache``'s); the profile's measured table picks the "
        "bits when it has one (and, when it measured each layer's loss at 4 bits, may keep some layers at 8 "
        "bits and the rest at 4), else a fixed rule (``docs/memory.md``). ``cache.kv_bits`` (a tuple, one per "
        "layer, for mixed widths) and ``cache.memory_choice`` say what it chose. Every layer kind counts: "
        'sliding windows are compressed in the budget (``sliding`` defaults to ``"compress"`` with it; '
        'with ``"keep"`` their windows count whole), the layers left to transformers at what they hold.',
        check=checked_memory,
        kinds=(float, int, type(None)),
        low=0,
        before=None,  # files written before the option: no budget
    )
    max_bytes: int | None = option(
        None,
        "Like `memory`, a fixed bound instead: at most this many bytes per batch row after every forward.",
        "The byte analogue of ``max_tokens``: the same choice of bits and tokens as ``memory=``, for a number "
        "of bytes per row whatever the prompt's length (a prompt that fits is kept whole, at the model's "
        "precision when it fits so). At most ``2**50`` (1 PiB per row): a larger number is refused, not taken "
        "as no bound (``None`` is no budget).",
        check=checked_max_bytes,
        kinds=(int, type(None)),
        low=1,
        before=None,  # files written before the option: no budget
    )
    sliding: str = option(
        None,
        "What a sliding-window layer does with a prompt longer than its window ('keep' or 'compress').",
        '``"compress"`` (the default with ``ratio``): the layer drops what is older than its window, as '
        "transformers' own sliding layer does, and ``ratio`` removes that fraction of what is left too "
        "(allocated apart from the full-attention layers, which hold more tokens), so ``ratio`` counts every "
        "layer's entries; under ``memory``/``max_bytes`` the budget's bytes span every layer. ``\"keep\"`` "
        '(the default with ``max_tokens`` or ``decode_max_tokens``, which do not combine with ``"compress"`` '
        "yet, and with ``memory=1.0``): transformers' sliding layer holds the window whole and ``ratio`` "
        "removes entries of the full-attention layers only (a budget counts the windows whole), so the cache "
        "saves less than ``ratio`` says. On "
        'Gemma-3-270M, at equal bytes ``"compress"`` kept far more of the text (``docs/benchmarks.md``). A '
        "prompt that fits the window is compressed like a full layer's either way.",
        check=checked_sliding,
        kinds=(str,),
        before="keep",  # files written before the option: their sliding layers were "keep"'s
    )
    split: str = option(
        None,
        "How a memory budget shares its bytes between sliding-window and full-attention layers.",
        '``"global_first"`` (the default with ``memory``/``max_bytes``): the full-attention layers keep their '
        "tokens first and the compressed sliding windows give theirs first (they hold only the last tokens, "
        "which the full-attention layers hold too); once the windows keep only their protected tokens, the "
        'full-attention layers evict. ``"ratio"``: one ratio for every layer. Each layer ranks its own tokens '
        "either way. On Gemma-3-270M at 1k tokens (tuning texts) ``global_first`` kept 86.8% recall at "
        'memory=0.1 where ``"ratio"`` kept 51.4% (``docs/memory.md``). Only with a budget (``ratio`` without '
        "one evicts every layer at the ratio).",
        check=checked_split,
        kinds=(str,),
        before="ratio",  # files written before the option: one ratio for every layer
    )
    memory_floor: bool = option(
        False,
        "With `memory`/`max_bytes`: a prompt too short for the budget keeps its protected tokens instead of raising.",
        "A budget must hold the tokens every head keeps (``sink + window``) and the decode room; on a prompt "
        "of a few dozen tokens a small fraction of its bytes cannot, and ``memory=`` refuses the prompt "
        "(a ConfigurationError). With ``memory_floor=True`` the budget is then raised to what they need at "
        "the model's precision (the cache evicts every other token, as ``ratio=`` does on such a prompt). "
        "``from_pretrained(model, ratio=...)`` on a sliding-window model sets it (``docs/memory.md``).",
        check=checked_flag,
        kinds=(bool,),
        before=False,  # files written before the option: a budget without a floor
    )
    evict_ratio: Any = option(
        None,
        "`[layers, kv_heads]` fixed local evict ratios for the `profile` (or `hybrid`) allocator.",
        "They set the ratio (their mean), so ``ratio``/``max_tokens`` cannot be given too. "
        '``allocator_kwargs={"profile": profile}`` reads a profile\'s curve at the ratio instead.',
        saved=False,  # the allocator's option: saved under allocator_kwargs
    )
    allocator_kwargs: Mapping[str, Any] | None = option(
        None,
        "Options of the allocator's factory (e.g. `{'profile': profile}`).",
        check=checked_allocator_options,
        saved=False,  # saved from the allocator's own options (JSON, tensors and profiles)
    )

    @property
    def in_bytes(self) -> bool:
        """Whether a memory budget (``memory=`` or ``max_bytes=``) sets what the cache keeps."""
        return self.memory is not None or self.max_bytes is not None

    @property
    def keeps_whole(self) -> bool:
        """``memory=1.0``: the whole budget is the whole cache, so nothing is evicted or quantized and the
        layers hold what ``DynamicCache`` holds, byte for byte."""
        return self.memory is not None and self.memory >= 1.0

    @property
    def evicts_at_folds(self) -> bool:
        """Whether a fold while decoding evicts (:mod:`lukv_cache.cache.compression.fold`): under
        ``decode_max_tokens``, and under a memory budget, whose bytes hold after every forward, when the
        scorer can rank decoded tokens at a fold (``Scorer.decodes``; a scorer that reads every KV head of a
        token, ``context``, only by reusing each token's first score)."""
        scorer = self.scorer
        ranks = scorer.decodes and not (scorer.context and not scorer.keeps_scores)
        return self.decode_max_tokens is not None or (self.in_bytes and not self.keeps_whole and ranks)

    @property
    def defers(self) -> bool:
        """Whether eviction waits for the whole prefill (budgets need every layer's scores first)."""
        return self.allocator.whole_model

    @classmethod
    def check_option(cls, name: str, value: Any) -> Any:
        """``value`` (as given) of option ``name``, through its field's check: the value as kept.

        >>> CompressionPolicy.check_option("sink", 2)
        2
        """
        f = fields_of(cls)[name]
        check = option_spec(f).check
        return value if check is None else check(name, value, f.default)

    @classmethod
    def build(cls, **options: Any) -> Self:
        """The policy of ``LUKVCache(**options)`` (see :class:`~lukv_cache.LUKVCache`), every option checked
        (its field's check, then the checks across options); a :class:`~lukv_cache.errors.ConfigurationError`
        for the first that cannot hold. A subclass's own fields are checked last, each by its check.

        >>> CompressionPolicy.build(ratio=0.8, sink=2).window, CompressionPolicy.build(max_tokens=64).ratio
        (1, 0.0)
        """
        known = fields_of(cls)
        for name in options:
            if name not in known:
                raise TypeError(f"{cls.__name__}.build() got an unexpected keyword argument {name!r}")
        given = {name: options.get(name, f.default) for name, f in known.items()}
        check = cls.check_option
        ratio, max_tokens = given["ratio"], given["max_tokens"]
        allocator_kwargs = check("allocator_kwargs", given["allocator_kwargs"])
        kwargs = dict(allocator_kwargs or {})
        if given["evict_ratio"] is not None:
            kwargs["evict_ratio"] = given["evict_ratio"]
        _check_table_alone(kwargs.get("evict_ratio"), ratio, max_tokens)
        memory = check("memory", given["memory"])
        max_bytes = check("max_bytes", given["max_bytes"])
        _check_budget_alone(memory, max_bytes, given, kwargs.get("evict_ratio"))
        decode_max_tokens = check("decode_max_tokens", given["decode_max_tokens"])
        fold_interval = check("fold_interval", given["fold_interval"])
        if fold_interval is None:
            fold_interval = BUDGET_FOLD_AT if memory is not None or max_bytes is not None else FOLD_AT
        kv_bits = check("kv_bits", given["kv_bits"])
        in_bytes = memory is not None or max_bytes is not None
        bounded = max_tokens is not None or decode_max_tokens is not None
        sliding = given["sliding"]
        if sliding is None:
            # the default: compress (a budget's bytes are counted layer by layer, the sliding ones too), but
            # a token bound is shared by layers holding the same tokens, and memory=1.0 holds what
            # DynamicCache holds
            sliding = "keep" if bounded or (memory is not None and memory >= 1.0) else "compress"
        sliding = check("sliding", sliding)
        split = given["split"]
        if split == "global_first" and not in_bytes:
            raise ConfigurationError(
                f"split={split!r} shares a memory budget's bytes between layer kinds: pass memory= or max_bytes= "
                "with it (ratio= evicts every layer at the ratio)."
            )
        split = check("split", "global_first" if split is None and in_bytes else split or "ratio")
        memory_floor = check("memory_floor", given["memory_floor"])
        if memory_floor and not in_bytes:
            raise ConfigurationError(
                "memory_floor=True raises a memory budget on prompts too short for it: pass memory= or "
                "max_bytes= with it."
            )
        if sliding == "compress" and bounded:
            _refuse_compressed_sliding(given)
        if decode_max_tokens is not None:
            if decode_max_tokens > _MAX_TOKENS_LIMIT:
                raise ConfigurationError(
                    f"decode_max_tokens={decode_max_tokens} is beyond any context; pass None for no bound."
                )
            if not in_bytes:  # a byte budget bounds the prompt itself
                max_tokens = bounded_prompt(ratio, max_tokens, decode_max_tokens, kwargs.get("evict_ratio"))
        if max_tokens is not None:
            if ratio is not None:
                raise ConfigurationError(
                    "Pass either ratio= (the fraction removed) or max_tokens= (a budget per head), not both."
                )
            max_tokens = check("max_tokens", max_tokens)
            if max_tokens > _MAX_TOKENS_LIMIT:
                raise ConfigurationError(
                    f"max_tokens={max_tokens} is beyond any context; pass max_tokens=None for no cap."
                )
            ratio = 0.0  # decided per prompt, at prefill
        if in_bytes:
            ratio = 0.0  # decided per prompt, at prefill, with the bits
        scorer = check("scorer", given["scorer"])
        if decode_max_tokens is not None:
            _check_decodes(scorer)
        sink = check("sink", given["sink"])
        window = check("window", given["window"])
        prefill_chunk_size = check("prefill_chunk_size", given["prefill_chunk_size"])
        min_keep = check("min_keep", given["min_keep"])
        window = scorer.window if window is None else window
        for name, bound in (("max_tokens", max_tokens), ("decode_max_tokens", decode_max_tokens)):
            if bound is not None and bound < sink + window:
                raise ConfigurationError(
                    f"{name}={bound} is below the tokens every head always keeps (sink={sink} + "
                    f"window={window}): raise {name} to at least {sink + window}, or lower sink/window."
                )
        decode_window = _decode_window(
            check("decode_window", given["decode_window"]), decode_max_tokens, sink, window
        )
        allocator = get_allocator(given["allocator"], **kwargs)
        if kwargs.get("evict_ratio") is not None:  # validated by the allocator: the ratio it implies
            ratio = min(_table_mean(kwargs["evict_ratio"]), math.nextafter(1.0, 0.0))
        kept = dict(
            ratio=default_ratio(ratio),
            scorer=scorer,
            allocator=allocator,
            max_tokens=max_tokens,
            decode_max_tokens=decode_max_tokens,
            sink=sink,
            window=window,
            min_keep=min_keep,
            prefill_chunk_size=prefill_chunk_size,
            fold_interval=fold_interval,
            decode_window=decode_window,
            kv_bits=kv_bits,
            memory=memory,
            max_bytes=max_bytes,
            sliding=sliding,
            split=split,
            memory_floor=memory_floor,
            evict_ratio=given["evict_ratio"],
            allocator_kwargs=allocator_kwargs,
        )
        for name in known:  # a subclass's own options
            if name not in kept:
                kept[name] = check(name, given[name])
        return cls(**kept)

    @classmethod
    def rebuilt_options(cls, kept: Mapping[str, Any]) -> dict[str, Any]:
        """The options as given that :meth:`build` turns into a policy holding ``kept`` again (a saved
        policy's values): ``kept`` less what build derives (the ratio a ``max_tokens`` bound, a memory
        budget or an ``evict_ratio`` table sets; ``decode_window``'s 0 without ``decode_max_tokens``)."""
        options = dict(kept)
        table = (options.get("allocator_kwargs") or {}).get("evict_ratio")
        budget = options.get("memory") is not None or options.get("max_bytes") is not None
        if options.get("max_tokens") is not None or table is not None or budget:
            options["ratio"] = None
        if options.get("decode_max_tokens") is None:
            options.pop("decode_window", None)
        return options

    @classmethod
    def bind(cls, owner: str, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """``owner(*args, **kwargs)``'s options by name (positional ones in field order), or the TypeError
        Python raises for an unknown keyword, a second value or too many positional arguments.

        >>> CompressionPolicy.bind("LUKVCache", (0.8, "snapkv"), {"sink": 2})
        {'ratio': 0.8, 'scorer': 'snapkv', 'sink': 2}
        """
        try:
            return dict(option_signature(cls).bind(*args, **kwargs).arguments)
        except TypeError as err:
            raise TypeError(f"{owner}() {err}") from None


def bounded_prompt(ratio: Any, max_tokens: Any, decode_max_tokens: Any, evict_ratio: Any = None) -> Any:
    """``max_tokens``, or ``decode_max_tokens`` when nothing else sets the prompt's budget (no ratio, no
    ``max_tokens``, no table): a bound on the whole generation bounds the prompt too.

    >>> bounded_prompt(None, None, 64), bounded_prompt(0.5, None, 64)
    (64, None)
    """
    if ratio is None and max_tokens is None and evict_ratio is None and decode_max_tokens is not None:
        return decode_max_tokens
    return max_tokens


def check_bits_fit(kv_bits: int | None, config: Any) -> None:
    """Refuse ``kv_bits=4`` for a model whose head dim, read from its ``config``, is odd (4-bit codes pack two
    channels per byte): a :class:`~lukv_cache.errors.ConfigurationError` at construction, as the first
    compression of a cache built without ``config=`` raises. A config that gives no head dim passes.

    >>> from types import SimpleNamespace
    >>> check_bits_fit(4, SimpleNamespace(hidden_size=64, num_attention_heads=4))  # head dim 16
    >>> check_bits_fit(8, SimpleNamespace(head_dim=15))  # one channel per byte
    >>> check_bits_fit(4, SimpleNamespace(head_dim=15))
    Traceback (most recent call last):
    lukv_cache.errors.ConfigurationError: kv_bits=4 packs two channels per byte: head_dim 15 (SimpleNamespace) is odd; use kv_bits=8.
    """
    if kv_bits != 4:
        return
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    dim = getattr(text, "head_dim", None)
    heads, hidden = getattr(text, "num_attention_heads", None), getattr(text, "hidden_size", None)
    if not isinstance(dim, int) and isinstance(heads, int) and heads > 0 and isinstance(hidden, int):
        dim = hidden // heads
    if isinstance(dim, int) and not isinstance(dim, bool) and dim % 2:
        raise ConfigurationError(
            f"kv_bits=4 packs two channels per byte: head_dim {dim} ({type(text).__name__}) is odd; use "
            "kv_bits=8."
        )


def default_ratio(ratio: Any) -> float:
    """``ratio`` checked, :data:`RATIO` when not given.

    >>> default_ratio(None)
    0.5
    """
    return check_ratio(RATIO if ratio is None else ratio)


def _table_mean(table: Any) -> float:
    if isinstance(table, torch.Tensor):
        return float(table.detach().double().mean())
    return float(np.asarray(table, dtype=np.float64).mean())


def _check_table_alone(evict_ratio: Any, ratio: Any, max_tokens: Any) -> None:
    """A fixed evict-ratio table sets every head's budget, hence the ratio: refuse a second answer."""
    if evict_ratio is None or (ratio is None and max_tokens is None):
        return
    given = "ratio=" if ratio is not None else "max_tokens="
    raise ConfigurationError(
        f"evict_ratio= fixes every head's budget (its mean is the ratio), so {given} cannot also apply. "
        f"Drop {given}, or read a profile's curve at your ratio: LUKVCache(ratio, allocator='profile', "
        "allocator_kwargs={'profile': profile}) or LUKVCache.from_pretrained(model_id, ratio=...)."
    )


def _refuse_compressed_sliding(given: Mapping[str, Any]) -> None:
    """``sliding="compress"`` with a token bound: the error names the bound the user passed."""
    tokens = [f"{name}=" for name in ("max_tokens", "decode_max_tokens") if given[name] is not None]
    raise ConfigurationError(
        f"sliding='compress' does not combine with {' or '.join(tokens)} yet (a token bound is shared by "
        "layers that all hold the same tokens); use ratio= or memory=, or leave sliding= unset (with a token "
        "bound it is 'keep')."
    )


def _check_budget_alone(memory: Any, max_bytes: Any, given: Mapping[str, Any], evict_ratio: Any) -> None:
    """A memory budget chooses the ratio and the bits itself: refuse a second answer to either."""
    if memory is None and max_bytes is None:
        return
    if memory is not None and max_bytes is not None:
        raise ConfigurationError(
            "Pass either memory= (a fraction of the full cache's bytes) or max_bytes= (bytes per row), not both."
        )
    budget = "memory=" if memory is not None else "max_bytes="
    others = [f"{name}=" for name in ("ratio", "max_tokens", "kv_bits") if given[name] is not None]
    if evict_ratio is not None:
        others.append("evict_ratio=")
    if others:
        raise ConfigurationError(
            f"{budget} chooses how many tokens to keep and at how many bits, so {', '.join(others)} cannot "
            f"also apply: drop {' and '.join(others)}, or drop {budget} and choose them yourself."
        )


def _decode_window(decode_window: int | None, decode_max_tokens: int | None, sink: int, window: int) -> int:
    """The recent tokens protected at every fold: ``decode_window`` (checked), or a quarter of the bound (at
    least the prompt's ``window``, at most what the bound leaves after the sinks)."""
    if decode_max_tokens is None:
        if decode_window is not None:
            raise ConfigurationError(
                "decode_window= protects recent tokens when eviction at fold time runs; pass "
                "decode_max_tokens= too, or drop decode_window=."
            )
        return 0
    if decode_window is None:
        return min(max(window, decode_max_tokens // 4), decode_max_tokens - sink)
    if sink + decode_window > decode_max_tokens:
        raise ConfigurationError(
            f"decode_window={decode_window} and sink={sink} do not fit in decode_max_tokens={decode_max_tokens}: "
            f"lower decode_window to at most {decode_max_tokens - sink}, or raise decode_max_tokens."
        )
    return decode_window


def _check_decodes(scorer: Scorer) -> None:
    """A scorer asked to rank tokens generated while decoding must be able to (``Scorer.decodes``)."""
    if not scorer.decodes:
        why = (
            "its scores come from repeat passes over the whole context, run once by cache.prefill"
            if scorer.reconstruction is not None
            else "it is registered with decodes=False"
        )
        raise ConfigurationError(
            f"Scorer {scorer.name!r} cannot rank tokens generated while decoding (decode_max_tokens=): {why}. "
            "Use 'kvzap' (a learned surrogate of KVzip+ that scores every token in the ordinary forward: "
            "LUKVCache.from_pretrained(model, scorer='kvzap', decode_max_tokens=...)) or 'keydiff', or drop "
            "decode_max_tokens= to compress the prompt only."
        )
    if scorer.context and scorer.rescores:
        raise ConfigurationError(
            f"Scorer {scorer.name!r} reads every KV head of a token (context=True), which eviction no longer keeps "
            "together, so it cannot rescore a head's tokens at a fold: give it rescores=False (each token keeps "
            "the score it got when first scored)."
        )
