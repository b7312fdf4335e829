"""KVzap (Jegou & Jeblick, arXiv 2601.07891): a learned surrogate of KVzip's scores, a small map per layer.

KVzip ranks a context token by the attention the model pays it while repeating the context; KVzip+ (the
paper's target) also multiplies by ``||v W_O||`` (:mod:`lukv_cache.scorers.kvzip`). That costs repeat
passes through the model. KVzap learns, per layer, a map from features of the token to ``log`` of that
score for every KV head, and scores in the ordinary prefill. Which score a surrogate learned is in its
``meta["target"]`` (``lukv build --kvzap-target``; KVzip's by default, the better of the two here).

The features here are the token's keys before RoPE and its values, of every KV head of the layer
(``2 * H_kv * D`` numbers): what the cache holds anyway, so scoring needs no hook and works for every
token the cache holds (chunked prefill, padded rows, decoded tokens). RoPE is undone with the model's own
rotary embedding at the token's position. A token's KVzip score depends on the token only through its
key (at its position) and its value; the position-free part of the key is what a surrogate can use
(``benchmarks/results/kvzap_surrogate/kvzap_features.py`` measures this choice against the hidden states entering the layer).

They also read the window attention (how strongly the context's last queries read the token) and the
context's length, where the feature set says so (:data:`FEATURE_SETS`). :class:`Surrogate` holds the maps
(a ridge regression, closed form, or a 2-layer MLP); it lives inside the model's profile file
(:mod:`lukv_cache.profiles.profile`).
"""

from __future__ import annotations

import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..errors import ConfigurationError
from .base import Scorer, group_queries

FEATURES = "keys_prerope_values"  # every surrogate reads these; the feature sets below may add more
WINDOW_ATTENTION = (
    "+window_attention"  # one more feature per KV head: what the last queries read of the token
)
WINDOW_QUERIES = 32  # the last queries the window attention reads (as SnapKV's observation window)
# how a surrogate reads the context's length T: not at all, log T as one more input, or log T and every
# feature times it (a surrogate trained on several lengths learns how each head's scores move with T)
_LENGTH_SUFFIXES = {"none": "", "log": "+log_length", "interactions": "+log_length+interactions"}


@dataclass(frozen=True)
class FeatureSet:
    """What a surrogate reads: per KV head the token's pre-RoPE key and value, its window attention if
    ``window_attention`` (context its key and value lack), and the context's length as ``length`` says
    (``"none"``, ``"log"`` or ``"interactions"``). Profile files store :attr:`name`; :meth:`named` reads
    one back.

    >>> FeatureSet.named("keys_prerope_values+log_length")
    FeatureSet(window_attention=False, length='log')
    >>> WINDOW_FEATURES == FeatureSet(window_attention=True, length="interactions").name
    True
    """

    window_attention: bool = False
    length: str = "none"

    def __post_init__(self) -> None:
        if self.length not in _LENGTH_SUFFIXES:
            raise ConfigurationError(
                f"A kvzap feature set reads the length as one of {list(_LENGTH_SUFFIXES)}, not {self.length!r}."
            )

    @property
    def name(self) -> str:
        """The set's name, as profile files store it."""
        return FEATURES + (WINDOW_ATTENTION if self.window_attention else "") + _LENGTH_SUFFIXES[self.length]

    @staticmethod
    def named(name: str) -> FeatureSet:
        """The feature set called ``name`` (one of :data:`FEATURE_SETS`)."""
        if name not in _BY_NAME:
            raise ConfigurationError(f"Unknown kvzap feature set {name!r}; use one of {list(FEATURE_SETS)}.")
        return _BY_NAME[name]

    def base_features(self, kv_heads: int, head_dim: int) -> int:
        """The token features read before the length: per KV head the key, the value (``head_dim`` each)
        and the window attention if the set has it."""
        return kv_heads * (2 * head_dim + (1 if self.window_attention else 0))

    def input_size(self, features: int) -> int:
        """The surrogate's inputs for ``features`` token features."""
        return {"none": features, "log": features + 1, "interactions": 2 * features + 1}[self.length]

    def inputs(self, kv_heads: int, head_dim: int) -> int:
        """The surrogate's inputs for a layer of ``kv_heads`` KV heads of ``head_dim``.

        >>> FeatureSet.named(WINDOW_FEATURES).inputs(3, 64)  # 2 * (3 * (2 * 64 + 1)) + 1
        775
        """
        return self.input_size(self.base_features(kv_heads, head_dim))


