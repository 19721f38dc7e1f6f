"""Feedback a student understands (firstprinciples.grading.feedback), made by the plain
`nbgrader generate_feedback` with the repo's config from a graded softmax class:

- test cells named by their grade_id, with their points, in the table at the top too;
- the reason of a failure first (before any traceback) and wrapped;
- tracebacks cut to the student's own frames (no _core.py, guard.py, torch);
- no hidden test's source (their results are shown);
- the grader's notes for that student, each kind under its own heading: a repaired notebook,
  a piece that hangs (time limit), a piece that kills its kernel;
- no empty box: an error without a message (the KeyboardInterrupt and CellTimeoutError of
  a cell interrupted at its time limit) says what happened in words;
- a test score an instructor set by hand is shown as such, and nothing on the page claims
  the automatic score ("This test scores 0.") beside it;
- an exactness failure prints the value exactly (0.9999999989999999, not "1");
- math as MathML, and nothing fetched from elsewhere (no remote script or stylesheet).
"""
from __future__ import annotations

import html
import re
from pathlib import Path

import nbformat
import pytest
from bs4 import BeautifulSoup

from course import SOLUTIONS, fill, make_course, nbgrader, nbgrader_meta, solution_answers

NAIVE = '''import torch

def softmax(x, dim=-1):
    e = torch.exp(x)
    return e / e.sum(dim=dim, keepdim=True)
'''
EPSILON = '''import torch

def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return e / (e.sum(dim=dim, keepdim=True) + 1e-9)
'''
RAISES = '''import torch

def _normalise(e, dim):
    return e / e.sum(dim=dim + 10, keepdim=True)  # a wrong dim: raises IndexError in torch

def softmax(x, dim=-1):
    e = torch.exp(x - x.amax(dim=dim, keepdim=True))
    return _normalise(e, dim)
'''
WRONG = '''import torch

def softmax(x, dim=-1):
    return x.clone()
'''
# the in-kernel checks are fooled (every check "passes"); the trusted re-check is not
FOOLS_CHECKS = '''class checks:
    def __getattr__(self, name):
        return lambda *a, **k: None
checks = checks()
'''
# a piece that never returns (interruptible), and one that kills its kernel on every call
HANGS = '''import torch

def softmax(x, dim=-1):
    while True:
        pass
'''
DIES = '''import torch

def softmax(x, dim=-1):
    import os, signal
    os.kill(os.getpid(), signal.SIGKILL)
'''
TESTS = ["test_worked_example", "test_large_inputs", "test_minus_inf", "test_dims", "test_gradients_and_inputs"]
TIMEOUT = 10  # seconds per cell in this class (the course's 60 would make the hang cost a minute)


@pytest.fixture(scope="module")
def feedback(tmp_path_factory):
    course = make_course(tmp_path_factory.mktemp("feedback"))
    nbgrader(course, "generate_assignment", "softmax", "--force")
    release = nbformat.read(course / "exercises" / "softmax" / "softmax.ipynb", as_version=4)
    source = nbformat.read(SOLUTIONS / "softmax" / "softmax.ipynb", as_version=4)
    correct = solution_answers(source)
    students = {}
    for student, answer in [("correct", None), ("naive", NAIVE), ("epsilon", EPSILON), ("raises", RAISES),
                            ("repaired", None), ("fools", WRONG), ("hangs", HANGS), ("dies", DIES),
                            ("by_hand", NAIVE)]:
        nb = fill(release, {**correct, **({"softmax": answer} if answer else {})})
        if student == "repaired":  # a deleted test cell: put back by the grader, with a note
            nb.cells = [c for c in nb.cells if nbgrader_meta(c).get("grade_id") != "test_dims"]
        if student == "fools":
            at = next(i for i, c in enumerate(nb.cells) if nbgrader_meta(c).get("grade_id") == "try_it_code")
            nb.cells.insert(at + 1, nbformat.v4.new_code_cell(FOOLS_CHECKS))
        folder = course / "submitted" / student / "softmax"
        folder.mkdir(parents=True)
        nbformat.write(nb, folder / "softmax.ipynb")
        students[student] = folder
    nbgrader(course, "autograde", "softmax", f"--Execute.timeout={TIMEOUT}", "--RobustExecute.recheck_piece_timeout=10")
    # an instructor gives 1 of 2 points by hand (as formgrader does) to a test the naive softmax fails
    from nbgrader.api import Gradebook

    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gb:
        grade = gb.find_grade("test_large_inputs", "softmax", "softmax", "by_hand")
        assert grade.auto_score == 0
        grade.manual_score = 1
        gb.db.commit()
    nbgrader(course, "generate_feedback", "softmax")
    pages = {s: (course / "feedback" / s / "softmax" / "softmax.html").read_text() for s in students}
    return course, source, pages


