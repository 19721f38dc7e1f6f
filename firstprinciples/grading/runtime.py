"""The sandbox side of the trusted re-check: runs one probe in the student's kernel.

The trusted grader sends one cell per probe::

    __import__("firstprinciples.grading.runtime", fromlist=["run_probe"]).run_probe(globals(), '<json>')

with the probe's name and its encoded cases. ``run_probe`` looks the object up
in the notebook's namespace, runs the probe's ``run`` on every case while
watching for forbidden built-ins, and prints one line: a marker followed by the
encoded results. Nothing here is trusted: the grader only reads plain data back
and compares it with its own reference results.
"""
from __future__ import annotations

import json
import sys

MARK = "@@fp-trusted-probe@@"


def report(namespace: dict, name: str, cases: list) -> dict:
    """Run probe ``name`` on ``namespace[name]`` for every encoded case: plain data only."""
    from .. import guard
    from . import probes, wire

    probe = probes.load()[name]
    if name not in namespace:
        return {"name": name, "missing": True}
    obj = namespace[name]
    results = []
    for enc in cases:
        case = probes.decode_case(enc)
        with guard.forbid(**probe.watch()) as hits:
            try:
                out = probe.run(obj, case)
                entry = {"outputs": {k: wire.encode(v) for k, v in out.items()}}
            except (Exception, SystemExit) as e:  # the answer's fault: reported, graded 0
                entry = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        entry["hits"] = sorted(set(hits))
        results.append(entry)
    return {"name": name, "results": results}


def run_probe(namespace: dict, spec_text: str) -> None:
    """The probe cell's entry point: print the marker and the report as one JSON line."""
    from . import wire

    spec = json.loads(spec_text)
    out = report(namespace, spec["name"], spec["cases"])
    sys.stdout.write("\n" + MARK + wire.dumps(out) + "\n")
    sys.stdout.flush()
