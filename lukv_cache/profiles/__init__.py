"""Profiles: LU-KV's per-head evict ratios as safetensors files, shared on the Hub by model id.

* :mod:`.profile`: the file format (:class:`Profile`);
* :mod:`.location`: where profiles live (:class:`HubLocation`, file names);
* :mod:`.download`: finding one (:func:`resolve_profile`);
* :mod:`.index`: ``index.json`` and the local mirror; :mod:`.publish`: uploading;
* :mod:`.convert`: LU-KV / kvpress ``.npy`` curves; :mod:`.cli`: ``lukv pull | push | list | convert``.

>>> from lukv_cache.profiles import Profile, resolve_profile
>>> profile = resolve_profile("meta-llama/Llama-3.1-8B-Instruct", "keydiff")  # doctest: +SKIP
>>> profile.at(0.8).shape  # doctest: +SKIP
(32, 8)
"""

from .convert import KVPRESS_GRID, convert_curve
from .download import download_profile, model_id_of, resolve_profile
from .index import INDEX_FORMAT_VERSION, list_profiles, save_to_local_dir
from .location import (
    DEFAULT_REPO_ID,
    DEFAULT_SCORER,
    INDEX_FILENAME,
    LOCAL_DIR_ENV,
    REPO_ID_ENV,
    HubLocation,
    profile_filename,
    profile_repo_id,
)
from .profile import FORMAT_VERSION, Profile
from .publish import push_profile

__all__ = [
    "DEFAULT_REPO_ID",
    "DEFAULT_SCORER",
    "FORMAT_VERSION",
    "INDEX_FILENAME",
    "INDEX_FORMAT_VERSION",
    "KVPRESS_GRID",
    "LOCAL_DIR_ENV",
    "REPO_ID_ENV",
    "HubLocation",
    "Profile",
    "convert_curve",
    "download_profile",
    "list_profiles",
    "model_id_of",
    "profile_filename",
    "profile_repo_id",
    "push_profile",
    "resolve_profile",
    "save_to_local_dir",
]
