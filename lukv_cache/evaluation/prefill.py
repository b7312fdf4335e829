"""One context prefill shared by every method of a benchmark.

Compression happens right after each layer's prefill attention and never changes that layer's output, so
every method sees the same keys, values and queries; :class:`SharedPrefill` records them once (with a full
cache) and replays them into each method's fresh ``LUKVCache`` through the installed attention function,
which compresses exactly as in a real prefill (``tests/evaluation`` checks that the replayed cache equals a
real one).
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .._compat import cache_kwarg
from ..attention.swap import attention_swapped
from ..errors import ConfigurationError
from .methods import Method, make_cache

if TYPE_CHECKING:
    from transformers.cache_utils import DynamicLayer

_RECORD_IMPL = "lukv_bench_record"


@dataclass
class SharedPrefill:
    """One context's prefill, recorded once: per layer the full keys/values and the last ``n_queries``
    post-RoPE queries, plus the last-position logits. :meth:`cache_for` turns it into any method's cache.

    >>> shared = SharedPrefill.record(model, inputs["input_ids"], n_queries=64)
    >>> cache = shared.cache_for(Method("uniform", "keydiff", 0.8), model)
    >>> cache.get_seq_length()
    48
    """

    n_queries: int
    attn_implementation: str
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    modules: dict[int, Any] = field(default_factory=dict)
    last_logits: torch.Tensor | None = None
    seconds: float = 0.0
    input_ids: torch.Tensor | None = None
    _reconstruction: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    @torch.no_grad()
    def record(cls, model: Any, input_ids: torch.Tensor, n_queries: int) -> SharedPrefill:
        """Prefill ``input_ids`` once through the model's own ``sdpa`` or ``eager`` attention (with that
        implementation's masks), recording what :meth:`cache_for` replays."""
        impl = model.config._attn_implementation
        if impl not in ("sdpa", "eager"):
            raise ConfigurationError(
                f"The shared prefill needs attn_implementation sdpa or eager, got {impl!r}."
            )
        recording = cls(max(2, n_queries), impl)
        stock = ALL_ATTENTION_FUNCTIONS[impl]

        def observe(module: Any, query: torch.Tensor, key: torch.Tensor, *args: Any, **kwargs: Any):
            recording.queries[module.layer_idx] = query[:, :, -recording.n_queries :].detach().clone()
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

    @torch.no_grad()
    def cache_for(
        self,
        method: Method,
        model: Any,
        profiles_dir: str | os.PathLike[str] | None = None,
        *,
        hub: bool = False,
        scores: dict[int, torch.Tensor] | None = None,
    ) -> Any:
        """``method``'s cache holding this context, as if the context had been prefilled into it.

        ``scores``: per-layer scores computed elsewhere (a reconstruction scorer's, from
        :meth:`reconstruction_scores`); the replayed context is then held and ranked by them.
        """
        cache = make_cache(method, model, profiles_dir, hub=hub)
        if method.is_full:
            for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values)):
                cache.update(keys.clone(), values.clone(), layer_idx)
            return cache
        return self.replay_into(cache, scores)

    def replay_into(self, cache: Any, scores: dict[int, torch.Tensor] | None = None) -> Any:
        """``cache`` (a compressed cache you built, e.g. with settings a :class:`Method` does not name)
        holding this context, as if the context had been prefilled into it; ``scores``: as
        :meth:`cache_for`'s. Returns ``cache``."""
        with cache.holding() if scores is not None else contextlib.nullcontext():
            self._replay(cache)
        if scores is not None:
            cache.evict_held(scores)
        cache.state.end_prompt()  # as cache.prefill: the questions forwarded next are appended whole
        return cache

    def cache_with_scores(
        self,
        method: Method,
        model: Any,
        tokenizer: Any,
        profiles_dir: str | os.PathLike[str] | None = None,
        *,
        hub: bool = False,
    ) -> Any:
        """:meth:`cache_for`, with a reconstruction scorer's scores computed once per scorer and shared by
        every method that uses it."""
        from ..scorers import get_scorer

        scores = None
        scorer = cast(str, method.scorer)  # a name unless the method is the full cache
        if not method.is_full and get_scorer(scorer).reconstruction is not None:
            if scorer not in self._reconstruction:
                self._reconstruction[scorer] = self.reconstruction_scores(
                    model,
                    tokenizer,
                    scorer,
                    cast(torch.Tensor, self.input_ids),  # set by record
                )
            scores = self._reconstruction[scorer]
        return self.cache_for(method, model, profiles_dir, hub=hub, scores=scores)

    def scored_cache(
        self,
        method: Method,
        model: Any,
        tokenizer: Any,
        profiles_dir: str | os.PathLike[str] | None = None,
        *,
        hub: bool = False,
        scores: dict[int, torch.Tensor] | None = None,
    ) -> tuple[Any, dict[int, torch.Tensor] | None]:
        """``method``'s cache and the per-layer scores it ranked the context by (``None`` for the full cache).

        Pass those scores back (``scores=``) for the same allocator and scorer at another ratio: that cache
        is then compressed from the same scored prefill, without scoring it again (``lukv check`` does so
        for every ratio of an allocator). Without ``scores``: :meth:`cache_with_scores`, scores kept.

        >>> shared = SharedPrefill.record(model, inputs["input_ids"], n_queries=64)
        >>> cache, scores = shared.scored_cache(Method("uniform", "keydiff", 0.5), model, tokenizer=None)
        >>> other, _ = shared.scored_cache(Method("uniform", "keydiff", 0.8), model, None, scores=scores)
        >>> other.get_seq_length()
        48
        """
        if method.is_full:
            return self.cache_for(method, model), None
        if scores is None:
            from ..scorers import get_scorer

            scorer = cast(str, method.scorer)  # not the full cache: a name
            if get_scorer(scorer).reconstruction is not None:
                cache = self.cache_with_scores(method, model, tokenizer, profiles_dir, hub=hub)
                return cache, self._reconstruction[scorer]
            cache = make_cache(method, model, profiles_dir, hub=hub)
            cache.prefill_scores = {}  # keep what the replay scores (keep_scores=True)
            self._replay(cache)
            cache.state.end_prompt()  # as cache.prefill: the questions forwarded next are appended whole
            scores, cache.prefill_scores = cache.prefill_scores, None
            return cache, scores
        return self.cache_for(method, model, profiles_dir, hub=hub, scores=scores), scores

    def _replay(self, cache: Any) -> None:
        attention = ALL_ATTENTION_FUNCTIONS[self.attn_implementation]
        for layer_idx, (keys, values) in enumerate(zip(self.keys, self.values)):
            k, v = cache.update(keys.clone(), values.clone(), layer_idx)
            module = self.modules[layer_idx]
            # The installed attention function compresses the layer after a multi-token forward, reading
            # the queries it is given (the scorer takes the last n_queries). Its output is discarded.
            attention(module, self.queries[layer_idx], k, v, None, dropout=0.0, scaling=module.scaling)

    @staticmethod
    @torch.no_grad()
    def reconstruction_scores(
        model: Any, tokenizer: Any, scorer: str, input_ids: torch.Tensor, sink: int = 4
    ) -> dict[int, torch.Tensor]:
        """A reconstruction scorer's per-layer scores for this context (one pass, shared by every method
        with that scorer): ``{layer: [B, H_kv, T]}``."""
        from ..cache import LUKVCache

        cache = LUKVCache(0.0, scorer, sink=sink, window=0, config=model.config, keep_scores=True)
        cache.prefill(model, input_ids, tokenizer=tokenizer, logits_to_keep=1)
        return dict(cast("dict[int, torch.Tensor]", cache.prefill_scores))  # keep_scores=True


def shareable(model: Any) -> bool:
    """Whether the shared prefill applies: every layer full attention, attention sdpa or eager."""
    config = model.config.get_text_config(decoder=True)
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    no_sliding = all(t == "full_attention" for t in layer_types) and not getattr(
        config, "sliding_window", None
    )
    return no_sliding and model.config._attn_implementation in ("sdpa", "eager")
