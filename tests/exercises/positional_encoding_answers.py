"""positional_encoding: the answers the generic harness (test_declarations.py) runs besides the
declaration's own mistakes, per piece: unusual correct answers (the source's own SinusoidalPE table,
built through the module or pasted as the function's body, among them), which must pass everywhere,
and wrong answers that no mistake names, each with the test cells it fails in the notebook (its
visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import math
import re
import textwrap

import torch

from course import as_student_code
from firstprinciples import reference
from seeds import seed_code, seed_namespace

PIECES = True


# ================================================================ sinusoidal_encoding
correct_table = as_student_code(reference.sinusoidal_encoding)


def table_float32_exp_log(max_len, d_model):
    # A correct answer computed in float32 throughout, via exp and log.
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.empty(max_len, d_model)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)
    return table


def table_by_stacking(max_len, d_model):
    # A correct answer without in-place writes: stack (sin, cos) and flatten.
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    angle = pos / 10000.0 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1).float()


def seed_table_via_module():
    """The source's SinusoidalPE module pasted in, its table returned."""
    SinusoidalPE = seed_namespace("SinusoidalPE")["SinusoidalPE"]

    def sinusoidal_encoding(max_len, d_model):
        return SinusoidalPE(d_model, max_len).pe[0]

    return sinusoidal_encoding


def seed_table_as_body():
    """The table-building lines of the source's SinusoidalPE.__init__, pasted as
    the body of ``sinusoidal_encoding`` (read from the seed at test time)."""
    code = seed_code("SinusoidalPE")
    imports = "\n".join(line for line in code.splitlines() if re.match(r"^(import|from) ", line))
    init = re.search(r"def __init__\(self[^)]*\):\n(.*?)(?=\n    def |\Z)", code, flags=re.S).group(1)
    body = [
        line for line in textwrap.dedent(init).splitlines()
        if line.strip() and "super()" not in line and "register_buffer" not in line
    ]
    assert any("pe[:, 0::2]" in line for line in body), body  # the construction was found
    src = imports + "\n\ndef sinusoidal_encoding(max_len, d_model):\n" + textwrap.indent("\n".join(body), "    ")
    src += "\n    return pe\n"
    ns: dict = {}
    exec(compile(src, "<seed table as body>", "exec"), ns)
    return ns["sinusoidal_encoding"]


def table_calls_reference(max_len, d_model):
    return reference.sinusoidal_encoding(max_len, d_model)


def table_from_reference_rope(max_len, d_model):
    # Rotating (0, 1) by the angle gives (-sin, cos): flip the sign of the even columns.
    x = torch.zeros(max_len, d_model, dtype=torch.float64)
    x[:, 1::2] = 1.0
    flip = torch.tensor([-1.0, 1.0], dtype=torch.float64).repeat(d_model // 2)
    return (reference.apply_rope(x) * flip).float()


def table_float64(max_len, d_model):
    return correct_table(max_len, d_model, dtype=torch.float64)


def table_with_batch_dim(max_len, d_model):
    return correct_table(max_len, d_model)[None]


def table_numpy(max_len, d_model):
    return correct_table(max_len, d_model).numpy()


def table_arguments_swapped(max_len, d_model):
    return correct_table(d_model, max_len)


_EXAMPLE_TABLE = correct_table(6, 4).tolist()


def table_hard_coded_example(max_len, d_model):
    return torch.tensor(_EXAMPLE_TABLE)


def table_base_1000(max_len, d_model):
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    angle = pos * 1000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(1).float()





# ================================================================ apply_rope
correct_rope = as_student_code(reference.apply_rope)


def rope_complex(x, base=10000.0):
    # A correct answer with complex numbers: pair i is x[2i] + j x[2i+1].
    T, d = x.shape[-2], x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    angle = torch.arange(T, dtype=x.dtype)[:, None] * theta  # (T, d/2)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).reshape(x.shape)


def rope_rotate_every_two(x, base=10000.0):
    # A correct answer in the "x * cos + rotate_every_two(x) * sin" form, with
    # cos and sin repeated over both members of a pair.
    T, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=x.dtype) / d)
    angle = torch.outer(torch.arange(T, dtype=x.dtype), inv).repeat_interleave(2, dim=-1)  # (T, d)
    swapped = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)  # (-x1, x0, -x3, x2, ...)
    return x * angle.cos() + swapped * angle.sin()


