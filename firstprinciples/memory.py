"""Measuring the memory a computation takes, tensor by tensor.

``StorageSizes`` is the tiled attention chapter's measure and its exercise's memory test
(the adapter of ``exercises/tiled_attention.py``, in the notebook and in the re-check's runner):
one tool, so that the chapter shows the number the test judges.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class StorageSizes(TorchDispatchMode):
    """Records the largest storage (in elements) of any tensor a torch operation creates."""

    def __init__(self):
        super().__init__()
        self.largest, self.shape, self.op = 0, (), ""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # (torch's switch for a mode's own ``__torch_dispatch__``: when on, torch wraps it so that
        # torch.compile skips it, and the wrapper imports torch._dynamo at its first call: 0.7-1 s
        # in every kernel, re-check and service that measures a tiled attention. Off, a compiled
        # answer is compiled with the mode's recording inside it and reports the same sizes.)
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # (an operator returns a tensor or a tuple or list of them; torch's tree_flatten, which a
        # recursive closure implements, leaves a reference cycle a call: with the re-check's
        # collector off while a case runs, they pile up in the memory that case is measured by)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                n = t.untyped_storage().nbytes() // max(t.element_size(), 1)
                if n > self.largest:
                    self.largest, self.shape, self.op = n, tuple(t.shape), str(func.overloadpacket.__name__)
        return out
