"""Class reports for instructors, from the nbgrader gradebook and the autograded notebooks.

    python -m firstprinciples.grading.reports softmax [--course DIR] [--out DIR]

writes into ``--out`` (default ``<course>/reports``):

- ``<assignment>-tests.csv`` and ``.md``: one row per graded test cell (grade_id,
  points), how many graded students lost points on it (score < max), and the most
  common reason: the ``evalue`` of the cell's first error output in
  ``autograded/<student>/<assignment>/<notebook>.ipynb``, with numbers, tensors and
  shapes normalised so that one mistake is one reason (the re-check's verdict comes first
  in a cell it failed); and the typical mistake most often named by the course's
  checks in those cells ("no max subtracted", "dim ignored");
- ``lms.csv``: one row per student of the gradebook, one column per assignment (the
  score after nbgrader's late penalty, as ``nbgrader export`` computes it:
  ``max(0, score - late_submission_penalty)``, 0 without a submission) and a total;
- ``per-test.csv``: student, assignment, notebook, grade_id, score, max (the cell's
  score before any late penalty: nbgrader stores the penalty per notebook);
- ``<assignment>-similarity.csv``: clusters of answers (solution cells, by grade_id)
  nearly identical, once identifiers, comments, docstrings and layout are normalised,
  to each other or to the course's own code (``solutions/<assignment>``,
  ``firstprinciples/reference``): students who may share one source, one row per
  cluster (its size, students, the answer or course file it is built around, how alike,
  the students' grades), one printed line each; ``<assignment>-similarity-pairs.csv``:
  the alike pairs behind them, between distinct answers (the students who handed in the
  same normalised answer are one row). It decides nothing.

Similarity uses copydetect (token filtering with pygments: every identifier becomes
one symbol, comments and whitespace dropped, strings one symbol; then winnowed
k-gram fingerprints). The code released to every student (the stub of the answer
cell) is boilerplate and never counts. Two answers are alike when the matched part covers
at least ``--threshold`` (0.8) of one side and is at least ``--min-size`` (100)
normalised characters long, about five lines of code: below that, independent
correct answers (a three-line softmax) are the same token stream as the reference and
nothing can be told from the text. Answers that reach the threshold but are too
short are counted per grade_id in the printed summary, never listed. A cluster is a
connected group of alike answers (``cluster_answers``).

Work: each distinct text is fingerprinted once (linear in the class); the students whose
normalised answers are the same are one answer, compared with itself once; only distinct
answers are compared pairwise, and only those that share a fingerprint in full. Copies of
one leaked solution cost one comparison, however many students hand it in; what grows
with the square is the number of distinct answers that share code.

The gradebook is the course's (``c.CourseDirectory.db_url`` in its
``nbgrader_config.py``, which reads ``$FP_GRADEBOOK_URL``; else ``gradebook.db`` in
the course folder), read through nbgrader's ``Gradebook``. A student whose autograded
notebook is missing or unreadable is reported and the rest go on.
"""
from __future__ import annotations

import argparse
import collections
import csv
import fnmatch
import glob
import io
import itertools
import os
import re
import sys
import time
from pathlib import Path

import nbformat

THRESHOLD = 0.8
MIN_SIZE = 100
NOISE = 25  # copydetect's k: matches shorter than 25 normalised characters are noise
NO_ERROR = "(lost points with no error output)"


# ---------------------------------------------------------------- course and notebooks
def course_directory(course: Path):
    """nbgrader's CourseDirectory for ``course``, configured by its nbgrader_config.py."""
    from nbgrader.coursedir import CourseDirectory
    from traitlets.config import Config
    from traitlets.config.loader import PyFileConfigLoader

    config = Config()
    if (course / "nbgrader_config.py").exists():
        config = PyFileConfigLoader("nbgrader_config.py", path=str(course)).load_config()
    elif os.environ.get("FP_GRADEBOOK_URL"):
        from . import gradebook_url

        config.CourseDirectory.db_url = gradebook_url(os.environ["FP_GRADEBOOK_URL"])
    config.CourseDirectory.root = str(course.resolve())
    return CourseDirectory(config=config)


def read_notebook(path) -> tuple[object | None, str | None]:
    """(notebook, None), or (None, why it could not be read)."""
    if not os.path.exists(path):
        return None, "missing"
    try:
        return nbformat.read(path, as_version=4), None
    except Exception as error:  # a broken file of one student must not stop the report
        return None, f"unreadable ({type(error).__name__})"