def rope_calls_reference(x, base=10000.0):
    return reference.apply_rope(x, base)


def rope_uses_reference_table(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    table = reference.sinusoidal_encoding(T, d, dtype=x.dtype)  # sin, cos of pos * 10000^(-2i/d)
    s, c = table[:, 0::2], table[:, 1::2]
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * c - o * s, e * s + o * c), dim=-1).flatten(-2)


def rope_in_place(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    e, o = x[..., 0::2].clone(), x[..., 1::2].clone()
    x[..., 0::2] = e * angle.cos() - o * angle.sin()
    x[..., 1::2] = e * angle.sin() + o * angle.cos()
    return x


def rope_detached(x, base=10000.0):
    return correct_rope(x.detach(), base)


def rope_numpy(x, base=10000.0):
    return correct_rope(x.detach(), base).numpy()


def rope_float32(x, base=10000.0):
    return correct_rope(x, base).float()


def rope_returns_tuple(x, base=10000.0):
    return correct_rope(x, base), torch.arange(x.shape[-2])


def rope_identity(x, base=10000.0):
    return x.clone()


def rope_float32_angles(x, base=10000.0):
    # torch.arange(T) and an int tensor / d give float32 angles whatever x's dtype.
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T)[:, None] * base ** (-torch.arange(0, d, 2) / d)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()), -1).flatten(-2)


def rope_T_from_first_axis(x, base=10000.0):
    T, d = x.shape[0], x.shape[-1]  # right for (T, d), the batch size otherwise
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()), -1).flatten(-2)


def rope_added_not_rotated(x, base=10000.0):
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    return x + torch.stack((angle.sin(), angle.cos()), -1).flatten(-2)


def rope_angle_quadratic(x, base=10000.0):
    # Still a rotation that keeps position 0, but the angle grows like pos ** 2.
    T, d = x.shape[-2], x.shape[-1]
    pos = torch.arange(T, dtype=x.dtype)
    angle = (pos**2)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    e, o = x[..., 0::2], x[..., 1::2]
    return torch.stack((e * angle.cos() - o * angle.sin(), e * angle.sin() + o * angle.cos()), -1).flatten(-2)


def rope_no_base_argument(x):
    return correct_rope(x)





def table_complex_powers(max_len, d_model):
    # row pos is z^pos with z = e^(i freq) per pair: sin in the imaginary part, cos in the real part
    freq = torch.exp(-torch.arange(0, d_model, 2, dtype=torch.float64) * math.log(10000.0) / d_model)
    z = torch.polar(torch.ones_like(freq), freq)  # (d_model/2,) complex128
    powers = z[None, :] ** torch.arange(max_len, dtype=torch.float64)[:, None]  # (max_len, d_model/2)
    return torch.stack((powers.imag, powers.real), dim=-1).reshape(max_len, d_model).to(torch.float32)


def table_phase_shifted_sines(max_len, d_model):
    # one sine per column: cos(a) = sin(a + pi/2) in the odd columns
    col = torch.arange(d_model)
    freq = 10000.0 ** (-(col - col % 2).double() / d_model)  # both columns of a pair share 2i
    phase = (col % 2).double() * (math.pi / 2)
    return torch.sin(torch.arange(max_len).double()[:, None] * freq + phase).float()


