"""Generate op_lists/schemas_contrib.json: the schemas of ONNX Runtime's com.microsoft ops (inputs,
outputs, type constraints, attribute types), per version.

Why data: the colouring needs a contrib op's type groups (which slots share `T`, which are fixed
float32 like SkipLayerNormalization's statistics `U`) exactly as it reads the standard ops' from
`onnx.defs`. Read from a file, they are the same on every install, whatever ONNX Runtime build
(or none) is present; this script is how the file is made, from the registry ONNX Runtime exposes
(`get_all_operator_schema()`, contrib ones included), never by hand.

    python tools/gen_contrib_schemas.py
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOMAIN = "com.microsoft"


def _formal(param) -> list:
    """[name, type string, option]: option 0 single, 1 optional, 2 variadic (ORT's enum)."""
    return [param.name, param.typeStr, int(param.option)]


def schema_row(schema) -> dict:
    return {
        "since": int(schema.since_version),
        "inputs": [_formal(p) for p in schema.inputs],
        "outputs": [_formal(p) for p in schema.outputs],
        "types": {c.type_param_str: sorted(c.allowed_type_strs) for c in schema.type_constraints},
        "attributes": {name: int(a.type) for name, a in sorted(schema.attributes.items())},
    }


def contrib_table(schemas, version: str) -> dict:
    """'OpType' -> its versions, oldest first, for the com.microsoft domain."""
    ops: dict = {}
    for schema in schemas:
        if schema.domain == DOMAIN:
            ops.setdefault(schema.name, []).append(schema_row(schema))
    for rows in ops.values():
        rows.sort(key=lambda r: r["since"])
    source = f"onnxruntime {version} get_all_operator_schema(), domain {DOMAIN}"
    return {"domain": DOMAIN, "source": source, "schemas": dict(sorted(ops.items()))}


def current_table() -> dict:
    import onnxruntime
    from onnxruntime.capi import onnxruntime_pybind11_state as ort_state

    return contrib_table(ort_state.get_all_operator_schema(), onnxruntime.__version__)


def render(table: dict) -> str:
    """One line per op, so diffs stay readable."""
    lines = [f"  {json.dumps(op)}: {json.dumps(rows)}" for op, rows in table["schemas"].items()]
    head = {k: v for k, v in table.items() if k != "schemas"}
    text = json.dumps(head)[:-1] + ', "schemas": {\n' + ",\n".join(lines) + "\n}}\n"
    json.loads(text)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "op_lists" / "schemas_contrib.json")
    args = p.parse_args(argv)
    table = current_table()
    args.out.write_text(render(table))
    print(f"wrote {args.out} ({len(table['schemas'])} ops)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
