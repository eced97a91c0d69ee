"""The repository's documentation stands on its own: every reference resolves to a file in it.

* no file cites a document outside the repository, or a tracker issue by number;
* every relative Markdown link, and every anchor into a Markdown page, resolves;
* every repository path named in the Markdown pages or in the code under ``fastspec/`` exists;
* every environment variable the code reads is in the table of ``docs/environment.md``.

Each test lists every offence as ``path:line: text``, so one run shows the whole sweep.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
DOC_PAGES = ("README.md", "accumulators.md", "conventions.md", "metrics.md", "fits.md",
             "protocols.md", "environment.md", "kernels.md", "alerts.md", "analysis.md", "analyze.md",
             "olmo_core.md", "torchtitan.md", "hf.md", "lightning.md", "megatron.md")


def _files(*patterns: str, exclude: Iterable[Path] = ()) -> list[Path]:
    """Repository files matching the glob ``patterns`` (relative to the root), sorted, no caches."""
    skip = {p.resolve() for p in exclude}
    out = set()
    for pattern in patterns:
        for p in REPO.glob(pattern):
            if (p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".pyc", ".o")
                    and p.resolve() not in skip):
                out.add(p)
    return sorted(out)


def _rel(p: Path) -> str:
    return p.relative_to(REPO).as_posix()


def _lines(p: Path) -> list[str]:
    return p.read_text(encoding="utf-8", errors="replace").splitlines()


# Markdown pages whose links and paths must resolve
MARKDOWN = ("README.md", "docs/*.md", "benchmarks/README.md", "csrc/README.md")
# files that must not cite outside documents or issue numbers
PROSE_AND_CODE = ("fastspec/**/*.py", "examples/*.py", "README.md", "docs/**/*", "benchmarks/*.md", "benchmarks/*.py",
                  "benchmarks/*.sh", "csrc/*", "setup.py", "tests/*.py", ".ci/run", "pyproject.toml")
# code whose path mentions must resolve (docstrings, comments, messages)
CODE_WITH_PATHS = ("fastspec/**/*.py", "examples/*.py", "setup.py", "benchmarks/*.py", "benchmarks/*.sh")
# code whose environment variables must be documented
CODE_WITH_ENV = ("fastspec/**/*.py", "examples/*.py", "setup.py", "benchmarks/*.py", "benchmarks/*.sh", "tests/*.py", ".ci/run")


def _report(offences: list[str], what: str) -> None:
    if offences:
        pytest.fail(f"{len(offences)} {what}:\n" + "\n".join(offences), pytrace=False)


# --------------------------------------------------------------------- (a) outside references
OUTSIDE_REF = re.compile(r"SPEC\.md|SPEC\s*§|STYLE\.md|\bissue\s*#?\s*\d+", re.IGNORECASE)


def test_no_references_outside_the_repository():
    """No file cites the contract or style notes that live outside the repository, or an issue number."""
    offences = []
    for path in _files(*PROSE_AND_CODE, exclude=[Path(__file__)]):  # this file names the patterns
        for i, line in enumerate(_lines(path), 1):
            m = OUTSIDE_REF.search(line)
            if m:
                offences.append(f"{_rel(path)}:{i}: {m.group(0)!r} in {line.strip()[:120]}")
    _report(offences, "references to documents outside the repository or to issue numbers")


# --------------------------------------------------------------------- (b) Markdown links
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _without_code_blocks(text: str) -> str:
    """Text with fenced code blocks blanked out (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _links(path: Path) -> list[tuple[int, str]]:
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in LINK.finditer(line):
            out.append((i, m.group(1)))
    return out


def _is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) is not None  # http:, https:, mailto:


def test_markdown_links_resolve():
    """Every relative link ``[text](path)`` in the Markdown pages points at an existing file or folder."""
    offences = []
    for page in _files(*MARKDOWN):
        for line, target in _links(page):
            if _is_external(target) or target.startswith("#"):
                continue
            rel = target.split("#", 1)[0]
            if not (page.parent / rel).exists():
                offences.append(f"{_rel(page)}:{line}: link target {target!r} does not exist")
    _report(offences, "broken Markdown links")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = _without_code_blocks(page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.MULTILINE):
        slug = _slug(m.group(1))
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return out


def test_markdown_anchors_resolve():
    """Every ``#anchor`` of a link to a Markdown page (or within one) names a heading of that page."""
    offences = []
    for page in _files(*MARKDOWN):
        for line, target in _links(page):
            if _is_external(target) or "#" not in target:
                continue
            rel, anchor = target.split("#", 1)
            dest = page if not rel else page.parent / rel
            if dest.suffix != ".md" or not dest.is_file():
                continue  # a missing file is test_markdown_links_resolve's to report
            if anchor.lower() not in _anchors(dest):
                offences.append(f"{_rel(page)}:{line}: no heading for #{anchor} in {_rel(dest)}")
    _report(offences, "broken Markdown anchors")


