"""Plain-data encoding of probe inputs and results (JSON, never pickle).

The trusted grader sends a probe's inputs into the student's sandboxed kernel
and reads the results back as JSON text. A tensor travels as its exact type
name, dtype, shape, ``requires_grad`` flag and raw bytes (base64); Python
scalars, strings, ``None``, tuples and lists travel as themselves. Decoding on
the trusted side only ever builds NumPy arrays from bytes with a known dtype
and a checked size, so nothing a student's kernel prints can run code in the
grader or pass for anything but plain numbers.
"""
from __future__ import annotations

import base64
import json
import math
from typing import Any

import numpy as np

# What starts each line of a re-check runner's report (then its nonce, then one JSON event).
MARK = "@@fp-trusted-probe@@"

# dtypes that travel as their own bytes; any other floating dtype travels as float64
# values with its real name kept (so a bfloat16 answer is seen, and rejected, as bfloat16).
NUMPY_DTYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_,
}
MAX_ELEMENTS = 2_000_000  # a result larger than this is refused (probes use small inputs)


class WireError(ValueError):
    """Raised for data that is not a well-formed encoded value."""


def _type_name(value) -> str:
    t = type(value)
    return f"{t.__module__}.{t.__qualname__}"


def encode(value: Any) -> dict:
    """Encode a tensor, array, scalar, string, None, tuple or list as a JSON-safe dict."""
    import torch

    kind = _type_name(value)
    if isinstance(value, torch.Tensor):
        t = value.detach()
        out = {"type": kind, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
               "requires_grad": bool(value.requires_grad)}
        t = t.cpu().contiguous()
        if out["dtype"] not in NUMPY_DTYPES:
            t = t.real.double() if t.is_complex() else t.double()
        out["data"] = base64.b64encode(t.numpy().tobytes()).decode("ascii")
        out["data_dtype"] = str(t.dtype).removeprefix("torch.")
        return out
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        name = a.dtype.name
        if name not in NUMPY_DTYPES:
            a, name = a.astype(np.float64), "float64"
        return {"type": kind, "dtype": a.dtype.name, "shape": list(a.shape), "requires_grad": False,
                "data": base64.b64encode(a.tobytes()).decode("ascii"), "data_dtype": name}
    if value is None or isinstance(value, (bool, int, str)):
        return {"type": kind, "value": value}
    if isinstance(value, float):
        return {"type": kind, "value": value if math.isfinite(value) else repr(value)}
    if isinstance(value, (tuple, list)):
        return {"type": kind, "items": [encode(v) for v in value]}
    if isinstance(value, dict):
        return {"type": kind, "keys": [str(k) for k in value], "items": [encode(v) for v in value.values()]}
    return {"type": kind}


def array(d: dict) -> np.ndarray:
    """The NumPy array of an encoded tensor or array (checked, copied)."""
    try:
        data_dtype = NUMPY_DTYPES[d["data_dtype"]]
        shape = [int(s) for s in d["shape"]]
        raw = base64.b64decode(d["data"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise WireError(f"not an encoded array: {e}") from None
    if any(s < 0 for s in shape):
        raise WireError("negative dimension")
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise WireError(f"{n} elements is more than the grader accepts ({MAX_ELEMENTS})")
    if len(raw) != n * np.dtype(data_dtype).itemsize:
        raise WireError("the data does not match the shape and dtype")
    return np.frombuffer(raw, dtype=data_dtype).reshape(shape).copy()


def is_array(d: dict) -> bool:
    return isinstance(d, dict) and "data" in d


def scalar(d: dict):
    v = d.get("value")
    if isinstance(v, str) and d.get("type") == "builtins.float":
        return float(v)
    return v


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False)


def loads(text: str):
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(WireError(f"constant {c}")))


# Every text the grader writes for a student (a note in grades.csv and the log, a flag beside a
# test) is at most this long: parts of it (a name, an error) can come from the student's code,
# and a 4 MB attribute name must not become a 12 MB row or log line.
NOTE_MAX = 600


def capped(text, limit: int = NOTE_MAX) -> str:
    """``text`` as a string of at most ``limit`` characters (cut in the middle of a long part)."""
    text = str(text)
    if len(text) <= limit:
        return text
    keep = max(limit - 40, 2) // 2  # (40: room for the marker)
    return f"{text[:keep]} [... {len(text) - 2 * keep:,} characters cut ...] {text[len(text) - keep:]}"
