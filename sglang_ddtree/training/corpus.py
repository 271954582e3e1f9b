"""Training corpus: the Python sources (code, docstrings, comments) installed on this machine.

Roots are the standard library and every site directory / sys.path directory outside the
current repository. A *package* is the first path component under its root (`asyncio`,
`numpy`, or a top-level module such as `os` for `os.py`). Whole packages are held out for
evaluation: a fixed list of stdlib packages plus the first present of a few site packages.

Everything is deterministic for a given machine and seed: files are listed in sorted order,
then shuffled with `random.Random(seed)` and taken until the byte cap, so the cap samples all
packages rather than the alphabetically first ones. Duplicate files (vendored copies) are kept
once, and a training file whose bytes equal a held-out file is dropped.
"""

from __future__ import annotations

import hashlib
import os
import random
import site
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Stdlib packages present in 3.11 and 3.12 that nothing vendors under another name
# (json: simplejson, tomllib: tomli would leak).
HELD_OUT_STDLIB = ("asyncio", "email", "http")
# The first of these present in a site directory is held out (PyYAML, then numpy).
HELD_OUT_SITE_CANDIDATES = ("yaml", "numpy", "docutils", "pygments")

HELD_OUT_SHUFFLE_SEED = 1234
# A stdlib without a venv nests its site-packages; those are walked as their own root.
_SKIP_DIRS = {"__pycache__", ".git", "node_modules", "site-packages", "dist-packages"}
_SKIP_PACKAGES = {"sglang_ddtree"}  # our own code, if installed non-editable


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute path
    root_kind: str  # "stdlib" or "site"
    package: str  # first path component under its root, ".py" stripped
    rel: str  # path relative to its root
    size: int  # bytes on disk


@dataclass(frozen=True)
class CorpusLimits:
    max_train_bytes: int  # cap on training text
    max_heldout_bytes: int  # cap on held-out text
    max_file_bytes: int = 200_000  # larger files are data tables or generated code
    max_line_chars: int = 1000  # longer lines: minified / embedded blobs


@dataclass
class Corpus:
    train: list[tuple[str, str]]  # (relative name, text), in training order
    heldout: list[tuple[str, str]]
    heldout_packages: list[dict]  # [{"package", "root_kind", "files", "bytes"}]
    stats: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"heldout_packages": self.heldout_packages, **self.stats}


# ----------------------------------------------------------------------------- discovery


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[2]


def source_roots() -> list[tuple[str, Path]]:
    """[(kind, dir)]: the stdlib, then site dirs and other sys.path dirs (sorted, deduplicated).

    sys.path directories inside this repository (the repo root, scripts/) are skipped, unless
    they are a site-packages / dist-packages directory (a virtual environment in the checkout):
    the corpus is the machine's installed Python, not our own code.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    candidates = list(site.getsitepackages()) + [site.getusersitepackages()]
    candidates += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    candidates += [p for p in sys.path if p]
    repo = _repo_root()
    site_dirs: set[Path] = set()
    for c in candidates:
        p = Path(c).resolve()
        is_packages_dir = p.name in ("site-packages", "dist-packages")
        in_stdlib = p.is_relative_to(stdlib) and not is_packages_dir
        in_repo = p.is_relative_to(repo) and not is_packages_dir
        if p.is_dir() and not in_stdlib and not in_repo:  # lib-dynload belongs to the stdlib
            site_dirs.add(p)
    return [("stdlib", stdlib)] + [("site", p) for p in sorted(site_dirs)]


def _walk_py(root: Path, other_roots: set[Path]) -> Iterable[Path]:
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and (here / d) not in other_roots
        )
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield here / name


def list_sources(roots: list[tuple[str, Path]] | None = None) -> list[SourceFile]:
    """Every .py file under the roots, sorted by (root order, relative path)."""
    roots = source_roots() if roots is None else roots
    all_roots = {r for _, r in roots}
    out: list[SourceFile] = []
    for kind, root in roots:
        for path in _walk_py(root, all_roots - {root}):
            rel = path.relative_to(root)
            try:
                size = path.stat().st_size
            except OSError:
                continue
            package = rel.parts[0].removesuffix(".py")
            if package in _SKIP_PACKAGES:
                continue
            out.append(SourceFile(str(path), kind, package, rel.as_posix(), size))
    return out


def choose_heldout(files: list[SourceFile]) -> list[tuple[str, str]]:
    """[(root_kind, package)]: HELD_OUT_STDLIB present here + the first present site candidate."""
    present = {(f.root_kind, f.package) for f in files}
    chosen = [("stdlib", p) for p in HELD_OUT_STDLIB if ("stdlib", p) in present]
    site_pick = next((p for p in HELD_OUT_SITE_CANDIDATES if ("site", p) in present), None)
    if site_pick is not None:
        chosen.append(("site", site_pick))
    return chosen


# ----------------------------------------------------------------------------- reading


def read_source(path: str, limits: CorpusLimits) -> str | None:
    """The file's text, or None when it is too big, not UTF-8, binary-ish or has huge lines."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if not data or len(data) > limits.max_file_bytes or b"\x00" in data:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if max(len(line) for line in text.splitlines() or [""]) > limits.max_line_chars:
        return None
    return text


