"""Where the commands (and ``fastspec analyze``'s loop) write: can a file be made in a folder? Asked
before a command measures, trains or writes anything, so that an output path the user cannot write to is a one-line error
naming its flag (:mod:`fastspec.cli`) instead of a traceback after the header, or minutes into
the run.

The answer is found by trying, not by reading permission bits: ``os.access`` says yes to root
everywhere, yet root cannot make ``/proc/nope``, and nothing but an attempt sees a read-only
mount, a full disk or a quota. The attempt leaves nothing behind. No torch here (the commands'
``--help`` stays light).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def unwritable(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (a folder that does not exist yet counts as the
    folders that would be made for it), or None when one can.

    The missing folders are made, a probe file is created and deleted in ``folder``, then the
    folders made here are removed again (innermost first, only if still empty): the place is
    left as it was found. The reason is one line for the user that names ``folder``, e.g.
    ``cannot create /tmp/x/run (/tmp/x is a file, not a folder)``, ``cannot create /proc/nope/run
    (No such file or directory: /proc/nope)`` or ``cannot write in /mnt/ro (Read-only file
    system)``."""
    folder = Path(folder)
    made: list[Path] = []
    try:
        missing, existing = [], folder
        while not existing.exists() and existing.parent != existing:
            missing.append(existing)
            existing = existing.parent
        if not existing.is_dir():  # a path through a regular file: no folder can go under it
            return f"cannot create {folder} ({existing} is a file, not a folder)"
        for path in reversed(missing):
            try:
                path.mkdir()
            except OSError as e:
                return f"cannot create {folder} ({e.strerror or e}: {path})"
            made.append(path)
        try:
            fd, probe = tempfile.mkstemp(prefix=".fastspec-write-check-", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:  # the probe's random name would say nothing: name the folder
            return f"cannot write in {folder} ({e.strerror or e})"
    except OSError as e:  # e.g. a folder on the way that may not be looked into
        return f"cannot create or write in {folder} ({e.strerror or e}: {e.filename or folder})"
    finally:
        for path in reversed(made):
            with contextlib.suppress(OSError):
                path.rmdir()
    return None
