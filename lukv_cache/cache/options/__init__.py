"""What the user asked of a cache, declared and checked once.

* :mod:`.policy`: :class:`~.policy.CompressionPolicy`, every option of ``LUKVCache`` as one frozen
  dataclass, validated on construction;
* :mod:`.memory`: the memory budget (``memory=`` / ``max_bytes=``): bytes turned into bits and tokens.
"""

from .memory import MemoryChoice
from .policy import CompressionPolicy, check_ratio

__all__ = ["CompressionPolicy", "MemoryChoice", "check_ratio"]
