"""Packages (the rest of the build is in pyproject.toml): ``lukv_cache*``, and the shipped profiles.

``profiles_hub/`` at the top of the repository mirrors the shared Hub repository (``<org>/<model>/<scorer>
.safetensors`` + ``index.json``) and is the one copy in git; the wheel carries it as ``lukv_cache/profiles_hub/``
so that an installed package finds its profiles offline. An editable install reads the top-level folder
itself (``lukv_cache.profiles.location.BUNDLED_DIR``).
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["lukv_cache*"]), "lukv_cache.profiles_hub"],
    package_dir={"lukv_cache.profiles_hub": "profiles_hub"},
)
