"""LUKVCache: a DynamicCache that evicts per (layer, KV head) right after each layer's prefill."""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import numbers
import os
import sys
import warnings
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    DynamicCache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

from ..allocation import AllocationRequest, allocators_reading_profile, get_allocator
from ..attention.calls import AttentionCall, announce_attention, discard_attention, guard_attention
from ..errors import BatchMismatchError, ConfigurationError, IncompatibleAttentionError
from ..scorers import Scorer, get_scorer
from ..scorers.kvzap import kvzap_scorer
from ..scorers.kvzip import RepeatPrompt, chunk_scores, value_norms
from .compression import (
    CompressionPolicy,
    Region,
    keep_mask,
    masked_scores,
    plan_region,
    score_suffix,
    suffix_positions,
    trim_counts,
    valid_from_mask,
)
from .decoding import Held, fit_counts, gather_held, held_tokens, masked_held, rescore
from .hybrid import LUKVHybridLayer
from .layer import FOLD_AT, LUKVLayer
from .parallel import HeadShard, head_shard, mesh_shard
from .quant import check_kv_bits
from .ragged import keep_mask_from_counts
from .reconstruction import ReconstructionRound, check_prefill_inputs, plan_rounds


def check_ratio(ratio: Any) -> float:
    """``ratio`` as a float in [0, 1): Python, numpy and 0-d torch numbers are accepted; bools, NaN,
    strings and anything out of range raise :class:`~lukv_cache.errors.ConfigurationError`.

    >>> check_ratio(0.8)
    0.8
    """
    if isinstance(ratio, torch.Tensor) and ratio.ndim == 0 and ratio.dtype != torch.bool:
        ratio = ratio.item()
    valid = (
        isinstance(ratio, numbers.Real) and not isinstance(ratio, bool) and type(ratio).__name__ != "bool_"
    )
    if not valid or math.isnan(float(ratio)) or not 0.0 <= float(ratio) < 1.0:
        raise ConfigurationError(
            f"ratio is the fraction of the prompt's KV entries to remove and must be in [0, 1); got {ratio!r}. "
            "ratio=0.8 keeps 20% of the tokens."
        )
    return float(ratio)


_MAX_TOKENS_LIMIT = 2**40  # far beyond any context; larger numbers are a mistake (None means no cap)


