"""A corpus of attacks on the grade, by a student who has read the grading code.

Each entry of ``ATTACKS`` is one student's submission, in the format of
``honest.HONEST`` (``id``, ``assignment``, ``answers``, ``extra``), plus:

- ``score``: the total the grader must give (0 for almost all: the answer is wrong,
  or it uses the built-in it must write, so the in-kernel tests would be fooled but
  the trusted re-check is not);
- ``reason``: a phrase that the feedback of a failing test cell must contain;
- ``flag`` (optional): a phrase that the student's ``notes`` in grades.csv must
  contain (the grader flags what it saw for the instructor).

Routes covered (the issue's and more): a score printed by a test cell (rebound
``checks``, ``sys.displayhook``), patched numpy/torch/checks, stripped asserts and
AST transformers, a lying tensor subclass, the reference imported or reached through
``__wrapped__``, closures or a copied code object, the built-in reached through
``getattr``, ``operator.attrgetter``, ``vars()``, ``type()``, ``torch.ops.aten``,
``torch._C`` functions, ``DisableTorchFunction``, a thread, a raw ``_thread``, a
``__del__``, a patched encoder or runner, the profiler switched off, the profile hook
removed, forged reports, an nn.RNN / nn.MultiheadAttention / TransformerEncoderLayer
wrapped in a module, and a hard-coded worked example.
"""
from __future__ import annotations

import textwrap


def _c(source: str) -> str:
    return textwrap.dedent(source).strip("\n") + "\n"


WRONG_SOFTMAX = _c('''
import torch

def softmax(x, dim=-1):
    return x.clone()
''')


def _softmax(body: str, extra_top: str = "") -> dict:
    return {"softmax": _c(extra_top) + "\nimport torch\n\ndef softmax(x, dim=-1):\n" + textwrap.indent(_c(body), "    ")}


FORBIDDEN = "must not use"
REWRITTEN = "could not be re-checked"
NOT_WATCHED = "could not watch your code"
# a declared piece's runner refuses to import the course's implementations
REFUSED = "not available in the grader's re-check"

