"""lukv_cache.testing, the public tiny-model factory: its refusals are the library's typed errors."""

from __future__ import annotations

import pytest

from lukv_cache.errors import UnknownNameError
from lukv_cache.testing import ARCHS, tiny_config


def test_an_unknown_tiny_architecture_is_a_typed_error_naming_the_known_ones():
    with pytest.raises(UnknownNameError, match="Unknown tiny architecture 'gpt2'") as err:
        tiny_config("gpt2")
    assert err.value.name == "gpt2" and err.value.known == list(ARCHS)
    assert "llama" in str(err.value) and isinstance(err.value, KeyError)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_known_tiny_architecture_builds_a_config(arch):
    assert tiny_config(arch).num_key_value_heads == 2
