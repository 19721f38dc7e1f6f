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
  grader's memory or the gradebook.

Selected in ``nbgrader_config.py`` (``c.Autograde.autograde_preprocessors``).
"""
from __future__ import annotations

import copy

from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbgrader.preprocessors import Execute
from traitlets import Integer

FAULT_NAME = "GradingFault"


def _error(evalue: str) -> NotebookNode:
    return NotebookNode(output_type="error", ename=FAULT_NAME, evalue=evalue,
                        traceback=[f"\x1b[0;31m{FAULT_NAME}\x1b[0m: {evalue}"])


class RobustExecute(Execute):
    probe_timeout = Integer(15, help="Seconds a kernel has to answer a trivial request after a timeout.").tag(config=True)
    max_output_bytes = Integer(200_000, help="Largest output (in characters) kept for one cell.").tag(config=True)
    max_restarts = Integer(10, help="Fresh kernels at most per notebook; after that the remaining cells fail.").tag(config=True)

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
        self.set_widgets_metadata()

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

    async def _responsive(self) -> bool:
        probe = NotebookNode(cell_type="code", source="pass", metadata={}, outputs=[], execution_count=None)
        saved = self.timeout
        self.timeout = self.probe_timeout
        try:
            await self.async_execute_cell(probe, len(self.nb.cells), execution_count=None)
        except (DeadKernelError, CellTimeoutError):
            return False
        finally:
            self.timeout = saved
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
            shadow = copy.deepcopy(self.nb.cells[i])
            try:
                await self.async_execute_cell(shadow, i, execution_count=None)
            except (DeadKernelError, CellTimeoutError):
                await self._new_kernel()


async def _maybe_await(value):
    if hasattr(value, "__await__"):
        return await value
    return value