def soup(page: str) -> BeautifulSoup:
    return BeautifulSoup(page, "html.parser")


def text(page: str) -> str:
    return soup(page).get_text()


def toc_rows(page: str) -> dict:
    """Test name -> (points, result, why) from the table at the top."""
    rows = {}
    for tr in soup(page).select("#toc tbody tr"):
        cells = [td.get_text(" ", strip=True) for td in tr.find_all("td")]
        rows[cells[0]] = tuple(cells[1:])
    return rows


def test_table_names_every_test_with_its_points(feedback):
    _, _, pages = feedback
    assert toc_rows(pages["correct"]) == {name: ("2 / 2", "passed", "") for name in TESTS}
    naive = toc_rows(pages["naive"])
    assert naive["test_large_inputs"][:2] == ("0 / 2", "failed") and "NaN" in naive["test_large_inputs"][2]
    assert naive["test_worked_example"] == ("2 / 2", "passed", "")
    for page in pages.values():
        assert "Test cell" not in text(page)
        links = {a["href"] for a in soup(page).select("#toc a")}
        assert links == {f"#{name}" for name in TESTS}
        anchors = {a.get("id") for a in soup(page).find_all("a")}
        assert set(TESTS) <= anchors  # each link lands on its test cell


def test_each_test_cell_is_headed_by_its_name_and_points(feedback):
    _, _, pages = feedback
    headings = [h.get_text(" ", strip=True) for h in soup(pages["naive"]).select("div.nbgrader_cell .panel-heading")]
    assert any(h.startswith("Test test_large_inputs") and "0 / 2 points" in h for h in headings), headings
    assert any(h.startswith("Test test_dims") and "2 / 2 points" in h for h in headings), headings
    assert "Score: 4 / 10" in text(pages["naive"])


def test_reason_comes_first_and_wraps(feedback):
    _, _, pages = feedback
    page = pages["naive"]
    s = soup(page)
    anchor = s.find("a", id="test_large_inputs")
    panel = anchor.find_parent("div", class_="nbgrader_cell")
    reason = panel.find("div", class_="fp-reason")
    assert "no max subtracted" in reason.get_text() or "NaN" in reason.get_text()
    # the reason sits before the test's source and before any traceback
    parts = [el for el in panel.descendants if getattr(el, "name", None) in ("div", "details", "pre")]
    first_fold = next(i for i, el in enumerate(parts) if el.name == "details")
    assert parts.index(reason) < first_fold
    css = " ".join(st.get_text() for st in s.find_all("style"))
    rule = re.search(r"[^}]*\.fp-reason[^{]*\{[^}]*\}", css).group(0)
    assert "pre-wrap" in rule and "overflow-wrap: anywhere" in rule, rule


def test_tracebacks_keep_only_the_students_frames(feedback):
    _, _, pages = feedback
    for student, page in pages.items():
        t = text(page)
        for internal in ("_core.py", "guard.py", "_student.py", "site-packages", "skipping hidden",
                         "Traceback (most recent call last)"):
            assert internal not in t, (student, internal)
    # an error raised in the student's helper: the student's own lines are shown, torch's are not
    folds = [pre.get_text() for pre in soup(pages["raises"]).select("details.fp-fold pre")
             if "Cell In[" in pre.get_text()]
    assert any("_normalise" in f and "dim=dim + 10" in f for f in folds), folds
    assert "IndexError" in text(pages["raises"])