_BY_NAME = {  # the sets a surrogate can read, by the names profile files store
    s.name: s
    for s in (
        FeatureSet(),  # named FEATURES
        FeatureSet(length="log"),
        FeatureSet(length="interactions"),
        FeatureSet(
            window_attention=True, length="interactions"
        ),  # the richest: SmolLM2's shipped surrogate's
    )
}
FEATURE_SETS = tuple(_BY_NAME)
_, LOG_LENGTH_FEATURES, INTERACTION_FEATURES, WINDOW_FEATURES = FEATURE_SETS


def reads_window(feature_set: str) -> bool:
    """Whether surrogates of ``feature_set`` read the window attention (and so the last queries)."""
    return FeatureSet.named(feature_set).window_attention


def base_features(feature_set: str, kv_heads: int, head_dim: int) -> int:
    """The token features a surrogate of ``feature_set`` reads before the length: per KV head its pre-RoPE
    key and value, and its window attention if the set has it.

    >>> base_features(INTERACTION_FEATURES, 3, 64), base_features(WINDOW_FEATURES, 3, 64)
    (384, 387)
    """
    return FeatureSet.named(feature_set).base_features(kv_heads, head_dim)


def input_size(feature_set: str, features: int) -> int:
    """The number of inputs a surrogate of ``feature_set`` reads for ``features`` token features.

    >>> [input_size(s, 384) for s in FEATURE_SETS]
    [384, 385, 769, 769]
    """
    return FeatureSet.named(feature_set).input_size(features)


def surrogate_inputs(features: torch.Tensor, lengths: torch.Tensor | None, feature_set: str) -> torch.Tensor:
    """fp32 ``[B, T, input_size]``: a surrogate's inputs from token features ``[B, T, F]`` and each row's
    context length ``lengths [B]`` (tokens the row holds; ``None``: ``T``).

    >>> surrogate_inputs(torch.ones(1, 2, 3), torch.tensor([8]), INTERACTION_FEATURES)[0, 0]
    tensor([1.0000, 1.0000, 1.0000, 2.0794, 2.0794, 2.0794, 2.0794])
    """
    x = features.float()
    length = FeatureSet.named(feature_set).length
    if length == "none":
        return x
    b, t, _ = x.shape
    lengths = torch.full((b,), t) if lengths is None else lengths
    log_t = lengths.to(x.device, torch.float32).clamp_min(1).log()[:, None, None].expand(b, t, 1)
    return torch.cat([x, log_t, x * log_t] if length == "interactions" else [x, log_t], dim=-1)


# ---------------------------------------------------------------------------------------------- features