def _meta(cell) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def source_notebooks(cd, assignment) -> dict:
    """{notebook name: source notebook} from the course's source directory."""
    out = {}
    for path in sorted(glob.glob(cd.format_path(cd.source_directory, ".", assignment) + "/*.ipynb")):
        nb, _ = read_notebook(path)
        if nb is not None:
            out[Path(path).stem] = nb
    return out


def answers_of(nb) -> dict:
    """{grade_id: source} of the notebook's code solution cells."""
    return {_meta(c)["grade_id"]: c.source for c in nb.cells
            if c.cell_type == "code" and _meta(c).get("solution") and _meta(c).get("grade_id")}


# ---------------------------------------------------------------- (a) per-test table
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?(?![\w])")
_RUN = re.compile(r"#(?:\s*,\s*#)+")
_LIST = re.compile(r"\[[\[\]#,.\s…]*\]")
RECHECK = "The trusted re-check (run by the grader outside your notebook, on new inputs) failed: "


def normalise_reason(text: str) -> str:
    """One reason per mistake: numbers become #, lists and tensors of them [#], and the
    trusted re-check's preamble is shortened."""
    text = _ANSI.sub("", text or "").strip()
    if text.startswith(RECHECK):
        text = "trusted re-check: " + text[len(RECHECK):].removesuffix(" This test scores 0.").rstrip(".")
    text = _NUMBER.sub("#", text)
    text = _RUN.sub("#", text)
    for _ in range(3):
        text = _LIST.sub("[#]", text)
    text = re.sub(r"\s+", " ", text)
    return text if len(text) <= 240 else text[:239] + "…"


_MISTAKE = re.compile(r"match(?:es)? a typical mistake:\s*-\s*([^:\n]+):")  # (the kernel's, the re-check's)


