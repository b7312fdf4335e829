"""lukv_cache: LU-KV per-head KV-cache eviction for Hugging Face transformers.

>>> from lukv_cache import LUKVCache
>>> cache = LUKVCache(ratio=0.8, scorer="keydiff", allocator="uniform")

Importing the package is cheap: the public names below load their modules (and torch) on first use, and
lukv's attention wrappers are registered in transformers' attention registry as soon as that registry
(``transformers.modeling_utils``) is imported, which every transformers model class does.
:mod:`lukv_cache.integration` lists what that changes in the process and undoes it (``uninstall()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_names
from ._version import __version__ as __version__
from .errors import (
    BatchIndexError,
    BatchMismatchError,
    CalibrationFormatError,
    ConfigurationError,
    HubUnavailableError,
    IncompatibleAttentionError,
    LUKVError,
    ModelUnavailableError,
    PlotUnavailableError,
    ProfileError,
    ProfileFormatError,
    ProfileMismatchError,
    ProfileNotFoundError,
    PublishError,
    RaggedCacheError,
    SavedContextError,
    SavedContextMismatchError,
    TensorParallelError,
    TextUnavailableError,
    UnknownNameError,
    UnsupportedOperationError,
)
from .integration import install_when_imported

# public name -> the module that defines it, imported on first access (PEP 562)
_LAZY = {
    "AllocationRequest": ".allocation",
    "Allocator": ".allocation",
    "get_allocator": ".allocation",
    "register_allocator": ".allocation",
    "lukv_aware": ".attention",
    "LUKVCache": ".cache",
    "load_cache": ".cache.save_load",
    "save_cache": ".cache.save_load",
    "LUKVPipeline": ".pipeline",
    "Profile": ".profiles",
    "build_profile": ".profiling",
    "build_profiles": ".profiling",
    "Scorer": ".scorers",
    "get_scorer": ".scorers",
    "register_scorer": ".scorers",
}
# the same names from the same modules, for type checkers and editors (kept equal: tests/test_lazy_names.py)
if TYPE_CHECKING:
    from .allocation import AllocationRequest, Allocator, get_allocator, register_allocator
    from .attention import lukv_aware
    from .cache import LUKVCache
    from .cache.save_load import load_cache, save_cache
    from .pipeline import LUKVPipeline
    from .profiles import Profile
    from .profiling import build_profile, build_profiles
    from .scorers import Scorer, get_scorer, register_scorer

_SUBPACKAGES = (
    "allocation",
    "attention",
    "cache",
    "cli",
    "evaluation",
    "models",
    "profiles",
    "profiling",
    "scorers",
    "texts",
)


__getattr__, __dir__ = lazy_names(__name__, _LAZY, _SUBPACKAGES)

install_when_imported()

__all__ = [
    "AllocationRequest",
    "Allocator",
    "BatchIndexError",
    "BatchMismatchError",
    "CalibrationFormatError",
    "ConfigurationError",
    "HubUnavailableError",
    "IncompatibleAttentionError",
    "LUKVCache",
    "LUKVError",
    "LUKVPipeline",
    "ModelUnavailableError",
    "PlotUnavailableError",
    "Profile",
    "ProfileError",
    "ProfileFormatError",
    "ProfileMismatchError",
    "ProfileNotFoundError",
    "PublishError",
    "RaggedCacheError",
    "SavedContextError",
    "SavedContextMismatchError",
    "Scorer",
    "TensorParallelError",
    "TextUnavailableError",
    "UnknownNameError",
    "UnsupportedOperationError",
    "build_profile",
    "build_profiles",
    "get_allocator",
    "get_scorer",
    "load_cache",
    "lukv_aware",
    "register_allocator",
    "register_scorer",
    "save_cache",
]