class RopeInverse:
    """Undo RoPE on cached keys with the model's own rotary embedding (found next to the attention class).

    >>> inverse = RopeInverse.for_module(model.model.layers[0].self_attn)
    >>> k = torch.randn(1, 2, 5, 16)
    >>> cos, sin = inverse.cos_sin(k, torch.arange(5)[None])
    >>> rotated = k * cos[:, None] + torch.cat([-k[..., 8:], k[..., :8]], -1) * sin[:, None]
    >>> torch.allclose(inverse(rotated, torch.arange(5)[None]), k, atol=1e-5)
    True
    """

    def __init__(self, rotary: torch.nn.Module, layer_type: str | None = None):
        self.rotary = rotary
        self.layer_type = layer_type
        self._device: torch.device | None = None  # where the rotary module's buffers are
        # the last call's positions and (cos, sin): a fold scores every layer at the same positions, and
        # the layers of one model share one RopeInverse (rope_inverse)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def for_module(cls, module: Any) -> RopeInverse:
        config = getattr(module, "config", None)
        namespace = sys.modules.get(type(module).__module__)
        found = [
            obj
            for name, obj in vars(namespace or {}).items()
            if name.endswith("RotaryEmbedding") and isinstance(obj, type) and issubclass(obj, torch.nn.Module)
        ]
        if config is None or len(found) != 1:
            raise ConfigurationError(
                f"kvzap undoes RoPE with the model's rotary embedding, and none was found for "
                f"{type(module).__name__} ({len(found)} candidates in {type(module).__module__}). "
                "Use another scorer (e.g. 'keydiff') for this model."
            )
        rotary = found[0](config)
        layer_type = None
        if "layer_type" in inspect.signature(rotary.forward).parameters:
            types = getattr(config, "layer_types", None) or []
            idx = getattr(module, "layer_idx", 0)
            layer_type = types[idx] if idx < len(types) else None
        return cls(rotary, layer_type)

    def cos_sin(self, like: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos/sin ``[B, T, R]`` (``R`` rotary dims) at ``positions [B, T]``."""
        positions = positions.to(like.device).long()
        last = self._last
        if last is not None and last[0].shape == positions.shape and last[0].device == positions.device:
            if torch.equal(last[0], positions):
                return last[1], last[2]
        if self._device != like.device:
            self.rotary.to(like.device)
            self._device = like.device
        x = like.new_empty(0, dtype=torch.float32)
        args = (self.layer_type,) if self.layer_type is not None else ()
        cos, sin = self.rotary(x, positions, *args)
        cos, sin = cos.float(), sin.float()
        # kept for a fold's few positions only: a prompt's would pin [B, T, R] floats after the prefill
        self._last = (positions.clone(), cos, sin) if positions.numel() <= _KEPT_POSITIONS else None
        return cos, sin

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Keys before RoPE, fp32 ``[B, H, T, D]``, from cached keys ``[B, H, T, D]`` at ``positions``."""
        cos, sin = self.cos_sin(keys, positions)
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, R]
        r = cos.shape[-1]
        k = keys.float()
        rot, rest = k[..., :r], k[..., r:]
        half = r // 2
        swapped = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)  # rotate_half
        unrotated = (rot * cos - swapped * sin) / (cos * cos + sin * sin).clamp_min(1e-12)
        return torch.cat([unrotated, rest], dim=-1)