def test_hidden_tests_source_is_never_shown(feedback):
    _, source, pages = feedback
    hidden = []
    for cell in source.cells:
        m = re.search(r"### BEGIN HIDDEN TESTS\n(.*?)### END HIDDEN TESTS", cell.source, re.S)
        if m:
            hidden += [line.strip() for line in m.group(1).splitlines() if line.strip()]
    assert hidden == []  # softmax is declared: its hidden tier is the re-check's secret cases
    for student, page in pages.items():
        t = text(page)
        assert "HIDDEN TESTS" not in page, student
    # the re-check's failures are shown: they say what kind of input failed (not its values)
    assert "rows around" in text(pages["naive"])


def test_repair_notes_are_shown_to_that_student_only(feedback):
    _, _, pages = feedback
    notes = soup(pages["repaired"]).find(id="notes")
    assert notes is not None
    assert headings(pages["repaired"]) == ["Your notebook was repaired before grading"]
    assert "were put back" in notes.get_text() and "test_dims" in notes.get_text()
    assert toc_rows(pages["repaired"])["test_dims"][:2] == ("2 / 2", "passed")
    assert soup(pages["correct"]).find(id="notes") is None


def headings(page: str) -> list[str]:
    """The headings of the grader's notes at the top of a page, in order."""
    return [h.get_text(strip=True) for h in soup(page).select("#notes h2")]


def test_timeouts_deaths_and_repairs_each_have_their_own_heading(feedback):
    """A time-out is not a repair, nor is a dead kernel: each kind of note under its own heading,
    the later tests of the piece that hung or killed the kernel with it."""
    _, _, pages = feedback
    notes = {s: soup(pages[s]).find(id="notes").get_text(" ", strip=True) for s in ("hangs", "dies")}
    assert headings(pages["hangs"]) == ["Your code ran past its time limit"], notes["hangs"]
    assert f"softmax did not return within {TIMEOUT} s" in notes["hangs"]
    assert "that call softmax failed at once" in notes["hangs"]
    assert headings(pages["dies"]) == ["The kernel died"], notes["dies"]
    assert "in softmax" in notes["dies"] and "that call softmax failed at once" in notes["dies"]
    for student in ("hangs", "dies"):
        assert "repaired" not in notes[student], notes[student]
    assert all(soup(pages[s]).find(id="notes") is None for s in ("correct", "naive", "by_hand"))


def test_no_box_is_empty(feedback):
    """Every error box says what happened in words; the cell interrupted at its time limit says
    so once (KeyboardInterrupt and CellTimeoutError, both without a message, are one box)."""
    _, _, pages = feedback
    for student, page in pages.items():
        for box in soup(page).select("div.fp-reason"):
            label = box.find(class_="fp-label").get_text(strip=True)
            said = box.get_text(strip=True)[len(label):].strip()
            assert label and said, (student, box)
            assert label not in ("KeyboardInterrupt", "CellTimeoutError", "GradingFault"), (student, box)
    boxes = [b.get_text(" ", strip=True) for b in soup(pages["hangs"]).select("div.fp-reason")]
    stopped = [b for b in boxes if b.startswith("Time limit reached")]
    assert stopped == [f"Time limit reached Your softmax did not return within {TIMEOUT} s, so the grader "
                       "interrupted it."], boxes
    assert any(b.startswith("Not run again") for b in boxes), boxes
    # where it was when it was stopped: the student's loop
    assert any("while True" in pre.get_text() for pre in soup(pages["hangs"]).select("details.fp-fold pre"))
    assert any(b.startswith("The kernel died") for b in
               (x.get_text(" ", strip=True) for x in soup(pages["dies"]).select("div.fp-reason")))


def test_a_score_set_by_hand_is_shown_consistently(feedback):
    """1 of 2 points given by hand to a test the automatic grading scored 0: the table, the
    test's box and the total all say 1 / 2, the box says it was set by hand, and no message
    on the page still says "This test scores 0." for that test."""
    _, _, pages = feedback
    page = pages["by_hand"]
    points, result, why = toc_rows(page)["test_large_inputs"]
    assert (points, result) == ("1 / 2", "partly")
    assert why.startswith("Score set by your instructor (the automatic grading gave 0 / 2).") and "NaN" in why, why
    assert "scores 0" not in why
    panel = soup(page).find("a", id="test_large_inputs").find_parent("div", class_="nbgrader_cell")
    said = panel.get_text(" ", strip=True)
    assert "1 / 2 points" in said and "set this test's score by hand: 1 / 2" in said, said
    assert "automatic grading gave 0 / 2" in said and "scores 0" not in said, said
    assert "Score: 5 / 10" in text(page)
    # the other failed tests keep their own words
    other = soup(page).find("a", id="test_minus_inf").find_parent("div", class_="nbgrader_cell")
    assert "This test scores 0." in other.get_text(" ", strip=True)
    assert "set by hand" not in text(pages["naive"]) and "Score set by" not in text(pages["naive"])


