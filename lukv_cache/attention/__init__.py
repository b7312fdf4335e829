"""Attention over a compressed LUKVCache, and the routing that makes stock sdpa/eager read it.

* :mod:`.calls`: the contract with the cache (:class:`AttentionCall`, :func:`claim_attention`) and the
  guard for implementations that cannot read it (:func:`lukv_aware` marks your own wrappers);
* :mod:`.routing`: the wrapped ``sdpa`` / ``eager`` / ``lukv`` functions (:mod:`lukv_cache.integration`
  registers them and the guards in transformers' registries, and undoes it);
* :mod:`.compressed`: store + dense suffix, exact: computes the plan of :mod:`.dispatch`;
* :mod:`.dispatch`: which implementation serves a call (:class:`~.dispatch.AttentionPlan`), decided once;
* :mod:`.masked`, :mod:`.tiles`: the CPU paths (one masked product; fixed-size tiles of the flat store);
* :mod:`.partial`: the torch math (partial attentions and their log-sum-exp merge);
* :mod:`.kernels`: the CUDA kernels (flash-attn; Triton: :mod:`._triton_ragged`, and :mod:`._triton_quantized`
  over a quantized store's codes) and which serves a call;
* :mod:`.limits`: the tuning limits of all of them, one frozen :class:`~.limits.AttentionLimits`.
"""

from .calls import AttentionCall, claim_attention, is_lukv_aware, lukv_aware, peek_attention
from .compressed import compressed_attention
from .dispatch import ragged_attention
from .limits import AttentionLimits
from .partial import merge_partials, partial_attention, ragged_attention_reference
from .routing import route

__all__ = [
    "AttentionCall",
    "AttentionLimits",
    "claim_attention",
    "compressed_attention",
    "is_lukv_aware",
    "lukv_aware",
    "merge_partials",
    "partial_attention",
    "peek_attention",
    "ragged_attention",
    "ragged_attention_reference",
    "route",
]
