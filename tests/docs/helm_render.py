#!/usr/bin/env python3
"""Renders the Helm chart with the values a guide shows, as `helm install`
would, for tests/docs.rs.

Reads {"chart": PATH, "renders": [{"label", "release", "namespace",
"values"}]} as JSON on stdin and prints, per render, JSON with:
  * "unknown": value paths that name no key of values.schema.json (where
    the schema lists an object's keys);
  * "error": Helm's error (schema validation, a template's `fail`) or null;
  * "objects": each rendered object's kind and name, a Service's ports
    and a Secret's data keys.

Needs helm-python-sdk and pyyaml (tests/run.sh installs them, as for
charts/test_chart.py).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import helm_python
import yaml


def resolve(schema: dict, root: dict) -> dict:
    while "$ref" in schema:
        ref = schema["$ref"]
        assert ref.startswith("#/"), ref
        node = root
        for part in ref[2:].split("/"):
            node = node[part]
        schema = node
    return schema


def unknown(values: object, schema: dict, root: dict, path: str) -> list[str]:
    schema = resolve(schema, root)
    props = schema.get("properties")
    if not isinstance(values, dict) or props is None:
        return []
    out = []
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key in props:
            out.extend(unknown(value, props[key], root, where))
        else:
            out.append(where)
    return out


def describe(obj: dict) -> dict:
    kind = obj.get("kind")
    out = {"kind": kind, "name": (obj.get("metadata") or {}).get("name")}
    if kind == "Service":
        out["ports"] = [p.get("port") for p in obj["spec"].get("ports", [])]
    if kind == "Secret":
        out["data_keys"] = sorted({**obj.get("data", {}), **obj.get("stringData", {})})
    return out


def main() -> int:
    request = json.load(sys.stdin)
    chart_dir = Path(request["chart"])
    schema = json.loads((chart_dir / "values.schema.json").read_text())
    # Helm's own log lines go nowhere; its errors still arrive as exceptions.
    quiet = logging.getLogger("larder-docs-test.helm")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    helm_python.enable_logging(logging.CRITICAL, quiet)
    chart = helm_python.Chart.load(str(chart_dir))
    results = []
    for r in request["renders"]:
        result = {"label": r["label"], "unknown": unknown(r["values"], schema, schema, ""), "error": None, "objects": []}
        try:
            manifests = chart.render(r["values"], name=r["release"], namespace=r["namespace"], is_install=True)
        except helm_python.HelmError as e:
            result["error"] = str(e)
        else:
            for path, text in sorted(manifests.items()):
                if path.endswith("NOTES.txt"):
                    continue
                result["objects"].extend(describe(d) for d in yaml.safe_load_all(text) if d)
        results.append(result)
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
