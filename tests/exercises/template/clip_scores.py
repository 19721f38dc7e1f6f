"""clip_scores(x, limit): the template exercise of docs/contributors/adding-an-exercise.md."""
from __future__ import annotations

import numpy as np
import torch

from . import Exercise, Mistake, Test, case
from .adapters import call_runner


def _upper_only(x, limit):
    return torch.minimum(x, torch.full_like(x, limit))


def _magnitude(x, limit):
    return torch.minimum(x.abs(), torch.full_like(x, limit))


def within_limit(case, out, want):
    """Every entry is within [-limit, limit], the limit as the output's dtype holds it."""
    limit = np.asarray(case["limit"], dtype=out["output"].dtype)
    worst = np.abs(out["output"]).max() if out["output"].size else 0.0
    return None if worst <= limit else f"an entry is {float(worst):g}, outside [-{float(limit):g}, {float(limit):g}]."


def secret(rng):
    cases = []
    for dtype in ("float32", "float64"):
        for shape in ((int(rng.integers(1, 6)),), (3, int(rng.integers(2, 6))), (2, 3, 4)):
            limit = float(rng.uniform(0.5, 3.0))
            x = (rng.standard_normal(shape) * 3).astype(dtype)
            cases.append(case(f"for a {dtype} x of shape {shape}, limit {limit:.3g}", ("worked", "shapes"),
                              x=x, limit=limit))
    return cases


EXERCISE = Exercise(
    name="clip_scores",
    piece="clip_scores",
    call="clip_scores(x, limit)",
    adapter=call_runner(("x", "limit")),
    reference="firstprinciples.reference:clip_scores",
    names={"output": "clip_scores(x, limit)"},
    visible=(
        case("for x = [-3, -0.5, 0, 2] and limit 1", "worked", x=np.array([-3.0, -0.5, 0.0, 2.0]), limit=1.0),
        case("for a (2, 3) float32 x and limit 2", "shapes",
             x=np.array([[-5.0, 1.0, 2.5], [0.25, -2.0, 9.0]], dtype="float32"), limit=2.0),
    ),
    secret=secret,
    tests={
        "test_worked_example": Test(1, frozenset({"worked"}), then=(within_limit,)),
        "test_shapes_and_dtypes": Test(1, frozenset({"shapes"})),
    },
    forbidden=dict(torch_patterns=("clamp", "clip"), pieces=("clip_scores",), what="the clipping"),
    mistakes=(
        Mistake("upper bound only", "clip from below too: entries under -limit become -limit.", _upper_only,
                frozenset({"test_worked_example", "test_shapes_and_dtypes"})),
        Mistake("sign lost", "clip the entries themselves, not their magnitudes: -0.5 stays -0.5.", _magnitude,
                frozenset({"test_worked_example", "test_shapes_and_dtypes"})),
    ),
)
