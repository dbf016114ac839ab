"""The folder kernels/ installs as the import package ``epas_kernels`` (never ``kernels``: Hugging
Face's PyPI package of that name is what transformers probes for). pyproject.toml lists the packages
by hand (a renamed folder needs it), so this checks the list against the folders on disk: a new
subpackage of epas_megatron/ or kernels/ fails here until it is listed."""

import tomllib

from setuptools import find_packages

import epas_kernels
from epas_testing import REPO


def test_pyproject_lists_every_package_and_maps_kernels_to_epas_kernels():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == {"epas_kernels": "kernels"}
    on_disk = find_packages(str(REPO), include=["epas_megatron", "epas_megatron.*"])
    on_disk += ["epas_kernels", *(f"epas_kernels.{p}" for p in find_packages(str(REPO / "kernels")))]
    assert sorted(setuptools["packages"]) == sorted(on_disk)
    assert not [p for p in setuptools["packages"] if p == "kernels" or p.startswith("kernels.")]


def test_epas_kernels_is_the_kernels_folder():
    assert (REPO / "kernels" / "__init__.py").samefile(epas_kernels.__file__)
    assert not (REPO / "epas_megatron" / "kernels").exists()
