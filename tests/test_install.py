"""Installing fastspec prints no warning of its own: its metadata is valid for today's setuptools.

``pip install -e . -v`` used to print ``SetuptoolsDeprecationWarning: project.license as a TOML
table`` three times (a build error from 2027-02-18). The metadata is read here exactly as the
build reads it, with every warning an error.
"""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"


def test_pyproject_metadata_reads_without_warnings():
    setuptools = pytest.importorskip("setuptools")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # SetuptoolsDeprecationWarning included
        dist = apply_configuration(Distribution(), PYPROJECT)
    assert dist.get_name() == "fastspec", setuptools.__version__


def test_license_is_an_spdx_expression_and_the_build_requires_a_setuptools_that_reads_it():
    meta = tomllib.loads(PYPROJECT.read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    req = [r for r in meta["build-system"]["requires"] if r.startswith("setuptools")]
    m = re.fullmatch(r"setuptools>=(\d+)", req[0]) if req else None
    assert m and int(m.group(1)) >= 77, f"an SPDX license string needs setuptools>=77, got {req}"