def token_features(
    keys_prerope: torch.Tensor, values: torch.Tensor, attention: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 ``[B, T, H_kv, 2 * D (+ 1)]``: each token's pre-RoPE key and value, per KV head, and its window
    attention ``[B, H_kv, T]`` if given (flatten the last two dims for a surrogate's input)."""
    parts = [keys_prerope.float(), values.float()]
    if attention is not None:
        parts.append(attention.float().unsqueeze(-1))
    return torch.cat(parts, dim=-1).transpose(1, 2)


def window_attention(keys: torch.Tensor, queries: torch.Tensor, scaling: float) -> torch.Tensor:
    """fp32 ``[B, H_kv, T]``: how strongly the last queries read each token, ``log mean exp(q . k * scaling)``
    over the queries ``[B, H_q, W, D]`` (the last ``W`` tokens' own, post-RoPE) of the KV head's group that
    may see the token (causal), from post-RoPE ``keys [B, H_kv, T, D]``.

    Unnormalised (no softmax over the keys): a token gets the same value whichever other tokens the cache
    holds beside it, so a token scored when it leaves the decoding suffix compares with one scored at
    prefill. The ``-inf`` of a token no query may see (none, when the queries are the last tokens') is
    never produced.

    >>> k, q = torch.randn(1, 1, 5, 4), torch.randn(1, 2, 2, 4)
    >>> a = window_attention(k, q, 0.5)
    >>> logits = torch.einsum("bqwd,btd->bqwt", q, k[:, 0]) * 0.5  # 2 query heads x 2 queries x 5 keys
    >>> bool(torch.allclose(a[0, 0, 3], logits[0, :, :, 3].flatten().logsumexp(0) - torch.log(torch.tensor(4.0))))
    True
    >>> bool(torch.allclose(a[0, 0, 4], logits[0, :, 1, 4].logsumexp(0) - torch.log(torch.tensor(2.0))))
    True
    """
    b, h, t, d = keys.shape
    w = queries.shape[2]
    g = queries.shape[1] // h
    q = group_queries(queries.float(), h).flatten(2, 3)  # rows (group member, query)
    logits = torch.einsum("bhmd,bhtd->bhmt", q, keys.float()) * scaling
    # query i (the token at suffix position t - w + i) sees the tokens up to its own
    sees = torch.arange(t, device=keys.device)[None, :] <= torch.arange(t - w, t, device=keys.device)[:, None]
    sees = sees.repeat(g, 1)  # [G * W, T]
    logits = logits.masked_fill(~sees, float("-inf"))
    return logits.logsumexp(dim=2) - sees.sum(0).clamp_min(1).float().log()


def module_window_attention(module: Any, keys: torch.Tensor, queries: torch.Tensor) -> torch.Tensor:
    """:func:`window_attention` of the last :data:`WINDOW_QUERIES` of ``queries``, at the attention
    ``module``'s own scaling (``1 / sqrt(D)`` where it declares none): what scoring and training both read."""
    scaling = getattr(module, "scaling", None) or keys.shape[-1] ** -0.5
    return window_attention(keys, queries[:, :, -WINDOW_QUERIES:], scaling)


_INVERSES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_SHARED: dict[tuple[int, type, str | None], tuple[weakref.ref, RopeInverse]] = {}
_KEPT_POSITIONS = 1024  # RopeInverse keeps its last cos and sin for at most this many positions


def rope_inverse(module: Any) -> RopeInverse:
    """The :class:`RopeInverse` of an attention module (built once per module), shared by the modules of one
    model that rotate alike (the same config object, rotary class and layer type), so that the layers scored
    at the same positions (a fold, a prefill) compute cos and sin once."""
    if module not in _INVERSES:
        inverse = RopeInverse.for_module(module)
        config = getattr(module, "config", None)
        key = (id(config), type(inverse.rotary), inverse.layer_type)
        shared = _SHARED.get(key)
        if shared is not None and shared[0]() is config:
            inverse = shared[1]
        else:
            for dead in [k for k, (ref, _) in _SHARED.items() if ref() is None]:
                del _SHARED[dead]  # models gone since
            _SHARED[key] = (weakref.ref(config), inverse)
        _INVERSES[module] = inverse
    return _INVERSES[module]


# ---------------------------------------------------------------------------------------------- surrogate


@dataclass(eq=False)
class Surrogate:
    """Per layer: a token's features ``x [F]`` (pre-RoPE keys and values of every KV head of the layer,
    ``F = 2 * H_kv * D``) -> its predicted log KVzip (or KVzip+) score for each KV head, with
    ``z = (x - mean[l]) / std[l]`` (``mean``/``std [L, F]``):

    * ``linear`` (ridge regression): ``z . weight[l, h] + bias[l, h]``, ``weight [L, H_kv, F]``;
    * ``mlp``: ``gelu(hidden_weight[l] z + hidden_bias[l]) . weight[l, h] + bias[l, h]``, with
      ``hidden_weight [L, M, F]``, ``hidden_bias [L, M]`` and ``weight [L, H_kv, M]``.

    ``bias`` is ``[L, H_kv]``. ``layers``: the layers it was trained for (sliding-window layers are never
    evicted and keep zeros). ``meta``: what it was trained on and how well it fits.

    Read-only once a cache scores with it: ``copy.deepcopy`` returns the surrogate itself, so every copy of
    a cache (the copy-per-question recipe) shares one surrogate instead of duplicating it (11.6 MiB for
    SmolLM2's); to change a copy's weights, build a new ``Surrogate``.

    >>> s = Surrogate.zeros(num_layers=2, heads=2, features=8)
    >>> s.predict(0, torch.ones(1, 3, 8)).shape
    torch.Size([1, 2, 3])
    >>> Surrogate.zeros(num_layers=2, heads=2, features=8, hidden=16).family
    'mlp'
    """

    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    layers: list[int] = field(default_factory=list)
    features: str = FEATURES
    meta: dict = field(default_factory=dict)
    hidden_weight: torch.Tensor | None = None
    hidden_bias: torch.Tensor | None = None
    # (layer, heads, device) -> the tensors' versions and the folded maps (_folded); not saved, not compared
    _folded_maps: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def zeros(cls, num_layers: int, heads: int, features: int, hidden: int | None = None) -> Surrogate:
        """An all-zero surrogate (``hidden``: the MLP's width; ``None`` for a linear one)."""
        mlp: dict[str, Any] = {}  # hidden_weight, hidden_bias: tensors
        if hidden is not None:
            mlp = {
                "hidden_weight": torch.zeros(num_layers, hidden, features),
                "hidden_bias": torch.zeros(num_layers, hidden),
            }
        return cls(
            torch.zeros(num_layers, heads, features if hidden is None else hidden),
            torch.zeros(num_layers, heads),
            torch.zeros(num_layers, features),
            torch.ones(num_layers, features),
            **mlp,
        )

    def __deepcopy__(self, memo: dict) -> Surrogate:
        return self  # read-only: shared by every deep copy of a cache (see the class docstring)

    @property
    def family(self) -> str:
        return "linear" if self.hidden_weight is None else "mlp"

    @property
    def num_layers(self) -> int:
        return int(self.weight.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[1])

    @property
    def num_features(self) -> int:
        return int(self.mean.shape[1])

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors as stored in a profile (``kvzap.*``)."""
        out = {"weight": self.weight, "bias": self.bias, "mean": self.mean, "std": self.std}
        if self.hidden_weight is not None:
            out |= {"hidden_weight": self.hidden_weight, "hidden_bias": cast(torch.Tensor, self.hidden_bias)}
        return {f"kvzap.{name}": t.detach().float().contiguous() for name, t in out.items()}

    def predict(
        self,
        layer: int,
        features: torch.Tensor,
        heads: slice = slice(None),
        lengths: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """fp32 ``[B, H, T]`` predicted log-scores from token features ``[B, T, F]`` (``heads``: which of the
        surrogate's heads to predict, e.g. a tensor-parallel rank's; ``lengths [B]``: each row's context
        length, for a surrogate whose feature set reads it; default ``T``). Standardisation is folded into
        the first weights: one ``[B, T, F] x [F, H]`` matmul (linear), or ``[F, M]`` then ``[M, H]`` (MLP),
        nothing of size ``H x T x F``."""
        x = surrogate_inputs(features, lengths, self.features)
        first, first_bias, weight, bias = self._folded(layer, heads, features.device)
        out = x @ first.T + first_bias  # linear: the scores; MLP: the hidden layer
        if self.hidden_weight is None:
            return out.transpose(1, 2)
        return (torch.nn.functional.gelu(out) @ weight.T + bias).transpose(1, 2)

    def _folded(self, layer: int, heads: slice, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``(first, first_bias, weight, bias)`` of ``layer`` on ``device``: the first map's weights divided by
        ``std`` and its bias less their product with ``mean`` (standardisation folded in), then, for an MLP,
        the output map's; computed once per (layer, heads, device) and kept while no tensor of the surrogate
        changes in place (their version counters are checked: a change replaces the entry, so the cache holds at
        most one per key), as a cache's folds score a few tokens of every layer every few decoding steps."""
        versions = tuple(
            t._version
            for t in (self.weight, self.bias, self.mean, self.std, self.hidden_weight, self.hidden_bias)
            if t is not None
        )
        key = (layer, heads.start, heads.stop, heads.step, str(device))
        kept = self._folded_maps.get(key)
        if kept is not None and kept[0] == versions:
            return kept[1]
        mean, std = self.mean[layer].to(device), self.std[layer].to(device)
        weight, bias = self.weight[layer, heads].to(device), self.bias[layer, heads].to(device)
        if self.hidden_weight is None:
            scale = weight / std  # [H, F]
            maps = (scale, bias - scale @ mean, weight, bias)
        else:
            first = self.hidden_weight[layer].to(device) / std  # [M, F]
            hidden_bias = cast(torch.Tensor, self.hidden_bias)  # an MLP surrogate has both
            maps = (first, hidden_bias[layer].to(device) - first @ mean, weight, bias)
        self._folded_maps[key] = (versions, maps)
        return maps


# ---------------------------------------------------------------------------------------------- the scorer

KVZAP_WINDOW = 32  # the recent window KVzip protects here too: the surrogate stands in for its scores
# the allocator LUKVCache.from_pretrained uses with a kvzap profile when none is given: one model-wide top-k
# (kvzap's scores are comparable across layers and heads; it lost the least on SmolLM2-135M: docs/kvzap.md)
KVZAP_ALLOCATOR = "global"
_HOW = (
    "LUKVCache.from_pretrained(model_id, ratio=..., scorer='kvzap') reads the surrogate from the model's profile; "
    "build one with `lukv build <model> --scorer kvzap`, or pass scorer=kvzap_scorer(surrogate)."
)


def _kvzap(keys, values, queries, *, surrogate, layer_idx, module, heads, positions, gather_heads=None):
    attention = None
    if reads_window(surrogate.features):
        if queries is None or queries.shape[2] == 0:
            raise ConfigurationError(
                "This kvzap surrogate reads the window attention of the context's last queries, and none were "
                "kept for these tokens. Score them in the forward that brings them (generate, cache.prefill)."
            )
        attention = module_window_attention(module, keys, queries)
    features = token_features(rope_inverse(module)(keys, positions), values, attention)  # [B, T, H_kv, F_h]
    if gather_heads is not None:  # tensor parallelism: every rank's heads make the features
        features = gather_heads(features, dim=2)
    lengths = positions.amax(dim=-1) + 1  # each row's context so far (padding sits at lower positions)
    features = features.flatten(2)
    _check_fits(surrogate, layer_idx, features.shape[-1], keys.shape[1], heads)
    scores = surrogate.predict(layer_idx, features, heads, lengths)
    if not bool(torch.isfinite(scores).all()):
        bad = int((~torch.isfinite(scores)).sum())
        raise ConfigurationError(
            f"The kvzap surrogate of layer {layer_idx} produced non-finite scores ({bad} of {scores.numel()}): "
            "its weights overflow (or the model's keys and values are not finite). Rebuild the surrogate "
            "(lukv build <model> --scorer kvzap), or use another scorer (e.g. 'keydiff')."
        )
    return scores


def _check_fits(surrogate: Surrogate, layer: int, features: int, kv_heads: int, heads: slice) -> None:
    """A ConfigurationError naming the layer unless ``surrogate`` has a map for ``layer`` that reads
    ``features`` token features and predicts ``kv_heads`` heads (``heads`` of its own)."""
    problem = None
    expected = input_size(surrogate.features, features)
    if not 0 <= layer < surrogate.num_layers:
        problem = f"the surrogate has {surrogate.num_layers} layer(s), none for this one"
    elif expected != surrogate.num_features:
        problem = (
            f"the surrogate reads {surrogate.num_features} inputs per token but the model gives {expected} "
            f"({features} features of its keys and values for {surrogate.features!r})"
        )
    else:
        predicted = len(range(*heads.indices(surrogate.num_heads)))
        if predicted != kv_heads:
            problem = f"the surrogate predicts {predicted} KV head(s) here but the layer has {kv_heads}"
    if problem is not None:
        raise ConfigurationError(
            f"This kvzap surrogate does not fit the model at layer {layer}: {problem}. Use the surrogate "
            f"built for this model (its kvzap profile), or build one: lukv build <model> --scorer kvzap."
        )


def kvzap_scorer(surrogate: Surrogate, window: int = KVZAP_WINDOW) -> Scorer:
    """The ``kvzap`` scorer with a trained ``surrogate``: predicted log KVzip scores, in the ordinary forward.

    >>> scorer = kvzap_scorer(Surrogate.zeros(2, 2, 32))
    >>> scorer.name, scorer.window, scorer.context
    ('kvzap', 32, True)
    """
    if not isinstance(surrogate, Surrogate):
        raise ConfigurationError(f"kvzap_scorer needs a Surrogate, got {type(surrogate).__name__}. {_HOW}")
    # a token's score is kept from when it was scored (at prefill, or when it leaves the decoding suffix):
    # once heads hold different tokens, its key and value can no longer be gathered from every head
    return Scorer(
        "kvzap",
        _kvzap,
        n_queries=WINDOW_QUERIES if reads_window(surrogate.features) else 0,
        window=window,
        params={"surrogate": surrogate},
        context=True,
        decodes=True,
        rescores=False,
        from_surrogate=kvzap_scorer,
        default_allocator=KVZAP_ALLOCATOR,
    )


def _untrained(*args, **kwargs):
    raise ConfigurationError(f"Scorer 'kvzap' has no trained surrogate. {_HOW}")


KVZAP_PLACEHOLDER = Scorer(
    "kvzap",
    _untrained,
    window=KVZAP_WINDOW,
    context=True,
    decodes=True,
    rescores=False,
    missing=(f"Scorer 'kvzap' scores with a surrogate trained for one model, and none was given. {_HOW}"),
    from_surrogate=kvzap_scorer,
    default_allocator=KVZAP_ALLOCATOR,
)