def test_notes_are_grouped_by_kind():
    """Each note the grader writes (execute, sanitize, verdicts) falls under the heading of what
    happened; the later tests of a piece go with what the piece did."""
    from firstprinciples.grading.feedback import group_notes, note_kind
    from firstprinciples.grading.verdicts import FORBIDDEN_NOTE

    kinds = {
        "graded as 0: no notebook named 'softmax.ipynb' was submitted": "not graded",
        "try_it_code timed out: softmax did not return within 60 s": "timeout",
        "code cell 7 did not finish within 60 s and was interrupted; what it defined before that was kept": "timeout",
        "softmax did not finish within 60 s and did not stop when interrupted; grading went on in a fresh "
        "kernel without it": "timeout",
        "test_dims: the kernel died (in softmax: it crashed, exited, or went over the memory or CPU limit); "
        "grading went on in a fresh kernel": "died",
        "syntax error in softmax, line 3: expected ':'": "syntax",
        "unanswered: softmax (still as released)": "unanswered",
        FORBIDDEN_NOTE + "softmax calls torch.softmax": "forbidden",
        "missing cells put back from the source: test_dims": "repair",
        "cell 'test_dims' was there twice: the last copy is graded, the other runs as a plain cell": "repair",
        "cell 'test_dims' had been turned into markdown: graded as code again": "repair",
        "cells with unknown ids graded as plain cells: mine": "repair",
        "cells without nbgrader metadata recognised by their content: test_dims": "repair",
        "extra files beside the notebook (the sandboxed kernel does not see them): data.pt": "repair",
        "graded 'softmax-Copy1.ipynb' (the only notebook submitted) as 'softmax.ipynb'": "repair",
        "FLAGGED for an instructor: torch.allclose was replaced": "flag",
        "something new": "other",
    }
    assert {note: note_kind(note) for note in kinds} == kinds
    at_once = "4 later test(s) that call softmax failed at once: test_dims, test_minus_inf"
    died = "try_it_code: the kernel died (in softmax: it crashed); grading went on in a fresh kernel"
    hung = "try_it_code timed out: project_qkv did not return within 60 s"
    groups = group_notes([hung, "missing cells put back from the source: test_dims", died, at_once])
    assert [(g["heading"], len(g["notes"])) for g in groups] == [
        ("Your code ran past its time limit", 1), ("The kernel died", 2),
        ("Your notebook was repaired before grading", 1)], groups
    assert groups[2]["notes"] == ["cells missing from your notebook were put back from the course's copy and "
                                  "graded: test_dims"]


