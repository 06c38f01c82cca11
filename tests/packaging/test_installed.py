"""The installed distribution holds every module of the source tree and its data.

Run in a fresh interpreter whose working directory is outside the checkout, so the import can
only come from what pip installed (a wheel in CI; the editable finder in a developer's checkout).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[2] / "amp_rewrite"

PROBE = r"""
import importlib, json, sys
names = json.loads(sys.argv[1])
failed = {}
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - report every failure, not the first
        failed[name] = f"{type(exc).__name__}: {exc}"
import amp_rewrite
from amp_rewrite.analysis.oplists import load_op_lists
lists = load_op_lists("bfloat16")  # extends float16: both YAML files must ship
from importlib import resources
script = resources.files("amp_rewrite.report").joinpath("picture.js").read_text()  # the HTML picture's
print(json.dumps({"failed": failed, "file": amp_rewrite.__file__, "allow": len(lists.ops("allow")), "js": len(script)}))
"""


def source_modules() -> list[str]:
    names = []
    for path in sorted(SOURCE.rglob("*.py")):
        parts = path.relative_to(SOURCE.parent).with_suffix("").parts
        if parts[-1] != "__main__":  # importing it runs the CLI
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_source_module_imports_from_the_installed_distribution(tmp_path):
    names = source_modules()
    assert "amp_rewrite.autodiff.rules.nn" in names and len(names) > 40
    clean_path = [p for p in sys.path if p and Path(p).resolve() != SOURCE.parent]
    env = {"PYTHONPATH": "", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.path[:] = {clean_path!r}\n" + PROBE, json.dumps(names)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["failed"] == {}, found["failed"]
    assert found["allow"] > 10  # the op lists were read from the installed data
    assert found["js"] > 1000  # the report's drawing script ships too
