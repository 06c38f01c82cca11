"""No module of the package over 400 lines: a module a reader can hold in their head. Read from
the checkout (after `ruff format`, which `.ci/run` checks), so it needs no import."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "amp_rewrite"
MAX_LINES = 400


def oversized(package: Path = PACKAGE, limit: int = MAX_LINES) -> dict[str, int]:
    """{module path: line count} of every module over `limit` lines."""
    counts = {
        p.relative_to(package).as_posix(): len(p.read_text().splitlines()) for p in package.rglob("*.py")
    }
    return {name: n for name, n in sorted(counts.items()) if n > limit}


def test_no_module_over_400_lines():
    assert oversized() == {}


def test_the_check_sees_a_long_module(tmp_path):
    (tmp_path / "short.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * 401)
    assert oversized(tmp_path) == {"sub/long.py": 401}


def test_every_module_name_is_unique():
    """One name, one module: `kernels` meant the rewrite's kernel table in analysis/ and the CPU
    probe in training/, which a reader (and a traceback) could not tell apart."""
    seen: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name not in ("__init__.py", "__main__.py", "_common.py"):
            seen.setdefault(path.stem, []).append(path.relative_to(PACKAGE).as_posix())
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
