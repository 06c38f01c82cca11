"""README's exit-code table is the product's: each row's class has that exit code, every error class
has a row, and the corpus and the hostile tests end in the codes the table lists (issue 24).

The rows' promises ("written: nothing") are held by the hostile tests themselves: each snapshots
its folder before and after.
"""

from __future__ import annotations

import re
import signal

import pytest

from amp_rewrite import errors
from helpers import ROOT, load_script

make_corpus = load_script("tests/hostile/make_corpus.py")


def _table() -> dict[int, tuple[str, str, str]]:
    """exit code -> (classes, when, written), from README's 'Errors and exit codes' table."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Errors and exit codes", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and re.fullmatch(r"[\d, ]+", cells[0]):
            for code in cells[0].split(","):
                rows[int(code)] = tuple(cells[1:])
    return rows


def test_every_error_class_has_its_row_and_code():
    rows = _table()
    classes = {
        cls.__name__: cls
        for cls in vars(errors).values()
        if isinstance(cls, type) and issubclass(cls, errors.AmpRewriteError)
    }
    named = {}
    for code, (cells, _, _) in rows.items():
        for name in re.findall(r"`(\w+)`", cells):
            named.setdefault(name, set()).add(code)
    assert set(named) == set(classes)
    for name, cls in classes.items():
        assert cls.exit_code in named[name], (name, cls.exit_code, named[name])


def test_the_table_lists_exactly_the_codes_the_cli_can_end_in():
    codes = set(_table())
    assert codes == {0, 1, 2, 3, 4, 5, 6, 7, 8, 70, 130, 128 + signal.SIGTERM}
    assert {case.code for case in make_corpus.CASES} <= codes


@pytest.mark.parametrize("code", [2, 3, 4, 5, 70, 130, 143])
def test_refusals_write_nothing(code):
    assert _table()[code][2].startswith(("nothing", "each file whole or absent"))


def test_over_tolerance_writes_only_when_asked():
    assert _table()[6][2] == "nothing; with `--keep-failed`, what was asked"
