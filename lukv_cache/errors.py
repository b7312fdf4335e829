"""One family of typed errors. Every message names what was wrong and what to do next."""

from __future__ import annotations


class LUKVError(Exception):
    """Base class of every error lukv_cache raises on purpose."""


class ConfigurationError(LUKVError, ValueError):
    """A bad argument: ratio out of range, a table of the wrong shape, a negative window..."""


class UnknownNameError(LUKVError, KeyError):
    """A scorer or allocator name that is not registered. The message lists the known names."""

    def __str__(self) -> str:  # KeyError quotes its message; we want it readable
        return str(self.args[0]) if self.args else ""


class IncompatibleAttentionError(LUKVError, RuntimeError):
    """A compressed LUKVCache met an attention implementation that cannot read its ragged store."""


class ProfileError(LUKVError):
    """Base class for everything that can go wrong with a profile file, its lookup or its upload."""


class ProfileFormatError(ProfileError, ValueError):
    """The file is not a valid profile: truncated, corrupt, unknown version, bad metadata or bad values."""


class ProfileMismatchError(ProfileError, ValueError):
    """The profile was built for another model shape (layers, KV heads)."""


class ProfileNotFoundError(ProfileError, FileNotFoundError):
    """No profile for this model id / scorer, locally or in the shared repository."""


class HubUnavailableError(ProfileError, ConnectionError):
    """The Hub could not be reached and nothing usable is cached."""


class PublishError(ProfileError, RuntimeError):
    """An upload to the shared profile repository failed. Local files are untouched."""
