"""An nbgrader ``Execute`` preprocessor for which a fault costs only the faulty cell.

Stock nbgrader runs a notebook in one kernel: an infinite loop that ignores
interrupts, ``os._exit``, a segfault or the memory limit ends the kernel (or
leaves it stuck), and the rest of the notebook, every later test included,
fails or the student's grading is aborted. ``RobustExecute`` instead:

- runs the cells one by one; when a cell times out and the kernel does not
  answer a short probe afterwards, or when the kernel dies, that cell gets an
  error output that says what happened (so a test cell scores 0 with that
  reason in the feedback);
- starts a fresh kernel, replays the cells before it that ran without a fault
  (setup and answer cells; test cells are not replayed), and goes on with the
  next cell;
- caps the output a single cell may produce (``max_output_bytes``): beyond it
  the output is cut, with a note, so a gigabyte of printing cannot exhaust the
  grader's memory or the gradebook;
- gives a notebook a time budget (``notebook_timeout``): once it is spent, the
  cells left are not run (each says why), so one answer that hangs on every call
  costs minutes, not a worker's afternoon;
- remembers a graded piece that hung: once a test cell timed out inside ``softmax``
  (named by the interrupted traceback, or the only piece the cell tests), every later
  test cell that tests only hung pieces fails at once ("softmax did not return within
  60 s in test_dims") instead of waiting for its own timeout, the re-check does not
  run that piece again, and a cell that ran past its timeout is re-checked with a
  short limit; each is a note for the student and in ``grades.csv``;
- after the last cell, runs the trusted re-check (``firstprinciples.grading.trusted``)
  in a fresh sandboxed interpreter, never in the student's kernel, and makes its
  verdict final in every test cell. Before it, for a piece the notebook trains (the
  capstone's ``model``), one more cell, not part of the notebook, prints the trained
  parameters, which the re-check loads into the student's own class instead of training
  it a second time (``kernelstate``).

Selected in ``nbgrader_config.py`` (``c.Autograde.autograde_preprocessors``).
"""
from __future__ import annotations

import copy
import os
import re
import threading
from pathlib import Path

from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Bool, Float, Integer

from . import folderwatch, here, kernelstate, scan, trusted, verdicts, warm
from .notes import add_note

FAULT_NAME = "GradingFault"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _error(evalue: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=FAULT_NAME, evalue=evalue,
                        traceback=[f"\x1b[0;31m{FAULT_NAME}\x1b[0m: {evalue}"])


