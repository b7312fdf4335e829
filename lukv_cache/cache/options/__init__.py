"""What the user asked of a cache, declared and checked once.

* :mod:`.values`: the checks of one option's value, each alone (``check_ratio``, ``check_flag``, a count,
  each field's own check);
* :mod:`.spec`: how a field of the policy is an option (``Option``, ``option``, ``option_spec``) and the call
  signature the fields make;
* :mod:`.policy`: :class:`~.policy.CompressionPolicy`, every option of ``LUKVCache`` as one frozen
  dataclass, built and checked across options;
* :mod:`.surface`: the cache's read-only properties of its options (``cache.ratio``, ``cache.kv_bits``);
* :mod:`.docs`: the options rendered from the fields (docs/usage.md's table, the cache docstring's Args);
* :mod:`.memory`: the memory budget (``memory=`` / ``max_bytes=``): bytes turned into bits and tokens.
"""

from .memory import MemoryChoice
from .policy import CompressionPolicy
from .values import check_ratio

__all__ = ["CompressionPolicy", "MemoryChoice", "check_ratio"]