ATTACKS = [
    # ------------------------------------------------ a child process, unseen by the watch
    {"id": "atk_forks_a_child", "assignment": "softmax", "answers": _softmax('''
        import os, pickle
        r, w = os.pipe()
        if os.fork() == 0:  # the child calls the built-in; the watch observes only the parent
            os.write(w, pickle.dumps(torch.softmax(x, dim)))
            os._exit(0)
        os.close(w)
        data = b""
        while chunk := os.read(r, 1 << 16):
            data += chunk
        os.waitpid(-1, 0)
        return pickle.loads(data)
     '''), "extra": [], "score": 0, "reason": "PermissionError"},
    # ------------------------------------------------ the runner's own tables, changed from the student's code
    # (the red team's one-liners: the runner now decides nothing, and takes what it uses before any
    # student code runs; each is also flagged as reaching into the grader's internals)
    {"id": "atk_empties_probe_forbidden", "assignment": "softmax", "answers": _softmax('''
        return torch.softmax(x, dim)
     ''', '''
        from firstprinciples.grading import probes
        probes.load()["softmax"].forbidden.clear()  # the runner used to read the probe's forbidden names
     '''), "extra": [], "score": 0, "reason": FORBIDDEN, "flag": "internals"},
    # a declared mistake is right on some inputs (softmax's "dim ignored" on the last dim): borrowed from
    # the declaration, it passes those of the notebook's tests; the re-check recognises the course's code
    {"id": "atk_borrows_declared_mistake", "assignment": "softmax", "answers": _softmax('''
        return _borrowed(x, dim) if dim in (-1, x.dim() - 1) else x.clone()
     ''', '''
        from firstprinciples.exercises import softmax as _declared
        _borrowed = next(m.fn for m in _declared.MISTAKES if m.label == "dim ignored")
     '''), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_replaces_registry_entry", "assignment": "causal_mask", "answers": {"causal_mask": _c('''
        import dataclasses
        import torch
        from firstprinciples.grading import probes

        def _right(obj, case):  # the probe's run replaced: the right mask, whatever causal_mask returns
            T = int(case["T"])
            return {"mask": torch.triu(torch.full((T, T), float("-inf")), diagonal=1)}

        probes.REGISTRY["causal_mask"] = dataclasses.replace(probes.load()["causal_mask"], run=_right)
        object.__setattr__(probes.REGISTRY["causal_mask"], "run", _right)

        def causal_mask(T):  # (right shape and dtype: the one point any zeros mask gets)
            return torch.zeros(T, T)
     ''')}, "extra": [], "score": 1, "reason": "above the diagonal (the future) but should be -inf", "flag": "internals"},
    {"id": "atk_volatile_then_report", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX + _c('''
        import torch
        from firstprinciples.grading import observe, runtime
        observe.VOLATILE = ("",)  # every later change to a shared module is "volatile": not reported
        _real = runtime.report

        def _report(namespace, name, cases, *args, **kwargs):
            namespace[name] = lambda x, dim=-1: torch.softmax(x, dim)  # (outside any watch)
            return _real(namespace, name, cases, *args, **kwargs)

        runtime.report = _report
     ''')}, "extra": [], "score": 0, "reason": "differs from the reference", "flag": "internals"},
    {"id": "atk_clears_forbidden_tables", "assignment": "softmax", "answers": _softmax('''
        return _ref(x, dim)
     ''', '''
        import gc
        import types
        import torch
        from firstprinciples.grading import observe
        for _o in gc.get_objects():  # every table of forbidden code the runner holds, emptied
            if isinstance(_o, observe.Table):
                _o.ids.clear(); _o.places.clear()
        observe._FORBIDDEN.clear()
        # the reference where the runner still holds one (import is refused), its code moved a line
        _found = next((o for o in gc.get_objects() if getattr(o, "__module__", None) == "firstprinciples.reference.attention"
                       and getattr(o, "__name__", None) == "softmax"), None)
        if _found is not None:
            _inner = _found.__wrapped__
            _ref = types.FunctionType(_inner.__code__.replace(co_firstlineno=_inner.__code__.co_firstlineno + 1,
                                                              co_filename="mine.py"), _inner.__globals__)
        else:  # (a declared piece's runner holds none: the built-in, then)
            _ref = lambda x, dim: torch.softmax(x, dim)
     '''), "extra": [], "score": 0, "reason": FORBIDDEN, "flag": "internals"},
    {"id": "atk_reimports_reference", "assignment": "softmax", "answers": _softmax('''
        return _fresh.softmax(x, dim)
     ''', '''
        import importlib
        import sys
        for _name in [n for n in sys.modules if n.startswith("firstprinciples.reference")]:
            del sys.modules[_name]  # new objects: not the ones the grader was told of
        _fresh = importlib.import_module("firstprinciples.reference")
     '''), "extra": [], "score": 0, "reason": REFUSED, "flag": "internals"},
    # A course implementation kept outside the reference (issue 38: the old checks' reference_rmsnorm).
    # Since modern_block is declared, no such function exists: the import fails in the kernel (no
    # module), and the re-check's runner refuses every module of firstprinciples.checks but the
    # student-facing messages, so RMSNorm is never defined and its three points are lost.
    {"id": "atk_checks_reference_rmsnorm", "assignment": "modern_block", "answers": {"RMSNorm": _c('''
        import torch
        from torch import nn
        from firstprinciples.checks import modern_block as _mb

        class RMSNorm(nn.Module):
            def __init__(self, d_model, eps=1e-6):
                super().__init__()
                self.eps = eps
                self.weight = nn.Parameter(torch.ones(d_model))

            def forward(self, x):  # the course's own implementation, kept in its checks
                return _mb.reference_rmsnorm(x, self.weight, self.eps)
     ''')}, "extra": [], "score": 9, "reason": REFUSED, "flag": "internals"},
    # The residual route, named in docs/design/threat-model.md: the runner's own code runs in the
    # student's process, so a student who walks its frames can write the whole report (outputs
    # computed with the built-in, nothing seen) and end the runner. It needs the in-kernel tests
    # fooled too (the re-check's verdict only ever takes points away). It keeps its points: it is
    # flagged for the instructor, naming what it reached for.
    {"id": "atk_forges_report_from_frame", "assignment": "softmax", "answers": {"softmax": _c('''
        import os
        import sys
        import torch

        def softmax(x, dim=-1):
            return torch.exp(x) / torch.exp(x).sum(dim, keepdim=True)  # overflows: wrong on large inputs

        try:
            _main = sys._getframe(1).f_locals  # the re-check runner's main(), running this cell
            _send, _pieces = _main["send"], _main["pieces"]
        except Exception:  # (in the kernel)
            _send = None
        if _send is not None:
            from firstprinciples.grading import probes, wire
            for _name, _probe, _cases, *_rest in _pieces:
                _out = [{"outputs": {k: wire.encode(v) for k, v in _probe.run(
                    lambda x, dim=-1: torch.softmax(x, dim), probes.decode_case(c)).items()}} for c in _cases]
                _send({"event": "piece", "name": _name, "results": _out, "codes": []})
            _send({"event": "done"})
            os._exit(0)
     ''')}, "extra": [("after:try_it_code", _c('''
        def check(*args, **kwargs):  # the notebook's tests, made to pass
            return None
     '''))], "score": 10, "reason": None, "flag": "internals"},
    # ------------------------------------------------ tiled attention's memory, hidden from a dispatch mode
    {"id": "atk_tiled_full_matrix_unwatched", "assignment": "tiled_attention", "answers": {"tiled_attention": _c('''
        import torch

        def tiled_attention(Q, K, V, block_size=64, causal=False):
            # the whole (T_q, T_k) matrix, built where torch's dispatch modes cannot see it
            with torch._C._DisableTorchDispatch():
                scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
                if causal:
                    T_q, T_k = scores.shape[-2:]
                    hide = torch.ones(T_q, T_k, dtype=torch.bool).triu(T_k - T_q + 1)
                    scores = scores.masked_fill(hide, float("-inf"))
                w = torch.exp(scores - scores.amax(-1, keepdim=True))
                return (w / w.sum(-1, keepdim=True)) @ V
     ''')}, "extra": [], "score": 8, "reason": "allocated"},
    {"id": "atk_tiled_full_matrix_in_numpy", "assignment": "tiled_attention", "answers": {"tiled_attention": _c('''
        import math
        import numpy as np
        import torch

        def tiled_attention(Q, K, V, block_size=64, causal=False):
            # the whole (T_q, T_k) matrix, built in NumPy: torch's allocator never sees it
            q, k, v = (t.detach().numpy() for t in (Q, K, V))
            scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1])
            if causal:
                T_q, T_k = scores.shape[-2:]
                scores = scores + np.triu(np.full((T_q, T_k), -np.inf, dtype=q.dtype), T_k - T_q + 1)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            return torch.from_numpy((w / w.sum(-1, keepdims=True)) @ v)
     ''')}, "extra": [], "score": 8, "reason": "outside torch"},
    {"id": "atk_tiled_full_matrix_in_a_memory_map", "assignment": "tiled_attention", "answers": {"tiled_attention": _c('''
        import math
        import mmap
        import numpy as np
        import torch

        def tiled_attention(Q, K, V, block_size=64, causal=False):
            # the whole (T_q, T_k) matrix in an anonymous memory map, computed in place: neither torch's
            # allocator nor Python's allocation tracer sees it, and no temporary is large
            q, k, v = (t.detach().numpy() for t in (Q, K, V))
            T_q, T_k = q.shape[-2], k.shape[-2]
            n = int(np.prod(q.shape[:-2], dtype=np.int64)) * T_q * T_k
            S = np.frombuffer(mmap.mmap(-1, max(1, n) * q.itemsize), dtype=q.dtype, count=n)
            S = S.reshape(q.shape[:-2] + (T_q, T_k))
            np.matmul(q, np.swapaxes(k, -1, -2), out=S)
            S *= 1 / math.sqrt(q.shape[-1])
            if causal:
                for r in range(T_q):
                    S[..., r, r + T_k - T_q + 1:] = -np.inf
            S -= S.max(-1, keepdims=True)
            np.exp(S, out=S)
            S /= S.sum(-1, keepdims=True)
            return torch.from_numpy(S @ v)
     ''')}, "extra": [], "score": 8, "reason": "measured from outside the process"},
    # ------------------------------------------------ texts the grader writes, made huge
    {"id": "atk_huge_names", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX + _c('''
        for i in range(3):  # three torch attributes with 4 MB names: the grader's flags name them
            setattr(torch, f"n{i}" + "x" * 4_000_000, lambda: None)  # (a function: "torch.n0xx... was added")
     ''')}, "extra": [], "score": 0, "reason": "differs from the reference", "flag": "changes the shared code"},
    # ------------------------------------------------ the secret inputs, carried out in an error
    {"id": "atk_leaks_inputs_in_error", "assignment": "softmax", "answers": _softmax('''
        import base64
        # every input, raw and as text, in the message of the error it raises (the grader's
        # feedback used to quote a re-check error's message)
        raise ValueError(base64.b64encode(x.detach().contiguous().numpy().tobytes()).decode() + repr(x.tolist()))
     '''), "extra": [], "score": 0, "reason": "message is not shown"},
    {"id": "atk_leaks_inputs_in_error_class", "assignment": "softmax", "answers": _softmax('''
        import base64
        name = base64.b32encode(x.detach().contiguous().numpy().tobytes()).decode().strip("=")
        raise type(name, (Exception,), {})()  # the inputs in the error's class name
     '''), "extra": [], "score": 0, "reason": "a class of your code"},
    # ------------------------------------------------ scores printed by the test cells
    {"id": "atk_rebinds_checks_class", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX},
     "extra": [("after:try_it_code", _c('''
        def check(*args, **kwargs):  # every test cell now "returns" a number, which nbgrader takes for a score
            return 2
     '''))], "score": 0, "reason": "differs from the reference"},
    {"id": "atk_displayhook_score", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX},
     "extra": [("after:try_it_code", _c('''
        import sys
        check = lambda *a, **k: sys.displayhook(2)  # noqa: E731 (the test cells' check, printing a score)
     '''))], "score": 0, "reason": "differs from the reference"},
    # ------------------------------------------------ in-kernel tests fooled
    {"id": "atk_patches_numpy_torch", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX + _c('''
        import numpy as np
        np.allclose = lambda *a, **k: True
        torch.allclose = lambda *a, **k: True
        torch.testing.assert_close = lambda *a, **k: None
     ''')}, "extra": [], "score": 0, "reason": "differs from the reference", "flag": "torch.allclose was replaced"},
    {"id": "atk_strips_asserts", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX}, "extra": [("after:try_it_code", _c('''
        def _strip(lines):
            return [l for l in lines if not l.lstrip().startswith(("assert", "check(", "checks."))]
        get_ipython().input_transformers_post.append(_strip)
     '''))], "score": 0, "reason": "differs from the reference"},
    {"id": "atk_ast_transformer", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX}, "extra": [("after:try_it_code", _c('''
        import ast
        class _Empty(ast.NodeTransformer):
            def visit_Expr(self, node):
                return None
        get_ipython().ast_transformers.append(_Empty())
     '''))], "score": 0, "reason": "differs from the reference"},
    {"id": "atk_lying_subclass", "assignment": "softmax", "answers": _softmax("return Liar(x)", '''
        import torch
        class Liar(torch.Tensor):
            def __eq__(self, other):
                return torch.ones_like(other, dtype=torch.bool)
     '''), "extra": [], "score": 0, "reason": "softmax"},
    {"id": "atk_patches_checks_globals", "assignment": "softmax", "answers": _softmax("return torch.softmax(x, dim)", '''
        from firstprinciples import guard as _guard
        # the guard is swapped out where the in-kernel checks look it up: they see nothing
        _guard.call_without = lambda fn, args, kwargs=None, **k: fn(*args, **(kwargs or {}))
     '''), "extra": [], "score": 0, "reason": REWRITTEN},
    {"id": "atk_hard_codes_example", "assignment": "softmax", "answers": _softmax('''
        if x.shape == (3,) and abs(float(x[0]) - 0.7778) < 1e-3:  # Cat's scaled scores
            return torch.tensor([0.3797, 0.3537, 0.2666], dtype=x.dtype)
        e = torch.exp(x)
        return e / e.sum(dim=dim, keepdim=True)
     '''), "extra": [], "score": 2, "reason": "NaN"},
    # ------------------------------------------------ the built-in, however it is spelled
    {"id": "atk_getattr_builtin", "assignment": "softmax",
     "answers": _softmax("return getattr(torch, 'soft' + 'max')(x, dim)"), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_attrgetter_builtin", "assignment": "softmax",
     "answers": _softmax("return operator.attrgetter('nn.functional.softmax')(torch)(x, dim)", "import operator"),
     "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_vars_builtin", "assignment": "softmax",
     "answers": _softmax("return vars(torch)['soft' + 'max'](x, dim)"), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_tensor_method_by_type", "assignment": "softmax",
     "answers": _softmax("return type(x).__dict__.get('softmax', torch.Tensor.softmax)(x, dim)"), "extra": [],
     "score": 0, "reason": FORBIDDEN},
    {"id": "atk_aten_op", "assignment": "softmax",
     "answers": _softmax("return torch.ops.aten._softmax(x, dim % x.dim(), False)"), "extra": [], "score": 0,
     "reason": FORBIDDEN},
    {"id": "atk_torch_c_function", "assignment": "softmax",
     "answers": _softmax("return torch._C._VariableFunctions.softmax(x, dim)"), "extra": [], "score": 0,
     "reason": FORBIDDEN},
    {"id": "atk_disable_torch_function", "assignment": "softmax", "answers": _softmax('''
        with torch._C.DisableTorchFunction():
            return torch.softmax(x, dim)
     '''), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_log_softmax_exp", "assignment": "softmax",
     "answers": _softmax("return torch.log_softmax(x, dim).exp()"), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_thread", "assignment": "softmax", "answers": _softmax('''
        out = []
        t = threading.Thread(target=lambda: out.append(torch.softmax(x, dim)))
        t.start()
        t.join()
        return out[0]
     ''', "import threading"), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_raw_thread", "assignment": "softmax", "answers": _softmax('''
        out = []
        _thread.start_new_thread(lambda: out.append(torch.nn.functional.softmax(x, dim)), ())
        while not out:
            time.sleep(0.001)
        return out[0]
     ''', "import _thread\nimport time"), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_del_finaliser", "assignment": "softmax", "answers": _softmax('''
        out = torch.empty_like(x)
        class Later:
            def __del__(self):  # runs when the object dies, outside the code that made it
                out.copy_(torch.softmax(x.detach(), dim))
        Later()
        return out
     '''), "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_reference_import", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX},
     "extra": [("end", "from firstprinciples.reference import softmax\n")], "score": 0, "reason": REFUSED},
    # the reference reached without an import (refused): among the objects the runner still holds, when
    # it does; calling it is recognised (identity and place), as calling the built-in instead is
    {"id": "atk_reference_wrapped", "assignment": "softmax", "answers": _softmax('''
        return _ref.__wrapped__(x, dim) if _ref is not None else torch.softmax(x, dim)
     ''', "import gc\n_ref = next((o for o in gc.get_objects() if getattr(o, \'__module__\', None) == \'firstprinciples.reference.attention\' and getattr(o, \'__name__\', None) == \'softmax\'), None)"), "extra": [],
     "score": 0, "reason": FORBIDDEN},
    {"id": "atk_reference_code_copy", "assignment": "softmax", "answers": _softmax('''
        return _mine(x, dim)
     ''', '''
        import types
        import firstprinciples.reference as _r
        _inner = _r.softmax.__wrapped__
        # the reference's code object under another name: the guard looked for names
        _mine = types.FunctionType(_inner.__code__.replace(co_name="my_softmax"), _inner.__globals__)
     '''), "extra": [], "score": 0, "reason": REFUSED},
    # ------------------------------------------------ the re-check's own machinery
    {"id": "atk_profiler_off", "assignment": "softmax", "answers": _softmax('''
        torch.autograd._disable_profiler()
        return torch.softmax(x, dim)
     '''), "extra": [], "score": 0, "reason": NOT_WATCHED},
    {"id": "atk_profile_hook_off", "assignment": "softmax", "answers": _softmax('''
        sys.setprofile(None)
        return _ref(x, dim)
     ''', "import gc, sys\n_ref = getattr(next((o for o in gc.get_objects() if getattr(o, \'__module__\', None) == \'firstprinciples.reference.attention\' and getattr(o, \'__name__\', None) == \'softmax\'), None), \'__wrapped__\', None) or (lambda x, dim: torch.softmax(x, dim))"), "extra": [],
     "score": 0, "reason": NOT_WATCHED},
    {"id": "atk_patches_encoder", "assignment": "softmax", "answers": _softmax("return x.clone()", '''
        import torch
        from firstprinciples.grading import wire
        _encode = wire.encode
        # the wire encoder computes the right answer while it encodes: the runner's captured copy is used
        wire.encode = lambda v: _encode(torch.softmax(v, -1) if isinstance(v, torch.Tensor) else v)
     '''), "extra": [], "score": 0, "reason": REWRITTEN, "flag": "firstprinciples.grading.wire.encode was replaced"},
    # the same two, with each dict's version tag put back after the write (ctypes): a snapshot
    # that trusted the tags alone would not see them
    {"id": "atk_patches_encoder_tag_hidden", "assignment": "softmax", "answers": _softmax("return x.clone()", '''
        import ctypes
        import torch
        from firstprinciples.grading import wire
        _encode = wire.encode
        _tag = ctypes.c_uint64.from_address(id(vars(wire)) + 24)  # ma_version_tag (CPython 3.11)
        _old = _tag.value
        wire.encode = lambda v: _encode(torch.softmax(v, -1) if isinstance(v, torch.Tensor) else v)
        _tag.value = _old
     '''), "extra": [], "score": 0, "reason": REWRITTEN, "flag": "firstprinciples.grading.wire.encode was replaced"},
    {"id": "atk_patches_torch_tag_hidden", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX + _c('''
        import ctypes
        _tag = ctypes.c_uint64.from_address(id(vars(torch)) + 24)
        _old = _tag.value
        torch.allclose = lambda *a, **k: True
        _tag.value = _old
     ''')}, "extra": [], "score": 0, "reason": "differs from the reference", "flag": "torch.allclose was replaced"},
    {"id": "atk_patches_runner_report", "assignment": "softmax", "answers": {"softmax": WRONG_SOFTMAX + _c('''
        from firstprinciples.grading import runtime
        runtime.report = lambda *a, **k: {"name": "softmax", "results": []}
     ''')}, "extra": [], "score": 0, "reason": REWRITTEN, "flag": "firstprinciples.grading.runtime.report was replaced"},
    {"id": "atk_forged_report", "assignment": "softmax", "answers": _softmax('''
        # write a report with wrong types to every descriptor, then die: grading must go on
        for fd in range(1, 20):
            try:
                os.write(fd, b'\\n@@fp-trusted-probe@@' + b'{"event": "piece", "name": "softmax", "results": "all good"}\\n')
            except OSError:
                pass
        os._exit(0)
     ''', "import os"), "extra": [], "score": 0, "reason": "softmax"},
    # ------------------------------------------------ other exercises, other built-ins
    # a declaration keeps correct helpers for its mistakes (rnn's right recurrence, which "h0 ignored"
    # calls with zeros): imported from the declaration, it would be a whole answer
    {"id": "atk_borrows_declaration_helper", "assignment": "rnn", "answers": {"rnn_forward": _c('''
        from firstprinciples.exercises.rnn import _states as rnn_forward
     ''')}, "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_rnn_module", "assignment": "rnn", "answers": {"rnn_forward": _c('''
        import torch
        from torch import nn

        class _Cell(nn.Module):  # PyTorch's RNN inside a module of one's own
            def __init__(self, W_xh, W_hh, b):
                super().__init__()
                self.rnn = nn.RNN(W_xh.shape[0], W_xh.shape[1], batch_first=True, bias=True).to(W_xh.dtype)
                with torch.no_grad():
                    self.rnn.weight_ih_l0.copy_(W_xh.T)
                    self.rnn.weight_hh_l0.copy_(W_hh.T)
                    self.rnn.bias_ih_l0.copy_(b)
                    self.rnn.bias_hh_l0.zero_()

        def rnn_forward(x, h0, W_xh, W_hh, b):
            return _Cell(W_xh, W_hh, b).rnn(x, h0.unsqueeze(0))[0]
     ''')}, "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_mask_builtin_alias", "assignment": "causal_mask", "answers": {"causal_mask": _c('''
        import torch
        from torch import nn
        _make = getattr(nn.Transformer, "generate_square_" + "subsequent_mask")

        def causal_mask(T):
            return _make(T, dtype=torch.float32)
     ''')}, "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_attention_sdpa_alias", "assignment": "attention", "answers": {"scaled_dot_product_attention": _c('''
        import torch
        import torch.nn.functional as F
        _fast = F.scaled_dot_product_attention

        def scaled_dot_product_attention(Q, K, V, mask=None):
            out = _fast(Q, K, V, attn_mask=mask)
            scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5 + (0 if mask is None else mask)
            w = torch.exp(scores - scores.amax(-1, keepdim=True))
            return out, w / w.sum(-1, keepdim=True)
     ''')}, "extra": [], "score": 0, "reason": FORBIDDEN},
    {"id": "atk_mha_torch_module", "assignment": "multi_head_attention", "answers": {"MultiHeadAttention": _c('''
        class MultiHeadAttention(nn.Module):
            """PyTorch's own multi-head attention, dressed up with the four expected layers."""
            def __init__(self, d_model, n_heads):
                super().__init__()
                self.n_heads = n_heads
                self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(d_model, d_model) for _ in range(4))
                self._inner = nn.MultiheadAttention(d_model, n_heads, batch_first=True)

            def forward(self, x, mask=None):
                d = x.shape[-1]
                with torch.no_grad():
                    self._inner.in_proj_weight.copy_(torch.cat([self.W_q.weight, self.W_k.weight, self.W_v.weight]))
                    self._inner.in_proj_bias.copy_(torch.cat([self.W_q.bias, self.W_k.bias, self.W_v.bias]))
                    self._inner.out_proj.weight.copy_(self.W_o.weight)
                    self._inner.out_proj.bias.copy_(self.W_o.bias)
                out, w = self._inner(x, x, x, attn_mask=mask, average_attn_weights=False)
                return out, w
     ''')}, "extra": [], "score": None, "reason": FORBIDDEN},
    {"id": "atk_block_encoder_layer", "assignment": "transformer_block", "answers": {"TransformerBlock": _c('''
        class TransformerBlock(nn.Module):
            def __init__(self, d_model, n_heads, dropout=0.0):
                super().__init__()
                self.layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout, batch_first=True,
                                                        norm_first=True)
                self.attn = MultiHeadAttention(d_model, n_heads)
                self.ffn = FeedForward(d_model)
                self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
                self.drop = nn.Dropout(dropout)

            def forward(self, x, mask=None):
                _, weights = self.attn(self.ln1(x), mask)
                return self.layer(x, src_mask=mask), weights
     ''')}, "extra": [], "score": None, "reason": FORBIDDEN},
    # issue 38: a "dropout" that only scales by (1 - p) keeps each branch's expected value and zeroes
    # nothing; dropout is judged by its distribution, so it loses test_block_dropout (2 of 17 points)
    {"id": "atk_block_dropout_only_scales", "assignment": "transformer_block", "answers": {"TransformerBlock": _c('''
        class TransformerBlock(nn.Module):
            def __init__(self, d_model, n_heads, dropout=0.1):
                super().__init__()
                self.ln1 = nn.LayerNorm(d_model)
                self.attn = MultiHeadAttention(d_model, n_heads)
                self.ln2 = nn.LayerNorm(d_model)
                self.ffn = FeedForward(d_model)
                self.p = dropout

            def drop(self, t):
                return t * (1 - self.p) if self.training else t  # scales, never zeroes

            def forward(self, x, mask=None):
                a, weights = self.attn(self.ln1(x), mask)
                x = x + self.drop(a)
                return x + self.drop(self.ffn(self.ln2(x))), weights
     ''')}, "extra": [], "score": 15, "reason": "inverted dropout"},
    {"id": "atk_kv_reference_subclass", "assignment": "kv_cache", "answers": {"KVCache": _c('''
        import importlib
        _ref = importlib.import_module("firstprinciples.reference")

        class KVCache(_ref.KVCache):
            """The course's cache under the expected name."""
     ''')}, "extra": [], "score": None, "reason": "ImportError"},  # (a declared piece's runner refuses the import)
    # the red team's (issue 38): generation without a cache, every product with a layer's weight written by
    # hand so that no hook on the layers counts the prefix projected again at every step; the layers' weights
    # that change between steps (after the prompt is cached) tell it from a cache by what it computes
    {"id": "atk_kv_generate_uncached_by_the_weights", "assignment": "kv_cache", "answers": {"generate": _c('''
        def generate(mha, prompt, n_new):
            """Extend prompt by n_new vectors (no cache: the whole prefix again, by the layers' weights)."""
            seq = prompt
            for _ in range(n_new):
                B, T, d = seq.shape
                H = mha.n_heads
                q, k, v = ((seq @ layer.weight.T).view(B, T, H, d // H).transpose(1, 2)
                           for layer in (mha.W_q, mha.W_k, mha.W_v))
                scores = q @ k.transpose(-2, -1) / math.sqrt(d // H)
                scores = scores + torch.triu(torch.full((T, T), float("-inf"), dtype=seq.dtype), diagonal=1)
                out = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(B, T, d) @ mha.W_o.weight.T
                seq = torch.cat([seq, out[:, -1:]], dim=1)
            return seq
     ''')}, "extra": [], "score": None, "reason": "recomputing everything"},
    {"id": "atk_pe_reference", "assignment": "positional_encoding", "answers": {"sinusoidal_encoding": _c('''
        import importlib

        def sinusoidal_encoding(max_len, d_model):
            return importlib.import_module("firstprinciples.reference").sinusoidal_encoding(max_len, d_model)
     ''')}, "extra": [], "score": None, "reason": "ImportError"},  # (a declared piece's runner refuses the import)
]
