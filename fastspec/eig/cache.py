"""The rules of fastspec's on-disk kernel cache: private to the user, or not used at all.

A cache file is loaded onto the GPU when its embedded SHA-256 matches its payload; that hash
catches a torn or corrupt file, not a planted one, since anyone who can write the folder can
write a matching file. So a cache is used only where no one else could have written it:

* folders fastspec creates (the missing parents too) are ``0700``, whatever the umask;
* the cache folder and the one above it (``$FASTSPEC_CACHE``, which could swap the folder) are
  used only when owned by this user (or root, who can replace the package anyway) and not
  writable by group or others (:func:`problem`); otherwise one warning names the folder and the
  fix, and the kernels compile into memory for the process (nothing read, nothing written);
* a cache file is opened without following a symbolic link and read only when the open file is a
  regular file passing the same test; otherwise one warning names it, and it is neither read nor
  replaced (:func:`read`);
* files are written under a ``mkstemp`` name (mode ``0600``) and renamed
  (:func:`fastspec.eig.nvrtc._write_atomic`); NVRTC's error logs go into the private cache, else
  to a ``mkstemp`` name in the temporary folder, never to a fixed name in a shared one.

Folders above ``$FASTSPEC_CACHE`` (a home folder) are not checked. Every program compiled through
:func:`fastspec.eig.nvrtc.compile_program` (the eigensolver, the covariance Gram kernel) shares
this cache; a new on-disk cache goes through :func:`private_folder` and :func:`read` too.
"""
from __future__ import annotations

import errno
import logging
import os
import stat
from pathlib import Path

log = logging.getLogger("fastspec")

_warned: set[str] = set()


class Untrusted(Exception):
    """A cache file someone else could have written: its message says which, why and the fix."""


def owner(uid: int) -> str:
    """The user name of ``uid``, its number where it has none."""
    try:
        import pwd  # POSIX only

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return str(uid)


def mode(st: os.stat_result) -> str:
    """The permission bits of ``st`` as ``chmod`` takes them, e.g. ``0700``."""
    return f"{stat.S_IMODE(st.st_mode):04o}"


def problem(st: os.stat_result) -> str:
    """Why a folder or file of status ``st`` may have been written by someone else: owned by
    another user (root excepted) or writable by group or others; "" when it may be trusted."""
    if not hasattr(os, "geteuid"):  # not POSIX: no owner or mode bits to go by
        return ""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return f"owned by {owner(st.st_uid)}, not by {owner(me)}"
    if st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "group"), (0o002, "others")) if st.st_mode & bit)
        return f"writable by {who} (mode {mode(st)})"
    return ""


def refusal(folder: Path) -> str:
    """Why the cache ``folder`` may not be used, "" when it may (or does not exist yet): it or
    the folder above it is not private (:func:`problem`). The message names the folder and the fix."""
    for f in (folder.parent, folder):
        try:
            st = os.stat(f)
        except OSError:  # missing: made 0700 when needed
            continue
        why = problem(st)
        if why:
            fix = f"run `chmod 700 {f}` or set" if why.startswith("writable") else "set"
            return f"folder {f} is {why}: {fix} FASTSPEC_CACHE to a private folder of your own"
    return ""


def make(folder: Path) -> None:
    """Create ``folder`` and its missing parents, each ``0700``; OSError when one cannot be."""
    missing = []
    p = folder
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # another process made it at the same moment: checked like any
            continue
        os.chmod(d, 0o700)  # whatever the umask


def private_folder(folder: Path) -> Path | None:
    """``folder``, created ``0700`` where missing, when it may be used as a cache (:func:`refusal`);
    None, with one warning naming the folder and the fix, when not: the caller then keeps its
    kernels in memory. OSError when the folder cannot be created."""
    why = refusal(folder)
    if not why:
        make(folder)
        why = refusal(folder)  # again: a folder someone else made in between
    if why:
        warn_once(str(folder), f"fastspec: kernel cache not used, {why}; kernels compile into memory for this process")
        return None
    return folder


def read(path: Path) -> bytes | None:
    """The bytes of the cache file ``path``; None when there is none or it cannot be read.
    Untrusted when it may have been planted: a symbolic link, not a regular file, or a file
    :func:`problem` rejects. The checks are made on the opened file (nothing can swap it after)."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise Untrusted(f"{path} is a symbolic link") from None
        return None
    try:
        st = os.fstat(fd)
        why = problem(st) if stat.S_ISREG(st.st_mode) else "not a regular file"
        if why:
            raise Untrusted(f"{path} is {why}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def warn_once(what: str, message: str) -> None:
    """Log ``message`` the first time ``what`` (a folder or file) is refused in this process."""
    if what not in _warned:
        _warned.add(what)
        log.warning(message)


def describe(folder: Path) -> dict[str, object]:
    """``fastspec info``'s view of the cache ``folder``: its owner and mode (None when it does not
    exist yet) and why it is not used ("" when it is)."""
    try:
        st = os.stat(folder)
    except OSError:
        owner_name, bits = None, None
    else:
        owner_name, bits = owner(st.st_uid), mode(st)
    return {"cache_owner": owner_name, "cache_mode": bits, "cache_refused": refusal(folder)}
