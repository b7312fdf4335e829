"""lukv_cache: LU-KV per-head KV-cache eviction for Hugging Face transformers.

>>> from lukv_cache import LUKVCache
>>> cache = LUKVCache(ratio=0.8, scorer="keydiff", allocator="uniform")
"""

__version__ = "0.1.0"

from .allocation import AllocationRequest, Allocator, get_allocator, register_allocator  # noqa: E402
from .attention import install as _install_attention  # noqa: E402
from .attention import lukv_aware  # noqa: E402
from .cache import LUKVCache  # noqa: E402
from .errors import (  # noqa: E402
    BatchMismatchError,
    CalibrationFormatError,
    ConfigurationError,
    HubUnavailableError,
    IncompatibleAttentionError,
    LUKVError,
    ModelUnavailableError,
    ProfileError,
    ProfileFormatError,
    ProfileMismatchError,
    ProfileNotFoundError,
    PublishError,
    TensorParallelError,
    TextUnavailableError,
    UnknownNameError,
)
from .scorers import Scorer, get_scorer, register_scorer  # noqa: E402

_install_attention()


def __getattr__(name: str):
    # Profiles and profiling pull in more (huggingface_hub, tqdm); load them on first use.
    if name == "Profile":
        from .profiles import Profile

        return Profile
    if name in ("build_profile", "build_profiles"):
        from . import profiling

        return getattr(profiling, name)
    raise AttributeError(f"module 'lukv_cache' has no attribute {name!r}")


__all__ = [
    "AllocationRequest",
    "Allocator",
    "BatchMismatchError",
    "CalibrationFormatError",
    "ConfigurationError",
    "HubUnavailableError",
    "IncompatibleAttentionError",
    "LUKVCache",
    "LUKVError",
    "ModelUnavailableError",
    "Profile",
    "ProfileError",
    "ProfileFormatError",
    "ProfileMismatchError",
    "ProfileNotFoundError",
    "PublishError",
    "Scorer",
    "TensorParallelError",
    "TextUnavailableError",
    "UnknownNameError",
    "build_profile",
    "build_profiles",
    "get_allocator",
    "get_scorer",
    "lukv_aware",
    "register_allocator",
    "register_scorer",
]
