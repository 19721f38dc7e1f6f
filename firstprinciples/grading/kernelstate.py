"""The parameters of a trained object, read from the student's kernel after its last cell.

The capstone's locked cell trains the student's ``StudentGPT`` (about ten seconds); the
trusted re-check used to train it a second time in its runner, from the same cells, to
probe the result. Instead, for a probe with ``rebuild`` (``probes.Probe``), the grader runs
one more cell in the kernel once the notebook's cells are done (``snippet``: it is not part
of the notebook and its output is not kept) that prints the object's ``state_dict()`` as plain
data (``wire``), and the re-check's runner builds the object again from the notebook's own
class and those numbers.

Nothing read here is trusted, exactly as nothing a runner prints is: the numbers are only
numbers (no pickle; ``parse`` checks every array), they are loaded into the student's own
class in the sandboxed runner and probed there, watched, with the course's thresholds
applied by the grader. What the student's code could do to them (print other numbers) it
could do as well in the cells the runner would load to train the model itself: the trained
model's provenance is not provable either way (``exercises.capstone``, the trained model). A state that is missing,
malformed or over ``MAX_BYTES``, or a rebuilt object that fails, sends the piece back to the
re-check as before (its cells loaded, the model trained again).

The same cell says which of the modules in ``recheck.LAZY`` the kernel has imported
(``IMPORTED``). Before, the runner that trained the model again imported them too (an
optimizer's step imports torch._dynamo, 1.1 s) and said so, and the grading worker's template
then imported them once for every later child; a runner that only rebuilds the model never
imports them, so each capstone kernel paid that import itself. It is a hint only, as the
runner's is: it can make the template import a module of that fixed list, nothing else.
"""
from __future__ import annotations

import json

from . import wire

MARK = "@@fp-kernel-state@@"
MAX_BYTES = 64 * 2**20  # characters of printed state at most (the capstone's model: about 0.6 MB)
IMPORTED = ".imported"  # the name of the line that lists the modules (not an identifier: never a piece's)


def snippet(names, nonce: str, lazy=()) -> str:
    """The cell the grader runs in the kernel: print the state of each of ``names``, and which of
    the modules ``lazy`` the kernel has imported."""
    return (f"__import__('firstprinciples.grading.kernelstate', fromlist=['emit']).emit(globals(), "
            f"{sorted(names)!r}, {nonce!r}, {sorted(lazy)!r})")


def emit(namespace: dict, names, nonce: str, lazy=()) -> None:
    """In the kernel, lines of ``MARK nonce JSON``: first {"name": IMPORTED, "imported": the
    modules of ``lazy`` in ``sys.modules``}, then one per name: {"name", "state": key -> encoded
    tensor} or {"name", "error"}."""
    import sys

    if lazy:
        doc = {"name": IMPORTED, "imported": [m for m in lazy if m in sys.modules]}
        sys.stdout.write("\n" + MARK + nonce + wire.dumps(doc) + "\n")
    for name in names:
        try:
            obj = namespace[name]
            state = {str(k): wire.encode(v) for k, v in obj.state_dict().items()}
            doc = {"name": name, "state": state}
        except Exception as e:  # noqa: BLE001 (no such object, or not a module: the re-check trains it)
            doc = {"name": name, "error": f"{type(e).__name__}: {str(e)[:200]}"}
        sys.stdout.write("\n" + MARK + nonce + wire.dumps(doc) + "\n")
    sys.stdout.flush()


def printed(outputs, nonce: str) -> dict:
    """The lines ``emit`` printed among a cell's outputs: name -> the JSON text (unparsed; the
    first line of each name counts)."""
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream" and o.get("name") == "stdout")
    if len(text) > MAX_BYTES:
        return {}
    found: dict = {}
    prefix = MARK + nonce
    for line in text.split("\n"):
        if line.startswith(prefix):
            body = line[len(prefix):]
            try:
                name = json.loads(body).get("name")
            except (ValueError, AttributeError):
                continue
            if isinstance(name, str):
                found.setdefault(name, body)
    return found


def imported(found: dict | None, lazy) -> set:
    """The modules of ``lazy`` that the kernel said it had imported (``found``: what ``printed``
    returned); an empty set where it said nothing usable."""
    try:
        said = json.loads((found or {}).get(IMPORTED) or "null")
    except (ValueError, TypeError):
        return set()
    listed = said.get("imported") if isinstance(said, dict) else None
    return {m for m in listed if isinstance(m, str)} & set(lazy) if isinstance(listed, list) else set()


def parse(text) -> dict | None:
    """A state as the runner is given it (key -> encoded array), or None when ``text`` is not
    one: not JSON, an error, a key that is not a string, a value that is not a well-formed
    array, or larger than ``MAX_BYTES``."""
    if not isinstance(text, str) or len(text) > MAX_BYTES:
        return None
    try:
        doc = wire.loads(text)
    except (ValueError, wire.WireError):
        return None
    state = doc.get("state") if isinstance(doc, dict) else None
    if not isinstance(state, dict) or not state:
        return None
    for key, value in state.items():
        if not isinstance(key, str) or not isinstance(value, dict) or not wire.is_array(value):
            return None
        try:
            wire.array(value)
        except wire.WireError:
            return None
    return state
