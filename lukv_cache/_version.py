"""The library's version, in a leaf that imports nothing: the package root re-exports it, and what writes
files (profiles, saved contexts) stamps it without importing the package."""

__version__ = "0.1.0"  # as pyproject.toml's [project] version (tests/test_architecture.py checks they agree)
