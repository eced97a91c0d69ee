"""Installing fastspec prints no warning of its own: its metadata is valid for today's setuptools,
and the wheel and the sdist carry the license text.

``pip install -e . -v`` used to print ``SetuptoolsDeprecationWarning: project.license as a TOML
table`` three times (a build error from 2027-02-18). The metadata is read here exactly as the
build reads it, with every warning an error.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import warnings
import zipfile
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


APACHE_HEAD = "Apache License\n                           Version 2.0, January 2004\n"


def test_the_license_file_is_the_apache_text_and_pyproject_ships_it():
    meta = tomllib.loads(PYPROJECT.read_text())
    assert meta["project"]["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text(encoding="ascii")
    assert text.lstrip().startswith(APACHE_HEAD) and "END OF TERMS AND CONDITIONS" in text


def _checkout_files(dest: Path) -> Path:
    """The files a clean clone has (what git tracks or would add), copied to ``dest``."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the files a clean clone has)")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for f in filter(None, files):
        if (REPO / f).is_file() and not f.startswith("benchmarks/results/"):
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / f, dest / f)
    return dest


@pytest.mark.slow
def test_the_wheel_and_the_sdist_carry_the_license(tmp_path):
    """A wheel built from the checkout has the text in .dist-info/licenses/ and names it in
    METADATA (PEP 639); the sdist has it at its root, so a wheel built from the sdist does too."""
    if not (importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel")):
        pytest.skip("needs setuptools and wheel installed (the build runs without isolation: offline)")
    src = _checkout_files(tmp_path / "src")
    env = {**os.environ, "FASTSPEC_NO_EXT": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}  # no C++ build: metadata only
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel")], env=env, check=True, timeout=600)
    wheel = next((tmp_path / "wheel").glob("fastspec-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        licenses = [n for n in names if re.fullmatch(r"fastspec-[^/]+\.dist-info/(licenses/)?LICENSE", n)]
        assert licenses, names
        assert z.read(licenses[0]) == (REPO / "LICENSE").read_bytes()
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    headers = metadata.split("\n\n", 1)[0].splitlines()
    assert "License-Expression: Apache-2.0" in headers and "License-File: LICENSE" in headers, headers
    # the sdist, as a PEP 517 front end asks setuptools for it
    proc = subprocess.run([sys.executable, "-c", "import setuptools.build_meta as b; print(b.build_sdist('dist'))"],
                          cwd=src, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with tarfile.open(src / "dist" / proc.stdout.strip().splitlines()[-1]) as t:
        top = t.getnames()[0].split("/")[0]
        member = t.extractfile(f"{top}/LICENSE")
        assert member is not None and member.read() == (REPO / "LICENSE").read_bytes()
