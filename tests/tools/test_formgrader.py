"""Formgrader's autograde button, with the repo's nbgrader_config.py (``firstprinciples.grading.formgrader``).

A headless ``jupyter server`` (the formgrader is one of its extensions) runs in a
temporary course. Its autograde API is called for a student whose notebook
sleeps for ``SLEEP`` seconds, and while that submission is graded the test times
other requests (a formgrader API page and a JupyterLab/server API page): every
one must answer within ``LATENCY`` seconds. The same is done with nbgrader's
stock handler (the config block left out), which must block (the test can fail).
The answer the dialog shows must be a short summary: score and notes, no log.
"""
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import nbformat
import pytest

import docpages
from course import SOLUTIONS, fill, make_course, nbgrader, scratch, solution_answers

ASSIGNMENT = NOTEBOOK = "softmax"
SLEEP = 6  # seconds the student's extra cell sleeps; grading takes about SLEEP + 4 s
LATENCY = 1.0  # seconds any other request may take while a submission is graded
BLOCK = "# ---- exchange and formgrader (firstprinciples.grading.exchange / .formgrader) ----"
TOKEN = "fp-test-token"
# Pages asked for while grading: formgrader's own (the list of submissions reads the gradebook
# that the grader is writing) and the Jupyter server's (what JupyterLab polls).
PAGES = ("/formgrader/api/status", f"/formgrader/api/submissions/{ASSIGNMENT}", "/formgrader", "/api/contents",
         "/api/kernelspecs")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(base, path, method="GET", timeout=300):
    req = urllib.request.Request(base + path, method=method, data=b"" if method == "POST" else None,
                                 headers={"Authorization": f"token {TOKEN}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status, r.read().decode()


def prepare(tmp, stock=False):
    """A course with one released assignment and a slow, correct submission from ``sleepy``
    (who also left a file beside the notebook, so that there is a note to show)."""
    course = make_course(tmp)
    if stock:  # the repo's config without this block: nbgrader's own handler
        config = course / "nbgrader_config.py"
        text = config.read_text()
        config.write_text(text[:text.index(BLOCK)])
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    released = nbformat.read(course / "exercises" / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)
    nb = fill(released, solution_answers(nbformat.read(SOLUTIONS / ASSIGNMENT / f"{NOTEBOOK}.ipynb", as_version=4)))
    nb.cells.insert(1, nbformat.v4.new_code_cell(f"import time\ntime.sleep({SLEEP})  # a slow student"))
    folder = course / "submitted" / "sleepy" / ASSIGNMENT
    folder.mkdir(parents=True)
    nbformat.write(nb, folder / f"{NOTEBOOK}.ipynb")
    (folder / "scratch.py").write_text("x = 1\n")
    return course


def start_server(course, extra_env=None):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBGRADER")}
    env.update(extra_env or {})
    scratch(course).mkdir(exist_ok=True)
    env.update(TMPDIR=str(scratch(course)), JUPYTER_RUNTIME_DIR=str(scratch(course) / "runtime"))
    log = open(course.parent / "server.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "server", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
         f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={course}", "--allow-root"],
        cwd=course, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if request(base, "/formgrader/api/status", timeout=5)[0] == 200:
                return proc, base
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (course.parent / "server.log").read_text()[-4000:]
        time.sleep(0.5)


def autograde_while_timing(course):
    """POST the autograde of ``sleepy``; while it runs, time GETs of other pages.
    Returns (the POST's status, body and seconds; [(path, seconds) of each GET asked for while it ran])."""
    proc, base = start_server(course)
    try:
        answer = {}

        def post():
            t0 = time.monotonic()
            path = f"/formgrader/api/submission/{ASSIGNMENT}/sleepy/autograde"
            answer["status"], answer["body"] = request(base, path, method="POST")
            answer["seconds"] = time.monotonic() - t0

        poster = threading.Thread(target=post)
        poster.start()
        timings = []
        while poster.is_alive():
            # the submission is being graded once its autograded folder exists
            if (course / "autograded" / "sleepy").exists():
                for path in PAGES:
                    if not poster.is_alive():
                        break
                    t0 = time.monotonic()  # asked for while the submission is being graded
                    try:
                        request(base, path, timeout=120)
                    except OSError as exc:  # a refused or failed request also counts as slow
                        path = f"{path} ({exc})"
                    timings.append((path, time.monotonic() - t0))
            time.sleep(0.3)
        poster.join()
        return answer, timings
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return autograde_while_timing(prepare(tmp_path_factory.mktemp("formgrader")))


@pytest.fixture(scope="module")
def stock(tmp_path_factory):
    return autograde_while_timing(prepare(tmp_path_factory.mktemp("formgrader-stock"), stock=True))


def test_server_answers_while_grading(ours):
    answer, timings = ours
    assert answer["seconds"] > SLEEP  # the submission really was slow ...
    assert len(timings) >= 6, timings  # ... and other requests were made while it was graded
    slow = [(p, round(s, 2)) for p, s in timings if s >= LATENCY]
    assert not slow, f"requests slower than {LATENCY} s while grading: {slow}"


def test_stock_handler_blocks_the_server(stock):
    """What the replacement fixes: nbgrader's handler grades on the event loop."""
    answer, timings = stock
    assert answer["status"] == 200
    assert max(s for _, s in timings) > SLEEP / 2, timings


def test_dialog_shows_score_and_notes(ours):
    answer, _ = ours
    result = json.loads(answer["body"])
    assert result["success"] is True, result.get("error")
    top = result["max_score"]
    assert top > 0 and result["score"] == top
    log = result["log"]
    assert log.startswith(f"Score: {top:g} / {top:g}\n")
    assert f"{NOTEBOOK}.ipynb: {top:g} / {top:g}" in log
    assert re.search(r"Notes:\n  - softmax\.ipynb: extra files beside the notebook .*scratch\.py", log), log
    assert "DEBUG" not in log and "[INFO]" not in log and len(log) < 1000, log


def test_stock_dialog_is_a_log(stock):
    """nbgrader's dialog text: the captured log, no score."""
    result = json.loads(stock[0]["body"])
    assert "Score:" not in result.get("log", "") and "[INFO]" in result.get("log", "")


def test_the_exchange_set_up_as_documented_opens_the_formgrader_without_a_warning(tmp_path):
    """The exchange set-up of docs/instructors/grading-round.md, run as written (in a folder of the
    test's own instead of /srv): the formgrader opens without nbgrader's "exchange directory does not
    exist" warning and release_assignment writes there. A folder that cannot be made shows it."""
    setup = next(b for b in docpages.code_blocks(docpages.text(), "bash") if "FP_EXCHANGE=" in b)
    exchange = tmp_path / "srv" / "exchange"
    subprocess.run(["bash", "-ec", setup.replace("/srv/nbgrader/exchange", str(exchange))], check=True)
    assert exchange.is_dir() and exchange.stat().st_mode & 0o666 == 0o666
    course = make_course(tmp_path)
    nbgrader(course, "generate_assignment", ASSIGNMENT, "--force")
    (tmp_path / "not-a-folder").write_text("")
    pages = {}
    for label, root in (("set up", exchange), ("impossible", tmp_path / "not-a-folder" / "exchange")):
        proc, base = start_server(course, {"FP_EXCHANGE": str(root)})
        try:
            pages[label] = request(base, "/formgrader/manage_assignments")[1]
        finally:
            proc.terminate()
            proc.wait(30)
    assert 'id="warning-exchange"' not in pages["set up"]
    assert 'id="warning-exchange"' in pages["impossible"]  # (the check can fail)
    nbgrader(course, "release_assignment", ASSIGNMENT, env={"FP_EXCHANGE": str(exchange)})
    assert list(exchange.glob(f"*/outbound/{ASSIGNMENT}/{NOTEBOOK}.ipynb"))
