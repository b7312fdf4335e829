"""What the scorers of :mod:`lukv_cache.scorers` share: :class:`Scorer`, the registry and
:func:`register_scorer`, :func:`check_scores`, :func:`kvzip_scorer` and the query grouping the built-ins and
kvzap read. The built-ins (:mod:`.builtin`), :mod:`.kvzap` and the package import it; the package
re-exports every public name and registers the built-ins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._registry import Registry
from ..errors import ConfigurationError
from .kvzip import Reconstruction

ScoreFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Scorer:
    """A registered scorer: the function, and what the cache must give it.

    ``n_queries``: how many trailing prefill queries it reads (0 = none).
    ``window``: the recent window it protects by default (LU-KV: 1, SnapKV: 32).
    ``params``: keyword defaults passed to ``fn``. ``reconstruction``: set for scorers that score the
    whole context through the model after the prefill (KVzip); such a scorer has no ``fn``.
    ``context``: ``fn`` also receives ``layer_idx``, ``module`` (the attention module), ``heads`` (the
    slice of the model's KV heads these are: all of them, or a tensor-parallel rank's), ``positions``
    (int64 ``[B, T]`` position ids) and ``gather_heads`` (``None``, or under tensor parallelism
    ``gather_heads(tensor, dim)``: every rank's heads, concatenated), as keywords. ``missing``: set on a placeholder that
    needs model-specific data (``kvzap`` without a surrogate): the message a cache raises at construction.
    ``decodes``: it can rank tokens generated while decoding (``LUKVCache(decode_max_tokens=...)``); a
    reconstruction scorer cannot (its scores come from repeat passes over the whole context).
    ``rescores``: at each fold, score the tokens a head holds again (``True``: the score depends on the other
    tokens or on the latest queries, e.g. keydiff's anchor) or reuse each token's score from when it was
    first scored (``False``: it depends on the token alone; stored with the token). ``None``: ``False``
    for ``context`` scorers (they read every KV head of a token, which eviction no longer keeps together),
    ``True`` otherwise.
    ``from_surrogate``: set on a learned scorer (``kvzap``), whose model-specific part is a surrogate that the
    model's profile (or a saved cache) stores: ``from_surrogate(surrogate, window=...)`` is the scorer
    scoring with it, and ``params["surrogate"]`` holds it (:meth:`from_profile` binds a profile's).
    ``reads_values``: whether ``fn`` reads ``values`` (``False``: it is called with ``values=None`` where the
    values would cost a copy to gather, e.g. a quantized store's at a fold: keys alone are dequantized).
    ``default_allocator``: the allocator ``LUKVCache.from_pretrained`` uses with a profile of this scorer
    when none is given (``None``: ``"profile"``, the profile's budgets).
    """

    name: str
    fn: ScoreFn | None
    n_queries: int = 0
    window: int = 1
    params: dict[str, Any] = field(default_factory=dict)
    reconstruction: Reconstruction | None = None
    context: bool = False
    missing: str | None = None
    decodes: bool = True
    rescores: bool | None = None
    reads_values: bool = True
    from_surrogate: Callable[..., Scorer] | None = field(default=None, repr=False)
    default_allocator: str | None = field(default=None, repr=False)

    @property
    def keeps_scores(self) -> bool:
        """Whether eviction at fold time reuses each token's first score (see ``rescores``).

        >>> get_scorer("keydiff").keeps_scores
        False
        """
        return self.context if self.rescores is None else not self.rescores

    def from_profile(self, profile: Any) -> Scorer:
        """This scorer for the model of ``profile`` (a :class:`~lukv_cache.Profile`): a learned scorer
        (``from_surrogate`` set) bound to the surrogate the profile holds, any other scorer as it is. A
        profile without a surrogate raises a ConfigurationError saying where to get one.

        >>> get_scorer("keydiff").from_profile(profile).name
        'keydiff'
        """
        if self.from_surrogate is None:
            return self
        if profile.surrogate is None:
            raise ConfigurationError(
                f"The profile {profile.model_id}/{profile.scorer} ({profile.source or 'in memory'}) holds no "
                f"{self.name} surrogate. Use the model's {self.name} profile (scorer={self.name!r} looks up "
                f"<model id>/{self.name}.safetensors), or build one: lukv build <model> --scorer {self.name}."
            )
        return self.from_surrogate(profile.surrogate)

    def __call__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor | None,
        queries: torch.Tensor | None = None,
        **params: Any,
    ) -> torch.Tensor:
        if self.fn is None:
            raise ConfigurationError(
                f"Scorer {self.name!r} scores by context reconstruction, through the model: fill the cache with "
                "cache.prefill(model, input_ids, tokenizer=tokenizer)."
            )
        return self.fn(keys, values, queries, **{**self.params, **params})


SCORERS: Registry[Scorer] = Registry("scorer")


def register_scorer(
    name: str,
    fn: ScoreFn | None = None,
    *,
    n_queries: int = 0,
    window: int = 1,
    overwrite: bool = False,
    decodes: bool = True,
    rescores: bool | None = None,
    reads_values: bool = True,
    **params: Any,
):
    """Register ``fn`` as scorer ``name``; usable as a decorator. ``decodes`` and ``rescores``: how it
    ranks tokens generated while decoding; ``reads_values=False``: it never reads ``values`` (checked now: it
    must give the same scores with ``values=None``), so folds skip gathering them (see :class:`Scorer`).

    >>> @register_scorer("vnorm")
    ... def vnorm(keys, values, queries):
    ...     return values.norm(dim=-1)
    """

    def add(f: ScoreFn) -> ScoreFn:
        scorer = Scorer(
            name,
            f,
            n_queries,
            window,
            dict(params),
            decodes=decodes,
            rescores=rescores,
            reads_values=reads_values,
        )
        _probe(scorer)
        SCORERS.add(name, scorer, overwrite=overwrite)
        return f

    return add(fn) if fn is not None else add


def _probe(scorer: Scorer) -> None:
    """Call a scorer being registered on small random inputs: a wrong shape or a crash is a
    ConfigurationError now, naming the scorer, instead of a failure deep inside a prefill later."""
    if scorer.fn is None:
        return
    if not callable(scorer.fn):
        raise ConfigurationError(
            f"Scorer {scorer.name!r}: expected a function, got {type(scorer.fn).__name__}."
        )
    if not _is_count(scorer.n_queries):
        raise ConfigurationError(f"Scorer {scorer.name!r}: n_queries must be a non-negative integer.")
    if not _is_count(scorer.window):
        raise ConfigurationError(f"Scorer {scorer.name!r}: window must be a non-negative integer.")
    gen = torch.Generator().manual_seed(0)
    b, h, t, d = 1, 2, max(16, scorer.n_queries + 8), 8
    keys, values = torch.randn(b, h, t, d, generator=gen), torch.randn(b, h, t, d, generator=gen)
    queries = torch.randn(b, 2 * h, scorer.n_queries, d, generator=gen) if scorer.n_queries else None
    failed = f"Scorer {scorer.name!r} failed on keys/values [B, H_kv, T, D] = {[b, h, t, d]}"
    scores = _probe_call(scorer, (keys, values, queries), failed)
    check_scores(scorer, scores, (b, h, t))
    if not scorer.reads_values:
        failed = f"Scorer {scorer.name!r} is registered with reads_values=False but failed without values (values=None)"
        without = _probe_call(
            scorer, (keys, None, queries), failed, " Register it without reads_values=False."
        )
        if not isinstance(without, torch.Tensor) or not torch.equal(without, scores):
            raise ConfigurationError(
                f"Scorer {scorer.name!r} is registered with reads_values=False but scores differently without "
                "values (values=None): register it without reads_values=False."
            )


def _probe_call(scorer: Scorer, inputs: tuple, failed: str, after: str = "") -> Any:
    """``scorer(*inputs)``; a crash is a ConfigurationError saying ``failed``, the error, then ``after``."""
    try:
        return scorer(*inputs)
    except Exception as err:
        raise ConfigurationError(f"{failed}: {type(err).__name__}: {err}.{after}") from err


def _is_count(value: object, low: int = 0) -> bool:
    """Whether ``value`` is an integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_scores(scorer: Scorer, scores: object, expected: tuple[int, ...]) -> torch.Tensor:
    """``scores`` as fp32 if it is a float tensor of shape ``expected``; else a ConfigurationError naming
    the scorer and the shape it must return.

    >>> check_scores(get_scorer("keydiff"), torch.zeros(1, 2, 3), (1, 2, 3)).dtype
    torch.float32
    """
    if (
        not isinstance(scores, torch.Tensor)
        or tuple(scores.shape) != expected
        or not scores.is_floating_point()
    ):
        got = (
            f"a {scores.dtype} tensor of shape {list(scores.shape)}"
            if isinstance(scores, torch.Tensor)
            else type(scores).__name__
        )
        raise ConfigurationError(
            f"Scorer {scorer.name!r} returned {got}; a scorer returns float scores of shape "
            f"[B, H_kv, T] = {list(expected)} (higher = keep)."
        )
    return scores.float()


def get_scorer(name: str | Scorer) -> Scorer:
    """The registered scorer ``name`` (a :class:`Scorer` passes through)."""
    return name if isinstance(name, Scorer) else SCORERS.get(name)


def kvzip_scorer(
    chunk_size: int = 2048,
    overlap: int = 8,
    template: str = "auto",
    weighted: bool = False,
    name: str = "kvzip",
    window: int = 1,
) -> Scorer:
    """A KVzip scorer with your settings (``kvzip`` and ``kvzip_plus`` are registered with a 32-token
    window; ``window``: the recent tokens it protects by default).

    >>> kvzip_scorer(chunk_size=1024).reconstruction.chunk_size
    1024
    """
    if not _is_count(chunk_size, 1):
        raise ConfigurationError(f"chunk_size must be a positive number of tokens, got {chunk_size!r}.")
    for arg, value in (("overlap", overlap), ("window", window)):
        if not _is_count(value):
            raise ConfigurationError(
                f"{arg} must be a non-negative number of tokens (e.g. 8), got {value!r}."
            )
    if template not in ("auto", "chat", "plain"):
        raise ConfigurationError(f"template must be 'auto', 'chat' or 'plain', got {template!r}.")
    if not isinstance(weighted, bool):
        raise ConfigurationError(f"weighted must be True (KVzip+) or False, got {weighted!r}.")
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"name must be a non-empty string, got {name!r}.")
    return Scorer(
        name,
        None,
        window=window,
        reconstruction=Reconstruction(chunk_size, overlap, template, weighted),
        decodes=False,  # its scores come from repeat passes over the whole context, once
    )


def group_queries(queries: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[B, H_q, W, D] -> [B, H_kv, G, W, D]: the query heads that read each KV head."""
    b, hq, w, d = queries.shape
    return queries.view(b, num_kv_heads, hq // num_kv_heads, w, d)