def _relname(f: SourceFile) -> str:
    return f"{f.root_kind}:{f.rel}"


def _take(
    files: list[SourceFile], limits: CorpusLimits, cap: int, skip_hashes: set[str]
) -> tuple[list[tuple[str, str]], set[str], int]:
    """Read files in the given order until `cap` bytes; skip rejects and duplicate contents."""
    taken: list[tuple[str, str]] = []
    seen = set(skip_hashes)
    total = rejected = 0
    for f in files:
        if total >= cap:
            break
        text = read_source(f.path, limits)
        if text is None:
            rejected += 1
            continue
        digest = hashlib.sha1(text.encode("utf-8")).hexdigest()
        if digest in seen:
            continue
        seen.add(digest)
        taken.append((_relname(f), text))
        total += len(text.encode("utf-8"))
    return taken, seen - set(skip_hashes), rejected


def _tests_of(f: SourceFile, heldout: list[tuple[str, str]]) -> bool:
    """Is f the stdlib's own test suite of a held-out stdlib package (test/test_asyncio/...)?"""
    return f.root_kind == "stdlib" and any(
        kind == "stdlib" and f.rel.startswith(f"test/test_{pkg}") for kind, pkg in heldout
    )


def build_corpus(limits: CorpusLimits, seed: int, files: list[SourceFile] | None = None) -> Corpus:
    """Held-out text (a fixed shuffle of the held-out packages' files, capped), then training
    files (seeded shuffle, capped). The stdlib tests of held-out packages are in neither."""
    files = list_sources() if files is None else files
    heldout_keys = choose_heldout(files)
    is_heldout = {k: [f for f in files if (f.root_kind, f.package) == k] for k in heldout_keys}
    heldout_files = [f for fs in is_heldout.values() for f in fs]
    # A fixed shuffle (not the training seed): the same evaluation text for every run.
    random.Random(HELD_OUT_SHUFFLE_SEED).shuffle(heldout_files)
    # The hashes of *every* held-out file, so a vendored copy cannot leak into training.
    all_heldout, heldout_hashes, _ = _take(heldout_files, limits, 1 << 62, set())
    heldout = _cap(all_heldout, limits.max_heldout_bytes)
    train_pool = [
        f
        for f in files
        if (f.root_kind, f.package) not in is_heldout and not _tests_of(f, heldout_keys)
    ]
    random.Random(seed).shuffle(train_pool)
    train, _, rejected = _take(train_pool, limits, limits.max_train_bytes, heldout_hashes)
    packages = [
        {
            "package": pkg,
            "root_kind": kind,
            "files": len(fs),
            "bytes": sum(f.size for f in fs),
        }
        for (kind, pkg), fs in is_heldout.items()
    ]
    stats = {
        "source_files": len(files),
        "train_files": len(train),
        "train_bytes": _nbytes(train),
        "heldout_files": len(heldout),
        "heldout_bytes": _nbytes(heldout),
        "rejected_files_read": rejected,
        "limits": asdict(limits),
    }
    return Corpus(train, heldout, packages, stats)


def _cap(docs: list[tuple[str, str]], cap: int) -> list[tuple[str, str]]:
    out, total = [], 0
    for name, text in docs:
        if total >= cap:
            break
        out.append((name, text))
        total += len(text.encode("utf-8"))
    return out


def _nbytes(docs: list[tuple[str, str]]) -> int:
    return sum(len(t.encode("utf-8")) for _, t in docs)


def heldout_prompts(n: int, chars: int = 400) -> list[str]:
    """`n` prompts of `chars` characters from this Python's held-out standard-library packages
    (whole packages the shipped pair never trained on), the same on every machine with the same
    Python: the opening of each file (sorted paths, at least `chars` long), then, when more are
    asked for than there are files, each file's next `chars` characters, and so on."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for pkg in HELD_OUT_STDLIB for p in (stdlib / pkg).rglob("*.py"))
    texts = [t for t in (p.read_text(errors="replace").strip() for p in files) if len(t) >= chars]
    prompts: list[str] = []
    start = 0
    while len(prompts) < n and any(len(t) >= start + chars for t in texts):
        for text in texts:
            if len(text) >= start + chars and len(prompts) < n:
                prompts.append(text[start : start + chars])
        start += chars
    return prompts