def test_docs_pages_exist_and_are_indexed():
    """The documentation pages other files point at exist, and docs/README.md links each of them."""
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    missing = [p for p in DOC_PAGES if not (DOCS / p).is_file()]
    unindexed = [p for p in DOC_PAGES if p != "README.md" and f"]({p})" not in index]
    assert not missing, f"missing documentation pages: {missing}"
    assert not unindexed, f"pages not linked from docs/README.md: {unindexed}"


# --------------------------------------------------------------------- (c) repository paths
# a token that starts with a top-level folder of the repository, not preceded by a path character
# (so `../fastspec/x.py` in a link and `/abs/fastspec/...` are left to the link test / ignored)
REPO_PATH = re.compile(r"(?<![\w./$-])((?:fastspec|docs|csrc|benchmarks|tests|examples|\.ci)/[\w./*<>{}\[\]$-]*)")
PLACEHOLDER_CHARS = set("*<>{}[]$")
# all-caps stems are placeholders (NAME-DATE.json, OUT_DIR), except real all-caps file names
PLACEHOLDER_STEM = re.compile(r"^[A-Z][A-Z0-9_]*(?:-[A-Z][A-Z0-9_]*)*$")
REAL_CAPS_STEMS = {"README", "LICENSE", "CHANGELOG"}
# folders the code creates at run time (named as outputs, not as references)
OUTPUT_PATHS = {"benchmarks/results/pytest"}


def _repo_paths(line: str) -> list[str]:
    """Repository paths named in ``line``: globs and placeholders skipped, trailing dots dropped."""
    out = []
    for m in REPO_PATH.finditer(line):
        token = m.group(1)
        if PLACEHOLDER_CHARS & set(token) or "..." in token:
            continue
        token = token.rstrip(".")
        parts = [p for p in token.split("/") if p]
        if any(PLACEHOLDER_STEM.match(p.split(".")[0]) and p.split(".")[0] not in REAL_CAPS_STEMS
               for p in parts):
            continue
        out.append(token)
    return out


def test_repository_paths_exist():
    """Every repository path named in the Markdown pages and in the code exists."""
    offences = []
    for path in _files(*MARKDOWN, *CODE_WITH_PATHS):
        for i, line in enumerate(_lines(path), 1):
            for token in _repo_paths(line):
                if token.rstrip("/") not in OUTPUT_PATHS and not (REPO / token).exists():
                    offences.append(f"{_rel(path)}:{i}: {token} does not exist")
    _report(offences, "paths that name no file of the repository")


@pytest.mark.parametrize("line,expected", [
    ("see `fastspec/covariance/policy.py`.", ["fastspec/covariance/policy.py"]),
    ("(`docs/metrics.md#top`) and tests/test_fits.py:", ["docs/metrics.md", "tests/test_fits.py"]),
    ("`benchmarks/results/*.json`, `benchmarks/results/<device>-<date>.json`", []),
    ("`benchmarks/results/NAME-DATE.json` and `csrc/README.md`", ["csrc/README.md"]),
    ("[x](../fastspec/metrics.py) /abs/fastspec/y.py", []),
    ("f\"benchmarks/results/{name}.json\"", []),
])
def test_repo_path_extraction(line, expected):
    assert _repo_paths(line) == expected


# --------------------------------------------------------------------- (d) environment variables
PY_ENV_READ = re.compile(
    r"""(?:os\.environ\.get|os\.getenv|environ\.setdefault|os\.environ\.pop)\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']"""
    r"""|os\.environ\[\s*["']([A-Za-z_][A-Za-z0-9_]*)["']\s*\]""")
FASTSPEC_NAME = re.compile(r"\bFASTSPEC_[A-Z0-9_]*[A-Z0-9]\b")
SH_ENV_READ = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?[-+]")
SH_ASSIGN = re.compile(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=")


def _env_vars_in_code() -> dict[str, str]:
    """``{name: first place it is read}`` over the code: literal ``os.environ`` / ``getenv`` reads,
    every ``FASTSPEC_*`` name (read through helpers such as setup.py's ``_flag``), and shell
    ``${NAME:-default}`` reads of names the script does not assign itself."""
    found: dict[str, str] = {}
    for path in _files(*CODE_WITH_ENV, exclude=[Path(__file__)]):
        lines = _lines(path)
        shell = path.suffix == ".sh" or (lines and lines[0].startswith("#!") and "sh" in lines[0])
        local = set()
        if shell:
            for line in lines:
                if not line.lstrip().startswith(("export ", "#")):
                    local.update(SH_ASSIGN.findall(line))
        for i, line in enumerate(lines, 1):
            names = [a or b for a, b in PY_ENV_READ.findall(line)] + FASTSPEC_NAME.findall(line)
            if shell:
                names += [n for n in SH_ENV_READ.findall(line) if n not in local]
            for name in names:
                found.setdefault(name, f"{_rel(path)}:{i}")
    return found


def test_environment_variables_are_documented():
    """Every environment variable the code reads has a row in docs/environment.md."""
    table = (DOCS / "environment.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", table))
    offences = [f"{where}: {name} is not in docs/environment.md"
                for name, where in sorted(_env_vars_in_code().items()) if name not in documented]
    _report(offences, "undocumented environment variables")
