"""Op-list YAML files read bounded and contained (issue 24, findings 5 and 6).

`extends:` follows the external-data rules (the list's own folder, symlinks resolved, regular
files only) and no error quotes a file outside it; a file is read up to MAX_YAML_BYTES and
nested up to MAX_YAML_DEPTH, so /dev/zero, a FIFO or 100k brackets are one OpListError line.
"""

from __future__ import annotations

import os

import pytest

import amp_rewrite
from amp_rewrite import errors
from amp_rewrite.analysis import oplists
from amp_rewrite.cli import main
from helpers import load_script

make_corpus = load_script("tests/hostile/make_corpus.py")
SHADOW = "root:$6$secret-hash:19000:0:99999:7:::"


@pytest.fixture()
def folders(tmp_path):
    lists, outside = tmp_path / "lists", tmp_path / "outside"
    lists.mkdir()
    outside.mkdir()
    (outside / "shadow").write_text(SHADOW + "\n")
    model = tmp_path / "model.onnx"
    model.write_bytes(make_corpus.valid_model().SerializeToString())
    return model, lists, outside


def _setup(kind, lists, outside):
    """The op list file for one hostile case, and the fragment its error line must hold."""
    top = lists / "user.yaml"
    if kind == "extends_outside":
        top.write_text("extends: ../outside/shadow\n")
        return top, "escapes the op list's folder"
    if kind == "extends_absolute_dev_zero":
        top.write_text("extends: /dev/zero\n")
        return top, "must be a relative path"
    if kind == "extends_link_to_dev_zero":
        os.symlink("/dev/zero", lists / "zero.yaml")
        top.write_text("extends: zero.yaml\n")
        return top, "escapes the op list's folder"
    if kind == "extends_link_outside":
        os.symlink(outside / "shadow", lists / "base.yaml")
        top.write_text("extends: base.yaml\n")
        return top, "escapes the op list's folder"
    if kind == "extends_fifo":
        os.mkfifo(lists / "pipe.yaml")
        top.write_text("extends: pipe.yaml\n")
        return top, "is not a regular file"
    if kind == "top_file_fifo":
        os.mkfifo(top)
        return top, "is not a regular file"
    if kind == "oversize":
        top.write_text("allow:\n" + "".join(f"  - Op{i}\n" for i in range(200_000)))
        return top, f"larger than {oplists.MAX_YAML_BYTES} bytes"
    if kind == "deep_brackets":
        top.write_text("allow: " + "[" * 100_000 + "]" * 100_000 + "\n")
        return top, f"nested deeper than {oplists.MAX_YAML_DEPTH}"
    if kind == "deep_mappings":
        top.write_text("allow: " + "{a: " * 5000 + "x" + "}" * 5000 + "\n")
        return top, "nested deeper than"
    raise AssertionError(kind)


KINDS = [
    "extends_outside",
    "extends_absolute_dev_zero",
    "extends_link_to_dev_zero",
    "extends_link_outside",
    "extends_fifo",
    "top_file_fifo",
    "oversize",
    "deep_brackets",
    "deep_mappings",
]


@pytest.mark.parametrize("kind", KINDS)
def test_op_list_files_are_contained_and_bounded(kind, folders, capsys):
    model, lists, outside = folders
    top, fragment = _setup(kind, lists, outside)
    code = main([str(model), "--dry-run", "--op-lists", str(top)])
    err = capsys.readouterr().err.strip()
    assert code == 4, err
    assert len(err.splitlines()) == 1 and err.startswith("amp-rewrite: error: ") and fragment in err, err
    assert "secret-hash" not in err  # the outside file is never quoted
    with pytest.raises(errors.OpListError, match=fragment.split(" ")[0]):
        amp_rewrite.rewrite(str(model), op_lists=[str(top)])


def test_extends_inside_the_folder_still_works(folders):
    model, lists, _ = folders
    (lists / "base.yaml").write_text("deny: [Relu]\n")
    (lists / "user.yaml").write_text("extends: base.yaml\nallow: [Sigmoid]\n")
    merged = oplists.load_op_lists("float16", user_files=[lists / "user.yaml"])
    assert merged.classify("", "Relu").list == "deny" and merged.classify("", "Sigmoid").list == "allow"
