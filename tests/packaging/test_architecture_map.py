"""ARCHITECTURE.md is the one-page map: it names every module of the package and every data file,
and stays a page. Read from the checkout, so it needs no import.

A name in backticks is a path from the package root (`io/loader.py`), or a file name resolved
against the last folder named before it in the same bullet or paragraph (`io/` ... `loader.py`);
with no folder named yet, a file name is a top-level module (`cli.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAP = ROOT / "ARCHITECTURE.md"
MAX_LINES = 150
FILE = re.compile(r"[\w/]*\w\.(?:py|js|yaml|json)")
FOLDER = re.compile(r"(?:\w+/)+")


def package_files(root: Path = ROOT) -> set[str]:
    """Every module of the package but `__init__`, its data files, and the shipped op lists."""
    package = root / "amp_rewrite"
    files = {
        p.relative_to(package).as_posix()
        for p in package.rglob("*")
        if p.suffix in (".py", ".js") and p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    lists = {
        p.relative_to(root).as_posix()
        for p in (root / "op_lists").glob("*")
        if p.suffix in (".yaml", ".json")
    }
    return files | lists


def named(text: str) -> set[str]:
    """The paths the map names, each file name resolved against its block's last folder."""
    names = set()
    for block in re.split(r"\n(?=- )|\n\s*\n", text):
        folder = ""
        for token in re.findall(r"`([^`\n]+)`", block):
            if FOLDER.fullmatch(token):
                folder = token
            elif FILE.fullmatch(token):
                if "/" in token:
                    names.add(token)
                    folder = token.rsplit("/", 1)[0] + "/"
                else:
                    names.add(folder + token)
    return names


def missing(root: Path = ROOT) -> list[str]:
    return sorted(package_files(root) - named((root / "ARCHITECTURE.md").read_text()))


def test_the_map_names_every_module():
    assert not missing(), f"not named in ARCHITECTURE.md: {', '.join(missing())}"


def test_the_map_is_one_page():
    lines = MAP.read_text().count("\n")
    assert lines <= MAX_LINES, f"ARCHITECTURE.md has {lines} lines; the map keeps to {MAX_LINES}"


def test_a_module_left_out_of_the_map_is_found(tmp_path):
    """The check itself: a made-up package whose map forgets one module, names one only by its
    base name under another folder, and names the rest by path or under their folder."""
    for path in (
        "amp_rewrite/cli.py",
        "amp_rewrite/io/loader.py",
        "amp_rewrite/io/npz.py",
        "amp_rewrite/training/kernels.py",
        "amp_rewrite/analysis/kernels.py",
        "amp_rewrite/io/__init__.py",
        "op_lists/float16.yaml",
    ):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "ARCHITECTURE.md").write_text(
        "- `cli.py` the front end, `op_lists/float16.yaml`\n"
        "- **`io/`** `loader.py` · `npz.py`\n"
        "- `analysis/kernels.py`, and in training `kernels.py`\n"
    )
    assert missing(tmp_path) == ["training/kernels.py"]
