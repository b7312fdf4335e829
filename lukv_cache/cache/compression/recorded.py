"""A context's prefill recorded once and replayed into any number of compressed caches.

Compression happens right after each layer's prefill attention and never changes that layer's output, so
every cache that compresses a context sees the same keys, values and queries: :class:`RecordedPrefill`
records them once (with a full cache) and replays them into each fresh ``LUKVCache`` through the installed
attention function, which compresses exactly as in a real prefill (``tests/evaluation`` checks that a
replayed cache equals a real one). Used by the benchmarks' shared prefill
(:class:`lukv_cache.evaluation.prefill.SharedPrefill`) and by a profile's memory table.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Self, cast

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..._compat import cache_kwarg
from ...attention.swap import attention_swapped
from ...errors import ConfigurationError

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicLayer

_RECORD_IMPL = "lukv_bench_record"


@dataclass
class RecordedPrefill:
    """One context's prefill, recorded once: per layer the full keys/values and the last ``n_queries``
    post-RoPE queries, plus the last-position logits. :meth:`replay_into` fills a compressed cache with it,
    :meth:`full_cache` a ``DynamicCache``.

    >>> from lukv_cache import LUKVCache
    >>> recorded = RecordedPrefill.record(model, inputs["input_ids"], n_queries=64)
    >>> recorded.replay_into(LUKVCache(0.8, config=model.config)).get_seq_length()
    48
    """

    n_queries: int
    attn_implementation: str
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    prefill_queries: dict[int, torch.Tensor] = field(default_factory=dict)
    modules: dict[int, Any] = field(default_factory=dict)
    last_logits: torch.Tensor | None = None
    seconds: float = 0.0
    input_ids: torch.Tensor | None = None

    @classmethod
    @torch.no_grad()
    def record(cls, model: Any, input_ids: torch.Tensor, n_queries: int) -> Self:
        """Prefill ``input_ids`` once through the model's own ``sdpa`` or ``eager`` attention (with that
        implementation's masks), recording what :meth:`replay_into` replays."""
        impl = model.config._attn_implementation
        if impl not in ("sdpa", "eager"):
            raise ConfigurationError(
                f"The shared prefill needs attn_implementation sdpa or eager, got {impl!r}."
            )
        recording = cls(max(2, n_queries), impl)
        stock = ALL_ATTENTION_FUNCTIONS[impl]

        def observe(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any):
            recording.prefill_queries[module.layer_idx] = query[:, :, -recording.n_queries :].detach().clone()
            recording.modules[module.layer_idx] = module
            return stock(module, query, key, *args, **kwargs)

        cache = DynamicCache()
        started = time.perf_counter()
        with attention_swapped(model, _RECORD_IMPL, observe, mask=impl):
            out = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): cache})
        recording.seconds = time.perf_counter() - started
        recording.last_logits = out.logits[:, -1, :]
        recording.input_ids = input_ids
        layers = cast("list[DynamicLayer]", cache.layers)  # full attention only (shareable), all filled
        recording.keys = [cast(torch.Tensor, layer.keys) for layer in layers]
        recording.values = [cast(torch.Tensor, layer.values) for layer in layers]
        return recording

    def for_copy(self, model: Any, recorded_on: Any) -> RecordedPrefill:
        """This recording, made on ``recorded_on``, for ``model``: a copy of that model in another precision
        (``profiling.table_dtype.model_in``). Its keys, values, queries and logits cast to ``model``'s dtype
        and each layer's attention module ``model``'s own (the module of the same name), so replaying it is
        replaying a prefill of ``model`` up to the rounding of the other precision. Itself when ``model`` is
        ``recorded_on``."""
        if model is recorded_on:
            return self
        dtype = next(model.parameters()).dtype
        names = {id(module): name for name, module in recorded_on.named_modules()}
        own = dict(model.named_modules())
        return RecordedPrefill(
            n_queries=self.n_queries,
            attn_implementation=self.attn_implementation,
            keys=[keys.to(dtype) for keys in self.keys],
            values=[values.to(dtype) for values in self.values],
            prefill_queries={layer: q.to(dtype) for layer, q in self.prefill_queries.items()},
            modules={layer: own[names[id(module)]] for layer, module in self.modules.items()},
            last_logits=None if self.last_logits is None else self.last_logits.to(dtype),
            seconds=self.seconds,
            input_ids=self.input_ids,
        )

    def full_cache(self, config: Any) -> DynamicCache:
        """The full cache holding this context (copies of the recorded keys and values)."""
        cache = DynamicCache(config=config)
        for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values)):
            cache.update(keys.clone(), values.clone(), layer_idx)
        return cache

    def replay_into(self, cache: Any, scores: dict[int, torch.Tensor] | None = None) -> Any:
        """``cache`` (a fresh compressed cache) holding this context, as if the context had been prefilled
        into it. ``scores``: per-layer scores computed elsewhere (a reconstruction scorer's); the replayed
        context is then held and ranked by them. Returns ``cache``."""
        with cache.holding() if scores is not None else contextlib.nullcontext():
            self._replay(cache)
        if scores is not None:
            cache.evict_held(scores)
        cache.state.end_prompt()  # as cache.prefill: the questions forwarded next are appended whole
        return cache

    def _replay(self, cache: Any) -> None:
        attention = ALL_ATTENTION_FUNCTIONS[self.attn_implementation]
        for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values)):
            k, v = cache.update(keys.clone(), values.clone(), layer_idx)
            module = self.modules[layer_idx]
            # The installed attention function compresses the layer after a multi-token forward, reading
            # the queries it is given (the scorer takes the last n_queries). Its output is discarded.
            attention(
                module, self.prefill_queries[layer_idx], k, v, None, dropout=0.0, scaling=module.scaling
            )


def shareable(model: Any) -> bool:
    """Whether the shared prefill applies: every layer full attention, attention sdpa or eager."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    no_sliding = all(t == "full_attention" for t in layer_types) and not getattr(
        config, "sliding_window", None
    )
    return no_sliding and model.config._attn_implementation in ("sdpa", "eager")
