"""The kernel cache is private (fastspec/eig/cache.py): a planted file that passes the SHA-256
check must never reach the GPU.

Folders are made 0700; a folder (or the ``$FASTSPEC_CACHE`` above it) owned by another user or
writable by group or others is not used, nor a cache file that is, or that is a symbolic link: one
warning naming it and the fix, and the kernel compiles into memory. NVRTC's error log goes into the
private cache or to a unique name, never to a fixed name in the shared temporary folder. ``fastspec
info`` shows the cache's owner and mode. NVRTC is stubbed (a compile returns a fixed blob): what is
under test is which file is read and written, not the compiler (tests/test_eig_nvrtc.py compiles
for real). "Another user": uid 12345 by ``chown`` as root, else by the stat the checks see.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import tempfile

import pytest

from fastspec.cli import main
from fastspec.covariance import gram_cuda
from fastspec.eig import cache, cuda, nvrtc

OTHER = 12345  # a uid that is not this process's
H100 = cuda.DeviceSpec.for_arch(90)
PLANTED = b"\x7fELF planted by someone else"


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def fake_nvrtc(monkeypatch):
    """NVRTC stubbed: ``compile_program`` runs its cache logic, a compile returns ``b"\\x7fELF-<tag>"``."""
    compiled = []

    def compile_(program, src, defines, tag, target, extra):
        compiled.append(tag)
        return b"\x7fELF-" + tag.encode(), ""

    monkeypatch.setattr(nvrtc, "version", lambda: (13, 0))
    monkeypatch.setattr(nvrtc, "_compile", compile_)
    monkeypatch.setattr(cache, "_warned", set())
    monkeypatch.setattr(nvrtc, "_warned_unwritable", set())
    nvrtc.forget()
    yield compiled
    nvrtc.forget()


@pytest.fixture
def root(tmp_path, monkeypatch):
    """``$FASTSPEC_CACHE`` in a private test folder, not created yet; the eigensolver's is ``root / "eig"``."""
    monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _build(what: str = "eigvalsh") -> nvrtc.Image:
    """One image of the eigensolver or of the covariance Gram kernel (both share the cache)."""
    if what == "cov_gram":
        return nvrtc.compile_program(gram_cuda.PROGRAM, gram_cuda.defines(128, "bfloat16"), gram_cuda.tag(128, "bfloat16"),
                                     nvrtc.Target(90))
    return nvrtc.compile_variant(cuda.variant_for(128, "float32", H100), nvrtc.Target(90))


def _give_away(path, monkeypatch) -> None:
    """Make ``path`` owned by uid :data:`OTHER`: ``chown`` as root; otherwise the stat that the
    checks read says so (only root can give a file away)."""
    if os.geteuid() == 0:
        os.chown(path, OTHER, OTHER)
        return
    target = os.stat(path)
    for name in ("stat", "fstat"):
        real = getattr(os, name)

        def fake(p, *args, real=real, **kwargs):
            st = real(p, *args, **kwargs)
            if (st.st_ino, st.st_dev) != (target.st_ino, target.st_dev):
                return st
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, OTHER, OTHER, st.st_size,
                                   st.st_atime, st.st_mtime, st.st_ctime))

        monkeypatch.setattr(os, name, fake)


