"""``LUKVCache.from_pretrained(model_id, ratio=...)`` on a model with no profile anywhere: the profile-free
method, one log line, ``cache.profile is None`` (issue 44, item 4). The Hub is the test Hub server."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from lukv_cache import LUKVCache
from lukv_cache._compat import cache_kwarg
from lukv_cache.cache import pretrained
from lukv_cache.errors import (
    ConfigurationError,
    HubUnavailableError,
    ProfileFormatError,
    ProfileMismatchError,
    ProfileNotFoundError,
    UnknownNameError,
)
from lukv_cache.profiles import profile_filename, save_to_local_dir
from lukv_cache.testing import prompt, tiny_model

REPO = "lukv-test/profiles"
UNPROFILED = "org/no-profile-anywhere"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _first_time_in_the_process(monkeypatch):
    """The missing profile is said at WARNING level once per model id and process: each test starts fresh,
    and with no profile folder of its own (examples/_tiny.py, which other tests load, sets one for the process)."""
    monkeypatch.setattr(pretrained, "_announced", pretrained.RecentIds())
    monkeypatch.delenv("LUKV_PROFILE_DIR", raising=False)


@pytest.fixture
def hub_with_another_model(hub, profile):
    profile.push_to_hub(repo_id=REPO, endpoint=hub.url)  # the repository exists, without UNPROFILED
    return hub


def _online(hub, cache_dir, model=UNPROFILED, **kwargs) -> LUKVCache:
    return LUKVCache.from_pretrained(
        model, ratio=0.8, repo_id=REPO, endpoint=hub.url, cache_dir=cache_dir, **kwargs
    )


def test_a_model_the_hub_has_no_profile_for_gets_the_profile_free_cache(hub_with_another_model, hf_cache):
    cache = _online(hub_with_another_model, hf_cache)
    assert cache.profile is None
    assert (cache.scorer.name, cache.allocator_name, cache.ratio) == ("keydiff", "uniform", 0.8)


def test_offline_by_local_files_only_a_model_without_a_profile_gets_the_profile_free_cache(hf_cache):
    cache = LUKVCache.from_pretrained(UNPROFILED, ratio=0.8, cache_dir=hf_cache, local_files_only=True)
    assert cache.profile is None and (cache.scorer.name, cache.allocator_name) == ("keydiff", "uniform")


def test_with_hf_hub_offline_a_model_without_a_profile_gets_the_profile_free_cache(hf_cache):
    script = (
        "from lukv_cache import LUKVCache\n"
        f"cache = LUKVCache.from_pretrained({UNPROFILED!r}, ratio=0.8, cache_dir={str(hf_cache)!r})\n"
        "print(cache.profile, cache.scorer.name, cache.allocator_name)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "keydiff", "uniform"]
    assert f"no profile for {UNPROFILED}" in result.stderr  # the WARNING line, on stderr unconfigured


def test_the_fallback_logs_one_line_naming_the_model_the_method_and_lukv_build(
    hub_with_another_model, hf_cache, caplog
):
    with caplog.at_level(logging.INFO, logger="lukv_cache"):
        _online(hub_with_another_model, hf_cache)
    (line,) = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert line.name == "lukv_cache" and line.levelno == logging.WARNING
    assert line.getMessage() == (
        f"lukv_cache: no profile for {UNPROFILED} (looked in the Hub repository {REPO!r} at "
        f"{hub_with_another_model.url} and the profiles shipped with lukv_cache); using the profile-free "
        "LUKVCache(ratio=..., scorer='keydiff', allocator='uniform'). For LU-KV's per-head budgets build one "
        "(a keydiff build took 1 min 49 s for Qwen2.5-0.5B on 2 CPU threads, its memory table included; "
        f"it says its own estimate before the long part): lukv build {UNPROFILED}"
    )


def test_the_same_model_again_is_said_at_info_level_only(hf_cache, caplog):
    for _ in range(3):
        with caplog.at_level(logging.INFO, logger="lukv_cache"):
            LUKVCache.from_pretrained(UNPROFILED, ratio=0.5, cache_dir=hf_cache, local_files_only=True)
    said = [r for r in caplog.records if "no profile for" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO, logging.INFO]


def test_the_cache_says_which_method_it_uses_instead(hf_cache):
    cache = LUKVCache.from_pretrained(UNPROFILED, ratio=0.8, cache_dir=hf_cache, local_files_only=True)
    assert cache.profile is None
    assert "scorer='keydiff', allocator='uniform'" in repr(cache)


def test_a_model_loaded_from_a_local_folder_gets_the_profile_free_cache(tmp_path, hf_cache, caplog):
    """Its name is the folder, which keys no shared profile: before, a ConfigurationError."""
    model = tiny_model("llama", name_or_path=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="lukv_cache"):
        cache = LUKVCache.from_pretrained(model, ratio=0.5, cache_dir=hf_cache, local_files_only=True)
    assert cache.profile is None and cache.allocator_name == "uniform"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "local folder's name keys no shared profile" in line
    assert line.endswith(f"lukv build {tmp_path} --out keydiff.safetensors")


def test_a_scorer_or_allocator_asked_for_is_kept_without_a_profile(hf_cache):
    cache = LUKVCache.from_pretrained(
        UNPROFILED, ratio=0.8, scorer="snapkv", allocator="adakv", cache_dir=hf_cache, local_files_only=True
    )
    assert (cache.profile, cache.scorer.name, cache.allocator_name) == (None, "snapkv", "adakv")


def test_require_profile_raises_a_short_profile_not_found(hub_with_another_model, hf_cache):
    with pytest.raises(ProfileNotFoundError) as info:
        _online(hub_with_another_model, hf_cache, require_profile=True)
    err = info.value
    message = str(err)
    assert err.model_id == UNPROFILED and "\n" not in message and len(message) < 500
    assert REPO in message and "profiles shipped with lukv_cache" in message
    assert f"`lukv build {UNPROFILED}`" in message
    assert "LUKVCache(ratio=..., scorer='keydiff', allocator='uniform')" in message
    assert err.__cause__ is None and err.__suppress_context__  # no chain of the lookup's errors
    # a short traceback: few frames (counted as frames, not lines: 3.13 prints caret lines that 3.11 does not)
    frames = traceback.extract_tb(err.__traceback__)
    assert len(frames) < 6, [f"{f.filename}:{f.lineno} {f.name}" for f in frames]


@pytest.mark.parametrize(
    "asked",
    [{"allocator": "profile"}, {"scorer": "kvzap"}, {"revision": "main"}],
    ids=["profile-allocator", "kvzap", "pinned-revision"],
)
def test_asking_for_what_only_a_profile_gives_still_raises(hub_with_another_model, hf_cache, asked):
    with pytest.raises(ProfileNotFoundError):
        _online(hub_with_another_model, hf_cache, **asked)


def test_a_hub_that_cannot_be_reached_online_is_still_hub_unavailable_and_says_how_to_go_without(
    hub, hf_cache
):
    hub.stop()
    with pytest.raises(HubUnavailableError) as info:
        _online(hub, hf_cache, timeout=2.0)
    message = str(info.value)
    assert "Could not reach the Hub" in message and "HF_HUB_OFFLINE=1" in message
    assert message.endswith(
        "else the profile-free LUKVCache(ratio=..., scorer='keydiff', allocator='uniform')."
    )
    assert not isinstance(info.value.__cause__, HubUnavailableError)  # the network's error, not a repeat


def test_a_corrupt_profile_raises_instead_of_falling_back(tmp_path, hf_cache):
    path = tmp_path / profile_filename(UNPROFILED, "keydiff")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(ProfileFormatError):
        LUKVCache.from_pretrained(
            UNPROFILED, ratio=0.8, local_dir=tmp_path, cache_dir=hf_cache, local_files_only=True
        )


def test_a_profile_for_another_shape_raises_instead_of_falling_back(tmp_path, hf_cache, make_profile):
    save_to_local_dir(make_profile(layers=3, model_id=UNPROFILED), tmp_path)
    model = tiny_model("llama", name_or_path=UNPROFILED)  # 2 layers
    with pytest.raises(ProfileMismatchError):
        LUKVCache.from_pretrained(
            model, ratio=0.8, local_dir=tmp_path, cache_dir=hf_cache, local_files_only=True
        )


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_the_one_line_compresses_and_generates_on_a_family_without_a_profile(arch, hf_cache):
    """No config= (the README's line names only the model id); Gemma-2's local layers slide over 8 tokens."""
    attn = "eager" if arch == "gemma2" else "sdpa"  # transformers gives Gemma-2 no sdpa
    model = tiny_model(arch, attn=attn, name_or_path=f"org/tiny-{arch}-no-profile")
    cache = LUKVCache.from_pretrained(
        model.config.name_or_path, ratio=0.5, cache_dir=hf_cache, local_files_only=True
    )
    ids = prompt(length=40)
    with torch.no_grad():
        out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 44) and cache.profile is None
    kinds = getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    stored = cache.stored_tokens()  # [layers, batch, kv_heads]
    assert full and bool((stored[full] < 40).all())  # the prompt was compressed, not kept whole


# ---------------------------------------------------------------------------------- issue 54, items 8, 9, 10
ASKED = [{"allocator": "profile"}, {"scorer": "kvzap"}, {"revision": "main"}]
ASKED_IDS = ["profile-allocator", "kvzap", "pinned-revision"]


def test_offline_asking_for_what_only_a_profile_gives_raises_profile_not_found(hf_cache):
    """With HF_HUB_OFFLINE=1 these raised HubUnavailableError; the README promises ProfileNotFoundError."""
    script = (
        "from lukv_cache import LUKVCache\n"
        "from lukv_cache.errors import HubUnavailableError, ProfileNotFoundError\n"
        f"for asked in {ASKED!r}:\n"
        "    try:\n"
        f"        LUKVCache.from_pretrained({UNPROFILED!r}, ratio=0.8, cache_dir={str(hf_cache)!r}, **asked)\n"
        "    except ProfileNotFoundError as err:\n"
        "        said = str(err)\n"
        "        unavailable = isinstance(err, HubUnavailableError)\n"
        "        print(type(err).__name__, unavailable, 'needs this profile' in said, 'HF_HUB_OFFLINE' in said)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["ProfileNotFoundError False True True"] * len(ASKED), result.stdout


@pytest.mark.parametrize("asked", ASKED, ids=ASKED_IDS)
def test_an_unreachable_hub_and_what_only_a_profile_gives_is_profile_not_found_and_hub_unavailable(
    hub, hf_cache, asked
):
    hub.stop()
    with pytest.raises(ProfileNotFoundError) as info:
        _online(hub, hf_cache, timeout=2.0, **asked)
    err = info.value
    assert isinstance(err, HubUnavailableError) and err.model_id == UNPROFILED  # both excepts catch it
    ((name, value),) = asked.items()
    message = str(err)
    assert "Could not reach the Hub" in message
    assert f"{name}={value!r} needs this profile; without one, drop {name}={value!r}" in message
    assert "profile-free LUKVCache(ratio=..., scorer='keydiff', allocator='uniform')" in message


def test_require_profile_with_an_unreachable_hub_is_profile_not_found(hub, hf_cache):
    hub.stop()
    with pytest.raises(ProfileNotFoundError, match="require_profile=True needs this profile"):
        _online(hub, hf_cache, timeout=2.0, require_profile=True)


@pytest.mark.parametrize("asked", [{"scorer": "nonexistent"}, {"allocator": "nonexistent"}])
def test_an_unknown_name_is_refused_before_the_fallback_says_anything(hf_cache, caplog, asked):
    """The fallback's WARNING ('using the profile-free ...') came first, then the UnknownNameError."""
    with caplog.at_level(logging.INFO, logger="lukv_cache"), pytest.raises(UnknownNameError):
        LUKVCache.from_pretrained(UNPROFILED, ratio=0.8, cache_dir=hf_cache, local_files_only=True, **asked)
    assert not caplog.records


@pytest.mark.parametrize("kind", ["missing", "a-file"])
def test_a_local_dir_that_is_missing_or_a_file_is_refused(tmp_path, hf_cache, kind):
    local_dir = tmp_path / "profiles"
    if kind == "a-file":
        local_dir.write_text("not a folder")
    why = "is a file, not a folder" if kind == "a-file" else "no such folder"
    with pytest.raises(ConfigurationError, match=f"local_dir=.*: {why}. Pass a folder of profiles"):
        LUKVCache.from_pretrained(
            UNPROFILED, ratio=0.8, local_dir=local_dir, cache_dir=hf_cache, local_files_only=True
        )


@pytest.mark.parametrize("value", ["no", "False", 0, 1, None])
def test_require_profile_must_be_a_bool(hf_cache, value):
    """``require_profile="no"`` was taken as True."""
    with pytest.raises(ConfigurationError, match="require_profile must be True or False"):
        LUKVCache.from_pretrained(
            UNPROFILED, ratio=0.8, cache_dir=hf_cache, local_files_only=True, require_profile=value
        )


@pytest.mark.parametrize(
    "model_id", ["x" * 300, "org/" + "x" * 300, "/" + "x" * 300], ids=["id", "org-id", "path"]
)
def test_a_model_id_longer_than_a_file_name_is_a_configuration_error(hf_cache, model_id):
    """It was a raw OSError [Errno 36] (File name too long) from the profile lookup."""
    with pytest.raises(ConfigurationError) as info:
        LUKVCache.from_pretrained(model_id, ratio=0.8, cache_dir=hf_cache, local_files_only=True)
    message = str(info.value)
    assert "is not a Hub model id" in message and f"({len(model_id)} characters)" in message
    assert len(message) < 500  # the id is not printed whole (twice)


def test_the_fallback_remembers_a_bounded_number_of_model_ids(hf_cache, caplog):
    """One entry per model id grew without end (2,000 ids: 2,000 entries); now the recent ones only, and
    the same id again in a row is still said at INFO level."""
    for i in range(2_000):
        LUKVCache.from_pretrained(f"org/m{i}", ratio=0.5, cache_dir=hf_cache, local_files_only=True)
    assert len(pretrained._announced) == pretrained.ANNOUNCED_IDS
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lukv_cache"):
        for _ in range(2):
            LUKVCache.from_pretrained("org/m1999", ratio=0.5, cache_dir=hf_cache, local_files_only=True)
        LUKVCache.from_pretrained("org/m0", ratio=0.5, cache_dir=hf_cache, local_files_only=True)
    said = [r.levelno for r in caplog.records if "no profile for" in r.getMessage()]
    assert said == [logging.INFO, logging.INFO, logging.WARNING]  # org/m0 was forgotten: said again


SHIPPED = "HuggingFaceTB/SmolLM2-135M-Instruct"  # its keydiff and kvzap profiles ship with the package


def test_a_profile_folder_passed_over_for_a_shipped_profile_says_why(tmp_path, hf_cache, make_profile):
    # a flat <scorer>.safetensors at the folder's top is not looked up: the shipped profile serves, and a
    # warning says where the folder's profiles must sit
    make_profile(model_id=SHIPPED).save(tmp_path / "keydiff.safetensors")
    with pytest.warns(UserWarning, match=r"keydiff\.safetensors at its top is not looked at") as said:
        cache = LUKVCache.from_pretrained(
            SHIPPED,
            ratio=0.8,
            scorer="keydiff",
            local_dir=tmp_path,
            cache_dir=hf_cache,
            local_files_only=True,
        )
    assert f"{SHIPPED}/keydiff.safetensors here" in str(said[0].message)
    assert cache.profile is not None and tmp_path not in Path(cache.profile.source).parents
    # another scorer's profile of the model in the folder: the preferred kvzap is the shipped one, said so
    (tmp_path / "keydiff.safetensors").unlink()
    save_to_local_dir(make_profile(model_id=SHIPPED, scorer="snapkv"), tmp_path)
    with pytest.warns(UserWarning, match=r"holds snapkv\.safetensors for this model: pass scorer='snapkv'"):
        LUKVCache.from_pretrained(
            SHIPPED, ratio=0.8, local_dir=tmp_path, cache_dir=hf_cache, local_files_only=True
        )
    # the folder's own profile, or a folder with nothing for the model: no warning
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LUKVCache.from_pretrained(
            SHIPPED, ratio=0.8, scorer="snapkv", local_dir=tmp_path, cache_dir=hf_cache, local_files_only=True
        )
        empty = tmp_path / "empty"
        empty.mkdir()
        LUKVCache.from_pretrained(
            SHIPPED, ratio=0.8, local_dir=empty, cache_dir=hf_cache, local_files_only=True
        )