def rope_rotation_matrices(x, base=10000.0):
    # an explicit 2x2 rotation matrix per (position, pair), applied with einsum
    T, d = x.shape[-2], x.shape[-1]
    angle = torch.arange(T, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    c, s = angle.cos(), angle.sin()
    R = torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)  # (T, d/2, 2, 2)
    pairs = x.reshape(*x.shape[:-1], d // 2, 2)  # (..., T, d/2, 2)
    return torch.einsum("tpij,...tpj->...tpi", R, pairs).reshape(x.shape)


def rope_pair_by_pair(x, base=10000.0):
    # one pair at a time, in a Python loop over i, with negative indexing for T
    T, d = x.shape[-2], x.shape[-1]
    pos = torch.arange(T, dtype=x.dtype).unsqueeze(-1)  # (T, 1)
    columns = []
    for i in range(d // 2):
        a = pos * base ** (-(2.0 * i) / d)
        u, v = x[..., 2 * i : 2 * i + 1], x[..., 2 * i + 1 : 2 * i + 2]
        columns += [u * torch.cos(a) - v * torch.sin(a), u * torch.sin(a) + v * torch.cos(a)]
    return torch.cat(columns, dim=-1)


def _lazy(factory):
    """A correct answer built on first use (the seeds are read when a test runs it)."""
    made = []

    def answer(*args, **kwargs):
        if not made:
            made.append(factory())
        return made[0](*args, **kwargs)

    return answer


T_ALL = {"test_sinusoidal_example", "test_sinusoidal_tables"}
EXAMPLE, SHAPES, BASE, RELATIVE, GRADS = ("test_rope_example", "test_rope_shapes", "test_rope_base",
                                          "test_rope_relative_position", "test_rope_gradients_and_inputs")
R_ALL = {EXAMPLE, SHAPES, BASE, RELATIVE, GRADS}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
TABLE_WRONG = {
    "calls the reference": (table_calls_reference, T_ALL, T_ALL),
    "built with the reference apply_rope": (table_from_reference_rope, T_ALL, T_ALL),
    "returns float64": (table_float64, T_ALL, T_ALL),
    "keeps a batch dimension": (table_with_batch_dim, T_ALL, T_ALL),
    "returns numpy": (table_numpy, T_ALL, T_ALL),
    "arguments swapped": (table_arguments_swapped, T_ALL, T_ALL),
    # (the re-check draws other small sizes: a typed-in (6, 4) table earns nothing there)
    "hard-coded worked example": (table_hard_coded_example, {"test_sinusoidal_tables"}, T_ALL),
    "base 1000": (table_base_1000, T_ALL, T_ALL),
}
ROPE_WRONG = {
    "calls the reference": (rope_calls_reference, R_ALL, R_ALL),
    "uses the reference sinusoidal table": (rope_uses_reference_table, R_ALL, R_ALL),
    "modifies its input": (rope_in_place, R_ALL, R_ALL),
    "detached": (rope_detached, {GRADS}, {GRADS}),
    "returns numpy": (rope_numpy, R_ALL, R_ALL),
    "casts to float32": (rope_float32, R_ALL, R_ALL),
    "returns a tuple": (rope_returns_tuple, R_ALL, R_ALL),
    "position ignored": (rope_identity, R_ALL - {GRADS}, R_ALL - {GRADS}),
    "angles in float32": (rope_float32_angles, {EXAMPLE, SHAPES, BASE}, {EXAMPLE, SHAPES, BASE}),
    # (right for (T, d) inputs: the notebook's relative case has no leading dimension, the re-check's have some)
    "T = x.shape[0]": (rope_T_from_first_axis, R_ALL - {EXAMPLE, RELATIVE}, R_ALL - {EXAMPLE}),
    "added, not rotated": (rope_added_not_rotated, R_ALL - {GRADS}, R_ALL - {GRADS}),
    "no base argument": (rope_no_base_argument, {BASE}, {BASE}),
    "angle grows with pos ** 2": (rope_angle_quadratic, R_ALL - {GRADS}, R_ALL - {GRADS}),
}

CORRECT = {
    "sinusoidal_encoding": {
        "reference": correct_table, "float32 exp/log": table_float32_exp_log, "stacked": table_by_stacking,
        "seed module": _lazy(seed_table_via_module), "seed construction as body": _lazy(seed_table_as_body),
        "complex powers": table_complex_powers, "phase-shifted sines": table_phase_shifted_sines,
    },
    "apply_rope": {
        "reference": correct_rope, "complex numbers": rope_complex, "rotate every two": rope_rotate_every_two,
        "2x2 rotation matrices": rope_rotation_matrices, "pair by pair": rope_pair_by_pair,
    },
}
WRONG = {"sinusoidal_encoding": TABLE_WRONG, "apply_rope": ROPE_WRONG}
