"""A profile comes from a shared repository: nothing in a file may make the cache allocate without bound,
crash outside the library's typed errors, or be written in a form the library cannot read back."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save

from lukv_cache.errors import ConfigurationError, ProfileFormatError, PublishError
from lukv_cache.profiles import Profile, list_profiles, save_to_local_dir

ROOT = Path(__file__).resolve().parents[2]


def _with_metadata(profile: Profile, **changes) -> bytes:
    metadata = {**profile._metadata(), **changes}
    return save({"grid": profile.grid, "evict_ratio": profile.evict_ratio}, metadata=metadata)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window", str(10**6)),
        ("window", str(10**12)),
        ("sink", str(10**9)),
        ("window", "-1"),
        ("k_max", "0"),
        ("head_dim", "true"),
        ("head_dim", "-3"),
        ("min_keep", "1.0"),
        ("min_keep", "nan"),
        ("sink", "2.5"),
    ],
)
def test_out_of_range_metadata_raises_a_format_error_naming_the_field(profile, field, value):
    with pytest.raises(ProfileFormatError, match=field) as info:
        Profile.from_bytes(_with_metadata(profile, **{field: value}))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("field", "value"), [("sink", 2.5), ("head_dim", -3), ("window", 10**7), ("head_dim", True)]
)
def test_a_profile_the_library_cannot_read_is_never_built_or_written(profile, tmp_path, field, value):
    with pytest.raises(ProfileFormatError, match=field):
        Profile(
            profile.grid, profile.evict_ratio, model_id=profile.model_id, scorer="keydiff", **{field: value}
        )


def test_convert_with_a_negative_head_dim_fails_and_writes_nothing(tmp_path):
    curve = tmp_path / "c.npy"
    np.save(curve, np.full((99, 2, 2), 0.5, dtype=np.float32))
    out = tmp_path / "c.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "lukv_cache.cli", "convert", str(curve), "--model", "org/m", "--scorer", "keydiff",
         "--head-dim", "-3", "--out", str(out)],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.startswith("error:") and "head_dim" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("dtype", ["BF16", "F8_E4M3", "F64"])
def test_tensors_of_other_dtypes_raise_a_format_error(profile, dtype):
    data = bytearray(
        save({"grid": profile.grid, "evict_ratio": profile.evict_ratio}, metadata=profile._metadata())
    )
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    header["grid"]["dtype"] = dtype
    blob = json.dumps(header).encode()
    with pytest.raises(ProfileFormatError, match=dtype):
        Profile.from_bytes(len(blob).to_bytes(8, "little") + blob + bytes(data[8 + header_len :]))


def test_sink_and_window_beyond_the_models_positions_do_not_fit_it(profile):
    from lukv_cache.testing import tiny_config

    big = Profile(profile.grid, profile.evict_ratio, model_id="org/tiny-llama", scorer="keydiff", window=600)
    config = tiny_config(max_position_embeddings=512)
    with pytest.raises(Exception, match="positions") as info:
        big.validate_for(config)
    assert type(info.value).__name__ == "ProfileMismatchError"


# ------------------------------------------------------------------------------------------ local mirror


def _push(args):
    root, scorer, calibration = args
    from profile_factory import _make_profile

    save_to_local_dir(_make_profile(scorer=scorer, calibration=calibration), root)


def test_concurrent_pushes_to_one_mirror_all_land_in_its_index(tmp_path):
    jobs = [(str(tmp_path), f"scorer{i % 4}", f"round{i}") for i in range(12)]
    ctx = multiprocessing.get_context("spawn")
    env = os.environ.copy()
    sys_path = os.pathsep.join([str(Path(__file__).parent), str(Path(__file__).parents[1]), str(ROOT)])
    os.environ["PYTHONPATH"] = sys_path + os.pathsep + env.get("PYTHONPATH", "")
    try:
        with ctx.Pool(3) as pool:
            pool.map(_push, jobs)
    finally:
        os.environ.clear()
        os.environ.update(env)
    entries = list_profiles(local_dir=tmp_path)
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors"))
    assert sorted(e["path"] for e in entries) == files
    assert [e["scorer"] for e in entries] == ["scorer0", "scorer1", "scorer2", "scorer3"]


def test_an_index_that_is_a_folder_or_a_target_that_is_a_folder_is_a_typed_error(tmp_path, profile):
    (tmp_path / "index.json").mkdir()
    with pytest.raises(ConfigurationError, match="folder"):
        save_to_local_dir(profile, tmp_path)
    assert not list(tmp_path.rglob("*.safetensors"))  # no profile without its index entry
    other = tmp_path / "other"
    (other / "org" / "tiny-llama" / "keydiff.safetensors").mkdir(parents=True)
    with pytest.raises(ConfigurationError, match="folder"):
        save_to_local_dir(profile, other)


def test_a_malformed_index_entry_is_skipped_with_a_warning(tmp_path, profile):
    save_to_local_dir(profile, tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    index["profiles"].append({"model_id": "x/y", "scorer": "z", "num_layers": "many", "grid": {"min": "a"}})
    (tmp_path / "index.json").write_text(json.dumps(index))
    with pytest.warns(UserWarning, match="malformed"):
        entries = list_profiles(local_dir=tmp_path)
    assert [e["model_id"] for e in entries] == [profile.model_id]


def test_listing_a_file_as_a_mirror_is_a_typed_error(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ConfigurationError, match="not a folder"):
        list_profiles(local_dir=tmp_path / "f")


# ------------------------------------------------------------------------------------------ publishing


def test_a_connection_dropped_after_the_commit_says_the_upload_may_have_been_applied(hub, profile):
    hub.drop_after_commit = True
    with pytest.raises(PublishError) as info:
        profile.push_to_hub(repo_id="lukv-test/profiles", endpoint=hub.url)
    message = str(info.value)
    assert "may or may not have been applied" in message and "lukv list" in message
    assert "Nothing was changed in the repository" not in message
    repo = hub.repos[("model", "lukv-test/profiles")]
    assert "org/tiny-llama/keydiff.safetensors" in repo.snapshots[repo.branches["main"]]


# ------------------------------------------------------------------------------------------ deep JSON

DEEP = "[" * 5000 + "]" * 5000  # past Python's recursion limit: json.loads alone raises RecursionError


@pytest.mark.parametrize("field", ["extra", "scorer_params", "head_dim"])
def test_deeply_nested_metadata_is_a_format_error_naming_the_field(profile, field):
    with pytest.raises(ProfileFormatError, match=f"malformed metadata {field}=.*nested") as info:
        Profile.from_bytes(_with_metadata(profile, **{field: DEEP}))
    assert info.value.field == field and len(str(info.value)) < 500


def test_a_deeply_nested_safetensors_header_is_a_format_error(profile):
    data = profile.to_bytes()
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    blob = (json.dumps(header)[:-1] + ', "deep": ' + DEEP + "}").encode()
    with pytest.raises(ProfileFormatError, match="nested"):
        Profile.from_bytes(len(blob).to_bytes(8, "little") + blob + data[8 + header_len :])


def test_a_profile_file_with_deep_metadata_fails_typed_in_load_from_pretrained_and_show(
    tmp_path, profile, capsys
):
    from lukv_cache import LUKVCache
    from lukv_cache.cli import main

    path = tmp_path / "deep.safetensors"
    path.write_bytes(_with_metadata(profile, extra=DEEP))
    with pytest.raises(ProfileFormatError):
        Profile.load(path)
    with pytest.raises(ProfileFormatError):
        LUKVCache.from_pretrained(str(path), 0.5)
    assert main(["show", str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def _mirror_with_index(tmp_path, profile, index_text: str):
    save_to_local_dir(profile, tmp_path)
    (tmp_path / "index.json").write_text(index_text)
    return tmp_path


def test_a_deeply_nested_index_is_a_format_error_in_list_and_push(tmp_path, profile, capsys):
    from lukv_cache.cli import main

    mirror = _mirror_with_index(tmp_path / "mirror", profile, '{"profiles": ' + DEEP + "}")
    with pytest.raises(ProfileFormatError, match="nested"):
        list_profiles(local_dir=mirror)
    with pytest.raises(ProfileFormatError, match="nested"):
        save_to_local_dir(profile, mirror)
    file = profile.save(tmp_path / "p.safetensors")
    for argv in (["list", "--local-dir", str(mirror)], ["push", str(file), "--local-dir", str(mirror)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and "index" in err and "Traceback" not in err


def test_a_deeply_nested_index_on_the_hub_is_a_format_error(hub, hf_cache, profile):
    from huggingface_hub import HfApi

    from lukv_cache.profiles import HubLocation, push_profile

    api = HfApi(endpoint=hub.url)
    api.create_repo("lukv-test/profiles")
    api.upload_file(path_or_fileobj=DEEP.encode(), path_in_repo="index.json", repo_id="lukv-test/profiles")
    location = HubLocation(repo_id="lukv-test/profiles", endpoint=hub.url, cache_dir=hf_cache)
    with pytest.raises(ProfileFormatError, match="nested"):
        list_profiles(hub=location)
    with pytest.raises(PublishError, match="nested") as info:
        push_profile(profile, hub=location)
    assert isinstance(info.value.__cause__, ProfileFormatError)


@pytest.mark.parametrize(
    ("entry", "key"),
    [({"model_id": 5, "scorer": "keydiff"}, "model_id"), ({"model_id": "a/b", "scorer": ["x"]}, "scorer"),
     ({"model_id": "a/b", "scorer": "keydiff", "path": None}, "path")],
)  # fmt: skip
def test_an_index_entry_with_a_non_string_key_is_a_format_error_on_push(
    tmp_path, profile, capsys, entry, key
):
    from lukv_cache.cli import main

    index = {"format_version": 1, "profiles": [entry]}
    mirror = _mirror_with_index(tmp_path / "mirror", profile, json.dumps(index))
    with pytest.raises(ProfileFormatError, match=f"entry 1: {key} must be a string"):
        save_to_local_dir(profile, mirror)
    file = profile.save(tmp_path / "p.safetensors")
    assert main(["push", str(file), "--local-dir", str(mirror)]) == 2
    assert f"{key} must be a string" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ Hub timeout


@pytest.mark.parametrize("timeout", [float("inf"), 1e300, float("nan"), 0, -1.0, 86_401])
def test_a_timeout_that_is_not_a_finite_positive_number_of_seconds_is_refused(hub, hf_cache, timeout):
    from lukv_cache import LUKVCache
    from lukv_cache.profiles import HubLocation, download_profile

    with pytest.raises(ConfigurationError, match=r"timeout=.*finite number of seconds in \(0, 86400\]"):
        download_profile(
            "org/tiny-llama", hub=HubLocation(endpoint=hub.url, cache_dir=hf_cache, timeout=timeout)
        )
    with pytest.raises(ConfigurationError, match="finite number of seconds"):
        LUKVCache.from_pretrained(
            "org/tiny-llama", 0.5, endpoint=hub.url, cache_dir=hf_cache, timeout=timeout
        )


@pytest.mark.parametrize("value", ["inf", "1e300", "-5"])
def test_a_bad_timeout_in_the_environment_is_refused_naming_the_variable(monkeypatch, value):
    from lukv_cache.profiles import HubLocation

    monkeypatch.setenv("LUKV_HUB_TIMEOUT", value)
    with pytest.raises(ConfigurationError, match=r"\$LUKV_HUB_TIMEOUT=.*finite number of seconds"):
        HubLocation()


def test_a_day_long_timeout_is_accepted():
    from lukv_cache.profiles import HubLocation

    assert HubLocation(timeout=86_400).timeout == 86_400
