"""Build hook for fastspec's optional native extension.

All package metadata lives in pyproject.toml. This file only exists so the optional
CUDA / host eigensolver extension (csrc/) can be added to the build; with no compiler
for it the package still installs as pure Python.
"""
from setuptools import setup

setup()