def cell_reason(cell) -> tuple[str, str | None]:
    """(the normalised evalue of the cell's first error output: what scored it, the re-check's
    verdict when it failed, first; the first typical mistake its errors name, or None)."""
    errors = [str(o.get("evalue") or o.get("ename") or "error") for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    mistake = next((m.group(1).strip() for e in errors for m in [_MISTAKE.search(_ANSI.sub("", e))] if m), None)
    return (normalise_reason(errors[0]) if errors else NO_ERROR), mistake


def test_table(gb, cd, assignment: str) -> tuple[list[dict], list[str]]:
    """Rows of the per-test table (in notebook order) and the problems met."""
    sources = source_notebooks(cd, assignment)
    rows, problems = {}, []
    for notebook in gb.find_assignment(assignment).notebooks:
        order = [_meta(c).get("grade_id") for c in sources.get(notebook.name, nbformat.v4.new_notebook()).cells]
        cells = sorted((c for c in notebook.grade_cells if c.cell_type == "code"),
                       key=lambda c: (order.index(c.name) if c.name in order else len(order), c.name))
        for cell in cells:
            rows[(notebook.name, cell.name)] = {"notebook": notebook.name, "grade_id": cell.name,
                                                "points": cell.max_score, "graded": 0, "failed": 0,
                                                "reasons": collections.Counter(),
                                                "mistakes": collections.Counter()}
    for submission in sorted(gb.assignment_submissions(assignment), key=lambda s: s.student.id):
        student = submission.student.id
        for snb in submission.notebooks:
            path = cd.format_path(cd.autograded_directory, student, assignment) + f"/{snb.name}.ipynb"
            nb, why = read_notebook(path)
            if why:
                problems.append(f"{student}: autograded notebook {snb.name}.ipynb {why}")
            cells = {} if nb is None else {_meta(c).get("grade_id"): c for c in nb.cells}
            for grade in snb.grades:
                row = rows.get((snb.name, grade.name))
                if row is None:
                    continue
                row["graded"] += 1
                if (grade.score or 0) < grade.max_score:
                    row["failed"] += 1
                    cell = cells.get(grade.name)
                    reason, mistake = ((f"(autograded notebook {why})", None) if nb is None else
                                       ("(cell missing from the autograded notebook)", None) if cell is None
                                       else cell_reason(cell))
                    row["reasons"][reason] += 1
                    if mistake:
                        row["mistakes"][mistake] += 1
    out = []
    for row in rows.values():
        top = row["reasons"].most_common(1)
        mistake = row["mistakes"].most_common(1)
        out.append({"notebook": row["notebook"], "grade_id": row["grade_id"], "points": _num(row["points"]),
                    "graded": row["graded"], "failed": row["failed"],
                    "top_reason": top[0][0] if top else "", "top_reason_count": top[0][1] if top else 0,
                    "other_reasons": len(row["reasons"]) - 1 if top else 0,
                    "top_mistake": mistake[0][0] if mistake else "",
                    "top_mistake_count": mistake[0][1] if mistake else 0})
    return out, problems


def tests_markdown(assignment: str, rows: list[dict], problems: list[str]) -> str:
    lines = [f"# {assignment}: tests", "",
             "| test | points | failed / graded | most common reason (students) | other reasons "
             "| typical mistake named (students) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        reason = r["top_reason"].replace("|", "\\|")
        lines.append(f"| {r['grade_id']} | {r['points']} | {r['failed']} / {r['graded']} | "
                     f"{reason + ' (' + str(r['top_reason_count']) + ')' if reason else ''} | {r['other_reasons']} | "
                     f"{r['top_mistake'] + ' (' + str(r['top_mistake_count']) + ')' if r['top_mistake'] else ''} |")
    if problems:
        lines += ["", "Not read (counted from the gradebook, reason unknown):", ""] + [f"- {p}" for p in problems]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- (b) LMS export and per-test CSV
def _num(x) -> str:
    return f"{float(x or 0):g}"


def lms_rows(gb) -> tuple[list[str], list[dict]]:
    """Header and rows: one row per student, one column per assignment (late penalty
    applied as nbgrader's export does), and the total."""
    assignments = [a.name for a in sorted(gb.assignments, key=lambda a: (a.duedate is None, a.duedate, a.name))]
    scores = collections.defaultdict(dict)
    for name in assignments:
        for sub in gb.assignment_submissions(name):
            scores[sub.student.id][name] = max(0.0, (sub.score or 0.0) - (sub.late_submission_penalty or 0.0))
    header = ["student_id", "last_name", "first_name", "email", *assignments, "total"]
    rows = []
    for student in sorted(gb.students, key=lambda s: s.id):
        mine = scores.get(student.id, {})
        row = {"student_id": student.id, "last_name": student.last_name or "",
               "first_name": student.first_name or "", "email": student.email or ""}
        row.update({a: _num(mine.get(a, 0.0)) for a in assignments})
        row["total"] = _num(sum(mine.values()))
        rows.append(row)
    return header, rows


def per_test_rows(gb) -> list[dict]:
    rows = []
    for assignment in sorted(gb.assignments, key=lambda a: a.name):
        for sub in sorted(gb.assignment_submissions(assignment.name), key=lambda s: s.student.id):
            for snb in sorted(sub.notebooks, key=lambda n: n.name):
                for grade in sorted(snb.grades, key=lambda g: g.name):
                    rows.append({"student_id": sub.student.id, "assignment": assignment.name,
                                 "notebook": snb.name, "grade_id": grade.name,
                                 "score": _num(grade.score), "max_score": _num(grade.max_score)})
    return rows


# ---------------------------------------------------------------- (c) similarity
def _fingerprint(name: str, code: str, boilerplate=()):
    from copydetect import CodeFingerprint

    return CodeFingerprint(f"{name}.py", NOISE, 1, boilerplate=list(boilerplate), fp=io.StringIO(code))


def _compare(a, b) -> tuple[float, float, int]:
    """(share of a matched, share of b matched, matched normalised characters of a)."""
    from copydetect import compare_files

    if not a.hashes & b.hashes:
        return 0.0, 0.0, 0
    overlap, (share_a, share_b), _ = compare_files(a, b)
    return float(share_a), float(share_b), int(overlap)


def _clean(source: str) -> str:
    return re.sub(r"^\s*### (BEGIN|END) SOLUTION\s*$\n?", "", source, flags=re.M)


def reference_files() -> dict:
    import firstprinciples.reference as reference

    folder = Path(reference.__file__).parent
    return {f"reference:firstprinciples/reference/{p.name}": p.read_text()
            for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"}


def similarity(cd, assignment: str, threshold: float = THRESHOLD, min_size: int = MIN_SIZE,
               grades: dict | None = None):
    """(clusters, pairs, summary, problems) for one assignment.

    Per answer cell (notebook, grade_id): answers whose normalised text is the same are one
    answer (one fingerprint, one comparison with itself to know how long the shared part is);
    the distinct answers are compared with each other and with the course's own code (the
    solution cell, ``firstprinciples/reference``), and two answers are alike when the matched
    part covers at least ``threshold`` of one side over at least ``min_size`` normalised
    characters. A cluster is a connected group of alike answers (``cluster_answers``); its
    students may share one source. ``pairs`` are the alike relations actually found (one row
    per distinct answer pair, and one per answer several students submitted identically);
    ``grades``: {student: (score, max score)} for the clusters' grade range."""
    sources = source_notebooks(cd, assignment)
    release = {}
    for path in glob.glob(cd.format_path(cd.release_directory, ".", assignment) + "/*.ipynb"):
        nb, _ = read_notebook(path)
        if nb is not None:
            release[Path(path).stem] = answers_of(nb)
    refs = reference_files()
    students, problems = {}, []  # (notebook, grade_id) -> {student: source}
    folders = {os.path.basename(os.path.dirname(p)) for d in (cd.autograded_directory, cd.submitted_directory)
               for p in glob.glob(cd.format_path(d, "*", assignment))}
    for student in sorted(folders):
        for notebook in sorted(sources):
            nb, why = read_notebook(cd.format_path(cd.autograded_directory, student, assignment) + f"/{notebook}.ipynb")
            if nb is None:
                submitted = cd.format_path(cd.submitted_directory, student, assignment)
                nb, why2 = read_notebook(f"{submitted}/{notebook}.ipynb")
                if nb is None:
                    problems.append(f"{student}: {notebook}.ipynb {why} in autograded/, {why2} in submitted/")
                    continue
            for gid, code in answers_of(nb).items():
                students.setdefault((notebook, gid), {})[student] = code
    clusters, pairs, summary = [], [], []
    for (notebook, gid), answers in sorted(students.items()):
        stub = release.get(notebook, {}).get(gid, "")
        boiler = _fingerprint("stub", stub).hashes if stub else set()
        others = dict(refs)
        if gid in answers_of(sources.get(notebook, nbformat.v4.new_notebook())):
            others[f"solution:{cd.source_directory}/{assignment}/{notebook}.ipynb"] = \
                _clean(answers_of(sources[notebook])[gid])
        found = cluster_answers(answers, others, boiler, threshold, min_size)
        where = {"assignment": assignment, "notebook": notebook, "grade_id": gid}
        for number, c in enumerate(found["clusters"], 1):
            marks = [grades[s] for s in c["students"] if grades and s in grades]
            clusters.append({**where, "cluster": number, "size": len(c["students"]),
                             "students": " ".join(c["students"]), "around": c["around"],
                             "source": c["source"], "alike_min": round(c["alike"][0], 3),
                             "alike_max": round(c["alike"][1], 3),
                             "grade_min": _num(min(m[0] for m in marks)) if marks else "",
                             "grade_max": _num(max(m[0] for m in marks)) if marks else "",
                             "max_score": _num(marks[0][1]) if marks else "", "graded": len(marks)})
        for p in found["pairs"]:
            pairs.append({**where, **p})
        summary.append({**where, "answers": len(answers), "distinct": found["distinct"],
                        "clusters": len(found["clusters"]),
                        "in_clusters": sum(len(c["students"]) for c in found["clusters"]),
                        "too_short": len(found["too_short"]), "comparisons": found["comparisons"]})
    clusters.sort(key=lambda c: (c["notebook"], c["grade_id"], c["cluster"]))
    return clusters, pairs, summary, problems


def cluster_answers(answers: dict, others: dict, boiler=(), threshold: float = THRESHOLD,
                    min_size: int = MIN_SIZE) -> dict:
    """The students' answers to one cell ({student: code}) grouped by where they come from.

    ``others``: {name: code} of the course's own versions (a student alike one of them is in
    its cluster, which is built around it). Work: one fingerprint per distinct raw text, one
    comparison per normalised answer submitted by several students, then every pair of
    distinct normalised answers (and each with ``others``) that share at least one
    fingerprint: a class that shares one leaked solution costs about as much as one student.
    Returns {clusters: [{students, around, source, alike: (min, max)}], pairs, distinct,
    too_short: set of students, comparisons: how many copydetect comparisons ran}."""
    by_text, nodes = {}, {}  # raw text -> fingerprint; normalised text -> node
    for student, code in sorted(answers.items()):
        fp = by_text.get(code)
        if fp is None:
            fp = by_text[code] = _fingerprint(student, code, boiler)
        nodes.setdefault(fp.filtered_code, {"students": [], "fp": fp, "ref": None})["students"].append(student)
    nodes = list(nodes.values())
    for name, code in sorted(others.items()):
        nodes.append({"students": [], "fp": _fingerprint(name.split("/")[-1], code, boiler), "ref": name})
    comparisons, edges, too_short = 0, [], set()

    def judge(i, j):
        nonlocal comparisons
        a, b = nodes[i]["fp"], nodes[j]["fp"]
        if not a.hashes & b.hashes:
            return
        comparisons += 1
        share_a, share_b, overlap = _compare(a, b)
        score = max(share_a, share_b)
        if score < threshold:
            return
        if overlap < min_size:
            too_short.update(nodes[i]["students"] + nodes[j]["students"])
            return
        edges.append((i, j, score, share_a, share_b, overlap))

    for i, node in enumerate(nodes):  # identical copies: one comparison for all of them
        if len(node["students"]) > 1:
            judge(i, i)
    answers_only = [i for i, n in enumerate(nodes) if n["ref"] is None]
    for i, j in itertools.combinations(range(len(nodes)), 2):
        if nodes[i]["ref"] is None or nodes[j]["ref"] is None:  # (the course's versions are not compared with each other)
            judge(i, j)
    parent = list(range(len(nodes)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j, *_ in edges:
        parent[root(i)] = root(j)
    members, links = collections.defaultdict(list), collections.defaultdict(list)
    for i in range(len(nodes)):
        members[root(i)].append(i)
    for edge in edges:
        links[root(edge[0])].append(edge)
    found = []
    for r, mine in links.items():
        people = sorted(s for i in members[r] for s in nodes[i]["students"])
        if not people:
            continue
        refs = [i for i in members[r] if nodes[i]["ref"] is not None]
        weight = collections.Counter()  # how many students' answers are directly alike each answer
        for i, j, *_ in mine:
            if i != j:
                weight[i] += len(nodes[j]["students"])
                weight[j] += len(nodes[i]["students"])
        # built around the course's own version most of it matches, else the answer most students share
        centre = max(refs, key=lambda i: (weight[i], -i)) if refs else \
            max(members[r], key=lambda i: (len(nodes[i]["students"]) + weight[i], -i))
        found.append((people, members[r], centre, refs, mine))
    found.sort(key=lambda f: (-len(f[0]), f[0]))
    cluster_of, clusters = {}, []
    for number, (people, nodes_in, centre, refs, mine) in enumerate(found, 1):
        for i in nodes_in:
            cluster_of[i] = number
        clusters.append({"students": people, "around": nodes[centre]["ref"] or nodes[centre]["students"][0],
                         "source": ", ".join(nodes[i]["ref"] for i in refs),
                         "alike": (min(e[2] for e in mine), max(e[2] for e in mine))})
    pairs = []
    for i, j, score, share_a, share_b, overlap in edges:
        other = "(each other)" if i == j else nodes[j]["ref"] or " ".join(nodes[j]["students"])
        pairs.append({"cluster": cluster_of[i], "students": " ".join(nodes[i]["students"]) or nodes[i]["ref"],
                      "other": other, "score": round(score, 3), "student_share": round(share_a, 3),
                      "other_share": round(share_b, 3), "matched": overlap})
    pairs.sort(key=lambda p: (p["cluster"], -p["score"], p["students"], p["other"]))
    listed = {s for c in clusters for s in c["students"]}
    return {"clusters": clusters, "pairs": pairs, "distinct": len(answers_only), "too_short": too_short - listed,
            "comparisons": comparisons}


# ---------------------------------------------------------------- command
CLUSTER_COLUMNS = ["assignment", "notebook", "grade_id", "cluster", "size", "students", "around", "source",
                   "alike_min", "alike_max", "grade_min", "grade_max", "max_score", "graded"]
PAIR_COLUMNS = ["assignment", "notebook", "grade_id", "cluster", "students", "other", "score", "student_share",
                "other_share", "matched"]
NAMES_SHOWN = 12  # students named on a cluster's printed line (the CSV names them all)


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def cluster_line(c: dict) -> str:
    """One printed line per cluster: grade_id, size, what it is built around, how alike, the
    grades of its students, and who they are."""
    names = c["students"].split()
    who = ", ".join(names[:NAMES_SHOWN]) + (f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else "")
    alike = f"{c['alike_min']:.2f}" + (f"-{c['alike_max']:.2f}" if c["alike_max"] != c["alike_min"] else "")
    grades = "" if c["grade_min"] == "" else \
        f"  grades {c['grade_min']}" + (f"-{c['grade_max']}" if c["grade_max"] != c["grade_min"] else "") + \
        f" / {c['max_score']}" + (f" ({c['graded']} graded)" if c["graded"] < c["size"] else "")
    return (f"{c['grade_id']}  cluster {c['cluster']}: {_count(c['size'], 'student')} "
            f"around {c['around']}  alike {alike}{grades}: {who}")


def _write_csv(path: Path, header: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m firstprinciples.grading.reports",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("assignment")
    parser.add_argument("--course", type=Path, default=Path("."), help="the course folder (default: here)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: <course>/reports)")
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="similarity listed from (default 0.8)")
    parser.add_argument("--min-size", type=int, default=MIN_SIZE,
                        help="matched normalised characters needed to list a pair (default 100)")
    args = parser.parse_args(argv)
    from nbgrader.api import Gradebook

    cd = course_directory(args.course)
    out = args.out or args.course / "reports"
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with Gradebook(cd.db_url) as gb:
        # a name, or a pattern as autograde takes ("*": every assignment of the gradebook)
        names = sorted(a.name for a in gb.assignments if fnmatch.fnmatchcase(a.name, args.assignment))
        if not names:
            print(f"reports: no assignment {args.assignment!r} in the gradebook {cd.db_url}", file=sys.stderr)
            return 2
        tables = {name: test_table(gb, cd, name) for name in names}
        header, lms = lms_rows(gb)
        per_test = per_test_rows(gb)
        grades = {name: {sub.student.id: (max(0.0, (sub.score or 0.0) - (sub.late_submission_penalty or 0.0)),
                                          sub.max_score or 0.0)
                         for sub in gb.assignment_submissions(name)} for name in names}
    _write_csv(out / "lms.csv", header, lms)
    _write_csv(out / "per-test.csv", ["student_id", "assignment", "notebook", "grade_id", "score", "max_score"],
               per_test)
    written = []
    for name in names:
        rows, problems = tables[name]
        _write_csv(out / f"{name}-tests.csv", list(rows[0]) if rows else ["grade_id"], rows)
        table = tests_markdown(name, rows, problems)
        (out / f"{name}-tests.md").write_text(table)
        clusters, pairs, summary, sim_problems = similarity(cd, name, args.threshold, args.min_size, grades[name])
        _write_csv(out / f"{name}-similarity.csv", CLUSTER_COLUMNS, clusters)
        _write_csv(out / f"{name}-similarity-pairs.csv", PAIR_COLUMNS, pairs)
        print(table)
        print(f"similarity (alike: >= {args.threshold:g} of one side over >= {args.min_size} normalised characters; "
              "one line per cluster of alike answers):")
        for s in summary:
            print(f"  {s['grade_id']}: {_count(s['answers'], 'answer')} ({s['distinct']} distinct), "
                  f"{_count(s['clusters'], 'cluster')} of {_count(s['in_clusters'], 'student')}, "
                  f"{s['too_short']} alike but too short to judge")
            for c in (c for c in clusters if (c["notebook"], c["grade_id"]) == (s["notebook"], s["grade_id"])):
                print("  " + cluster_line(c))
        for problem in sim_problems:
            print(f"  not compared: {problem}")
        written.append(f"{name}-tests.csv, {name}-tests.md, {name}-similarity.csv ({_count(len(clusters), 'cluster')}), "
                       f"{name}-similarity-pairs.csv")
    print(f"wrote {'; '.join(written)}; lms.csv ({len(lms)} students), per-test.csv to {out} "
          f"in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
