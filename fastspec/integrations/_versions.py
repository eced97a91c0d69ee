"""The trainer integrations' version check: one warning at import when the installed trainer is
outside the versions the integration is tested with (their APIs change between minor releases)."""
from __future__ import annotations

import operator
import warnings
from importlib import metadata

_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq, ">": operator.gt, "<": operator.lt}


def _major_minor(version: str) -> tuple[int, ...] | None:
    """The leading ``major.minor`` of ``version`` as ints (None where a part has no leading digit)."""
    parts = []
    for p in version.split(".")[:2]:
        digits = "".join(ch for ch in p if ch.isdigit()) if p[:1].isdigit() else ""
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def in_range(version: str, tested: str) -> bool:
    """Whether ``version`` satisfies the specifier ``tested`` (``">=3.0,<3.1"``): ``packaging`` if
    installed (pre-releases allowed), else the leading ``major.minor`` of the version and of each
    clause's bound compared as ints, which is all the integrations' specifiers name."""
    try:
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        SpecifierSet = None
    if SpecifierSet is not None:
        try:
            return Version(version) in SpecifierSet(tested, prereleases=True)
        except InvalidVersion:
            return False
    have = _major_minor(version)
    if have is None:
        return False
    for clause in tested.split(","):
        op = next(o for o in _OPS if clause.strip().startswith(o))
        if not _OPS[op](have, _major_minor(clause.strip()[len(op):])):
            return False
    return True


def warn_if_untested(module: str, dist: str, tested: str) -> None:
    """Called at ``module``'s import: one warning if the installed distribution ``dist`` is not in
    ``tested``; nothing where ``dist`` has no metadata (a source checkout on ``sys.path``)."""
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return
    if not in_range(version, tested):
        # stacklevel 3: past this function and the module body, at the import
        warnings.warn(f"{module} is tested with {dist}{tested}; {dist} {version} is installed", stacklevel=3)