def _check_count(name: str, value: Any, *, positive: bool = False) -> int | None:
    """``value`` as an int (Python or numpy integers), or a ConfigurationError naming ``name``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_floating_point():
        value = value.item()
    if (
        isinstance(value, bool)
        or type(value).__name__ == "bool_"
        or not isinstance(value, numbers.Integral)
        or value < (1 if positive else 0)
    ):
        kind = "a positive" if positive else "a non-negative"
        raise ConfigurationError(f"{name} must be {kind} integer, got {value!r}.")
    return int(value)


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


def kv_cache_bytes(cache: Any) -> int:
    """Bytes of every tensor a transformers cache holds: a LUKVCache's stores, positions, offsets and suffix
    buffers, the keys/values of stock layers (``DynamicCache``, sliding and indexed layers) and the
    conv / recurrent states of linear-attention and SSM layers.

    >>> kv_cache_bytes(DynamicCache())
    0
    """
    total = 0
    for layer in getattr(cache, "layers", []):
        if isinstance(layer, LUKVLayer):  # a LUKVHybridLayer counts its linear states itself
            total += layer.memory_bytes()
            continue
        tensors = []
        if getattr(layer, "is_initialized", False):
            tensors += [getattr(layer, name, None) for name in ("keys", "values", "indexer_keys")]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors += [*layer.conv_states.values(), *layer.recurrent_states.values()]
        total += sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return total


def _positions(mask: torch.Tensor, length: int, past: int) -> torch.Tensor | None:
    """Position ids of the last ``length`` tokens as ``generate()`` numbers a left-padded batch (each row
    from 0, padding at 1), from a mask over the past and new tokens; None if the mask covers neither."""
    if mask.shape[-1] != past + length:  # e.g. a mask of the new tokens alone: the model numbers them
        return None
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -length:]


def _decode_window(decode_window, decode_max_tokens: int | None, sink: int, window: int) -> int:
    """The recent tokens protected at every fold: ``decode_window``, or a quarter of the bound (at least
    the prompt's ``window``, at most what the bound leaves after the sinks)."""
    decode_window = _check_count("decode_window", decode_window)
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


def _stock_keys(layer: Any) -> torch.Tensor | None:
    """``[B, H, S, D]``: the keys a stock transformers layer holds, or ``None`` (not filled yet, or a layer
    without per-token keys: linear-attention, SSM and placeholder layers)."""
    keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    return keys if isinstance(keys, torch.Tensor) and keys.ndim == 4 else None


def _lukv_layer(layer: Any) -> Any:
    """The layer the cache keeps in place of transformers' ``layer``: a compressed one for full attention
    (alone, or beside a linear-attention state), transformers' own for everything else."""
    if type(layer) is DynamicLayer:
        return LUKVLayer()
    if type(layer) is LinearAttentionAndFullAttentionLayer:
        return LUKVHybridLayer(number_of_states=layer.number_of_states)
    return layer


_WINDOWED = ("sliding_attention", "chunked_attention", "hybrid_sliding")  # stock layers bounded by a window
_HELD_WHOLE = ("indexed_attention",)  # stock attention layers that keep every token


def _callers(skip: int, limit: int) -> Iterator[Any]:
    """The frames calling the function that calls this one, innermost first, after ``skip`` of them."""
    frame = sys._getframe(skip + 2)
    for _ in range(limit):
        if frame is None:
            return
        yield frame
        frame = frame.f_back


def _calling_model() -> torch.nn.Module | None:
    """The nearest ``nn.Module`` with a config on the call stack (the model, or the layer, that called into
    the cache), or ``None`` (the cache used outside a model)."""
    for frame in _callers(1, 64):
        owner = frame.f_locals.get("self")
        config = getattr(owner, "config", None) if isinstance(owner, torch.nn.Module) else None
        if config is not None and hasattr(config, "get_text_config"):
            return owner
    return None


def generate_prefill_chunk() -> int | None:
    """The chunk size when the running forward is a chunk of transformers' chunked prefill
    (``model.generate(..., prefill_chunk_size=C)``), else ``None``.

    The cache cannot tell such a chunk from a question sent after a context (both are a later multi-token
    forward) by what it receives, so it looks for ``GenerationMixin._prefill``'s chunk loop on the call
    stack (transformers 5.23, the pinned release): cheap, and only asked after a compressed multi-token
    forward.

    >>> generate_prefill_chunk() is None
    True
    """
    # the model's forward, its layers and wrappers lie between _prefill and here
    for frame in _callers(0, 128):
        if (
            frame.f_code.co_name == "_prefill"
            and frame.f_globals.get("__name__") == "transformers.generation.utils"
        ):
            config = frame.f_locals.get("generation_config")
            chunk = getattr(config, "prefill_chunk_size", None)
            return int(chunk) if chunk is not None and "chunk_idx" in frame.f_locals else None
    return None


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


def _profile_scorer(profile: Any, name: str) -> str | Scorer:
    """``name``, or for ``kvzap`` the scorer bound to the surrogate stored in ``profile``."""
    if name != "kvzap":
        return name
    if profile.surrogate is None:
        raise ConfigurationError(
            f"The profile {profile.model_id}/{profile.scorer} ({profile.source or 'in memory'}) holds no kvzap "
            "surrogate. Use the model's kvzap profile (scorer='kvzap' looks up <model id>/kvzap.safetensors), or "
            "build one: lukv build <model> --scorer kvzap."
        )
    return kvzap_scorer(profile.surrogate)


class LUKVCache(DynamicCache):
    """KV cache with per-head eviction after prefill, stored ragged so the memory is really freed.

    Args:
        ratio: fraction of the prompt's evictable KV entries to remove (``0.8`` keeps 20%; default 0.5).
        max_tokens: instead of ``ratio``, a hard bound: after the prompt's forward, each row holds at most
            this many tokens per (full-attention layer, KV head) on average, sinks and window included,
            whatever the prompt's length (each prompt gets its own ratio, budgets are trimmed if an
            allocator asks for more; a prompt that already fits is kept whole). At least ``sink + window``.
        scorer: name of a registered scorer (``keydiff``, ``snapkv``, ``expected_attention``, ``knorm``,
            ``tova``, ``streaming``, ``random``) or a :class:`~lukv_cache.scorers.Scorer`.
        allocator: ``uniform``, ``pyramid``, ``adakv``, ``profile`` (needs ``evict_ratio`` or a ``profile``) or any
            registered name; ``allocator_kwargs`` go to its factory.
        sink: first tokens of each row always kept (attention sinks).
        window: last prompt tokens always kept, dense (default: the scorer's, 1 or 32 for snapkv).
        min_keep: every head keeps at least this fraction of its evictable tokens (and >= 1 token).
        prefill_chunk_size: also compress later multi-token forwards once this many uncompressed tokens
            pile up (chunked prefill); by default only the first forward (the context) is compressed.
        evict_ratio: ``[layers, kv_heads]`` fixed local evict ratios for ``allocator="profile"`` (or
            ``hybrid``); they set the ratio (their mean), so ``ratio``/``max_tokens`` cannot be given too.
            ``allocator_kwargs={"profile": profile}`` reads a profile's curve at the ratio instead.
        config: the model config; lets sliding-window layers use the stock sliding layer from the start.
        keep_scores: keep each layer's prefill scores (fp32 ``[B, H_kv, T]``) in :attr:`prefill_scores`.
        decode_max_tokens: bound the whole generation, not just the prompt: every ``fold_interval`` tokens
            after the prompt, the budgets are applied again to everything the cache holds, so that each row
            keeps at most this many tokens per (full-attention layer, KV head) on average (sinks and window
            included), the allocator's budgets read at the ratio that total implies. Without ``ratio`` or
            ``max_tokens`` it bounds the prompt too (``max_tokens`` is this). Needs a scorer that decodes
            (not ``kvzip``). Off by default.
        fold_interval: the dense suffix of decoded tokens is folded into the ragged store every this many
            tokens (default 256), and with ``decode_max_tokens`` evicted there.
        kv_bits: store the kept keys and values in 8 or 4 bits (per token, groups of 32 channels with an
            fp16 scale and zero each; :mod:`lukv_cache.cache.quant`) instead of the model's dtype; the dense
            suffix (window, new tokens) stays at full precision until it folds. Scores are computed before
            quantization, so the prompt's eviction is the same for every ``kv_bits``. Default ``None``.
        decode_window: with ``decode_max_tokens``, the most recent tokens each head keeps at every fold
            (part of the bound). Default: a quarter of ``decode_max_tokens`` (at least ``window``); recent
            tokens matter most to the next ones, and a quarter measured best for kvzap and keydiff
            (``benchmarks/results/decode_window_tuning/``).
        device_mesh: tensor parallelism's ``DeviceMesh`` (1-D, or one with a ``"tp"`` dimension such as
            transformers' ``model._device_mesh``). Rarely needed: a model loaded with ``tp_plan="auto"`` is
            recognised from its sharded attention weights. Under tensor parallelism each rank's cache holds
            the rank's block of KV heads (:attr:`head_shard`), with the budgets of a single-process run.

    Example:
        >>> cache = LUKVCache(ratio=0.8, scorer="keydiff", allocator="uniform")
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=4, do_sample=False)
        >>> cache.stored_tokens().shape  # [layers, batch, kv_heads]
        torch.Size([2, 1, 2])
    """

    def __init__(
        self,
        ratio: float | None = None,
        scorer: str | Scorer = "keydiff",
        allocator: Any = "uniform",
        *,
        max_tokens: int | None = None,
        sink: int = 4,
        window: int | None = None,
        min_keep: float = 0.01,
        prefill_chunk_size: int | None = None,
        evict_ratio: Any = None,
        allocator_kwargs: dict | None = None,
        config: Any = None,
        keep_scores: bool = False,
        device_mesh: Any = None,
        decode_max_tokens: int | None = None,
        fold_interval: int = FOLD_AT,
        decode_window: int | None = None,
        kv_bits: int | None = None,
    ):
        kwargs = dict(allocator_kwargs or {})
        if evict_ratio is not None:
            kwargs["evict_ratio"] = evict_ratio
        _check_table_alone(kwargs.get("evict_ratio"), ratio, max_tokens)
        decode_max_tokens = _check_count("decode_max_tokens", decode_max_tokens, positive=True)
        if fold_interval is None:
            raise ConfigurationError(
                f"fold_interval must be a positive integer (tokens between folds; default {FOLD_AT}), got None."
            )
        fold_interval = _check_count("fold_interval", fold_interval, positive=True)
        kv_bits = check_kv_bits(kv_bits)
        if decode_max_tokens is not None:
            if decode_max_tokens > _MAX_TOKENS_LIMIT:
                raise ConfigurationError(
                    f"decode_max_tokens={decode_max_tokens} is beyond any context; pass None for no bound."
                )
            if ratio is None and max_tokens is None and kwargs.get("evict_ratio") is None:
                max_tokens = decode_max_tokens  # the prompt is bounded too
        if max_tokens is not None:
            if ratio is not None:
                raise ConfigurationError(
                    "Pass either ratio= (the fraction removed) or max_tokens= (a budget per head), not both."
                )
            max_tokens = _check_count("max_tokens", max_tokens, positive=True)
            if max_tokens > _MAX_TOKENS_LIMIT:
                raise ConfigurationError(
                    f"max_tokens={max_tokens} is beyond any context; pass max_tokens=None for no cap."
                )
            ratio = 0.0  # decided per prompt, at prefill
        scorer_obj = get_scorer(scorer)
        if scorer_obj.missing:
            raise ConfigurationError(scorer_obj.missing)
        if decode_max_tokens is not None:
            _check_decodes(scorer_obj)
        sink = _check_count("sink", sink)
        window = _check_count("window", window)
        prefill_chunk_size = _check_count("prefill_chunk_size", prefill_chunk_size, positive=True)
        if isinstance(min_keep, bool) or not isinstance(min_keep, numbers.Real) or not 0.0 <= min_keep < 1.0:
            raise ConfigurationError(f"min_keep must be a number in [0, 1), got {min_keep!r}.")
        window = scorer_obj.window if window is None else window
        for name, bound in (("max_tokens", max_tokens), ("decode_max_tokens", decode_max_tokens)):
            if bound is not None and bound < sink + window:
                raise ConfigurationError(
                    f"{name}={bound} is below the tokens every head always keeps (sink={sink} + "
                    f"window={window}): raise {name} to at least {sink + window}, or lower sink/window."
                )
        decode_window = _decode_window(decode_window, decode_max_tokens, sink, window)
        allocator_obj = get_allocator(allocator, **kwargs)
        if kwargs.get("evict_ratio") is not None:  # validated by the allocator: the ratio it implies
            ratio = min(_table_mean(kwargs["evict_ratio"]), math.nextafter(1.0, 0.0))
        ratio = check_ratio(0.5 if ratio is None else ratio)
        self.policy = CompressionPolicy(
            ratio=ratio,
            scorer=scorer_obj,
            allocator=allocator_obj,
            sink=sink,
            window=window,
            min_keep=float(min_keep),
            prefill_chunk_size=prefill_chunk_size,
            max_tokens=max_tokens,
            decode_max_tokens=decode_max_tokens,
            fold_interval=fold_interval,
            decode_window=decode_window,
            kv_bits=kv_bits,
        )
        super().__init__()
        self.layer_class_to_replicate = LUKVLayer  # until the layout is known (config=, or the model's)
        self.profile = None  # the Profile the budgets come from (set by from_pretrained)
        self._mesh_shard = None if device_mesh is None else mesh_shard(device_mesh)
        self._kv_heads: int | None = None  # the model's KV heads per layer (from its config)
        self._head_shard: HeadShard | None = None
        self._heads_checked = False
        self.prefill_scores: dict[int, torch.Tensor] | None = {} if keep_scores else None
        self.num_layers: int | None = None
        self._last_full_layer: int | None = None
        self._full_layers: list[int] = []
        # sliding layers laid out as LUKVLayers until the first forward decides (its length vs the window):
        # layer -> window; whether that forward is still to come; the layout's own full-attention layers
        self._windows: dict[int, int] = {}
        self._undecided = False
        self._attention_layers: list[int] = []
        self._layout_warning: tuple | None = None  # what the warning, deferred to that decision, names
        self._warned: tuple | None = None
        self._cap_ratio: torch.Tensor | None = None  # max_tokens: each row's ratio in this forward
        self._config_checked = False
        self._record_past = False
        self._awaiting: int | None = None  # layer whose announced attention has not run yet
        # layer -> the attention module that read it (weak): a call announced for it names its reader
        self._readers: dict[int, weakref.ref] = {}
        self._unrouted = False  # the model attends in its own code, never through the attention interface
        self._other_keys = False  # a layer's attention received other keys than update() returned
        self._deferred: dict[int, tuple[Region, torch.Tensor | None]] = {}
        # decode_max_tokens: layers whose fold is due in this forward -> (attention module, mask)
        self._folding: dict[int, tuple[Any, torch.Tensor | None]] = {}
        # "hold": multi-token forwards plan their regions and keep everything (evict_held() evicts);
        # "reconstruct": a reconstruction scorer's pass, scored into _round.scores and cropped afterwards
        self._phase: str | None = None
        self._held: dict[int, Region] = {}
        self._round: ReconstructionRound | None = None
        if config is not None:
            self._set_layout(config)

    # ------------------------------------------------------------------ the policy, read-only
    @property
    def ratio(self) -> float:
        return self.policy.ratio

    @property
    def scorer(self) -> Scorer:
        return self.policy.scorer

    @property
    def evicts(self) -> bool:
        """Whether this cache removes anything (a ratio above 0, or a token budget)."""
        policy = self.policy
        return policy.ratio > 0 or policy.max_tokens is not None or policy.decode_max_tokens is not None

    @property
    def max_tokens(self) -> int | None:
        return self.policy.max_tokens

    @property
    def decode_max_tokens(self) -> int | None:
        return self.policy.decode_max_tokens

    @property
    def fold_interval(self) -> int:
        return self.policy.fold_interval

    @property
    def kv_bits(self) -> int | None:
        """Bits per entry of the stored keys and values (8 or 4), ``None`` at the model's precision."""
        return self.policy.kv_bits

    @property
    def decode_window(self) -> int:
        """The recent tokens each head keeps at every fold (0 without ``decode_max_tokens``)."""
        return self.policy.decode_window

    @property
    def allocator(self):
        return self.policy.allocator

    @property
    def allocator_name(self) -> str:
        return self.policy.allocator.name

    @property
    def sink(self) -> int:
        return self.policy.sink

    @property
    def window(self) -> int:
        return self.policy.window

    @property
    def min_keep(self) -> float:
        return self.policy.min_keep

    @property
    def prefill_chunk_size(self) -> int | None:
        return self.policy.prefill_chunk_size

    # ------------------------------------------------------------------ construction from a profile
    @classmethod
    def from_pretrained(
        cls,
        model_or_profile: Any,
        ratio: float | None = None,
        scorer: str | None = None,
        *,
        max_tokens: int | None = None,
        allocator: str | None = None,
        revision: str | None = None,
        repo_id: str | None = None,
        token: str | bool | None = None,
        local_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        endpoint: str | None = None,
        local_files_only: bool = False,
        timeout: float | None = None,
        sink: int | None = None,
        window: int | None = None,
        **kwargs: Any,
    ) -> LUKVCache:
        """A cache whose per-head budgets come from the LU-KV profile of a model.

        ``ratio``: the fraction of the prompt removed (default 0.5, as in ``LUKVCache()``); or
        ``max_tokens``: at most that many tokens per (layer, KV head) whatever the prompt's length, the
        profile read at each prompt's own ratio; or
        ``decode_max_tokens``: that bound kept for the whole generation (see :class:`LUKVCache`).

        ``model_or_profile``: a model id (looked up in ``local_dir`` / ``$LUKV_PROFILE_DIR`` first, then
        in the shared Hub repository at ``<model id>/<scorer>.safetensors``), a loaded model (its
        ``config.name_or_path`` is the key and its shape is checked), or a path to a profile file.
        The profile's scorer, sink and window become the cache's unless overridden. ``allocator``: by
        default ``"global"`` for a ``kvzap`` profile (its scores are comparable across layers and heads, and
        one model-wide top-k lost the least on SmolLM2-135M: docs/kvzap.md) and ``"profile"`` for every
        other scorer; ``"profile"`` (LU-KV's budgets as they are), ``"hybrid"`` (the profile's layer totals, spread over
        each layer's heads by score), ``"hybrid_global"``, ``"threshold"`` (a kvzap profile's score
        thresholds: every token above the one for the ratio; see :mod:`lukv_cache.allocation.builtin`), or
        any other registered allocator (``"global"``: the profile then gives the scorer, sink and window).
        ``scorer``: by default the model's ``kvzap`` profile when it has one (its surrogate scores), else
        ``keydiff``. ``revision``,
        ``repo_id``, ``token``, ``cache_dir``, ``endpoint``, ``local_files_only`` and ``timeout`` (seconds before the Hub counts as
        unreachable; default ``$LUKV_HUB_TIMEOUT`` or 5) go to huggingface_hub.

        >>> cache = LUKVCache.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", ratio=0.8)  # doctest: +SKIP
        """
        from ..profiles import HubLocation, resolve_profile

        if max_tokens is None and ratio is None and kwargs.get("decode_max_tokens") is not None:
            max_tokens = kwargs["decode_max_tokens"]  # the prompt is bounded too, as in LUKVCache()
        if max_tokens is None:
            ratio = check_ratio(0.5 if ratio is None else ratio)  # LUKVCache()'s default too
        hub = HubLocation(repo_id, revision, token, cache_dir, endpoint, local_files_only, timeout)
        profile = resolve_profile(model_or_profile, scorer, hub=hub, local_dir=local_dir)
        config = getattr(model_or_profile, "config", None)
        if config is not None:
            profile.validate_for(config)
            kwargs.setdefault("config", config)
        if scorer is not None and scorer != profile.scorer:
            warnings.warn(
                f"The profile {profile.model_id}/{profile.scorer} was built for scorer {profile.scorer!r}; "
                f"its budgets are used with scorer {scorer!r} instead.",
                stacklevel=2,
            )
        if allocator is None:
            allocator = "global" if profile.scorer == "kvzap" else "profile"
        reads_profile = allocator in allocators_reading_profile()
        allocator_kwargs = {"profile": profile} if reads_profile else {}
        cache = cls(
            ratio,
            _profile_scorer(profile, scorer or profile.scorer),
            allocator,
            sink=profile.sink if sink is None else sink,
            window=profile.window if window is None else window,
            min_keep=kwargs.pop("min_keep", profile.min_keep),
            max_tokens=max_tokens,
            # the profile's curve, read at the ratio (or each prompt's own ratio under max_tokens)
            allocator_kwargs={**allocator_kwargs, **(kwargs.pop("allocator_kwargs", None) or {})},
            **kwargs,
        )
        cache.profile = profile
        return cache

    # ------------------------------------------------------------------ the model's layer layout
    def _set_layout(self, config: Any) -> None:
        """transformers' own layer for every layer the cache does not compress (sliding and chunked windows,
        linear-attention / SSM states, KV-sharing placeholders, ...), a :class:`LUKVLayer` for every
        full-attention one; then learn what the model's layers mean for eviction."""
        text = config.get_text_config(decoder=True)
        kinds = get_layer_types_and_kwargs(text)[0]
        unknown = sorted(set(kinds) - set(DYNAMIC_LAYER_TYPE_MAPPING))
        if unknown:
            raise IncompatibleAttentionError(
                f"{type(text).__name__} has layers of type {unknown}, which keep state of their own that a "
                "LUKVCache cannot hold (transformers' DynamicCache cannot either); use the cache the model "
                "creates itself (generate without past_key_values)."
            )
        stock = DynamicCache(config=config).layers
        # KV sharing (Gemma-3n, Gemma-4 E-models): a layer whose KV later layers read keeps it whole, since
        # they receive the tensors its update() returned, not what a compressed layer holds
        modes = getattr(text, "kv_sharing_modes", None) or ()
        self._kv_producers = [i for i, mode in enumerate(modes) if mode == "store"]
        self.layers = [
            layer if i in self._kv_producers else _lukv_layer(layer) for i, layer in enumerate(stock)
        ]
        # sliding-window layers: compressed like full ones when the prompt fits their window (decided at the
        # first forward, _decide_windows); chunked layers share the stock class but not the mask: stock
        self._windows = {
            i: layer.sliding_window
            for i, (layer, kind) in enumerate(zip(stock, kinds))
            if type(layer) is DynamicSlidingWindowLayer
            and kind == "sliding_attention"
            and i not in self._kv_producers
        }
        self._pend_windows()
        self.layer_class_to_replicate = None
        if getattr(self, "_record_past", False):  # assisted decoding asked before the layers existed
            self._record_in(self.layers)
        self._learn_model(config)

    def _adopt_layout(self) -> None:
        """Built without ``config=``: when the model first reaches the cache, learn the layout from the
        model itself (the config of the module calling in), so that hybrid models' linear-attention / SSM
        layers, chunked and KV-sharing layers get their own layers from the start, as with ``config=``."""
        if self.layer_class_to_replicate is None or self.layers:
            return
        model = _calling_model()
        if model is None:
            return
        from transformers import PreTrainedModel

        accepts = inspect.signature(type(model).forward).parameters
        if isinstance(model, PreTrainedModel) and not {"past_key_values", "past_key_value"} & set(accepts):
            warnings.warn(
                f"{type(model).__name__} takes no past_key_values (it keeps a state of its own, as RWKV and Mamba "
                "do): this LUKVCache stays empty and compresses nothing.",
                stacklevel=4,
            )
        self._set_layout(model.config)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._adopt_layout()
        return super().get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        self._adopt_layout()
        return super().get_mask_sizes(query_length, layer_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        self._adopt_layout()
        return super().has_previous_state(layer_idx, state_idx)

    def get_conv_state(self, layer_idx: int, state_idx: int = 0):
        self._adopt_layout()
        return super().get_conv_state(self._linear(layer_idx), state_idx)

    def update_conv_state(self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs):
        self._adopt_layout()
        return super().update_conv_state(conv_states, self._linear(layer_idx), state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0):
        self._adopt_layout()
        return super().get_recurrent_state(self._linear(layer_idx), state_idx)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs
    ):
        self._adopt_layout()
        return super().update_recurrent_state(recurrent_states, self._linear(layer_idx), state_idx, **kwargs)

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self._adopt_layout()
        if layer_idx >= len(self.layers) or not hasattr(self.layers[layer_idx], "update_indexer"):
            raise IncompatibleAttentionError(
                f"Layer {layer_idx} attends through a sparse-attention indexer (DeepSeek-V3.2's DSA and kin), whose "
                "indexer keys this LUKVCache has no layer for. Build the cache with config=model.config "
                "(LUKVCache(..., config=model.config), or LUKVCache.from_pretrained(model, ...)): the indexed "
                "layers then keep transformers' own layer, uncompressed."
            )
        return super().update_indexer(indexer_key_states, layer_idx)

    def _linear(self, layer_idx: int) -> int:
        """``layer_idx``, once it is known to be a linear-attention / SSM layer; else a typed error."""
        if layer_idx < len(self.layers) and isinstance(
            self.layers[layer_idx], LinearAttentionCacheLayerMixin
        ):
            return layer_idx
        raise ConfigurationError(
            f"Layer {layer_idx} of this model is a linear-attention or state-space layer, and this LUKVCache does "
            "not know the model's layer layout. Build it with config=model.config (LUKVCache(..., "
            "config=model.config), or LUKVCache.from_pretrained(model, ...))."
        )

    @staticmethod
    def _record_in(layers: list[Any]) -> None:
        """Let ``layers`` roll back (assisted decoding crops rejected drafts), as ``activate_past_recording``
        does for the layers that exist when it is called."""
        for layer in layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()

    def _pend_windows(self) -> None:
        """Sliding layers become LUKVLayers that know their window, until the next first forward decides."""
        for i, window in self._windows.items():
            self.layers[i] = LUKVLayer(sliding_window=window)
        self._undecided = bool(self._windows)

    def _decide_windows(self, length: int) -> None:
        """The first forward (``length`` tokens, padding included) reached the cache: a sliding layer whose
        window holds it stays a compressed LUKVLayer (exact: transformers' sliding mask, built over the
        logical positions, hides what falls out of the window, and folds drop it); a longer prompt gives
        the layer to transformers' stock sliding layer, as a DynamicCache holds it."""
        self._undecided = False
        kept = [i for i, window in self._windows.items() if length <= window]
        for i, window in self._windows.items():
            if i not in kept:
                layer = DynamicSlidingWindowLayer(sliding_window=window)
                if self._record_past:
                    layer.activate_past_recording()
                self.layers[i] = layer
        self._full_layers = sorted({*self._attention_layers, *kept})
        self._last_full_layer = self._full_layers[-1] if self._full_layers else None
        if self._layout_warning is not None:
            self._warn_layout(*self._layout_warning, kept=kept, length=length)

    # ------------------------------------------------------------------ the forward
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        self._adopt_layout()
        if self._undecided:
            self._decide_windows(key_states.shape[-2])
        if layer_idx == 0:
            guard_attention()  # implementations registered since import must not read this cache silently
            self._cap_ratio = None
            if self._awaiting is not None:  # a previous forward raised between update() and attention
                self._awaiting = None
                discard_attention()
            if self._deferred:  # a forward ended before its last full-attention layer compressed
                self._evict_deferred()
            if self._folding:  # likewise for a fold
                self._fold_evict()
        if (
            self.scorer.reconstruction is not None
            and self._phase is None
            and self.evicts
            and key_states.shape[-2] > 1
            and self.get_seq_length(layer_idx) == 0
        ):
            raise ConfigurationError(
                f"Scorer {self.scorer.name!r} scores the context by reconstruction, which needs the model and the "
                "context's token ids: fill the cache with cache.prefill(model, input_ids, tokenizer=tokenizer) "
                "(then generate from it), or pick a scorer that ranks from the prefill alone (e.g. 'keydiff')."
            )
        if self._awaiting is not None:
            awaiting, self._awaiting = self._awaiting, None
            discard_attention()
            if (self.evicts or self.is_compressed) and self._other_keys:
                raise IncompatibleAttentionError(
                    f"LUKVCache layer {awaiting}: the attention received other keys than the cache's update() "
                    "returned, so the cache does not hold what attention reads. Multi-head latent attention "
                    "(DeepSeek-V2/V3/R1, Kimi-K2, MiniCPM3, GLM-4-MoE-Lite, LongCat, ...) does this: it caches one "
                    "compressed latent per token and expands it into keys and values only after update() "
                    "(docs/usage.md, 'Model families'). Only ratio=0 works: use transformers' DynamicCache for this "
                    "model."
                )
            if self.evicts or self.is_compressed:
                raise IncompatibleAttentionError(
                    f"LUKVCache layer {awaiting}: the model attended without going through transformers' "
                    "attention interface, so no lukv_cache attention function read the layer. This model family "
                    "computes attention in its own code (as Bloom, Falcon, GPT-J, GPT-Neo, MPT, CodeGen, XGLM and "
                    "CPM-Ant do), which cannot read a compressed cache whatever attn_implementation is set: only "
                    "ratio=0 works with it, so use transformers' DynamicCache for this model."
                )
            # ratio 0, nothing compressed: the model's own attention code reads the dense layers exactly;
            # announce nothing more (no call may wait for an attention function that never comes)
            self._unrouted = True
        self._check_batch(key_states)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        if isinstance(layer, LUKVLayer) and not self._unrouted:
            self._set_fold(layer)
            self._awaiting = layer_idx
            reader = self._readers.get(layer_idx)
            announce_attention(
                AttentionCall(
                    layer_idx,
                    keys,
                    values,
                    layer.store,
                    self._after_attention,
                    module=reader,
                    on_other_keys=self._keys_changed,
                )
            )
        return keys, values

    def _keys_changed(self) -> None:
        self._other_keys = True

    def _check_batch(self, key_states: torch.Tensor) -> None:
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                held = layer.batch_size if layer.is_initialized else None
            else:
                keys = _stock_keys(layer)
                held = None if keys is None else keys.shape[0]
            if held is not None:
                if key_states.shape[0] != held:
                    raise BatchMismatchError(
                        f"LUKVCache holds a batch of {held} rows but this forward has {key_states.shape[0]}; the "
                        "cache is unchanged. Beam search or num_return_sequences > 1 from a filled cache (after "
                        "cache.prefill) need its rows repeated first: cache.batch_repeat_interleave(n), with n = "
                        "num_beams x num_return_sequences. Otherwise use the same batch for the whole generation "
                        "or start a fresh cache.",
                        expected=held,
                        got=int(key_states.shape[0]),
                    )
                return

    def _after_attention(
        self,
        call: AttentionCall,
        module: Any,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
        sliding_window: int | None,
        scaling: float,
        softcap: float | None,
    ) -> None:
        """The layer's attention ran (see :class:`~lukv_cache.attention.AttentionCall`): compress it, or
        hand a sliding-window layer to the stock sliding layer."""
        self._awaiting = None
        idx = call.layer_idx
        layer = self.layers[idx]
        if idx not in self._readers:
            self._readers[idx] = weakref.ref(module)
        if self._phase == "reconstruct":
            self._score_round(idx, module, query, scaling, softcap)
            return
        self._learn_model(getattr(module, "config", None))
        if sliding_window is not None and layer.sliding_window is None and not layer.compressed:
            self.layers[idx] = layer.to_sliding(sliding_window, record_past=self._record_past)
            return
        self._learn_heads(layer, module)
        if not self._wants_compression(layer, query.shape[2]):
            if self.policy.decode_max_tokens is not None and self._phase is None:
                self._after_decoding(idx, layer, module, query, attention_mask)
            return
        region = plan_region(layer, self.policy, attention_mask)
        if self._phase == "hold":
            self._held[idx] = region
            return
        scores = None
        evictable = region.length and bool(region.n_evictable.any())
        # ratio 0 keeps every token: no scoring needed (a reconstruction scorer could not score here anyway)
        wanted = (evictable and self.evicts) or self.prefill_scores is not None
        if wanted and self.scorer.reconstruction is None:
            valid = valid_from_mask(
                attention_mask, layer.batch_size, layer.suffix_length, layer.suffix_keys.device
            )
            context = self._score_context(idx, module, layer, attention_mask)
            raw = score_suffix(self.policy.scorer, layer, query, valid, context)
            if self.prefill_scores is not None:
                self.prefill_scores[idx] = raw
            scores = masked_scores(raw, region) if evictable and self.evicts else None
        if self.policy.defers:
            self._deferred[idx] = (region, scores)
            if idx == self._last_full_layer:
                self._evict_deferred()
        else:
            self._evict({idx: (region, scores)})

    def _score_context(self, idx: int, module: Any, layer: LUKVLayer, attention_mask) -> dict | None:
        """What a scorer that reads more than keys and values gets (``Scorer.context``)."""
        if not self.scorer.context:
            return None
        shard = self._head_shard
        heads = slice(None) if shard is None else shard.heads(layer.num_heads * shard.size)
        return {
            "layer_idx": idx,
            "module": module,
            "heads": heads,
            "positions": suffix_positions(attention_mask, layer),
            "gather_heads": None if shard is None else shard.gather,
        }

    # ------------------------------------------------------------------ eviction at fold time
    @property
    def _keeps_scores(self) -> bool:
        """Whether stores keep each token's score (eviction at fold time with a scorer that reuses them)."""
        return self.policy.decode_max_tokens is not None and self.scorer.keeps_scores

    def _set_fold(self, layer: LUKVLayer) -> None:
        policy = self.policy
        layer.kv_bits = policy.kv_bits
        if policy.decode_max_tokens is None:
            layer.fold_at = policy.fold_interval
        else:  # the protected window and fold_interval tokens, then the fold evicts (never a plain fold)
            layer.fold_at, layer.bounded = policy.fold_interval + policy.window, True

    def _after_decoding(
        self,
        idx: int,
        layer: LUKVLayer,
        module: Any,
        query: torch.Tensor,
        attention_mask: torch.Tensor | None,
    ) -> None:
        """With ``decode_max_tokens``, after a forward that did not compress: keep the queries the scorer
        reads at the next fold; once ``fold_interval`` tokens arrived since the last eviction, the fold is
        due (every layer's at once, after the last full-attention layer's attention)."""
        fold = self.policy.fold_interval
        since = layer.cumulative_length - layer.settled_length
        wanted = self.scorer.n_queries
        if wanted and since > fold - wanted:
            layer.record_queries(query, wanted)
        if since >= fold:
            self._folding[idx] = (module, attention_mask)
            if idx == self._last_full_layer:
                self._fold_evict()

    def _fold_evict(self) -> None:
        """Eviction at fold time (:mod:`lukv_cache.cache.decoding`): the layers whose fold is due keep, per
        row, at most ``decode_max_tokens`` tokens per (layer, KV head) on average, sinks and window
        included; budgets from one allocator call at the ratio that total implies over the row's tokens."""
        folding, self._folding = self._folding, {}
        policy, shard = self.policy, self._head_shard
        idxs = sorted(folding)
        layers = [self.layers[i] for i in idxs]
        for layer in layers:  # a sliding layer's tokens older than its window are not held (nor counted)
            layer.slide()
        first = layers[0]
        b, h, device = first.batch_size, first.num_heads, first.suffix_keys.device
        real = valid_from_mask(folding[idxs[0]][1], b, first.cumulative_length, device).sum(-1).cpu()
        frames = [
            held_tokens(layer, self._suffix_valid(folding[i][1], layer), policy.sink, policy.decode_window)
            for i, layer in zip(idxs, layers)
        ]
        heads = h * (1 if shard is None else shard.size)
        # [L, B, H] protected (sinks, recent window) and evictable tokens: layers that hold different
        # amounts protect different counts, and the bound counts every layer's and head's own
        protected = torch.stack([f.protected.sum(-1).view(b, h) for f in frames]).cpu()
        evictable = torch.stack([f.evictable.sum(-1).view(b, h) for f in frames]).cpu()
        if shard is not None:
            protected, evictable = shard.gather(protected, dim=2), shard.gather(evictable, dim=2)
        # [B] evictable tokens the folding layers may keep in all, so that each row holds at most
        # decode_max_tokens per (layer, KV head) on average, protected tokens included
        allowed = (policy.decode_max_tokens * len(idxs) * heads - protected.sum((0, 2))).clamp_min(0)
        room = allowed.double() / (len(idxs) * heads)  # evictable tokens a head keeps on average
        protected = protected.double().mean((0, 2))  # [B], per head
        row_fits = evictable.sum((0, 2)) <= allowed  # such a row keeps everything, whatever the allocator
        fits = bool(row_fits.all())
        raw = None
        if not fits or self._keeps_scores:
            raw = [self._held_scores(i, layer, f, *folding[i]) for i, layer, f in zip(idxs, layers, frames)]
        if fits:
            keeps = [f.slots for f in frames]
        else:
            width = max(f.width for f in frames)
            if shard is not None:  # every rank's request has the same width
                width = int(shard.gather(torch.tensor([[width]], device=device), dim=1).max())
            scores = torch.stack(
                [
                    torch.nn.functional.pad(masked_held(r, f), (0, width - f.width), value=float("-inf"))
                    for r, f in zip(raw, frames)
                ]
            ).view(len(idxs), b, h, width)
            if shard is not None:
                scores = shard.gather(scores, dim=2)
            n = (real - protected.round().long()).clamp_min(0)
            request = AllocationRequest(
                scores=scores,
                n_evictable=n,
                ratio=torch.where(n > room, 1.0 - room / n.clamp_min(1).double(), 0.0).clamp(0.0, 0.999999),
                layers=tuple(idxs),
                num_layers=self.num_layers or max(idxs) + 1,
                min_keep=policy.min_keep,
            )
            counts = fit_counts(policy.allocator(request), evictable, allowed, not policy.allocator.adaptive)
            counts[:, row_fits] = evictable[:, row_fits]
            if shard is not None:
                counts, scores = (t[:, :, shard.heads(request.num_heads)] for t in (counts, scores))
            keeps = [
                f.protected
                | (keep_mask_from_counts(scores[i], counts[i]).flatten(0, 1)[:, : f.width] & f.evictable)
                for i, f in enumerate(frames)
            ]
        for i, (layer, frame, keep) in enumerate(zip(layers, frames, keeps)):
            kept = None if not self._keeps_scores else raw[i][keep]
            layer.refold(frame.source[keep], keep.sum(-1), kept, capacity=policy.fold_interval)

    @staticmethod
    def _suffix_valid(attention_mask: torch.Tensor | None, layer: LUKVLayer) -> torch.Tensor:
        return valid_from_mask(
            attention_mask, layer.batch_size, layer.suffix_length, layer.suffix_keys.device
        )

    def _held_scores(
        self, idx: int, layer: LUKVLayer, held: Held, module: Any, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        """fp32 ``[G, M]``: the scores of the tokens ``layer`` holds, in ``held``'s slots: kept ones from
        the store plus the suffix scored now, or every segment's tokens scored again."""
        store = layer.store
        if self._keeps_scores:
            context = self._score_context(idx, module, layer, attention_mask)
            valid = self._suffix_valid(attention_mask, layer)
            suffix = score_suffix(self.scorer, layer, layer.queries, valid, context)
            stored = None if store is None or store.scores is None else store.scores.unsqueeze(-1)
            return gather_held(held, stored, suffix.unsqueeze(-1)).squeeze(-1)
        keys = gather_held(held, None if store is None else store.keys, layer.suffix_keys)
        values = gather_held(held, None if store is None else store.values, layer.suffix_values)
        return rescore(self.scorer, held, keys, values, layer.queries, layer.num_heads)

    def _wants_compression(self, layer: LUKVLayer, query_length: int) -> bool:
        """Compress after a multi-token forward: always the first time; every chunk of transformers'
        chunked prefill (``generate(prefill_chunk_size=...)``, the last shorter chunk too); otherwise
        whenever the cache's own ``prefill_chunk_size`` has piled up that many uncompressed tokens (every
        time under a ``max_tokens`` cap). Other later forwards (a question after a context) are kept whole."""
        if not layer.compressed and layer.cumulative_length == query_length:
            return True  # the prompt, even of one token: what comes after it is decoding, as in a batch
        if query_length <= 1:
            return False
        if not layer.compressed or generate_prefill_chunk() is not None:
            return True
        chunk = self.policy.prefill_chunk_size
        if chunk is not None and self.policy.max_tokens is not None:
            return True  # a cap holds after every chunk, the last shorter one too
        return chunk is not None and layer.suffix_length - self.policy.window >= chunk

    def _evict_deferred(self) -> None:
        deferred, self._deferred = self._deferred, {}
        self._evict(deferred)

    def _evict(self, steps: dict[int, tuple[Region, torch.Tensor | None]]) -> None:
        """Evict the regions of ``steps`` (layer -> region, masked scores or None); one allocator call."""
        scored = [idx for idx, (_, scores) in steps.items() if scores is not None]
        counts = {}
        if scored:
            region = steps[scored[0]][0]
            scores = torch.stack([steps[idx][1] for idx in scored])
            shard = self._head_shard
            if shard is not None:  # allocate over every head of the model, keep this rank's block
                scores = shard.gather(scores, dim=2)
            cap, slots = self._token_cap(region, scored, scores.shape[2])
            request = AllocationRequest(
                scores=scores,
                n_evictable=region.n_evictable.cpu(),
                ratio=self._row_ratios(region, cap, slots),
                layers=tuple(scored),
                num_layers=self.num_layers or max(scored) + 1,
                min_keep=self.policy.min_keep,
            )
            allocated = self.policy.allocator(request)
            # a row at ratio 0 (a prompt that fits its bound) keeps every token, whatever the allocator
            # (a threshold read at a ratio below its table's smallest would still cut)
            fits = request.ratio <= 0
            if bool(fits.any()):
                allocated = allocated.clone()
                allocated[:, fits.to(allocated.device)] = (
                    request.n_evictable[fits].to(allocated).view(1, -1, 1)
                )
            if cap is not None:  # a hard bound: whatever the allocator or profile asked for
                allocated = trim_counts(allocated, cap)
            if shard is not None:
                allocated = allocated[:, :, shard.heads(request.num_heads)]
            counts = dict(zip(scored, allocated))
        for idx, (region, scores) in steps.items():
            layer = self.layers[idx]
            if scores is None:  # nothing to rank: keep every real token (none evictable, or ratio 0)
                b, h = layer.batch_size, layer.num_heads
                keep = (region.sinks | region.evictable).unsqueeze(1).expand(b, h, region.length)
            else:
                keep = keep_mask(region, scores, counts[idx])
            layer.evict(keep, scores if self._keeps_scores else None)

    # ------------------------------------------------------------------ prefill, and reconstruction scorers
    @torch.no_grad()
    def prefill(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        tokenizer: Any = None,
        repeat_prompt: RepeatPrompt | None = None,
        **model_kwargs: Any,
    ) -> Any:
        """Run the context ``input_ids [B, T]`` (left-padded with ``attention_mask``) through ``model`` into
        this cache and compress it; returns the model's output. Then generate from the cache as usual
        (``model.generate(torch.cat([input_ids, question_ids], 1), past_key_values=cache)``).

        Any scorer works; a reconstruction scorer (``kvzip``) needs it: after the context's forward the
        model repeats the context chunk by chunk (prompt from ``tokenizer``'s chat template, or
        ``repeat_prompt``), the scores come from those passes, and only then is every layer compressed.
        The full context KV is alive until then, and the passes cost about 2x the prefill.

        >>> cache = LUKVCache(0.8, scorer="kvzip", allocator="global")
        >>> out = cache.prefill(model, inputs["input_ids"], repeat_prompt=RepeatPrompt((5, 6), (7,), (8,)))
        >>> cache.get_seq_length(), int(cache.stored_tokens()[:, 0].sum()) < 2 * 2 * 48
        (48, True)
        """
        recon = self.scorer.reconstruction
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = getattr(text, "vocab_size", None)
        mask = check_prefill_inputs(
            input_ids, attention_mask, left_padding_only=recon is not None, vocab_size=vocab
        )
        if attention_mask is not None:
            attention_mask = mask
        model_kwargs.setdefault("position_ids", _positions(mask, input_ids.shape[1], self.get_seq_length()))
        if recon is None or not self.evicts and self.prefill_scores is None:
            return model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=self,
                use_cache=True,
                **model_kwargs,
            )
        if self.get_seq_length() > 0:
            raise ConfigurationError(
                f"Scorer {self.scorer.name!r} scores a whole context at once: prefill an empty cache "
                "(a fresh LUKVCache, or cache.reset())."
            )
        if repeat_prompt is None:
            if tokenizer is None:
                raise ConfigurationError(
                    f"Scorer {self.scorer.name!r} asks the model to repeat the context, in the model's own words: "
                    "pass tokenizer=<the model's tokenizer> (or repeat_prompt=RepeatPrompt(...))."
                )
            repeat_prompt = RepeatPrompt.from_tokenizer(tokenizer, recon.template)
        if isinstance(vocab, int):
            repeat_prompt.check_vocabulary(vocab)
        with self._in_phase("hold"):
            out = model(
                input_ids=input_ids,
                attention_mask=mask,
                past_key_values=self,
                use_cache=True,
                **model_kwargs,
            )
        scores = self._reconstruct(model, input_ids, mask, repeat_prompt)
        self.evict_held(scores)
        return out

    @contextlib.contextmanager
    def holding(self) -> Iterator[LUKVCache]:
        """Within this block, multi-token forwards fill the cache without compressing it; then rank the
        held tokens with your own scores (:meth:`evict_held`). ``prefill`` uses it for KVzip."""
        with self._in_phase("hold"):
            yield self

    @contextlib.contextmanager
    def _in_phase(self, phase: str) -> Iterator[None]:
        previous, self._phase = self._phase, phase
        try:
            yield
        finally:
            self._phase = previous

    def evict_held(self, scores: Mapping[int, torch.Tensor]) -> None:
        """Compress what :meth:`holding` kept, ranking each layer's tokens by ``scores[layer]`` (fp32
        ``[B, H_kv, T]`` over the layer's dense tokens, higher = keep), with this cache's allocator."""
        held, self._held = self._held, {}
        steps = {}
        for idx, region in held.items():
            layer = self.layers[idx]
            raw = scores[idx]
            expected = (layer.batch_size, layer.num_heads, layer.suffix_length)
            if not isinstance(raw, torch.Tensor) or tuple(raw.shape) != expected:
                got = tuple(raw.shape) if isinstance(raw, torch.Tensor) else type(raw).__name__
                raise ConfigurationError(
                    f"Scores for layer {idx} must have shape {list(expected)}, got {got}."
                )
            raw = raw.float().to(layer.suffix_keys.device)
            if self.prefill_scores is not None:
                self.prefill_scores[idx] = raw
            evictable = region.length and bool(region.n_evictable.any())
            steps[idx] = (region, masked_scores(raw, region) if evictable else None)
        self._evict(steps)

    def _reconstruct(
        self, model: Any, input_ids: torch.Tensor, mask: torch.Tensor, prompt: RepeatPrompt
    ) -> dict[int, torch.Tensor]:
        """The reconstruction passes: one forward per round of chunks, cropped after each; per-layer scores."""
        recon = self.scorer.reconstruction
        held = [i for i, layer in enumerate(self.layers) if isinstance(layer, LUKVLayer) and i in self._held]
        scores = {
            i: torch.zeros(
                self.layers[i].batch_size,
                self.layers[i].num_heads,
                input_ids.shape[1],
                device=input_ids.device,
            )
            for i in held
        }
        stock = {i: layer for i, layer in enumerate(self.layers) if not isinstance(layer, LUKVLayer)}
        for round_ in plan_rounds(input_ids, mask, prompt, recon.chunk_size, recon.overlap, self.policy.sink):
            self._round = round_
            round_.scores = scores
            saved = {i: copy.deepcopy(layer) for i, layer in stock.items()}  # sliding layers would slide
            try:
                with self._in_phase("reconstruct"):
                    model(
                        input_ids=round_.input_ids,
                        attention_mask=torch.cat([mask, round_.mask.long()], dim=1),
                        position_ids=round_.position_ids,
                        past_key_values=self,
                        use_cache=True,
                        logits_to_keep=1,
                    )
            finally:
                self._round = None
                for layer in self.layers:
                    if isinstance(layer, LUKVLayer):
                        layer.crop(-round_.length)
                for i, layer in saved.items():
                    self.layers[i] = layer
        return scores

    def _score_round(
        self, idx: int, module: Any, query: torch.Tensor, scaling: float, softcap: float | None
    ) -> None:
        round_, layer = self._round, self.layers[idx]
        if round_ is None or idx not in round_.scores:
            return
        weighted = self.scorer.reconstruction.weighted
        for row, bounds in enumerate(round_.chunks):
            if bounds is None:
                continue
            start, end = bounds
            weight = value_norms(module, layer.suffix_values[row, :, start:end]) if weighted else None
            round_.scores[idx][row, :, start:end] = chunk_scores(
                query[row],
                layer.suffix_keys[row],
                bounds,
                round_.sinks[row],
                round_.mask[row],
                scaling=scaling,
                softcap=softcap,
                value_weight=weight,
            )

    # ------------------------------------------------------------------ the model
    def _row_ratios(self, region: Region, cap: torch.Tensor | None, slots: int) -> torch.Tensor:
        """float64 ``[B]``: each row's ratio; with ``max_tokens``, the one that fills the room ``cap`` leaves
        over ``slots`` (layer, KV head) pairs still to evict in this forward (fixed at the forward's first
        eviction, so every layer reads its profile at one ratio)."""
        batch = region.evictable.shape[0]
        if cap is None:
            return torch.full((batch,), self.ratio, dtype=torch.float64)
        if self._cap_ratio is None or self._cap_ratio.shape[0] != batch:
            n = region.n_evictable.cpu().double()
            room = cap.double() / slots  # per head of every layer to come
            self._cap_ratio = torch.where(n > room, 1.0 - room / n.clamp_min(1), torch.zeros_like(n))
        return self._cap_ratio.clamp(0.0, 0.999999)

    def _token_cap(
        self, region: Region, layers: list[int], num_heads: int
    ) -> tuple[torch.Tensor | None, int]:
        """With ``max_tokens``: int64 ``[B]``, the evictable tokens that ``layers`` (evicted now, over all
        ``num_heads`` KV heads of the model) may keep in all, so that after this forward every row holds at
        most ``max_tokens`` tokens per (full-attention layer, KV head) on average (every layer's store, its
        protected window, and the sinks of the layers still to evict in this forward all count); and the
        number of (layer, head) pairs still to evict. ``(None, 0)`` without a cap."""
        if self.policy.max_tokens is None:
            return None, 0
        full = self._full_layers or [i for i, layer in enumerate(self.layers) if isinstance(layer, LUKVLayer)]
        later = 0 if self.policy.defers else sum(1 for i in full if i > max(layers))
        layer = self.layers[layers[0]]
        window = layer.suffix_length - region.length
        sinks = region.sinks.sum(-1).cpu()
        budget = self.policy.max_tokens * len(full) * num_heads
        protected = num_heads * (len(full) * window + (len(layers) + later) * sinks)
        cap = budget - self._stored_in_stores(sinks.shape[0]) - protected
        return cap, (len(layers) + later) * num_heads

    def _stored_in_stores(self, batch: int) -> torch.Tensor:
        """int64 ``[B]``: tokens in the ragged stores of every layer, over every KV head of the model."""
        per_head = torch.zeros(batch, 1, dtype=torch.long)
        for layer in self.layers:
            if isinstance(layer, LUKVLayer) and layer.store is not None:
                per_head = per_head + layer.store.counts().view(layer.batch_size, layer.num_heads).cpu()
        if self._head_shard is not None:  # every rank holds the same layers: one gather each
            per_head = self._head_shard.gather(per_head, dim=1)
        return per_head.sum(-1)

    def _learn_model(self, config: Any) -> None:
        """Once per cache: the model's layers (count, last full-attention one) and the profile's fit."""
        if self._config_checked or config is None or not hasattr(config, "get_text_config"):
            return
        text = config.get_text_config(decoder=True)
        self.num_layers = text.num_hidden_layers
        layer_types = get_layer_types_and_kwargs(text)[0]
        producers = getattr(self, "_kv_producers", [])
        full = [
            i
            for i, kind in enumerate(layer_types)
            if kind in ("full_attention", "hybrid") and i not in producers
        ]
        self._attention_layers = full
        self._full_layers = full
        self._last_full_layer = full[-1] if full else None
        heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", None)
        self._kv_heads = heads if isinstance(heads, int) else None
        # layers without per-token KV (linear attention, SSM, conv, KV-sharing placeholders) hold nothing to evict
        windowed = [i for i, kind in enumerate(layer_types) if kind in _WINDOWED]
        whole = [i for i, kind in enumerate(layer_types) if kind in _HELD_WHOLE]
        if self._undecided:  # what the sliding layers become is known at the first forward: warn then
            self._layout_warning = (layer_types, full, windowed, whole, producers)
        else:
            self._warn_layout(layer_types, full, windowed, whole, producers)
        if self.profile is not None:
            self.profile.validate_for(config)
        self._config_checked = True

    def _warn_layout(
        self,
        layer_types: list[str],
        full: list[int],
        windowed: list[int],
        whole: list[int],
        producers: list[int],
        *,
        kept: list[int] = (),
        length: int | None = None,
    ) -> None:
        """Warn which layers this cache leaves alone (once per outcome), naming those it compresses."""
        stock = [i for i in windowed if i not in kept]
        full = sorted({*full, *kept})
        if (stock, whole, producers, full) == self._warned:
            return
        self._warned = (stock, whole, producers, full)
        if self.evicts and (stock or whole or producers or not full):
            parts = []
            if stock:
                kinds = sorted({layer_types[i] for i in stock})
                why = ""
                if length is not None:
                    windows = sorted({self._windows[i] for i in stock if i in self._windows})
                    if windows:
                        why = (
                            f" (the prompt, {length} tokens with padding, is longer than their window of "
                            f"{', '.join(map(str, windows))}; a prompt that fits is compressed in them)"
                        )
                parts.append(
                    f"layers {stock} ({', '.join(kinds)}) keep transformers' stock layers, bounded by their "
                    f"window{why}"
                )
            if whole:
                kinds = sorted({layer_types[i] for i in whole})
                parts.append(
                    f"layers {whole} ({', '.join(kinds)}: sparse attention whose indexer keys are kept beside the KV) "
                    "keep transformers' stock layers, which hold every token: their memory is not bounded"
                )
            if producers:
                parts.append(
                    f"layers {producers} are read again by later layers (KV sharing) and keep every token, uncompressed"
                )
            if not parts:
                kinds = sorted(set(layer_types))
                parts.append(f"no layer is a full-attention one it can compress (layer types {kinds})")
            named = (
                "full-attention layers"
                if not kept
                else "layers (full attention, and sliding ones compressed)"
            )
            tail = (
                "this cache compresses nothing and max_tokens bounds nothing here."
                if not full
                else f"eviction, ratio and max_tokens apply to the {named} {full}."
            )
            which = "every layer" if not full else "some layers"
            warnings.warn(
                f"LUKVCache leaves {which} of this model alone: {'; '.join(parts)}; {tail}", stacklevel=4
            )

    def _learn_heads(self, layer: LUKVLayer, module: Any) -> None:
        """Once per cache, at the first full-attention layer: does this rank hold every KV head, or (tensor
        parallelism) which block of them (see :mod:`lukv_cache.cache.parallel`)."""
        if self._heads_checked or not layer.is_initialized:
            return
        self._head_shard = head_shard(layer.num_heads, self._kv_heads, self._mesh_shard, module)
        self._heads_checked = True

    @property
    def head_shard(self) -> HeadShard | None:
        """Under tensor parallelism, this rank's block of KV heads (``head_shard.heads(num_kv_heads)`` is
        the slice of the model's heads that :meth:`stored_tokens` and :attr:`prefill_scores` cover);
        ``None`` when the cache holds every head. Known after the first forward.

        >>> LUKVCache(0.5).head_shard is None
        True
        """
        return self._head_shard

    def activate_past_recording(self):
        # generate() calls this before assisted decoding, whose first forward is the prompt plus draft tokens
        if self.get_seq_length() > 0:
            raise ConfigurationError(
                "Assisted decoding cannot start from a filled cache: transformers' assisted generation feeds the "
                "whole prompt again (even into a DynamicCache), which would store it a second time, "
                "uncompressed, after the compressed copy. Generate from this cache without assistant_model=, "
                "or pass a fresh LUKVCache to the assisted generate (it then compresses the prompt itself)."
            )
        if self.evicts:
            warnings.warn(
                "LUKVCache with assisted decoding: the first forward holds the prompt and the assistant's draft "
                "tokens, so the drafts take part in the eviction (rejected ones are cropped out afterwards). "
                "The tokens can differ from plain greedy decoding with the same cache settings.",
                stacklevel=2,
            )
        self._record_past = True
        super().activate_past_recording()

    def reset(self) -> None:
        """Empty the cache for a new prompt, also after a forward that was interrupted (Ctrl-C, out of
        memory) inside a layer: nothing of that forward is left pending."""
        super().reset()
        if self._awaiting is not None:
            discard_attention()
        self._awaiting = None
        self._readers, self._unrouted = {}, False
        self._deferred, self._held, self._folding = {}, {}, {}
        self._phase, self._round, self._cap_ratio = None, None, None
        if self.prefill_scores is not None:
            self.prefill_scores = {}
        if self._windows:  # a new prompt: its length decides again what the sliding layers become
            self._pend_windows()
            if self._record_past:
                self._record_in([self.layers[i] for i in self._windows])
            self._full_layers = list(self._attention_layers)
            self._last_full_layer = self._full_layers[-1] if self._full_layers else None

    # ------------------------------------------------------------------ reporting
    @property
    def is_compressed(self) -> bool:
        """Whether any layer holds a compressed store."""
        return any(isinstance(layer, LUKVLayer) and layer.compressed for layer in self.layers)

    def kept_positions(self, layer_idx: int) -> torch.Tensor:
        """bool ``[batch, kv_heads, T]``: which logical positions (absolute columns of the input, ``T`` so
        far, padding included) each (row, KV head) of layer ``layer_idx`` still holds, in its ragged store
        or its dense suffix. Padding is never held by a compressed layer; transformers' own layers (e.g. a
        sliding window shorter than the prompt) report their last columns, as they hold them.

        >>> cache = LUKVCache(ratio=0.0)
        >>> _ = cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
        >>> cache.kept_positions(0).int().tolist()
        [[[1, 1, 1], [1, 1, 1]]]
        """
        layer = self.layers[layer_idx]
        if not getattr(layer, "is_initialized", False):
            return torch.zeros(0, 0, 0, dtype=torch.bool)
        if isinstance(layer, LUKVLayer):
            kept = torch.zeros(layer.batch_size, layer.num_heads, layer.cumulative_length, dtype=torch.bool)
            for row in range(layer.batch_size):
                for head in range(layer.num_heads):
                    kept[row, head, layer.head_tokens(row, head)[0].cpu()] = True
            return kept
        b, h, s, _ = layer.keys.shape
        kept = torch.zeros(b, h, max(s, layer.get_seq_length()), dtype=torch.bool)
        kept[:, :, kept.shape[-1] - s :] = True
        return kept

    def fork(self) -> LUKVCache:
        """A copy for one question that shares this cache's compressed stores: they are read-only (every
        eviction, fold, crop or row selection builds a new store), so a copy holds only what it appends
        (the dense suffix and what a question adds) and its own bookkeeping. ``copy.deepcopy`` copies the
        stores too. Each fork's :meth:`memory_bytes` counts the shared stores as its own.

        >>> question_cache = cache.fork()  # doctest: +SKIP
        """
        memo = {
            id(layer.store): layer.store for layer in self.layers if getattr(layer, "store", None) is not None
        }
        return copy.deepcopy(self, memo)

    def save(self, path, *, model: Any = None):
        """Write this filled cache to ``path`` as one safetensors file (:func:`lukv_cache.save_cache`, whose
        format and checks docs/saved.md describes); returns the path.

        >>> cache.save("context.safetensors")  # doctest: +SKIP
        """
        from .saved import save_cache

        return save_cache(self, path, model=model)

    @classmethod
    def load(cls, path, model: Any, **kwargs: Any) -> LUKVCache:
        """The cache :meth:`save` wrote to ``path``, checked against ``model`` and ready to continue
        (:func:`lukv_cache.load_cache`; ``kwargs``: its ``device``, ``scorer``, ``allocator``,
        ``allow_other_model_id``).

        >>> cache = LUKVCache.load("context.safetensors", model)  # doctest: +SKIP
        """
        from .saved import load_cache

        return load_cache(path, model, **kwargs)

    def memory_bytes(self) -> int:
        """Bytes held by every tensor of the cache (ragged stores, positions, offsets, suffix buffers,
        stock sliding layers)."""
        return kv_cache_bytes(self)

    def stored_tokens(self) -> torch.Tensor:
        """int64 ``[layers, batch, kv_heads]``: tokens stored per (layer, row, KV head), one row per layer that
        holds keys (layers without per-token KV, such as linear-attention or SSM layers, have none); when
        layers have different KV-head counts, a layer's missing heads count 0."""
        rows = []
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                if layer.is_initialized:
                    rows.append(layer.stored_counts())
                continue
            keys = _stock_keys(layer)
            if keys is not None:
                b, h, s, _ = keys.shape
                rows.append(torch.full((b, h), s, dtype=torch.long))
        if not rows:
            return torch.zeros(0, 0, 0, dtype=torch.long)
        heads = max(row.shape[1] for row in rows)
        return torch.stack([torch.nn.functional.pad(row, (0, heads - row.shape[1])) for row in rows])

    def __repr__(self) -> str:
        return (
            f"LUKVCache(ratio={self.ratio}, scorer={self.scorer.name!r}, allocator={self.allocator_name!r}, "
            f"sink={self.sink}, window={self.window}, layers={len(self.layers)})"
        )
