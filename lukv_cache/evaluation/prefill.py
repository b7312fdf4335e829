"""One context prefill shared by every method of a benchmark (:class:`SharedPrefill`: the recording and
replay of :mod:`lukv_cache.cache.compression.recorded`, and each method's cache)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..cache.compression.recorded import RecordedPrefill, shareable
from .methods import Method, make_cache


@dataclass
class SharedPrefill(RecordedPrefill):
    """One context's prefill, recorded once (:class:`~lukv_cache.cache.compression.recorded.RecordedPrefill`);
    :meth:`cache_for` turns it into any benchmark method's cache.

    >>> shared = SharedPrefill.record(model, inputs["input_ids"], n_queries=64)
    >>> cache = shared.cache_for(Method("uniform", "keydiff", 0.8), model)
    >>> cache.get_seq_length()
    48
    """

    _reconstruction: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)

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
        if method.is_full:  # the model's own cache
            return self.full_cache(model.config)
        return self.replay_into(make_cache(method, model, profiles_dir, hub=hub), scores)

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


__all__ = ["SharedPrefill", "shareable"]