def _warnings(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fastspec" and text in r.getMessage()]


# ------------------------------------------------------------------------------ the happy path


@pytest.mark.parametrize("what", ["eigvalsh", "cov_gram"])
def test_folders_are_made_0700_files_0600_and_found_again(fake_nvrtc, tmp_path, monkeypatch, caplog, what):
    root = tmp_path / "home" / ".cache" / "fastspec"  # missing parents too, whatever the umask
    monkeypatch.setenv("FASTSPEC_CACHE", str(root))
    old = os.umask(0o002)
    try:
        with caplog.at_level(logging.WARNING, logger="fastspec"):
            first = _build(what)
    finally:
        os.umask(old)
    assert first.origin == "nvrtc" and first.path.parent == root / "eig"
    for folder in (tmp_path / "home", tmp_path / "home" / ".cache", root, root / "eig"):
        assert _mode(folder) == 0o700, folder
    assert _mode(first.path) == 0o600 and [p.name for p in (root / "eig").iterdir()] == [first.path.name]
    nvrtc.forget()
    again = _build(what)
    assert again.origin == "disk" and again.data == first.data and fake_nvrtc == [fake_nvrtc[0]]
    assert not [r for r in caplog.records if r.name == "fastspec"]


def test_an_existing_folder_readable_by_others_is_used(fake_nvrtc, root):
    """0755 (``mkdir`` with the usual umask, or the GPU kit's folder from before): only its
    owner can write it, so it is private enough."""
    (root / "eig").mkdir(parents=True)
    os.chmod(root, 0o755)
    os.chmod(root / "eig", 0o755)
    assert _build().path.parent == root / "eig"
    nvrtc.forget()
    assert _build().origin == "disk"


# ----------------------------------------------------------------------------- refused folders


@pytest.mark.parametrize("what", ["eigvalsh", "cov_gram"])
@pytest.mark.parametrize("damage", ["group-writable", "world-writable", "world-writable root", "other owner"])
def test_a_folder_others_can_write_is_neither_read_nor_written(fake_nvrtc, root, monkeypatch, caplog, damage, what):
    good = _build(what)  # a private cache first: where the planted file goes
    nvrtc.forget()
    good.path.write_bytes(nvrtc._frame(PLANTED))  # the hash checks out: only the rules refuse it
    folder = root if damage == "world-writable root" else root / "eig"
    if damage == "other owner":
        _give_away(folder, monkeypatch)
    else:
        os.chmod(folder, {"group-writable": 0o770, "world-writable": 0o777, "world-writable root": 0o1777}[damage])
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        img = _build(what)
        nvrtc.compile_variant(cuda.variant_for(64, "float32", H100), nvrtc.Target(90))  # a second kernel
    assert img.origin == "nvrtc" and img.data == good.data and img.path is None  # compiled into memory
    assert good.path.read_bytes() == nvrtc._frame(PLANTED)  # left alone ...
    assert [p.name for p in (root / "eig").iterdir()] == [good.path.name]  # ... and nothing written
    (warning,) = _warnings(caplog, "kernel cache not used")  # once, not per kernel
    assert f"folder {folder} is " in warning and "FASTSPEC_CACHE" in warning
    if damage == "other owner":
        assert f"owned by {cache.owner(OTHER)}" in warning
    else:
        assert f"chmod 700 {folder}" in warning and "writable by " in warning
    assert _build(what).origin == "memory"


def test_a_folder_made_by_someone_else_first_is_refused(fake_nvrtc, root, monkeypatch, caplog):
    """Another user creates the cache folder before this user's first compile."""
    (root / "eig").mkdir(parents=True, mode=0o700)
    _give_away(root / "eig", monkeypatch)
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        assert _build().path is None
    assert len(_warnings(caplog, "owned by")) == 1 and list((root / "eig").iterdir()) == []


def test_precompile_refuses_a_cache_it_cannot_use(fake_nvrtc, root, capsys):
    (root / "eig").mkdir(parents=True)
    os.chmod(root / "eig", 0o777)
    assert main(["precompile", "--arch", "90", "--n", "32", "--dtype", "float32", "--cov-d", "--jobs", "1"]) == 1
    assert f"kernel cache {root / 'eig'} cannot be used" in capsys.readouterr().err
    assert fake_nvrtc == [] and list((root / "eig").iterdir()) == []


# ------------------------------------------------------------------------------- refused files


@pytest.mark.parametrize("damage", ["group-writable", "world-writable", "other owner", "symbolic link", "folder"])
def test_a_cache_file_others_could_have_written_is_not_read(fake_nvrtc, root, tmp_path, monkeypatch, caplog, damage):
    good = _build()
    nvrtc.forget()
    planted = nvrtc._frame(PLANTED)
    if damage == "symbolic link":
        (tmp_path / "elsewhere").write_bytes(planted)
        good.path.unlink()
        good.path.symlink_to(tmp_path / "elsewhere")
    elif damage == "folder":
        good.path.unlink()
        good.path.mkdir()
    else:
        good.path.write_bytes(planted)
        if damage == "other owner":
            _give_away(good.path, monkeypatch)
        else:
            os.chmod(good.path, 0o620 if damage == "group-writable" else 0o602)
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        img = _build()
    assert img.origin == "nvrtc" and img.data == good.data and img.path is None
    (warning,) = _warnings(caplog, "kernel cache file not read")
    assert str(good.path) in warning and "delete it" in warning
    expect = {"group-writable": "writable by group (mode 0620)", "world-writable": "writable by others (mode 0602)",
              "other owner": f"owned by {cache.owner(OTHER)}", "symbolic link": "is a symbolic link",
              "folder": "not a regular file"}[damage]
    assert expect in warning
    # not replaced either: the user decides (the link still points where it did)
    assert good.path.is_dir() if damage == "folder" else good.path.read_bytes() == planted
    assert good.path.is_symlink() == (damage == "symbolic link")
    nvrtc.forget()
    with caplog.at_level(logging.WARNING, logger="fastspec"):
        _build()
    assert len(_warnings(caplog, "kernel cache file not read")) == 1  # said once per file


# ---------------------------------------------------------------------------------- error logs


def test_error_log_in_the_private_cache_is_0600(fake_nvrtc, root):
    path = nvrtc._save_error_log("eigvalsh-x-sm_90", "error: no_such_name")
    assert path == root / "eig" / "eigvalsh-x-sm_90.error.log" and _mode(path) == 0o600
    assert path.read_text() == "error: no_such_name"


@pytest.mark.parametrize("cache_state", ["world-writable", "unwritable"])
def test_error_log_without_a_private_cache_gets_a_unique_name(fake_nvrtc, root, tmp_path, monkeypatch, cache_state):
    """Never ``/tmp/<stem>.error.log``: another user could have put a link there first."""
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (shared / "eigvalsh-x-sm_90.error.log").symlink_to(victim)  # the old fixed name, planted
    if cache_state == "unwritable":
        (tmp_path / "a-file").write_text("")
        monkeypatch.setenv("FASTSPEC_CACHE", str(tmp_path / "a-file" / "cache"))
    else:
        root.mkdir(mode=0o700)
        os.chmod(root, 0o777)
    paths = {nvrtc._save_error_log("eigvalsh-x-sm_90", f"error {i}") for i in range(2)}
    assert victim.read_text() == "keep me" and len(paths) == 2
    for p in paths:
        assert p.parent == shared and p.name.endswith(".error.log") and "eigvalsh-x-sm_90" in p.name
        assert not p.is_symlink() and _mode(p) == 0o600
    assert sorted(p.read_text() for p in paths) == ["error 0", "error 1"]


# ---------------------------------------------------------------------------------------- rules


def test_owner_and_write_bits(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)

    def st(uid: int, bits: int) -> os.stat_result:
        return os.stat_result((stat.S_IFDIR | bits, 0, 0, 1, uid, uid, 0, 0, 0, 0))

    assert cache.problem(st(1000, 0o700)) == "" and cache.problem(st(1000, 0o755)) == ""
    assert cache.problem(st(0, 0o755)) == ""  # root's: only root could have written it
    assert cache.problem(st(OTHER, 0o700)).startswith(f"owned by {cache.owner(OTHER)}, not by ")
    assert cache.problem(st(1000, 0o775)) == "writable by group (mode 0775)"
    assert cache.problem(st(1000, 0o757)) == "writable by others (mode 0757)"
    assert cache.problem(st(0, 0o1777)) == "writable by group and others (mode 1777)"  # /tmp


# ----------------------------------------------------------------------------------- fastspec info


def test_info_shows_the_caches_owner_and_mode_and_a_refusal(fake_nvrtc, root, capsys, monkeypatch):
    monkeypatch.setattr(cuda, "_binding", [(False, "test: no compiler")])
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {root / 'eig'} (not created yet: made 0700 at the first compile, writable, 0 kernels" in out
    _build()
    me = cache.owner(os.geteuid())
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {root / 'eig'} (owner {me}, mode 0700, writable, 1 kernels; FASTSPEC_CACHE moves it)" in out
    assert "NOT USED" not in out
    os.chmod(root / "eig", 0o777)
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"(owner {me}, mode 0777, writable, 1 kernels;" in out
    assert f"NOT USED (kernels compile into memory): folder {root / 'eig'} is writable by group and others" in out
    assert main(["info", "--json"]) == 0
    k = json.loads(capsys.readouterr().out)["eigvalsh_kernel"]
    assert (k["cache_owner"], k["cache_mode"]) == (me, "0777") and f"chmod 700 {root / 'eig'}" in k["cache_refused"]
    monkeypatch.setattr(cuda, "_binding", [])