def test_errors_without_a_message_are_put_in_words():
    import nbformat as nbf

    from firstprinciples.grading.feedback import explain_errors

    def error(name, value=""):
        return nbf.v4.new_output("error", ename=name, evalue=value, traceback=[])

    cell = nbf.v4.new_code_cell("loop()", outputs=[error("KeyboardInterrupt"), error("CellTimeoutError")])
    explain_errors(cell, "code cell 4", ["code cell 4 did not finish within 60 s and was interrupted"])
    assert [(o["fp_label"], o["evalue"]) for o in cell.outputs] == [
        ("Time limit reached", "This cell was still running after 60 s, so the grader interrupted it.")]
    # a KeyboardInterrupt the student raised is not a time-out
    cell = nbf.v4.new_code_cell("raise KeyboardInterrupt", outputs=[error("KeyboardInterrupt")])
    explain_errors(cell, "code cell 2", [])
    assert cell.outputs[0]["evalue"] == "KeyboardInterrupt was raised without a message."
    cell = nbf.v4.new_code_cell("softmax(x)", outputs=[error("NotImplementedError")])
    explain_errors(cell, "try_it_code", [])
    assert "placeholder" in cell.outputs[0]["evalue"]
    # deaf to the interrupt: the grader's own words, with where the code was
    stuck = error("KeyboardInterrupt")
    stuck["traceback"] = ["Cell In[3], line 2\n----> 2 while True: pass"]
    fault = "This cell did not finish within 60 s and did not stop when interrupted. Grading went on with a fresh kernel."
    cell = nbf.v4.new_code_cell("loop()", outputs=[stuck, error("CellTimeoutError"), error("GradingFault", fault)])
    explain_errors(cell, "code cell 4", [])
    assert [(o["fp_label"], o["evalue"], o["traceback"]) for o in cell.outputs] == [
        ("Time limit reached", fault, stuck["traceback"])]
    labels = {
        "The kernel died while running this cell (it crashed, exited, went over the memory limit or used up its "
        "CPU time). Grading went on with a fresh kernel from the next cell.": "The kernel died",
        "Your softmax killed the kernel (it crashed or went over the memory limit) in try_it_code. This test, "
        "which calls it, fails at once (it would only do the same again).": "Not run again",
        "Your softmax did not return within 60 s in try_it_code. This test, which calls it, fails at once (it "
        "would only do the same again).": "Not run again",
        "Not run: this notebook used up its 300 s of grading time (an earlier cell hung or was very slow).": "Not run",
        "Not run: the notebook crashed its kernel too many times.": "Not run",
    }
    for value, label in labels.items():
        cell = nbf.v4.new_code_cell("x", outputs=[error("GradingFault", value)])
        explain_errors(cell, "test_dims", [])
        assert (cell.outputs[0]["fp_label"], cell.outputs[0]["evalue"]) == (label, value)
    cell = nbf.v4.new_code_cell("def f(:", outputs=[error("SyntaxError", "invalid syntax (1648086921.py, line 3)")])
    explain_errors(cell, "softmax", [])
    assert cell.outputs[0]["evalue"] == "invalid syntax (line 3)"


def test_exactness_failure_prints_the_exact_value(feedback):
    _, _, pages = feedback
    t = html.unescape(text(pages["epsilon"]))
    assert "0.9999999989999999" in t and "must be exactly 1" in t, t[-3000:]
    assert not re.search(r"= 1 [^\n]*must be exactly 1", t)


def test_trusted_recheck_failure_is_shown(feedback):
    _, _, pages = feedback
    page = pages["fools"]
    rows = toc_rows(page)
    assert all(rows[name][1] == "failed" for name in TESTS), rows
    assert "Failed the grader's re-check" in text(page)
    assert "re-check" in rows["test_worked_example"][2]


def test_math_is_mathml_and_nothing_is_fetched(feedback):
    _, _, pages = feedback
    for student, page in pages.items():
        s = soup(page)
        assert s.find_all("script") == [], student
        assert not re.search(r"""<(script|link|img|iframe)[^>]+(src|href)=["']?(https?:)?//""", page), student
        assert "mathjax" not in page.lower(), student
        math = s.find_all("math")
        assert math and any(m.get("display") == "block" and m.find("mfrac") for m in math), student
        assert "\\frac" not in s.get_text() and "$$" not in s.get_text(), student


def test_latex_to_mathml_units():
    from firstprinciples.grading.feedback import FeedbackExporter, mathml

    assert mathml(r"\sqrt{d_k}", display=False).startswith('<math xmlns="http://www.w3.org/1998/Math/MathML" '
                                                          'display="inline">')
    assert "<code" in mathml(r"\notamacro{", display=True)  # unknown TeX stays readable
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "Inline $QK^\\top$, a block\n\n$$\\mathrm{softmax}(x)_i = \\frac{e^{x_i}}{\\sum_j e^{x_j}}$$\n\n"
        "and `$not math$` in code.")])
    body, _ = FeedbackExporter().from_notebook_node(nb, resources={"nbgrader": {"notebook": "n", "score": 0,
                                                                              "max_score": 0, "late_penalty": 0}})
    assert body.count("<math") == 2 and "<code>$not math$</code>" in body


