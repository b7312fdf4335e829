"""Profiles: LU-KV's per-head evict ratios as safetensors files, shared on the Hub by model id.

>>> from lukv_cache.profiles import Profile, resolve_profile
>>> profile = resolve_profile("meta-llama/Llama-3.1-8B-Instruct", "keydiff")  # doctest: +SKIP
>>> profile.at(0.8).shape  # doctest: +SKIP
(32, 8)
"""

from .convert import KVPRESS_GRID, convert_curve
from .hub import (
    DEFAULT_REPO_ID,
    INDEX_FILENAME,
    LOCAL_DIR_ENV,
    REPO_ID_ENV,
    download_profile,
    list_profiles,
    profile_filename,
    profile_repo_id,
    push_profile,
    resolve_profile,
    save_to_local_dir,
)
from .profile import DEFAULT_SCORER, FORMAT_VERSION, Profile

__all__ = [
    "DEFAULT_REPO_ID",
    "DEFAULT_SCORER",
    "FORMAT_VERSION",
    "INDEX_FILENAME",
    "KVPRESS_GRID",
    "LOCAL_DIR_ENV",
    "REPO_ID_ENV",
    "Profile",
    "convert_curve",
    "download_profile",
    "list_profiles",
    "profile_filename",
    "profile_repo_id",
    "push_profile",
    "resolve_profile",
    "save_to_local_dir",
]
