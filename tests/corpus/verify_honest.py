"""Run every entry of the honest corpus in a plain kernel and report its in-kernel score.

    python tests/corpus/verify_honest.py                 # every entry, one after the other
    python tests/corpus/verify_honest.py ID [ID ...]     # only these entries
    python tests/corpus/verify_honest.py --list          # the entries, without running them

For each entry of ``tests.corpus.honest.HONEST`` the student notebook is built the
way a student makes it: the RELEASED notebook (exercises/<assignment>/*.ipynb)
with the entry's answer cells filled in (the others keep the solution's code),
the test cells given back their hidden tests (each test cell's source replaced
by the source notebook's test cell of the same grade_id) and the entry's extra
cells inserted. It is run with nbclient in a plain ``python3`` kernel (no
sandbox, timeout 300 s per cell, errors allowed, working directory a fresh
temporary folder). A graded test cell that raises scores 0, one that does not
scores its points. One line per entry: points got/max, then the failing cells.
A non-graded cell that raises (an answer cell or an extra cell) is reported too,
and counts as a failure of the entry.

This is not a pytest test (it takes minutes); exit status 1 when an entry lacks
full marks or has a cell that raised, 0 otherwise.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
ROOT = TESTS.parent
for p in (str(TESTS), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

from course import EXERCISES, SOLUTIONS, answer_cells, fill, nbgrader_meta, solution_answers  # noqa: E402
from corpus.honest import HONEST  # noqa: E402


def _notebooks(assignment):
    sources = sorted((SOLUTIONS / assignment).glob("*.ipynb"))
    if len(sources) != 1:
        raise SystemExit(f"{assignment}: expected one source notebook, found {len(sources)}")
    name = sources[0].name
    return nbformat.read(sources[0], as_version=4), nbformat.read(EXERCISES / assignment / name, as_version=4), name


def _code_cell(source):
    return nbformat.v4.new_code_cell(source)  # with a fresh cell id (the notebooks are nbformat 4.5)


def build_notebook(entry):
    """The student's notebook of ``entry``, with the hidden tests restored."""
    source, released, name = _notebooks(entry["assignment"])
    gids = {nbgrader_meta(c)["grade_id"] for c in answer_cells(source)}
    unknown = set(entry["answers"]) - gids
    if unknown:
        raise SystemExit(f"{entry['id']}: no answer cell {sorted(unknown)} in {entry['assignment']} (has {sorted(gids)})")
    nb = fill(released, {**solution_answers(source), **entry["answers"]})
    tests = {nbgrader_meta(c)["grade_id"]: c.source for c in source.cells
             if nbgrader_meta(c).get("grade") and not nbgrader_meta(c).get("solution")}
    for cell in nb.cells:
        meta = nbgrader_meta(cell)
        if meta.get("grade") and not meta.get("solution"):
            cell.source = tests[meta["grade_id"]]
    for where, src in entry.get("extra", []):
        if where == "end":
            nb.cells.append(_code_cell(src))
            continue
        if not where.startswith("after:"):
            raise SystemExit(f"{entry['id']}: bad extra position {where!r}")
        gid = where[len("after:"):]
        idx = [i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == gid]
        if not idx:
            raise SystemExit(f"{entry['id']}: no cell with grade_id {gid!r} to insert after")
        # Several extras after the same cell keep their order: skip the extras already put there.
        at = idx[0] + 1
        while at < len(nb.cells) and nb.cells[at].get("metadata", {}).get("corpus_extra"):
            at += 1
        cell = _code_cell(src)
        cell.metadata["corpus_extra"] = True
        nb.cells.insert(at, cell)
    for cell in nb.cells:
        cell.metadata.pop("corpus_extra", None)
    nbformat.validate(nb)
    return nb, name


def _error(cell):
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error":
            return out
    return None


def _first_line(out):
    value = (out.get("evalue") or "").strip().splitlines()
    return f"{out.get('ename')}: {value[0] if value else ''}"[:300]


def run_entry(entry, verbose=False):
    nb, name = build_notebook(entry)
    with tempfile.TemporaryDirectory(prefix=f"honest_{entry['id']}_") as tmp:
        client = NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True,
                                resources={"metadata": {"path": tmp}})
        start = time.perf_counter()
        client.execute()
        seconds = time.perf_counter() - start
    got = top = 0
    failed, broken = [], []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = nbgrader_meta(cell)
        err = _error(cell)
        if meta.get("grade") and not meta.get("solution"):
            pts = meta.get("points", 0)
            top += pts
            if err is None:
                got += pts
            else:
                failed.append((meta["grade_id"], pts, err))
        elif err is not None:
            broken.append((meta.get("grade_id") or f"extra cell {i}", err))
    return dict(got=got, top=top, failed=failed, broken=broken, seconds=seconds, notebook=name, nb=nb)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="*", help="entries to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the entries and exit")
    parser.add_argument("--keep", metavar="DIR", help="write each executed notebook to DIR/<id>.ipynb")
    args = parser.parse_args(argv)

    ids = [e["id"] for e in HONEST]
    dupes = {i for i in ids if ids.count(i) > 1}
    if dupes:
        raise SystemExit(f"duplicate ids: {sorted(dupes)}")
    if args.list:
        for e in HONEST:
            print(f"{e['id']:<34} {e['assignment']:<22} {e['why']}")
        return 0
    unknown = set(args.ids) - set(ids)
    if unknown:
        raise SystemExit(f"unknown ids: {sorted(unknown)}")
    chosen = [e for e in HONEST if not args.ids or e["id"] in args.ids]

    # A small footprint on a shared machine: one thread per kernel.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(var, "1")

    bad = 0
    for entry in chosen:
        res = run_entry(entry)
        ok = res["got"] == res["top"] and not res["broken"]
        bad += not ok
        line = f"{'ok  ' if ok else 'FAIL'} {entry['id']:<34} {entry['assignment']:<22} {res['got']:>2}/{res['top']:<2} ({res['seconds']:.0f} s)"
        print(line, flush=True)
        for gid, pts, err in res["failed"]:
            print(f"       test {gid} ({pts} pt) raised {_first_line(err)}", flush=True)
        for gid, err in res["broken"]:
            print(f"       cell {gid} (not graded) raised {_first_line(err)}", flush=True)
        if args.keep:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            nbformat.write(res["nb"], Path(args.keep) / f"{entry['id']}.ipynb")
    print(f"{len(chosen) - bad} of {len(chosen)} entries at full marks", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