class RobustExecute(Execute):
    probe_timeout = Integer(15, help="Seconds a kernel has to answer a trivial request after a timeout.").tag(config=True)
    max_output_bytes = Integer(200_000, help="Largest output (in characters) kept for one cell.").tag(config=True)
    max_notebook_output_bytes = Integer(2_000_000, help="Largest output (in characters) kept for all the cells of "
                                        "a notebook that are not graded tests together (a graded test keeps its own "
                                        "cap, so its verdict is never crowded out).").tag(config=True)
    max_restarts = Integer(10, help="Fresh kernels at most per notebook; after that the remaining cells fail.").tag(config=True)
    trusted_verdicts = Bool(True, help="Re-check graded objects outside the kernel (firstprinciples.grading.trusted).").tag(config=True)
    notebook_timeout = Integer(300, help="Seconds of cell execution one notebook may use; later cells are not run.").tag(config=True)
    dependent_timeout = Integer(10, help="Seconds a course cell may run once a graded piece that it calls through "
                                "another one has hung (MultiHeadAttention using a merge_heads that did not return): "
                                "it runs, with this shorter limit, instead of waiting for the whole cell timeout "
                                "again.").tag(config=True)
    recheck_timeout = Float(300.0, help="Seconds the trusted re-check of one notebook may use in all.").tag(config=True)
    recheck_piece_timeout = Float(120.0, help="Seconds the trusted re-check may spend on one piece (watched, code with many small torch calls runs several times slower than in the kernel).").tag(config=True)
    recheck_service = Bool(None, allow_none=True, help="Make the trusted re-check's decisions in a child of "
                           "the warm template (verdicts.Service) instead of this process, which then never imports "
                           "torch. Default: wherever kernels are warm (warm.available()).").tag(config=True)

    # ------------------------------------------------------------ output cap
    def _count(self, cell_index: int, msg: dict) -> bool:
        """Count a message's whole content (text, data, metadata, error name, value and traceback)
        against the cell's cap; False once the cell is over it."""
        size = self._output_sizes.get(cell_index, 0)
        if size > self.max_output_bytes:
            return False
        content = msg.get("content", {})
        added = sum(len(str(v)) for v in content.values())
        self._output_sizes[cell_index] = size + added
        if not self._is_test(cell_index):
            self._untested_total += added
            if self._untested_total > self.max_notebook_output_bytes:
                self._cut_for_notebook.add(cell_index)
                return False
        return size + added <= self.max_output_bytes

    def _is_test(self, cell_index: int) -> bool:
        try:
            meta = self.nb.cells[cell_index].metadata.get("nbgrader", {})
        except (IndexError, AttributeError):
            return False
        return isinstance(meta, dict) and bool(meta.get("grade")) and not meta.get("solution")

    def output(self, outs, msg, display_id, cell_index):
        if not self._count(cell_index, msg):
            if not self._cut.get(cell_index):
                self._cut[cell_index] = True
                if cell_index in self._cut_for_notebook:
                    note = (f"\n[output cut: the notebook's cells printed more than {self.max_notebook_output_bytes:,} "
                            "characters in all; the rest was dropped by the grader]\n")
                else:
                    note = (f"\n[output cut: this cell printed more than {self.max_output_bytes:,} characters; "
                            "the rest was dropped by the grader]\n")
                outs.append(NotebookNode(output_type="stream", name="stderr", text=note))
            return None
        return super().output(outs, msg, display_id, cell_index)

    def on_cell_executed(self, **kwargs):
        """nbgrader adds the reply's error when the cell's own error output is missing (here: when
        it was cut): keep it, so the cell still fails, but cut to what fits under the cap."""
        before = len(kwargs["cell"].outputs)
        super().on_cell_executed(**kwargs)
        limit = 2_000
        for out in kwargs["cell"].outputs[before:]:
            if out.get("output_type") == "error":
                out["evalue"] = _cut(str(out.get("evalue", "")), limit)
                out["traceback"] = [_cut(str(t), limit) for t in list(out.get("traceback", []))[-5:]]

    def process_message(self, msg, cell, cell_index):
        # A message with a display id rewrites every earlier output with that id (in any cell)
        # before ``output`` sees it, and update_display_data never reaches ``output``: count them here.
        content = msg.get("content", {})
        transient = content.get("transient") or {}
        if (msg.get("msg_type") in ("update_display_data", "display_data", "execute_result")
                and transient.get("display_id") and not self._count(cell_index, msg)):
            return None
        return super().process_message(msg, cell, cell_index)

    # ------------------------------------------------------------ execution
    def preprocess(self, nb, resources=None, km=None):
        here.mark_grading()  # (the kernels started from now on: a notebook's every_test() cell does nothing)
        NotebookClient.__init__(self, nb, km)
        self.reset_execution_trackers()
        self._check_assign_resources(resources)
        self._output_sizes: dict[int, int] = {}
        self._untested_total = 0
        self._cut_for_notebook: set[int] = set()
        self._cut: dict[int, bool] = {}
        self._restarts = 0
        self._budget_end = None
        self._cell_limit = self.timeout
        self._timed_out = False  # the last cell run went past its timeout
        # graded piece -> the course cell it did not return in ([cell, seconds] when that cell had the
        # shorter dependent_timeout)
        self._hung: dict[str, str | list] = {}
        self._died: dict[str, str] = {}  # graded piece -> the course cell whose call of it killed the kernel
        self._slow: set[int] = set()  # indices of non-test cells that ran past their timeout
        self._seconds: dict[int, float] = {}  # test cell index -> seconds it took in the kernel
        self._tested = None  # test cell index -> the pieces it uses, once asked for (``_cells``)
        self._infos = None  # the notebook's cells, parsed, once a piece has hung (``_calls_hung``)
        self._seed = self._sources = None  # the re-check's seed and the course's sources (_plan_inputs)
        run_sync(self._execute_all)()
        return self.nb, self.resources

    async def _execute_all(self) -> None:
        clean: list[int] = []  # cells that ran without a fault, to replay after a restart
        import time

        self._budget_end = time.monotonic() + self.notebook_timeout
        self._service = None  # started with the first kernel (async_start_new_kernel)
        self._service_starting = None  # the thread that starts it, until it is joined
        self._abandoned = False  # the service was told to stop the re-check it started ahead
        self._want_service = self.trusted_verdicts and (
            warm.available() if self.recheck_service is None else self.recheck_service)
        known: dict = {}

        def tested() -> dict:
            """Test cell index -> the pieces it tests (asked for only once a cell timed out)."""
            if "tested" not in known:
                known["tested"] = self._service_call(lambda s: s.tested(), lambda: verdicts.tested_pieces(self.nb))
            return known["tested"]

        self._tested = tested
        failed_at_once: dict[str, list] = {}  # hung piece -> the later test cells that failed at once
        try:
            async with self.async_setup_kernel():
                await self._cells(tested, failed_at_once, clean)
        finally:
            if self._started_service() is not None:
                self._service.release()  # (kept for this process's next notebook)
                self._service = None
        self.set_widgets_metadata()
        self._note_zeros()

    def _note_zeros(self) -> None:
        """A note for what makes a zero without saying why in grades.csv: a cell Python cannot read
        (its cell and line) and an answer cell left as released (``raise NotImplementedError``).
        Read from what the kernel said when it compiled each cell (no second compilation here)."""
        position = 0
        for cell in self.nb.cells:
            if cell.cell_type != "code":
                continue
            position += 1
            for out in cell.get("outputs", []):
                if out.get("output_type") == "error" and out.get("ename") in _UNREADABLE:
                    found = _WHERE.search(str(out.get("evalue", "")))
                    msg = _WHERE.sub("", str(out.get("evalue", ""))).strip()
                    line = f", line {found.group(1)}" if found else ""
                    self._add_note(f"syntax error in {_grade_id(cell) or f'code cell {position}'}{line}: {msg}")
                    break
        left = [_grade_id(c) for c in self.nb.cells if c.cell_type == "code"
                and c.get("metadata", {}).get("nbgrader", {}).get("solution")
                and "raise NotImplementedError" in c.source and _grade_id(c)]
        if left:
            self._add_note(f"unanswered: {', '.join(left)} (still as released)")

    async def async_start_new_kernel(self, **kwargs) -> None:
        await super().async_start_new_kernel(**kwargs)
        if self._want_service:  # forked by the template right after the kernel, it gets ready beside it
            self._want_service = False
            # In a thread, while the first cells run: a grading command's template may be busy with
            # what it does when idle (``warm._prepare_recheck``: 0.3 s) before it forks the service. The thread
            # only waits on the template and writes the notebook to the service, from a copy
            # made here, before any cell has run.
            nb = copy.deepcopy(self.nb)

            def start():
                self._service = self._start_service(nb)

            self._service_starting = threading.Thread(target=start, name="fp-start-service", daemon=True)
            self._service_starting.start()

    def _started_service(self):
        """The service, once the thread that starts it is done (None where it could not start)."""
        if self._service_starting is not None:
            self._service_starting.join()
            self._service_starting = None
        return self._service

    def _plan_inputs(self) -> tuple[int, set | None]:
        """(the re-check's seed, the course's own cell sources) for this notebook, drawn once."""
        if self._seed is None:
            root, source = self._course()
            self._sources = trusted.course_sources(source) if source is not None else None
            self._seed = trusted.seed_for(self.resources, root)
        return self._seed, self._sources

    def _start_service(self, nb):
        try:  # (the re-check starts there at once, on the guess that no cell will time out: see _abandon_ahead)
            return verdicts.Service.begin(nb, *self._plan_inputs(), template=self._sandboxed(),
                                          ahead=(self._cell_limit, self._limits(), self._sandboxed()))
        except verdicts.ServiceError as e:
            warm._cold_note(e)
            return None

    def _service_call(self, there, here):
        """``there(service)``; where there is no service or it failed, ``here()`` in this process."""
        if self._started_service() is not None:
            try:
                return there(self._service)
            except verdicts.ServiceError as e:
                warm._cold_note(e)
                self._service.close()
                self._service = None
        return here()

    async def _cells(self, tested, failed_at_once: dict, clean: list) -> None:
        import time

        await self._kernel_info()
        for index, cell in enumerate(self.nb.cells):
            if cell.cell_type != "code":
                continue
            if self._restarts > self.max_restarts:
                cell.outputs = [_error("Not run: the notebook crashed its kernel too many times.")]
                continue
            if time.monotonic() >= self._budget_end:
                cell.outputs = [_error(f"Not run: this notebook used up its {self.notebook_timeout} s of grading "
                                       "time (an earlier cell hung or was very slow).")]
                continue
            pieces = (tested().get(index) or []) if (self._hung or self._died) else []
            if pieces and all(p in self._hung or p in self._died for p in pieces):
                cell.outputs = [_error(self._hung_reason(pieces) + " This test, which calls it, fails at once "
                                       "(it would only do the same again).")]
                for p in pieces:
                    failed_at_once.setdefault(p, []).append(_grade_id(cell) or f"cell {index + 1}")
                continue
            started = time.monotonic()
            waits_on = self._calls_hung(cell, index, tested) if self._hung else []
            fault = await self._run(cell, index, self.dependent_timeout if waits_on else None)
            if cell.get("metadata", {}).get("nbgrader", {}).get("grade", False) and fault is None \
                    and not self._timed_out:
                self._seconds[index] = time.monotonic() - started  # (slow tests: their piece's re-check gets more)
            if self._timed_out:
                pieces = tested().get(index) or []
                all_pieces = sorted({p for ps in tested().values() for p in ps})
                self._note_timeout(cell, index, pieces, all_pieces, stopped=fault is None, waits_on=waits_on)
                if self._hung or self._slow:
                    self._abandon_ahead()
            elif fault is not None:
                why = folderwatch.reason(getattr(self.km, "_own_folder", None))
                culprit = [] if why else self._died_in(cell, index, tested)
                self._add_note(f"{_grade_id(cell) or f'code cell {index + 1}'}: the kernel died ("
                               + (f"the grader stopped it: {why}" if why else
                                  (f"in {culprit[0]}: " if culprit else "")
                                  + "it crashed, exited, or went over the memory or CPU limit")
                               + "); grading went on in a fresh kernel")
            if fault is None:
                if not cell.get("metadata", {}).get("nbgrader", {}).get("grade", False):
                    clean.append(index)
                continue
            cell.outputs.append(_error(fault))
            await self._fresh_kernel(clean)
        for piece, cells in failed_at_once.items():
            self._add_note(f"{len(cells)} later test(s) that call {piece} failed at once: {', '.join(cells)}")
        if self.trusted_verdicts:
            await self._trusted_recheck(clean, await self._kernel_states())

    # ------------------------------------------------------------ hangs
    def _hung_reason(self, pieces) -> str:
        said = [f"Your {p} did not return within {within} s in {where}" for p in pieces if p in self._hung
                for where, within in (self._hung[p] if isinstance(self._hung[p], list) else
                                      [self._hung[p], self._cell_limit],)]
        said += [f"Your {p} killed the kernel (it crashed or went over the memory limit) in {self._died[p]}"
                 for p in pieces if p in self._died and p not in self._hung]
        return "; ".join(said) + "."

    def _calls_hung(self, cell, index: int, tested) -> list:
        """The hung pieces that a course cell (a test, or a locked cell such as "try it") reaches
        through the pieces it calls: those defined in the cells its pieces depend on (by the names
        the cells use, ``scan.dependencies``), other than the pieces themselves. Such a cell runs
        with ``dependent_timeout``: what it does still decides, only the wait is shorter."""
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if not (meta.get("grade") or meta.get("locked")) or meta.get("solution"):
            return []
        all_pieces = {p for ps in tested().values() for p in ps}
        pieces = set(tested().get(index) or [])
        if not pieces:
            tree = scan.parse(cell.source)
            pieces = (scan.loaded_names(tree) & all_pieces) if tree is not None else set()
        if not pieces or all(p in self._hung for p in pieces):
            return []
        if self._infos is None:
            self._infos = scan.cell_infos(self.nb)
        reached = set()
        for p in pieces - set(self._hung):
            for info in scan.dependencies(self._infos, p):
                reached |= info.defines
        return sorted((reached & set(self._hung)) - pieces)

    def _died_in(self, cell, index: int, tested) -> list:
        """The kernel died while a course cell (a test, or a locked cell such as "try it") ran: the
        graded piece it calls, when it calls exactly one, is remembered (``_died``), so that every
        later test that calls only such pieces fails at once instead of killing a kernel again
        (a piece that fills the memory took a minute each time). A cell of the student's says
        nothing of the piece: its inputs are the student's."""
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if not (meta.get("grade") or meta.get("locked")) or meta.get("solution"):
            return []
        pieces = list(tested().get(index) or [])
        if not pieces:
            all_pieces = sorted({p for ps in tested().values() for p in ps})
            tree = scan.parse(cell.source)
            pieces = sorted(scan.loaded_names(tree) & set(all_pieces)) if tree is not None else []
        if len(pieces) != 1:
            return []
        self._died.setdefault(pieces[0], _grade_id(cell) or f"code cell {index + 1}")
        return pieces

    def _note_timeout(self, cell, index: int, pieces: list, all_pieces: list, stopped: bool = True,
                      waits_on: list = ()) -> None:
        """A cell ran past its timeout: remember the graded pieces that did not return (the
        innermost one in the interrupted traceback, and, when the cell reached a piece that had
        hung already, every one it went through; else the only graded piece the cell calls), or
        else the cell itself, and say so in the notes. ``stopped``: the interrupt stopped it (False: the
        kernel had to be replaced); ``waits_on``: the hung pieces it reaches, for which it ran with
        the shorter ``dependent_timeout``."""
        gid = _grade_id(cell)
        where = gid or f"code cell {index + 1}"
        text = _ANSI.sub("", "\n".join(t for o in cell.get("outputs", []) if o.get("output_type") == "error"
                                        for t in o.get("traceback", [])))
        inner = [f for f in re.findall(r"\bin (\w+)", text) if f in all_pieces]
        if not pieces:  # a cell that is not a test: the graded pieces its code calls
            tree = scan.parse(cell.source)
            pieces = sorted(scan.loaded_names(tree) & set(all_pieces)) if tree is not None else []
        # (after a shorter wait for a piece that had hung, every piece the interrupted call went
        # through: MultiHeadAttention waiting in its merge_heads. Otherwise the innermost only: an
        # outer piece may well return on other inputs, its earlier cells keep their verdicts.)
        culprit = ((list(dict.fromkeys(reversed(inner))) if waits_on else [inner[-1]]) if inner
                   else (pieces if len(pieces) == 1 else []))
        # Only the course's own cells (tests, and locked cells such as "try it", which nbgrader
        # restores from the instructor's notebook) say that a piece hangs: their inputs are the
        # course's. A cell of the student's may just call it on something huge.
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if culprit and (meta.get("grade") or meta.get("locked")) and not meta.get("solution"):
            for p in culprit:
                if p not in self._hung:
                    self._hung[p] = where if not waits_on else [where, self.timeout]  # (where, the shorter limit)
            self._add_note(f"{where} timed out: {', '.join(culprit)} did not return within {self.timeout} s"
                           + (f" (a shorter limit: it calls {', '.join(waits_on)}, which had hung)" if waits_on else ""))
            return
        if not meta.get("grade"):
            self._slow.add(index)  # the re-check loads it with a short limit (and a replay, if stopped)
        if not stopped:
            self._add_note(f"{where} did not finish within {self.timeout} s and did not stop when interrupted; "
                           "grading went on in a fresh kernel without it")
            return
        self._add_note(f"{where} did not finish within {self.timeout} s and was interrupted"
                       + ("" if meta.get("grade") else "; what it defined before that was kept"))

    def _add_note(self, text: str) -> None:
        if (self.resources or {}).get("nbgrader", {}).get("student"):
            add_note(self.log, self.resources, text)

    # ------------------------------------------------------------ the trusted re-check
    def _course(self):
        """(course root, the instructor's source notebook) when grading a course, else (None, None)."""
        info = (self.resources or {}).get("nbgrader", {})
        if not info.get("assignment") or not info.get("notebook"):
            return None, None
        root = Path(os.getcwd())  # nbgrader's converters run in the course root
        source_dir = self.config.get("CourseDirectory", {}).get("source_directory", "source")
        return root, root / source_dir / info["assignment"] / f"{info['notebook']}.ipynb"

    def _sandboxed(self) -> bool:
        return self.kernel_name == "fp-sandbox"

    def _limits(self):
        """The re-check's limits; a piece whose test cells were slow in the kernel gets more time, as
        many times theirs as the watch may cost (``trusted.slow_in_kernel``: the guess made before the
        cells ran has none, so a notebook without a slow test keeps the re-check started ahead)."""
        kernel = {}
        if self._tested is not None and trusted.WATCH_FACTOR * sum(self._seconds.values()) > self.recheck_piece_timeout:
            kernel = trusted.slow_in_kernel(self._seconds, self._tested(), self.recheck_piece_timeout)
        return trusted.Limits(piece=self.recheck_piece_timeout, total=self.recheck_timeout, kernel=kernel)

    def _abandon_ahead(self) -> None:
        """A piece did not return or a cell ran past its timeout: the re-check that the service
        started beside the cells, on the guess that neither would happen, is stopped now (it runs
        again, told so, once the cells are done)."""
        if self._abandoned:
            return
        self._abandoned = True
        if self._started_service() is not None:
            try:
                self._service.abandon()
            except verdicts.ServiceError as e:
                warm._cold_note(e)
                self._service.close()
                self._service = None

    async def _kernel_states(self) -> dict:
        """What the kernel prints, in one more cell after the last (not part of the notebook, its
        output not kept), of the state of the pieces the re-check rebuilds instead of training them
        again (``kernelstate``): name -> text, never trusted. Empty where there is none, or the
        cell fails (the re-check then trains them as before)."""
        import secrets

        names = self._service_call(lambda s: s.rebuilt(), lambda: verdicts.rebuilt_pieces(self.nb))
        if not names or self._restarts > self.max_restarts:
            return {}
        nonce = secrets.token_hex(8)
        cell = NotebookNode(cell_type="code", source=kernelstate.snippet(names, nonce, warm.LAZY), metadata={},
                            outputs=[], execution_count=None)
        saved = self.max_output_bytes
        self.max_output_bytes = kernelstate.MAX_BYTES
        try:
            fault = await self._run_extra(cell)
        finally:
            self.max_output_bytes = saved
        return {} if fault else kernelstate.printed(cell.outputs, nonce)

    async def _trusted_recheck(self, clean: list[int], printed: dict | None = None) -> None:
        """The trusted re-check, in a fresh runner (never in the student's kernel), then the
        verdict made final in every test cell (``trusted.apply``)."""
        import asyncio

        args = (self._hung, self._slow, float(self._cell_limit), self._limits(), self._sandboxed(), printed)

        def here():
            return verdicts.decide(self.nb, trusted.make_plan(self.nb, *self._plan_inputs()), *args)

        failed, notes = await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._service_call(lambda s: s.decide(self.nb, *args), here))
        for index, reason in failed.items():
            self.log.warning("Trusted re-check failed for %s: %s",
                             self.nb.cells[index].metadata.get("nbgrader", {}).get("grade_id"), reason)
        if not (self.resources or {}).get("nbgrader", {}).get("student"):
            return
        for note in notes:  # a forbidden call: a note of its own, which names the call (not a flag)
            if note.startswith(verdicts.FORBIDDEN_NOTE):
                add_note(self.log, self.resources, note)
        notes = [n for n in notes if not n.startswith(verdicts.FORBIDDEN_NOTE)]
        if notes:
            add_note(self.log, self.resources, "FLAGGED for an instructor: " + "; ".join(notes[:5])
                     + (f" (and {len(notes) - 5} more)" if len(notes) > 5 else ""))

    async def _kernel_info(self):
        msg_id = await _maybe_await(self.kc.kernel_info())
        info = await self.async_wait_for_reply(msg_id)
        if info is not None and "language_info" in info["content"]:
            self.nb.metadata["language_info"] = info["content"]["language_info"]

    async def _run(self, cell, index, limit: int | None = None) -> str | None:
        """Run one cell (within ``limit`` seconds, when shorter than the cell timeout); return a
        description of the fault, or None."""
        import time

        self._timed_out = False
        if self._budget_end is not None:
            self.timeout = max(1, min(self._cell_limit, int(self._budget_end - time.monotonic()) + 1))
        if limit is not None:
            self.timeout = max(1, min(self.timeout, int(limit)))
        try:
            await self.async_execute_cell(cell, index, execution_count=self.code_cells_executed + 1)
        except DeadKernelError:
            return ("The kernel died while running this cell (it crashed, exited, went over the "
                    "memory limit or used up its CPU time). Grading went on with a fresh kernel from the next cell.")
        except CellTimeoutError:
            self._timed_out = True
            return (f"This cell did not finish within {self.timeout} s and did not stop when "
                    "interrupted. Grading went on with a fresh kernel from the next cell.")
        timed_out = any(o.get("output_type") == "error" and o.get("ename") == "CellTimeoutError"
                        for o in cell.get("outputs", []))
        self._timed_out = timed_out
        if timed_out and not await self._responsive():
            return (f"This cell did not finish within {self.timeout} s and did not stop when "
                    "interrupted. Grading went on with a fresh kernel from the next cell.")
        return None

    async def _run_extra(self, cell) -> str | None:
        """Run a cell that is not part of the notebook (nbclient stores a cell by index, so
        it is appended for the run and removed afterwards); return the fault or None."""
        self.nb.cells.append(cell)
        index = len(self.nb.cells) - 1
        self._output_sizes.pop(index, None)
        try:
            return await self._run(cell, index)
        finally:
            del self.nb.cells[index]
            self._output_sizes.pop(index, None)

    async def _responsive(self) -> bool:
        probe = NotebookNode(cell_type="code", source="pass", metadata={}, outputs=[], execution_count=None)
        self.nb.cells.append(probe)
        saved = self.timeout
        self.timeout = self.probe_timeout
        try:
            await self.async_execute_cell(probe, len(self.nb.cells) - 1, execution_count=None)
        except (DeadKernelError, CellTimeoutError):
            return False
        finally:
            self.timeout = saved
            self.nb.cells.remove(probe)
        return not any(o.get("ename") == "CellTimeoutError" for o in probe.outputs)

    async def _new_kernel(self) -> None:
        if self.km is not None:
            await self._async_cleanup_kernel()  # kills what is left of the old one
        self.km = self.create_kernel_manager()
        await self.async_start_new_kernel()
        await self.async_start_new_kernel_client()
        await self._kernel_info()

    async def _fresh_kernel(self, replay: list[int]) -> None:
        self._restarts += 1
        await self._new_kernel()
        saved = self.timeout
        for i in replay:  # restore the state: setup and answer cells, outputs discarded
            original = self.nb.cells[i]
            shadow = copy.deepcopy(original)
            # a cell that ran past its timeout (and was interrupted) gets a short one: what it
            # defines comes before the hang, and waiting again would only repeat it
            self.timeout = min(saved, int(trusted.SLOW_CELL_TIMEOUT)) if i in self._slow else saved
            try:
                await self.async_execute_cell(shadow, i, execution_count=None)
            except (DeadKernelError, CellTimeoutError):
                await self._new_kernel()
            finally:
                self.timeout = saved
                self.nb.cells[i] = original  # nbclient stored the shadow in its place


_UNREADABLE = ("SyntaxError", "IndentationError", "TabError")
_WHERE = re.compile(r"\s*\([^()]*, line (\d+)\)\s*$")  # IPython's "(<file>, line N)" after the message


def _grade_id(cell) -> str:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id", "")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"... [{len(text) - limit:,} more characters cut by the grader]"


async def _maybe_await(value):
    if hasattr(value, "__await__"):
        return await value
    return value
