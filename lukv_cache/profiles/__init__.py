"""Profiles: LU-KV's per-head evict ratios as safetensors files, shared on the Hub by model id.

* :mod:`.profile`: the file format (:class:`Profile`);
* :mod:`.location`: where profiles live (:class:`HubLocation`, file names);
* :mod:`.download`: finding one (:func:`resolve_profile`);
* :mod:`.index`: ``index.json`` and the local mirror; :mod:`.publish`: uploading; :mod:`.files`: writing;
* :mod:`.memory_table`: the measured loss at (kv_bits, ratio) a profile may hold (:class:`MemoryTable`);
* :mod:`.convert`: LU-KV / kvpress ``.npy`` curves; :mod:`.cli`: ``lukv pull | push | list | convert``.

>>> from lukv_cache.profiles import Profile, resolve_profile
>>> profile = resolve_profile("meta-llama/Llama-3.1-8B-Instruct", "keydiff")  # doctest: +SKIP
>>> profile.at(0.8).shape  # doctest: +SKIP
(32, 8)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_names

# public name -> the module of this package that defines it, imported on first access (PEP 562), so that
# the light ones (.location: names and places) do not pull in torch, safetensors and huggingface_hub
_LAZY = {
    "KVPRESS_GRID": ".convert",
    "convert_curve": ".convert",
    "download_profile": ".download",
    "model_id_of": ".download",
    "resolve_profile": ".download",
    "INDEX_FORMAT_VERSION": ".index",
    "list_profiles": ".index",
    "save_to_local_dir": ".index",
    "DEFAULT_REPO_ID": ".location",
    "DEFAULT_SCORER": ".location",
    "INDEX_FILENAME": ".location",
    "LOCAL_DIR_ENV": ".location",
    "REPO_ID_ENV": ".location",
    "HubLocation": ".location",
    "MemoryTable": ".memory_table",
    "profile_filename": ".location",
    "profile_repo_id": ".location",
    "FORMAT_VERSION": ".profile",
    "Profile": ".profile",
    "push_profile": ".publish",
}
# the same names from the same modules, for type checkers and editors (kept equal: tests/test_lazy_names.py)
if TYPE_CHECKING:
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
    from .memory_table import MemoryTable
    from .profile import FORMAT_VERSION, Profile
    from .publish import push_profile


__getattr__, __dir__ = lazy_names(__name__, _LAZY)


__all__ = [
    "DEFAULT_REPO_ID",
    "DEFAULT_SCORER",
    "FORMAT_VERSION",
    "INDEX_FILENAME",
    "INDEX_FORMAT_VERSION",
    "KVPRESS_GRID",
    "LOCAL_DIR_ENV",
    "MemoryTable",
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
