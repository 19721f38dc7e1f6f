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
- after the last cell, runs the trusted re-check (``firstprinciples.grading.trusted``):
  one probe cell per graded object, fresh secret inputs, results read back as
  plain data and compared in this process; a test cell whose objects fail it
  scores 0 with the reason in the feedback.

Selected in ``nbgrader_config.py`` (``c.Autograde.autograde_preprocessors``).
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Bool, Integer

from . import trusted

FAULT_NAME = "GradingFault"


def _error(evalue: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=FAULT_NAME, evalue=evalue,
                        traceback=[f"\x1b[0;31m{FAULT_NAME}\x1b[0m: {evalue}"])


class RobustExecute(Execute):
    probe_timeout = Integer(15, help="Seconds a kernel has to answer a trivial request after a timeout.").tag(config=True)
    max_output_bytes = Integer(200_000, help="Largest output (in characters) kept for one cell.").tag(config=True)
    max_restarts = Integer(10, help="Fresh kernels at most per notebook; after that the remaining cells fail.").tag(config=True)
    trusted_verdicts = Bool(True, help="Re-check graded objects outside the kernel (firstprinciples.grading.trusted).").tag(config=True)

    # ------------------------------------------------------------ output cap
    def output(self, outs, msg, display_id, cell_index):
        size = self._output_sizes.get(cell_index, 0)
        if size > self.max_output_bytes:
            return None  # already cut: drop the rest
        content = msg.get("content", {})
        added = len(str(content.get("text", ""))) + len(str(content.get("data", "")))
        self._output_sizes[cell_index] = size + added
        if size + added > self.max_output_bytes:
            note = (f"\n[output cut: this cell printed more than {self.max_output_bytes:,} characters; "
                    "the rest was dropped by the grader]\n")
            outs.append(NotebookNode(output_type="stream", name="stderr", text=note))
            return None
        return super().output(outs, msg, display_id, cell_index)

    # ------------------------------------------------------------ execution
    def preprocess(self, nb, resources=None, km=None):
        NotebookClient.__init__(self, nb, km)
        self.reset_execution_trackers()
        self._check_assign_resources(resources)
        self._output_sizes: dict[int, int] = {}
        self._restarts = 0
        run_sync(self._execute_all)()
        return self.nb, self.resources

    async def _execute_all(self) -> None:
        clean: list[int] = []  # cells that ran without a fault, to replay after a restart
        async with self.async_setup_kernel():
            await self._kernel_info()
            for index, cell in enumerate(self.nb.cells):
                if cell.cell_type != "code":
                    continue
                if self._restarts > self.max_restarts:
                    cell.outputs = [_error("Not run: the notebook crashed its kernel too many times.")]
                    continue
                fault = await self._run(cell, index)
                if fault is None:
                    if not cell.get("metadata", {}).get("nbgrader", {}).get("grade", False):
                        clean.append(index)
                    continue
                cell.outputs.append(_error(fault))
                await self._fresh_kernel(clean)
            if self.trusted_verdicts:
                await self._trusted_recheck(clean)
        self.set_widgets_metadata()

    # ------------------------------------------------------------ the trusted re-check
    def _course(self):
        """(course root, the instructor's source notebook) when grading a course, else (None, None)."""
        info = (self.resources or {}).get("nbgrader", {})
        if not info.get("assignment") or not info.get("notebook"):
            return None, None
        root = Path(os.getcwd())  # nbgrader's converters run in the course root
        source_dir = self.config.get("CourseDirectory", {}).get("source_directory", "source")
        return root, root / source_dir / info["assignment"] / f"{info['notebook']}.ipynb"

    async def _trusted_recheck(self, clean: list[int]) -> None:
        root, source = self._course()
        sources = trusted.course_sources(source) if source is not None else None
        plan = trusted.make_plan(self.nb, trusted.seed_for(self.resources, root), sources)
        verdicts = trusted.static_verdicts(plan)
        for check in plan.checks:
            if plan.tamper or check.name in verdicts:
                continue  # already void: no need to run it
            probe = NotebookNode(cell_type="code", source=check.source, metadata={}, outputs=[], execution_count=None)
            fault = await self._run_extra(probe)
            if fault is not None:
                verdicts[check.name] = trusted.Outcome("the re-check did not finish: " + fault.split(". Grading")[0])
                await self._fresh_kernel(clean)
                continue
            verdicts[check.name] = trusted.outcome(check, trusted.read_report(probe.outputs, check.name))
        failed = trusted.apply(self.nb, plan, verdicts)
        for index, reason in failed.items():
            self.log.warning("Trusted re-check failed for %s: %s",
                             self.nb.cells[index].metadata.get("nbgrader", {}).get("grade_id"), reason)

    async def _kernel_info(self):
        msg_id = await _maybe_await(self.kc.kernel_info())
        info = await self.async_wait_for_reply(msg_id)
        if info is not None and "language_info" in info["content"]:
            self.nb.metadata["language_info"] = info["content"]["language_info"]

    async def _run(self, cell, index) -> str | None:
        """Run one cell; return a description of the fault, or None."""
        try:
            await self.async_execute_cell(cell, index, execution_count=self.code_cells_executed + 1)
        except DeadKernelError:
            return ("The kernel died while running this cell (it crashed, exited, or went over the "
                    "memory limit). Grading went on with a fresh kernel from the next cell.")
        except CellTimeoutError:
            return (f"This cell did not finish within {self.timeout} s and did not stop when "
                    "interrupted. Grading went on with a fresh kernel from the next cell.")
        timed_out = any(o.get("output_type") == "error" and o.get("ename") == "CellTimeoutError"
                        for o in cell.get("outputs", []))
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
        for i in replay:  # restore the state: setup and answer cells, outputs discarded
            original = self.nb.cells[i]
            shadow = copy.deepcopy(original)
            try:
                await self.async_execute_cell(shadow, i, execution_count=None)
            except (DeadKernelError, CellTimeoutError):
                await self._new_kernel()
            finally:
                self.nb.cells[i] = original  # nbclient stored the shadow in its place


async def _maybe_await(value):
    if hasattr(value, "__await__"):
        return await value
    return value