def test_frames_of_course_internals_are_cut():
    from firstprinciples.grading import feedback as fb

    package = Path(fb.__file__).resolve().parents[1]
    cell = nbformat.v4.new_code_cell("checks.check_dims(softmax, full=False)\n### BEGIN HIDDEN TESTS\n"
                                     "checks.check_dims(softmax)\n### END HIDDEN TESTS")
    cell.metadata["nbgrader"] = {"grade": True, "solution": False, "grade_id": "test_dims", "points": 2}
    answer = nbformat.v4.new_code_cell("def softmax(x, dim=-1):\n    y = x * 2\n    return y.sum(dim=9)")
    traceback = [
        "\x1b[0;31m---------------------------------------------------------------------------\x1b[0m",
        "IndexError                                Traceback (most recent call last)",
        "Cell \x1b[0;32mIn[7], line 3\x1b[0m\n      1 checks.check_dims(softmax, full=False)\n"
        "      2 ### BEGIN HIDDEN TESTS\n\x1b[0;32m----> 3\x1b[0m checks.check_dims(softmax)\n"
        "      4 ### END HIDDEN TESTS\n",
        f"File \x1b[0;32m{package}/checks/_core.py:170\x1b[0m, in \x1b[0;36mcall_answer\x1b[0m(fn)\n"
        "    169 copies = 1\n--> 170 result = call_without(fn)\n",
        f"File {package}/guard.py:88, in call_without(fn)\n---> 88 return fn(*args)\n",
        "    [... skipping hidden 1 frame]\n",
        "Cell In[3], line 3, in softmax(x, dim)\n      1 def softmax(x, dim=-1):\n      2     y = x * 2\n"
        "----> 3     return y.sum(dim=9)\n",
        "File /usr/lib/python3/dist-packages/torch/_tensor.py:10, in sum()\n",
        "\x1b[0;31mIndexError\x1b[0m: Dimension out of range",
    ]
    frames = fb.student_frames(traceback, cell, [cell, answer], {"checks.check_dims(softmax)"})
    shown = "\n".join(frames)
    assert "_core.py" not in shown and "guard.py" not in shown and "torch" not in shown
    assert "checks.check_dims(softmax)" not in shown.replace("check_dims(softmax, full", "")
    assert "(a hidden test)" in shown and "HIDDEN" not in shown
    assert "return y.sum(dim=9)" in shown and "y = x * 2" in shown
    assert "Traceback" not in shown and "Dimension out of range" not in shown  # the reason is shown on its own
    # only the test cell's own line left: nothing worth a traceback
    assert fb.student_frames(traceback[:3] + traceback[-1:], cell, [cell], set()) == []
    assert fb.strip_hidden(cell.source) == "checks.check_dims(softmax, full=False)\n" + fb.HIDDEN_PLACEHOLDER


def test_every_formula_of_the_course_becomes_mathml():
    """latex2mathml knows every macro the released notebooks use (else the TeX is shown as code)."""
    from nbconvert.filters.markdown_mistune import MarkdownWithMath

    from course import released_notebooks
    from firstprinciples.grading.feedback import MathMLRenderer

    count = 0
    for path in released_notebooks():
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                out = MarkdownWithMath(renderer=MathMLRenderer(escape=False)).render(cell.source)
                assert 'class="fp-tex"' not in out, (path.name, cell.source[:300])
                count += out.count("<math")
    assert count >= 20


def test_template_ships_with_the_package():
    import fnmatch
    import tomllib

    from firstprinciples.grading.feedback import TEMPLATES

    root = Path(__file__).resolve().parents[2]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "firstprinciples.grading"]
    files = [p.relative_to(Path(TEMPLATES).parent).as_posix() for p in Path(TEMPLATES).rglob("*") if p.is_file()]
    assert {"templates/student_feedback/index.html.j2", "templates/student_feedback/conf.json"} <= set(files)
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files), (files, patterns)


def test_template_is_not_git_ignored():
    """The template must reach git: .gitignore's nbgrader output folder must not match it."""
    import shutil
    import subprocess

    from firstprinciples.grading.feedback import TEMPLATES

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    template = Path(TEMPLATES, "student_feedback", "index.html.j2").relative_to(root)
    ignored = subprocess.run(["git", "check-ignore", "-v", str(template)], cwd=root, capture_output=True, text=True)
    assert ignored.returncode == 1, f"{template} is ignored by git: {ignored.stdout.strip()}"
