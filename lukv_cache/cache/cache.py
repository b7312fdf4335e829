"""LUKVCache: a DynamicCache that evicts per (layer, KV head) right after each layer's prefill."""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, DynamicCache, get_layer_types_and_kwargs

from ..allocation import get_allocator
from ..attention.dispatch import guard_all
from ..errors import ConfigurationError
from ..scorers import Scorer, get_scorer
from .layer import LUKVLayer


def _check_ratio(ratio: Any) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= float(ratio) < 1.0:
        raise ConfigurationError(
            f"ratio is the fraction of the prompt's KV entries to remove and must be in [0, 1); got {ratio!r}. "
            "ratio=0.8 keeps 20% of the tokens."
        )
    return float(ratio)


class LUKVCache(DynamicCache):
    """KV cache with per-head eviction after prefill, stored ragged so the memory is really freed.

    Args:
        ratio: fraction of the prompt's evictable KV entries to remove (``0.8`` keeps 20%).
        scorer: name of a registered scorer (``keydiff``, ``snapkv``, ``expected_attention``, ``knorm``,
            ``tova``, ``streaming``, ``random``) or a :class:`~lukv_cache.scorers.Scorer`.
        allocator: ``uniform``, ``pyramid``, ``adakv``, ``profile`` (needs ``evict_ratio``) or any
            registered name; ``allocator_kwargs`` go to its factory.
        sink: first tokens of each row always kept (attention sinks).
        window: last prompt tokens always kept, dense (default: the scorer's, 1 or 32 for snapkv).
        min_keep: every head keeps at least this fraction of its evictable tokens (and >= 1 token).
        prefill_chunk_size: also compress later multi-token forwards once this many uncompressed tokens
            pile up (chunked prefill); by default only the first forward (the context) is compressed.
        evict_ratio: ``[layers, kv_heads]`` local evict ratios for ``allocator="profile"``.
        config: the model config; lets sliding-window layers use the stock sliding layer from the start.

    Example:
        >>> cache = LUKVCache(ratio=0.8, scorer="keydiff", allocator="uniform")
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP
        >>> cache.memory_bytes(), cache.stored_tokens().shape  # doctest: +SKIP
    """

    def __init__(
        self,
        ratio: float = 0.5,
        scorer: str | Scorer = "keydiff",
        allocator: str | Any = "uniform",
        *,
        sink: int = 4,
        window: int | None = None,
        min_keep: float = 0.01,
        prefill_chunk_size: int | None = None,
        evict_ratio: Any = None,
        allocator_kwargs: dict | None = None,
        config: Any = None,
    ):
        self.ratio = _check_ratio(ratio)
        self.scorer = get_scorer(scorer)
        for name, value in (("sink", sink), ("window", window), ("prefill_chunk_size", prefill_chunk_size)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigurationError(f"{name} must be a non-negative integer, got {value!r}.")
        if prefill_chunk_size == 0:
            raise ConfigurationError("prefill_chunk_size must be positive (or None to compress once).")
        if not 0.0 <= float(min_keep) < 1.0:
            raise ConfigurationError(f"min_keep must be in [0, 1), got {min_keep!r}.")
        self.sink, self.min_keep = sink, float(min_keep)
        self.window = self.scorer.window if window is None else window
        self.prefill_chunk_size = prefill_chunk_size
        kwargs = dict(allocator_kwargs or {})
        if evict_ratio is not None:
            kwargs["evict_ratio"] = evict_ratio
        self.allocator_name = (
            allocator if isinstance(allocator, str) else getattr(allocator, "__name__", "custom")
        )
        self.allocator = get_allocator(allocator, **kwargs) if isinstance(allocator, str) else allocator
        self.profile = None
        self.num_layers: int | None = None
        self._record_past = False
        self._recorded_scores: dict[int, torch.Tensor] | None = None
        self._config_checked = False
        layers = []
        if config is not None:
            text_config = config.get_text_config(decoder=True)
            self.num_layers = text_config.num_hidden_layers
            layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
            for idx, (kind, kw) in enumerate(zip(layer_types, per_layer_kwargs)):
                layers.append(
                    LUKVLayer(self, idx)
                    if kind == "full_attention"
                    else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw)
                )
            self._check_config(config)
        super(DynamicCache, self).__init__(layers=layers)

    # ------------------------------------------------------------------ construction from a profile
    @classmethod
    def from_pretrained(
        cls,
        model_or_profile: Any,
        ratio: float,
        scorer: str | None = None,
        *,
        revision: str | None = None,
        repo_id: str | None = None,
        token: str | bool | None = None,
        local_dir: str | os.PathLike | None = None,
        cache_dir: str | os.PathLike | None = None,
        endpoint: str | None = None,
        sink: int | None = None,
        window: int | None = None,
        **kwargs: Any,
    ) -> LUKVCache:
        """A cache whose per-head budgets come from the LU-KV profile of a model.

        ``model_or_profile``: a model id (looked up in ``local_dir`` / ``$LUKV_PROFILE_DIR`` first, then
        in the shared Hub repository at ``<model id>/<scorer>.safetensors``), a loaded model (its
        ``config.name_or_path`` is the key and its shape is checked), or a path to a profile file.
        The profile's scorer, sink and window become the cache's unless overridden.

        >>> cache = LUKVCache.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", ratio=0.8)  # doctest: +SKIP
        """
        from ..profiles import resolve_profile

        ratio = _check_ratio(ratio)
        profile = resolve_profile(
            model_or_profile,
            scorer,
            revision=revision,
            repo_id=repo_id,
            token=token,
            local_dir=local_dir,
            cache_dir=cache_dir,
            endpoint=endpoint,
        )
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
        cache = cls(
            ratio,
            scorer or profile.scorer,
            "profile",
            sink=profile.sink if sink is None else sink,
            window=profile.window if window is None else window,
            min_keep=kwargs.pop("min_keep", profile.min_keep),
            evict_ratio=profile.at(ratio),
            **kwargs,
        )
        cache.profile = profile
        return cache

    # ------------------------------------------------------------------ layer management
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            guard_all()  # implementations registered since import must not read this cache silently
        while len(self.layers) <= layer_idx:
            self.layers.append(LUKVLayer(self, len(self.layers)))
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def activate_past_recording(self):
        # generate() calls this before assisted decoding, whose first forward is the prompt plus draft tokens
        if self.ratio > 0 and not any(getattr(layer, "compressed", False) for layer in self.layers):
            warnings.warn(
                "LUKVCache with assisted decoding: the first forward holds the prompt and the assistant's draft "
                "tokens, so the drafts take part in the eviction (rejected ones are cropped out afterwards). "
                "The tokens can differ from plain greedy decoding with the same cache settings.",
                stacklevel=2,
            )
        self._record_past = True
        super().activate_past_recording()

    def _make_sliding(self, layer: LUKVLayer, sliding_window: int) -> None:
        self.layers[layer.layer_idx] = layer.to_sliding(sliding_window)

    def _check_config(self, config: Any) -> None:
        """Once per cache: the model's layer count, and the profile's shape if there is one."""
        if self._config_checked or config is None:
            return
        text_config = config.get_text_config(decoder=True)
        self.num_layers = self.num_layers or text_config.num_hidden_layers
        if self.profile is not None:
            self.profile.validate_for(config)
        self._config_checked = True

    def _compress_layer(self, layer: LUKVLayer, module, query: torch.Tensor, attention_mask) -> None:
        self._check_config(getattr(module, "config", None))
        if self.num_layers is None:
            self.num_layers = len(self.layers)
        layer.compress(query, attention_mask)

    # ------------------------------------------------------------------ reporting
    def memory_bytes(self) -> int:
        """Bytes held by every tensor of the cache (ragged stores, positions, offsets, suffix buffers,
        stock sliding layers)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                total += layer.memory_bytes()
            elif getattr(layer, "is_initialized", False):
                total += sum(
                    t.numel() * t.element_size() for t in (layer.keys, layer.values) if t is not None
                )
        return total

    def stored_tokens(self) -> torch.Tensor:
        """int64 ``[layers, batch, kv_heads]``: tokens stored per (layer, row, KV head)."""
        rows = []
        for layer in self.layers:
            if isinstance(layer, LUKVLayer):
                rows.append(layer.stored_counts())
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                b, h, s, _ = layer.keys.shape
                rows.append(torch.full((b, h), s, dtype=torch.long))
        return torch.stack(rows) if rows else torch.zeros(0, 0, 0, dtype=torch.long)

    def __repr__(self) -> str:
        return (
            f"LUKVCache(ratio={self.ratio}, scorer={self.scorer.name!r}, allocator={self.allocator_name!r}, "
            f"sink={self.sink}, window={self.window}, layers={len(self.layers)})"
        )


def prefill_scores(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    scorer: str | Scorer,
    attention_mask: torch.Tensor | None = None,
) -> list[torch.Tensor | None]:
    """The scores the cache ranks by at prefill, per layer: fp32 ``[B, H_kv, T]`` (None for layers that
    are never compressed, e.g. sliding-window ones). Used by the profiling pipeline so that profiles
    rank tokens with exactly the cache's code.
    """
    cache = LUKVCache(ratio=0.0, scorer=scorer, config=model.config, sink=0, window=0)
    cache._recorded_scores = {}
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True)
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    return [cache._recorded_scores.get(idx) for idx in range(num_layers)]
