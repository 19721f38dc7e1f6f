"""A corpus of honest but unusual correct answers, for every assignment.

Each entry of ``HONEST`` is one student's submission:

- ``id``: the student id (lowercase letters, digits, underscores), unique;
- ``assignment``: the folder under solutions/ and exercises/;
- ``answers``: grade_id of an answer cell -> the whole source of that cell (the
  answer cells not listed keep the solution's code);
- ``extra``: code cells the student added, as ``("after:<grade_id>", source)``
  (inserted right after the cell of that grade_id, in the order given) or
  ``("end", source)``;
- ``why``: what is unusual about it.

Every answer is correct and builds the piece itself: no answer calls the built-in
its piece asks to implement (PyTorch's softmax in the softmax exercise, PyTorch's
attention in the attention exercises, nn.RNN in the RNN exercise, PyTorch's
causal mask in the causal-mask exercise), and none imports the course's
reference. Some *added* cells do call those built-ins, to compare the answer
with them (``torch.testing.assert_close``): that is a student testing their
work, not the answer using the built-in. A grader must give every entry full
marks; ``tests/corpus/verify_honest.py`` runs them in a plain kernel.

``kv_own_helper_extend`` calls a helper method of its own ``KVCache`` from
``cached_attention_step``: both runners hand the step the student's own
cache (the declaration's ``needs``).
"""
from __future__ import annotations

import textwrap


def _c(source: str) -> str:
    """A cell's source: the block dedented, without its first and last blank lines."""
    return textwrap.dedent(source).strip("\n") + "\n"


# ============================================================ shared pieces
# Attention, written several ways (the later notebooks paste one of these).

SDPA_EINSUM = _c('''
def scaled_dot_product_attention(Q, K, V, mask=None):
    """softmax(Q K^T / sqrt(d_k) + mask) V with einsum; the softmax through logsumexp."""
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores + mask
    # exp(s - log(sum(exp(s)))): the log-normaliser taken out before exp, so nothing overflows
    weights = torch.exp(scores - torch.logsumexp(scores, dim=-1, keepdim=True))
    return torch.einsum("...qk,...kv->...qv", weights, V), weights
''')

SDPA_BADDBMM = _c('''
def scaled_dot_product_attention(Q, K, V, mask=None):
    """softmax(Q K^T / sqrt(d_k) + mask) V on 3-D batches: every leading dim folded into one."""
    T_q, d_k = Q.shape[-2:]
    T_k, d_v = V.shape[-2:]
    lead = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2],
                                  () if mask is None else mask.shape[:-2])

    def fold(t, rows, cols):
        return t.expand(*lead, rows, cols).reshape(-1, rows, cols)

    q, k, v = fold(Q, T_q, d_k), fold(K, T_k, d_k), fold(V, T_k, d_v)
    scale = 1.0 / math.sqrt(d_k)
    if mask is None:
        scores = torch.bmm(q, k.transpose(1, 2)) * scale
    else:
        input = fold(mask.to(Q.dtype), T_q, T_k)  # what baddbmm adds: its argument is called input
        scores = torch.baddbmm(input, q, k.transpose(1, 2), beta=1.0, alpha=scale)
    weights = torch.softmax(scores, dim=-1)
    return torch.bmm(weights, v).reshape(*lead, T_q, d_v), weights.reshape(*lead, T_q, T_k)
''')

SDPA_OPERATOR = _c('''
import functools
import operator

_over_keys = functools.partial(torch.softmax, dim=-1)


def scaled_dot_product_attention(Q, K, V, mask=None):
    """softmax(Q K^T / sqrt(d_k) + mask) V, spelt with the operator module."""
    scores = operator.truediv(operator.matmul(Q, K.mT), math.sqrt(Q.size(-1)))
    terms = [scores] if mask is None else [scores, mask]
    weights = _over_keys(functools.reduce(operator.add, terms))
    return operator.matmul(weights, V), weights
''')

# Splitting and merging heads.

SPLIT_UNFLATTEN = _c('''
def split_heads(x, n_heads):
    """(B, T, d_model) -> (B, n_heads, T, d_k): unflatten the features, then swap T and the heads."""
    return x.unflatten(-1, (n_heads, x.shape[-1] // n_heads)).transpose(-3, -2)
''')

MERGE_FLATTEN = _c('''
def merge_heads(x):
    """(B, n_heads, T, d_k) -> (B, T, n_heads * d_k)."""
    return x.transpose(-3, -2).flatten(-2)
''')

SPLIT_CHUNK = _c('''
def split_heads(x, n_heads):
    """(B, T, d_model) -> (B, n_heads, T, d_k): n_heads consecutive chunks of features, stacked."""
    return torch.stack(x.chunk(n_heads, dim=-1), dim=1)
''')

MERGE_CAT = _c('''
def merge_heads(x):
    """(B, n_heads, T, d_k) -> (B, T, n_heads * d_k): the heads side by side again."""
    return torch.cat(x.unbind(dim=1), dim=-1)
''')

# Multi-head attention.

MHA_SETATTR = _c('''
class MultiHeadAttention(nn.Module):
    """Self-attention with n_heads heads; the four projections made in a loop."""

    NAMES = ("W_q", "W_k", "W_v", "W_o")

    def __init__(self, d_model, n_heads):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} does not divide d_model={d_model}")
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        for name in self.NAMES:
            setattr(self, name, nn.Linear(d_model, d_model, bias=False))

    def forward(self, x, mask=None):
        Q, K, V = (split_heads(getattr(self, name)(x), self.n_heads) for name in self.NAMES[:3])
        out, weights = scaled_dot_product_attention(Q, K, V, mask)
        return getattr(self, "W_o")(merge_heads(out)), weights
''')

MHA_MODULEDICT_SUBCLASS = _c('''
class MultiHeadAttention(nn.ModuleDict):
    """Self-attention as an nn.ModuleDict of its four projections: self["W_q"] is self.W_q."""

    def __init__(self, d_model, n_heads):
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        super().__init__({name: nn.Linear(d_model, d_model, bias=False) for name in ("W_q", "W_k", "W_v", "W_o")})
        self.n_heads = n_heads
        self.d_k = d_model // n_heads

    def forward(self, x, mask=None):
        Q, K, V = (split_heads(self[name](x), self.n_heads) for name in ("W_q", "W_k", "W_v"))
        out, weights = scaled_dot_product_attention(Q, K, V, mask)
        return self["W_o"](merge_heads(out)), weights
''')

MHA_MODULEDICT_PROPERTIES = _c('''
class MultiHeadAttention(nn.Module):
    """The four projections live in one nn.ModuleDict; properties give them their names."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        assert d_model % n_heads == 0, "d_model must be divisible by n_heads"
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.proj = nn.ModuleDict({key: nn.Linear(d_model, d_model, bias=False) for key in "qkvo"})

    W_q = property(lambda self: self.proj["q"])
    W_k = property(lambda self: self.proj["k"])
    W_v = property(lambda self: self.proj["v"])
    W_o = property(lambda self: self.proj["o"])

    def forward(self, x, mask=None):
        Q, K, V = (split_heads(self.proj[key](x), self.n_heads) for key in "qkv")
        out, weights = scaled_dot_product_attention(Q, K, V, mask)
        return self.proj["o"](merge_heads(out)), weights
''')

MHA_EINSUM = _c('''
class MultiHeadAttention(nn.Module):
    """Self-attention whose projections are written as einsums with the layers' weights."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"n_heads={n_heads} does not divide d_model={d_model}")
        self.n_heads = n_heads
        self.d_k = d_model // n_heads
        self.W_q = nn.Linear(d_model, d_model, bias=False)
        self.W_k = nn.Linear(d_model, d_model, bias=False)
        self.W_v = nn.Linear(d_model, d_model, bias=False)
        self.W_o = nn.Linear(d_model, d_model, bias=False)

    @staticmethod
    def _project(layer, x):
        # nn.Linear computes x W^T: "d" the input feature, "e" the output feature
        # (not called _apply: nn.Module.to() and .double() use a method of that name)
        return torch.einsum("btd,ed->bte", x, layer.weight)

    def forward(self, x, mask=None):
        Q, K, V = (split_heads(self._project(layer, x), self.n_heads) for layer in (self.W_q, self.W_k, self.W_v))
        out, weights = scaled_dot_product_attention(Q, K, V, mask)
        return self._project(self.W_o, merge_heads(out)), weights
''')

MHA_DATACLASS = _c('''
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class HeadLayout:
    d_model: int
    n_heads: int

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} does not divide d_model={self.d_model}")

    @property
    def d_k(self) -> int:
        return self.d_model // self.n_heads


class MultiHeadAttention(nn.Module):
    """Self-attention; its shape described by a frozen dataclass."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.layout = HeadLayout(d_model, n_heads)
        self.n_heads = n_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    @property
    def d_k(self) -> int:
        return self.layout.d_k

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        heads = [split_heads(layer(x), self.layout.n_heads) for layer in (self.W_q, self.W_k, self.W_v)]
        out, weights = scaled_dot_product_attention(*heads, mask=mask)
        return self.W_o(merge_heads(out)), weights
''')

# Feed-forward networks.

FFN_SEQUENTIAL_SUBCLASS = _c('''
class FeedForward(nn.Sequential):
    """Linear -> GELU -> Linear as an nn.Sequential: forward is Sequential's own."""

    def __init__(self, d_model):
        super().__init__(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
''')

FFN_MODULELIST_FGELU = _c('''
import torch.nn.functional as F


class FeedForward(nn.Module):
    """Two Linear layers in an nn.ModuleList, the exact GELU from torch.nn.functional between them."""

    def __init__(self, d_model):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)])

    def forward(self, x):
        up, down = self.layers
        return down(F.gelu(up(x)))
''')

FFN_INNER_SEQUENTIAL = _c('''
from collections import OrderedDict


class FeedForward(nn.Module):
    """An nn.Sequential with named parts inside a module."""

    def __init__(self, d_model: int, expansion: int = 4) -> None:
        super().__init__()
        hidden = expansion * d_model
        self.net = nn.Sequential(OrderedDict(
            up=nn.Linear(d_model, hidden),
            act=nn.GELU(approximate="none"),
            down=nn.Linear(hidden, d_model),
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
''')

# Transformer blocks.

BLOCK_SETATTR = _c('''
class TransformerBlock(nn.Module):
    """Pre-LN block; the two LayerNorms made in a loop and looked up by name."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        for name in ("ln1", "ln2"):
            setattr(self, name, nn.LayerNorm(d_model))
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        a, weights = self.attn(getattr(self, "ln1")(x), mask)
        x = x + self.drop(a)
        return x + self.drop(self.ffn(getattr(self, "ln2")(x))), weights
''')

BLOCK_FDROPOUT = _c('''
import torch.nn.functional as F


class TransformerBlock(nn.Module):
    """Pre-LN block; dropout through torch.nn.functional, following self.training."""

    def __init__(self, d_model, n_heads, dropout=0.1):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model)
        self.p = float(dropout)

    def _dropped(self, y):
        return F.dropout(y, p=self.p, training=self.training)

    def forward(self, x, mask=None):
        a, weights = self.attn(self.ln1(x), mask)
        x = x + self._dropped(a)
        x = x + self._dropped(self.ffn(self.ln2(x)))
        return x, weights
''')

BLOCK_FUNCTIONAL_LN = _c('''
from typing import Optional, Tuple

import torch.nn.functional as F


class TransformerBlock(nn.Module):
    """Pre-LN block; the LayerNorm modules hold the parameters, F.layer_norm applies them."""

    def __init__(self, d_model: int, n_heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = MultiHeadAttention(d_model, n_heads)
        self.ffn = FeedForward(d_model)
        self.drop = nn.Dropout(p=dropout)

    @staticmethod
    def _norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        a, weights = self.attn(self._norm(self.ln1, x), mask)
        x = x + self.drop(a)
        x = x + self.drop(self.ffn(self._norm(self.ln2, x)))
        return x, weights
''')

# KV caches and cached steps.

KV_SETATTR = _c('''
class KVCache:
    """Keys and values seen so far, (B, H, T, d_k) each, or None while empty."""

    def __init__(self):
        for name in ("K", "V"):
            setattr(self, name, None)

    def append(self, k, v):
        for name, new in (("K", k), ("V", v)):
            old = getattr(self, name)
            setattr(self, name, new if old is None else torch.cat([old, new], dim=-2))
        return self.K, self.V

    def __len__(self):
        return 0 if self.K is None else int(self.K.shape[-2])
''')

KV_DATACLASS = _c('''
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass
class KVCache:
    """Keys and values seen so far, (B, H, T, d_k) each, or None while empty."""

    K: Optional[torch.Tensor] = None
    V: Optional[torch.Tensor] = None

    def append(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.K = k if self.K is None else torch.cat((self.K, k), dim=-2)
        self.V = v if self.V is None else torch.cat((self.V, v), dim=-2)
        return self.K, self.V

    def __len__(self) -> int:
        return 0 if self.K is None else self.K.size(-2)
''')

STEP_EINSUM = _c('''
def cached_attention_step(x_new, cache, mha):
    """Attention of x_new (B, T_new, d_model) over the cache and itself, with einsum."""
    B, T_new, d_model = x_new.shape
    H = mha.n_heads
    d_k = d_model // H
    T_past = len(cache)

    def heads(t):
        return t.reshape(B, T_new, H, d_k).permute(0, 2, 1, 3)  # (B, H, T_new, d_k)

    q, k, v = (heads(layer(x_new)) for layer in (mha.W_q, mha.W_k, mha.W_v))
    K, V = cache.append(k, v)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, K) / math.sqrt(d_k)
    if T_new > 1:  # new token i sits at position T_past + i
        rows = torch.arange(T_past, T_past + T_new, device=x_new.device)[:, None]
        cols = torch.arange(T_past + T_new, device=x_new.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bhkd->bqhd", weights, V).reshape(B, T_new, d_model)
    return mha.W_o(out), weights
''')

STEP_GETATTR = _c('''
def cached_attention_step(x_new, cache, mha):
    """Attention of x_new over the cache and itself; the projections looked up by name."""
    T_new, T_past = x_new.shape[1], len(cache)
    q, k, v = (split_heads(getattr(mha, f"W_{c}")(x_new), mha.n_heads) for c in "qkv")
    K, V = cache.append(k, v)
    mask = None
    if T_new > 1:
        new_pos = torch.arange(T_past, T_past + T_new, device=x_new.device)
        all_pos = torch.arange(T_past + T_new, device=x_new.device)
        future = all_pos[None, :] > new_pos[:, None]
        mask = torch.zeros(future.shape, dtype=x_new.dtype, device=x_new.device).masked_fill(future, float("-inf"))
    out, weights = scaled_dot_product_attention(q, K, V, mask)
    return getattr(mha, "W_o")(merge_heads(out)), weights
''')


# ============================================================ the entries
HONEST = []


def _entry(id, assignment, answers, extra=(), why=""):
    HONEST.append(dict(id=id, assignment=assignment, answers=dict(answers), extra=list(extra), why=why))


# ------------------------------------------------------------ softmax
_entry(
    "softmax_logsumexp_timeit", "softmax",
    {"softmax": _c('''
        def softmax(x, dim=-1):
            """Softmax of x along dim: exp(x - logsumexp(x)), never an overflowing exp."""
            return torch.exp(x - torch.logsumexp(x, dim=dim, keepdim=True))
    ''')},
    [("after:try_it_code", "%timeit -n 20 -r 3 softmax(torch.randn(64, 64))\n"),
     ("end", _c('''
        # my own check against PyTorch's softmax (only here, never in the answer)
        g = torch.Generator().manual_seed(0)
        for shape, dim in (((4, 5), -1), ((2, 3, 4), 0), ((2, 3, 4), 1)):
            for dtype in (torch.float32, torch.float64):
                t = 50 * torch.randn(*shape, generator=g, dtype=dtype)
                torch.testing.assert_close(softmax(t, dim=dim), torch.softmax(t, dim=dim))
        print("softmax agrees with torch.softmax")
    '''))],
    "softmax as exp(x - logsumexp(x)); an added %timeit cell and a torch.testing.assert_close self-test against torch.softmax",
)

_entry(
    "softmax_movedim_input_cellmagic", "softmax",
    {"softmax": _c('''
        def softmax(x, dim=-1):
            """Softmax along dim: move that axis last, normalise, move it back."""
            input = x.movedim(dim, -1)
            peak = input.max(dim=-1, keepdim=True).values
            e = (input - peak).exp()
            return (e / e.sum(-1, keepdim=True)).movedim(-1, dim)
    ''')},
    [("after:try_it_code", _c('''
        %%time
        big = softmax(torch.randn(256, 128), dim=0)
        print(big.shape)
    ''')),
     ("after:try_it_code", _c('''
        w = softmax(torch.tensor([[1.0, 2.0, 3.0], [0.0, float("-inf"), 5.0]]))
        print(w)
        assert torch.allclose(w.sum(dim=-1), torch.ones(2)), "rows should sum to 1"
        assert w[1, 1] == 0, "-inf gets exactly 0"
    '''))],
    "a variable named input, movedim and max(...).values; an added %%time cell and a print/assert cell",
)

_entry(
    "softmax_display_in_answer", "softmax",
    {"softmax": _c('''
        %matplotlib inline
        def softmax(x, dim=-1):
            """Softmax along dim, max subtracted; shows a small example with IPython's display."""
            e = (x - x.amax(dim=dim, keepdim=True)).exp()
            return e / e.sum(dim=dim, keepdim=True)

        display(softmax(torch.tensor([1.0, 2.0, 3.0])))
        shell = get_ipython()
        print(len(In), type(Out).__name__, shell is not None)
        %time _ = softmax(torch.randn(8, 8))
    ''')},
    [],
    "IPython's builtins display and get_ipython, In and Out, and line magics in the answer cell itself",
)

_entry(
    "softmax_float64_warnings", "softmax",
    {"softmax": _c('''
        import warnings


        def softmax(x, dim=-1):
            """Softmax along dim, accumulated in float64 and rounded back to x's dtype."""
            if not x.is_floating_point():
                warnings.warn("softmax of an integer tensor: computing in float32", UserWarning)
                x = x.float()
            wide = x.double()
            e = torch.exp(wide - wide.amax(dim=dim, keepdim=True))
            return (e / e.sum(dim=dim, keepdim=True)).to(x.dtype)
    ''')},
    [],
    "imports warnings (warns only for integer input, never tested); computes in float64 and casts back",
)

_entry(
    "softmax_l1_normalize_getattr", "softmax",
    {"softmax": _c('''
        from typing import Optional

        import torch.nn.functional as F


        def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
            """exp(x - max) divided by its L1 norm: the entries are >= 0, so that is their sum."""
            e = torch.exp(x - x.amax(dim=dim, keepdim=True))
            return F.normalize(e, p=1.0, dim=dim)
    ''')},
    [("end", _c('''
        import types

        seen = types.SimpleNamespace()
        for name, dim in (("rows", -1), ("columns", 0)):
            setattr(seen, name, softmax(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), dim=dim))
        print(getattr(seen, "rows"), getattr(seen, "columns"), sep="\\n")
    '''))],
    "normalises with F.normalize(p=1) (a torch.nn.functional call that is not a softmax); typing; setattr/getattr in an added cell",
)

# ------------------------------------------------------------ attention
_entry(
    "attn_einsum_timeit_selftest", "attention",
    {"scaled_dot_product_attention": SDPA_EINSUM},
    [("after:try_it_code", "%timeit -n 10 -r 3 scaled_dot_product_attention(*torch.randn(3, 2, 4, 16, 8))\n"),
     ("end", _c('''
        import torch.nn.functional as F

        # my own check against PyTorch's attention (only in this cell)
        g = torch.Generator().manual_seed(0)
        Qs, Ks, Vs = (torch.randn(2, 3, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
        causal = torch.full((5, 5), float("-inf"), dtype=torch.float64).triu(1)
        for m in (None, causal):
            mine, _ = scaled_dot_product_attention(Qs, Ks, Vs, m)
            torch.testing.assert_close(mine, F.scaled_dot_product_attention(Qs, Ks, Vs, attn_mask=m))
        print("agrees with F.scaled_dot_product_attention")
    '''))],
    "einsum scores and a logsumexp softmax; an added %timeit cell and an added torch.testing.assert_close against F.scaled_dot_product_attention",
)

_entry(
    "attn_baddbmm_input_cellmagic", "attention",
    {"scaled_dot_product_attention": SDPA_BADDBMM},
    [("after:try_it_code", _c('''
        %%time
        out, w = scaled_dot_product_attention(torch.randn(8, 32, 16), torch.randn(8, 32, 16), torch.randn(8, 32, 16))
        print(out.shape, w.shape)
    ''')),
     ("after:try_it_code", _c('''
        out, w = scaled_dot_product_attention(Q, K, V)
        print("row sums:", w.sum(-1))
        assert torch.allclose(w.sum(-1), torch.ones(1)), "weights should sum to 1"
        assert out.shape == (1, 2)
    '''))],
    "folds the leading dims and uses torch.baddbmm with a variable named input; an added %%time cell and a print/assert cell",
)

_entry(
    "attn_warnings_input_var", "attention",
    {"scaled_dot_product_attention": _c('''
        import warnings


        def scaled_dot_product_attention(Q, K, V, mask=None):
            """Scaled dot-product attention; the queries are scaled before the product."""
            input = Q
            d_k = input.shape[-1]
            if d_k == 0:
                warnings.warn("d_k = 0: every score is 0 and the weights are uniform", RuntimeWarning)
            scores = torch.matmul(input * (d_k ** -0.5 if d_k else 1.0), K.transpose(-1, -2))
            if mask is not None:
                scores = scores + mask
            weights = scores.softmax(dim=-1)
            return torch.matmul(weights, V), weights
    ''')},
    [],
    "a variable named input, Q scaled before the product, Tensor.softmax; imports warnings for an untested edge case",
)

_entry(
    "attn_operator_namespace", "attention",
    {"scaled_dot_product_attention": SDPA_OPERATOR},
    [("end", _c('''
        import types

        results = types.SimpleNamespace()
        eye = torch.eye(3)
        for name, m in (("plain", None), ("causal", torch.full((3, 3), float("-inf")).triu(1))):
            setattr(results, name, scaled_dot_product_attention(eye, eye, eye, m)[1])
        print(getattr(results, "causal"))
    '''))],
    "operator.matmul/truediv/add with functools.partial and reduce; setattr/getattr on a namespace in an added cell",
)

# ------------------------------------------------------------ multi-head attention
_entry(
    "mha_setattr_loop", "multi_head_attention",
    {"MultiHeadAttention": MHA_SETATTR},
    [("after:try_mha", "%time output, weights = mha(x)\n")],
    "the four nn.Linear layers made with setattr in a loop and used through getattr; an added %time cell",
)

_entry(
    "mha_moduledict_subclass", "multi_head_attention",
    {"split_heads": SPLIT_UNFLATTEN, "merge_heads": MERGE_FLATTEN, "MultiHeadAttention": MHA_MODULEDICT_SUBCLASS},
    [],
    "MultiHeadAttention subclasses nn.ModuleDict (self['W_q'] is self.W_q); heads split with unflatten, merged with flatten",
)

_entry(
    "mha_einsum", "multi_head_attention",
    {"scaled_dot_product_attention": SDPA_EINSUM, "MultiHeadAttention": MHA_EINSUM},
    [("end", _c('''
        # my own check against nn.MultiheadAttention with the same weights (only in this cell)
        mine = MultiHeadAttention(16, 4).double()
        theirs = nn.MultiheadAttention(16, 4, bias=False, batch_first=True).double()
        with torch.no_grad():
            theirs.in_proj_weight.copy_(torch.cat([mine.W_q.weight, mine.W_k.weight, mine.W_v.weight]))
            theirs.out_proj.weight.copy_(mine.W_o.weight)
            xx = torch.randn(2, 5, 16, dtype=torch.float64)
            a, wa = mine(xx)
            b, wb = theirs(xx, xx, xx, need_weights=True, average_attn_weights=False)
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(wa, wb)
        print("same as nn.MultiheadAttention")
    '''))],
    "einsum for the attention and for the projections (with the layers' weights); a torch.testing self-test against nn.MultiheadAttention",
)

_entry(
    "mha_dataclass_chunk", "multi_head_attention",
    {"split_heads": SPLIT_CHUNK, "merge_heads": MERGE_CAT, "MultiHeadAttention": MHA_DATACLASS},
    [],
    "a frozen @dataclass for the head layout (d_k a property that reads it), typing annotations, layers assigned by "
    "tuple unpacking; chunk/stack and unbind/cat for the heads",
)

# ------------------------------------------------------------ transformer block
_entry(
    "block_sequential_setattr", "transformer_block",
    {"MultiHeadAttention": MHA_SETATTR, "FeedForward": FFN_SEQUENTIAL_SUBCLASS, "TransformerBlock": BLOCK_SETATTR},
    [("after:try_block", "%time output, weights = block(x, mask)\n")],
    "FeedForward subclasses nn.Sequential; LayerNorms and projections made with setattr and used through getattr; %time",
)

_entry(
    "block_moduledict_dataloader", "transformer_block",
    {"scaled_dot_product_attention": SDPA_BADDBMM, "split_heads": SPLIT_CHUNK, "merge_heads": MERGE_CAT,
     "MultiHeadAttention": MHA_MODULEDICT_PROPERTIES, "FeedForward": FFN_MODULELIST_FGELU,
     "TransformerBlock": BLOCK_FDROPOUT},
    [("end", _c('''
        from torch.utils.data import DataLoader, TensorDataset

        torch.manual_seed(1)
        data = TensorDataset(torch.randn(10, 6, 32))
        blk = TransformerBlock(32, 4).eval()
        with torch.no_grad():
            for (batch,) in DataLoader(data, batch_size=4):
                out, w = blk(batch)
                print(tuple(batch.shape), "->", tuple(out.shape), tuple(w.shape))
    '''))],
    "projections in an nn.ModuleDict exposed as properties, F.gelu over an nn.ModuleList, F.dropout(training=...); torch.utils.data in an added cell",
)

_entry(
    "block_functional_layernorm_typing", "transformer_block",
    {"scaled_dot_product_attention": SDPA_EINSUM, "split_heads": SPLIT_UNFLATTEN, "merge_heads": MERGE_FLATTEN,
     "MultiHeadAttention": MHA_EINSUM, "FeedForward": FFN_INNER_SEQUENTIAL, "TransformerBlock": BLOCK_FUNCTIONAL_LN},
    [("end", _c('''
        def parameter_norms(module):
            """The size of every parameter, for a report: no gradient needed."""
            with torch.no_grad():
                return {name: round(p.norm().item(), 3) for name, p in module.named_parameters()}


        print(parameter_norms(TransformerBlock(8, 2)))
    '''))],
    "F.layer_norm applied with the LayerNorm modules' parameters, an OrderedDict Sequential, einsum attention, typing; a torch.no_grad helper in an added cell",
)

# ------------------------------------------------------------ capstone
_entry(
    "capstone_setattr_modulelist", "capstone",
    {
        "MultiHeadAttention": MHA_SETATTR,
        "FeedForward": FFN_SEQUENTIAL_SUBCLASS,
        "TransformerBlock": BLOCK_SETATTR,
        "KVCache": KV_SETATTR,
        "cached_attention_step": STEP_GETATTR,
        "StudentGPT": _c('''
            class StudentGPT(nn.Module):
                """Token + learned position embeddings, my blocks with a causal mask, ln_f and a bias-free head."""

                def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
                    super().__init__()
                    parts = {"tok": nn.Embedding(vocab_size, d_model), "pos": nn.Embedding(max_len, d_model)}
                    for name, part in parts.items():
                        setattr(self, name, part)
                    self.blocks = nn.ModuleList()
                    for _ in range(n_layers):
                        self.blocks.append(TransformerBlock(d_model, n_heads, dropout=0.0))
                    setattr(self, "ln_f", nn.LayerNorm(d_model))
                    setattr(self, "head", nn.Linear(d_model, vocab_size, bias=False))

                def forward(self, idx):
                    T = idx.shape[1]
                    i = torch.arange(T, device=idx.device)
                    x = getattr(self, "tok")(idx) + getattr(self, "pos")(i)
                    future = i[None, :] > i[:, None]  # key after query
                    mask = torch.zeros(T, T, dtype=x.dtype, device=x.device).masked_fill(future, float("-inf"))
                    attentions = []
                    for block in self.blocks:
                        x, weights = block(x, mask)
                        attentions.append(weights)
                    return getattr(self, "head")(getattr(self, "ln_f")(x)), attentions
        '''),
        "generate_cached": _c('''
            import itertools


            def generate_cached(model, ids, n_new):
                """Greedy decoding with one of my KVCache per block."""
                caches = [KVCache() for _ in model.blocks]
                chosen, step_logits, feed = [ids], [], ids
                with torch.no_grad():
                    for _ in itertools.repeat(None, n_new):
                        start = len(caches[0])
                        x = model.tok(feed) + model.pos(torch.arange(start, start + feed.shape[1], device=feed.device))
                        for block, cache in zip(model.blocks, caches):
                            a, _ = cached_attention_step(block.ln1(x), cache, block.attn)
                            x = x + a
                            x = x + block.ffn(block.ln2(x))
                        logits = model.head(model.ln_f(x[:, -1]))
                        step_logits.append(logits)
                        feed = logits.argmax(dim=-1, keepdim=True)
                        chosen.append(feed)
                return torch.cat(chosen, dim=1), torch.stack(step_logits, dim=1)
        '''),
    },
    [("end", _c('''
        from torch.utils.data import DataLoader

        right = total = 0
        for batch in DataLoader(corpus.held_out[:32], batch_size=8, collate_fn=list):
            for ex in batch:
                prompt_ids = torch.tensor([ex.ids[: ex.pronoun_index + 1]])
                out, _ = generate_cached(model.eval(), prompt_ids, 1)
                right += int(out[0, -1]) == ex.ids[ex.answer_index]
                total += 1
        print(f"{right} of {total} held-out referents named")
    '''))],
    "StudentGPT parts made with setattr, blocks appended to an nn.ModuleList, everything used via getattr; arange-comparison mask; setattr KVCache; itertools; torch.utils.data in an added cell",
)

_entry(
    "capstone_dataclass_einsum", "capstone",
    {
        "scaled_dot_product_attention": SDPA_EINSUM,
        "split_heads": SPLIT_UNFLATTEN,
        "merge_heads": MERGE_FLATTEN,
        "MultiHeadAttention": MHA_MODULEDICT_SUBCLASS,
        "FeedForward": FFN_MODULELIST_FGELU,
        "TransformerBlock": BLOCK_FUNCTIONAL_LN,
        "KVCache": KV_DATACLASS,
        "cached_attention_step": STEP_EINSUM,
        "StudentGPT": _c('''
            from dataclasses import dataclass
            from typing import List, Tuple


            @dataclass(frozen=True)
            class GPTConfig:
                vocab_size: int
                d_model: int = 64
                n_heads: int = 4
                n_layers: int = 2
                max_len: int = 32


            class StudentGPT(nn.Module):
                """A decoder-only transformer described by a GPTConfig."""

                def __init__(self, vocab_size, d_model=64, n_heads=4, n_layers=2, max_len=32):
                    super().__init__()
                    self.config = cfg = GPTConfig(vocab_size, d_model, n_heads, n_layers, max_len)
                    self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
                    self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
                    self.blocks = nn.ModuleList(
                        map(lambda _: TransformerBlock(cfg.d_model, cfg.n_heads, dropout=0.0), range(cfg.n_layers))
                    )
                    self.ln_f = nn.LayerNorm(cfg.d_model)
                    self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

                def forward(self, idx: torch.Tensor) -> Tuple[torch.Tensor, List[torch.Tensor]]:
                    T = idx.shape[-1]
                    x = self.tok(idx) + self.pos.weight[:T]  # rows 0..T-1 of the position table
                    mask = torch.ones(T, T, dtype=x.dtype, device=x.device).tril().log()  # log 1 = 0, log 0 = -inf
                    attentions: List[torch.Tensor] = []
                    for block in self.blocks:
                        x, w = block(x, mask)
                        attentions.append(w)
                    return self.head(self.ln_f(x)), attentions
        '''),
        "generate_cached": _c('''
            def generate_cached(model: nn.Module, ids: torch.Tensor, n_new: int):
                """Greedy decoding with my dataclass KVCache, one per block."""
                caches = [KVCache() for _ in range(len(model.blocks))]
                out, picked_from, feed = ids, [], ids
                with torch.no_grad():
                    while len(picked_from) < n_new:
                        offset = len(caches[0])
                        x = model.tok(feed) + model.pos.weight[offset: offset + feed.shape[1]]
                        for block, cache in zip(model.blocks, caches):
                            a, _ = cached_attention_step(block.ln1(x), cache, block.attn)
                            x = x + a
                            x = x + block.ffn(block.ln2(x))
                        last = model.head(model.ln_f(x[:, -1]))
                        picked_from.append(last)
                        feed = last.argmax(-1).unsqueeze(-1)
                        out = torch.cat((out, feed), dim=-1)
                return out, torch.stack(picked_from, 1)
        '''),
    },
    [("end", _c('''
        %%time
        ids = torch.tensor([vocab.encode("the dog did not cross the river because it was too wide . it", bos=True)])
        print(vocab.decode(generate_cached(model.eval(), ids, 2)[0][0, 1:]))
    '''))],
    "a @dataclass GPTConfig and a @dataclass KVCache, ModuleDict-subclass attention, einsum cached step, log(tril(ones)) mask, positions sliced from pos.weight; %%time",
)

# ------------------------------------------------------------ KV cache
_entry(
    "kv_own_helper_extend", "kv_cache",
    {
        "KVCache": _c('''
            class KVCache:
                """Keys and values seen so far, (B, H, T, d_k) each, or None while empty."""

                def __init__(self):
                    self.K = None
                    self.V = None

                def extend(self, k, v):
                    """Put k, v after the cached positions (the time axis, dim=-2)."""
                    self.K = k if self.K is None else torch.cat((self.K, k), dim=-2)
                    self.V = v if self.V is None else torch.cat((self.V, v), dim=-2)

                def append(self, k, v):
                    self.extend(k, v)
                    return self.K, self.V

                def __len__(self):
                    return 0 if self.K is None else self.K.size(-2)
        '''),
        "cached_attention_step": _c('''
            def cached_attention_step(x_new, cache, mha):
                """Attention of x_new over the cached tokens and itself; grows the cache with cache.extend."""
                B, T_new, d_model = x_new.shape
                H, d_k = mha.n_heads, d_model // mha.n_heads
                T_past = len(cache)

                def split(t):
                    return t.reshape(B, T_new, H, d_k).transpose(1, 2)

                q = split(mha.W_q(x_new))
                cache.extend(split(mha.W_k(x_new)), split(mha.W_v(x_new)))
                K, V = cache.K, cache.V
                scores = q @ K.transpose(-2, -1) / math.sqrt(d_k)
                if T_new > 1:
                    scores = scores + torch.full((T_new, T_past + T_new), float("-inf"), dtype=x_new.dtype).triu(T_past + 1)
                weights = torch.softmax(scores, dim=-1)
                return mha.W_o((weights @ V).transpose(1, 2).reshape(B, T_new, d_model)), weights
        '''),
    },
    [],
    "KNOWN TO FAIL UNTIL THE CHECKS ARE FIXED: cached_attention_step calls a helper of the student's own KVCache (cache.extend); the committed step checks (b4bcfda) hand it the course's KVCache, which has no extend, so 4/11 there; 11/11 once they use the student's cache",
)

_entry(
    "kv_dataclass_einsum", "kv_cache",
    {
        "KVCache": KV_DATACLASS,
        "cached_attention_step": STEP_EINSUM,
        "generate": _c('''
            import itertools


            def generate(mha, prompt, n_new):
                """Extend prompt (B, T_p, d_model) by n_new vectors with one KVCache."""
                cache = KVCache()
                pieces, x_new = [prompt], prompt
                for _ in itertools.repeat(None, n_new):
                    out, _ = cached_attention_step(x_new, cache, mha)
                    x_new = out[:, -1:]
                    pieces.append(x_new)
                return torch.cat(pieces, dim=1)
        '''),
    },
    [],
    "a @dataclass KVCache with typing annotations, an einsum step with an arange-comparison mask (masked_fill), itertools.repeat in generate",
)

_entry(
    "kv_setattr_getattr_timeit", "kv_cache",
    {
        "KVCache": KV_SETATTR,
        "cached_attention_step": _c('''
            def cached_attention_step(x_new, cache, mha):
                """Attention of x_new over the cache and itself; the layers looked up by name."""
                B, T_new, d_model = x_new.shape
                H = mha.n_heads
                T_past = len(cache)
                input = x_new  # the new tokens

                def project(name):
                    return getattr(mha, name)(input).reshape(B, T_new, H, -1).transpose(1, 2)

                q = project("W_q")
                K, V = cache.append(project("W_k"), project("W_v"))
                scores = q @ K.transpose(-2, -1) * K.shape[-1] ** -0.5
                if T_new > 1:
                    i = torch.arange(T_new)[:, None] + T_past
                    j = torch.arange(T_past + T_new)[None, :]
                    scores = torch.where(j > i, torch.tensor(float("-inf"), dtype=scores.dtype), scores)
                weights = torch.softmax(scores, dim=-1)
                return getattr(mha, "W_o")((weights @ V).transpose(1, 2).reshape(B, T_new, d_model)), weights
        '''),
        "generate": _c('''
            def generate(mha, prompt, n_new):
                """Extend prompt by n_new vectors with one KVCache (a while loop)."""
                if n_new < 0:
                    raise ValueError("n_new must be >= 0")
                cache, seq, x_new = KVCache(), prompt, prompt
                while seq.shape[1] < prompt.shape[1] + n_new:
                    out, _ = cached_attention_step(x_new, cache, mha)
                    x_new = out[:, -1:]
                    seq = torch.cat([seq, x_new], dim=1)
                return seq
        '''),
    },
    [("after:try_generate", "%timeit -n 1 -r 2 generate(big, prompt, 20)\n")],
    "KVCache built with setattr/getattr, layers fetched with getattr, a variable named input, torch.where mask; %timeit in an added cell",
)

# ------------------------------------------------------------ causal mask
_entry(
    "mask_arange_where_timeit", "causal_mask",
    {"causal_mask": _c('''
        def causal_mask(T):
            """0 where key s <= query t, -inf where s > t: compare the positions themselves."""
            query = torch.arange(T).unsqueeze(1)  # (T, 1)
            key = torch.arange(T).unsqueeze(0)  # (1, T)
            return torch.where(key > query, torch.tensor(float("-inf")), torch.tensor(0.0))
    ''')},
    [("after:try_it_code", "%timeit causal_mask(64)\n")],
    "comparison of two aranges and torch.where; an added %timeit cell",
)

_entry(
    "mask_log_tril_selftest", "causal_mask",
    {"causal_mask": _c('''
        def causal_mask(T):
            """log of the lower-triangular ones: log 1 = 0 on and below the diagonal, log 0 = -inf above."""
            return torch.log(torch.ones(T, T).tril())
    ''')},
    [("after:try_it_code", _c('''
        m = causal_mask(4)
        print(m)
        assert torch.equal(m, torch.full((4, 4), float("-inf")).triu(1))
    ''')),
     ("end", _c('''
        import torch.nn as nn

        # my own check against PyTorch's mask (only in this cell)
        for T in (1, 5, 9):
            torch.testing.assert_close(causal_mask(T), nn.Transformer.generate_square_subsequent_mask(T))
        print("same as nn.Transformer.generate_square_subsequent_mask")
    '''))],
    "torch.log of tril(ones); a print/assert cell and a torch.testing self-test against nn.Transformer.generate_square_subsequent_mask in added cells",
)

_entry(
    "mask_lru_cache_input", "causal_mask",
    {"causal_mask": _c('''
        import functools


        @functools.lru_cache(maxsize=None)
        def _mask_table(T):
            input = torch.zeros(T, T)
            return input.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(diagonal=1), float("-inf"))


        def causal_mask(T):
            """The cached (T, T) mask, copied so that a caller cannot change the cache."""
            return _mask_table(T).clone()
    ''')},
    [],
    "functools.lru_cache of the mask (returned as a copy), a variable named input, masked_fill",
)

# ------------------------------------------------------------ positional encoding
_entry(
    "pe_explog_lru_complex_rope", "positional_encoding",
    {
        "sinusoidal_encoding": _c('''
            import functools
            import math


            @functools.lru_cache(maxsize=8)
            def _table64(max_len, d_model):
                position = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
                div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
                pe = torch.zeros(max_len, d_model, dtype=torch.float64)
                pe[:, 0::2] = torch.sin(position * div_term)
                pe[:, 1::2] = torch.cos(position * div_term)
                return pe


            def sinusoidal_encoding(max_len, d_model):
                """The float32 table; .to() makes a new tensor, so the cached one is never handed out."""
                return _table64(max_len, d_model).to(torch.float32)
        '''),
        "apply_rope": _c('''
            def apply_rope(x, base=10000.0):
                """Each pair (x[2i], x[2i+1]) as the complex number x[2i] + j x[2i+1], times exp(j p theta_i)."""
                T, d = x.shape[-2], x.shape[-1]
                theta = torch.pow(base, -torch.arange(0, d, 2, dtype=x.dtype) / d)
                angle = torch.outer(torch.arange(T, dtype=x.dtype), theta)  # (T, d/2)
                rotor = torch.polar(torch.ones_like(angle), angle)
                pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
                return torch.view_as_real(pairs * rotor).reshape(x.shape)
        '''),
    },
    [],
    "exp/log frequencies, slice assignment into a zeros table, functools.lru_cache; RoPE with complex numbers (view_as_complex, polar)",
)

_entry(
    "pe_helpers_before_pow", "positional_encoding",
    {
        "sinusoidal_encoding": _c('''
            def sinusoidal_encoding(max_len, d_model):
                """Uses the helpers of the cell after the imports."""
                inv = Frequencies(10000.0, d_model).inverse(torch.float64)
                angle = torch.arange(max_len, dtype=torch.float64)[:, None] * inv[None, :]
                return interleave(angle.sin(), angle.cos()).float()
        '''),
        "apply_rope": _c('''
            def apply_rope(x, base=10000.0):
                """x * cos + (each pair turned a quarter) * sin, the cos and sin repeated per pair."""
                T, d = x.shape[-2:]
                angle = torch.arange(T, dtype=x.dtype)[:, None] * Frequencies(base, d).inverse(x.dtype)
                cos = angle.cos().repeat_interleave(2, dim=-1)  # (T, d)
                sin = angle.sin().repeat_interleave(2, dim=-1)
                quarter_turn = interleave(-x[..., 1::2], x[..., 0::2])  # (-x[2i+1], x[2i])
                return x * cos + quarter_turn * sin
        '''),
    },
    [("after:imports", _c('''
        # helpers of mine, used by both answers below
        from dataclasses import dataclass


        @dataclass(frozen=True)
        class Frequencies:
            base: float
            width: int

            def inverse(self, dtype: torch.dtype) -> torch.Tensor:
                """base^(-2i/width) for i = 0 .. width/2 - 1."""
                exponent = -torch.arange(0, self.width, 2, dtype=dtype) / self.width
                return torch.pow(torch.tensor(self.base, dtype=dtype), exponent)


        def interleave(even: torch.Tensor, odd: torch.Tensor) -> torch.Tensor:
            """(..., n) and (..., n) -> (..., 2n): even[..., i] at 2i, odd[..., i] at 2i + 1."""
            return torch.stack((even, odd), dim=-1).flatten(-2)
    '''))],
    "helpers (a @dataclass, typing) defined in an added cell before the answer cells; pow frequencies; RoPE by rotate-a-quarter with repeat_interleave",
)

_entry(
    "pe_phase_sine_rotation_einsum", "positional_encoding",
    {
        "sinusoidal_encoding": _c('''
            import math


            def sinusoidal_encoding(max_len, d_model):
                """One sine for every column: cos(a) = sin(a + pi/2), so odd columns get a phase of pi/2."""
                freq = (10000.0 ** (-torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)).repeat_interleave(2)
                phase = torch.tensor([0.0, math.pi / 2], dtype=torch.float64).repeat(d_model // 2)
                pos = torch.arange(max_len, dtype=torch.float64)[:, None]
                return torch.sin(pos * freq + phase).to(torch.float32)
        '''),
        "apply_rope": _c('''
            def apply_rope(x, base=10000.0):
                """Every pair multiplied by its 2 x 2 rotation matrix, with einsum."""
                T, d = x.shape[-2], x.shape[-1]
                theta = base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
                angle = torch.arange(T, dtype=x.dtype)[:, None] * theta  # (T, d/2)
                c, s = angle.cos(), angle.sin()
                R = torch.stack((torch.stack((c, -s), -1), torch.stack((s, c), -1)), -2)  # (T, d/2, 2, 2)
                pairs = x.unflatten(-1, (d // 2, 2))  # (..., T, d/2, 2)
                return torch.einsum("tpij,...tpj->...tpi", R, pairs).flatten(-2)
        '''),
    },
    [("end", _c('''
        import types

        summary = types.SimpleNamespace()
        for n in (4, 8):
            setattr(summary, f"d{n}", sinusoidal_encoding(3, n))
        print(getattr(summary, "d8"))
    '''))],
    "cos written as a phase-shifted sine; RoPE as explicit 2x2 rotation matrices applied with einsum; setattr/getattr in an added cell",
)

# ------------------------------------------------------------ queries, keys, values
_entry(
    "qkv_einsum_selftest", "qkv",
    {
        "project_qkv": _c('''
            def project_qkv(x, W_q, W_k, W_v):
                """Q, K, V with einsum: t the token, d the input feature, k the output feature."""
                return tuple(torch.einsum("btd,dk->btk", x, W) for W in (W_q, W_k, W_v))
        '''),
        "dot_product_scores": _c('''
            def dot_product_scores(Q, K):
                """S[..., i, j] = q_i . k_j."""
                return torch.einsum("...id,...jd->...ij", Q, K)
        '''),
    },
    [("end", _c('''
        import torch.nn.functional as F

        # my own check: a linear layer computes x W^T, so F.linear(x, W.T) is x W
        g = torch.Generator().manual_seed(0)
        xs = torch.randn(2, 4, 3, generator=g, dtype=torch.float64)
        Ws = [torch.randn(3, 5, generator=g, dtype=torch.float64) for _ in range(3)]
        for mine, W in zip(project_qkv(xs, *Ws), Ws):
            torch.testing.assert_close(mine, F.linear(xs, W.T))
        print("projections agree with F.linear")
    '''))],
    "einsum for the projections and the scores (returned as a tuple from a generator); torch.testing self-test in an added cell",
)

_entry(
    "qkv_operator_partial_broadcast", "qkv",
    {
        "project_qkv": _c('''
            import functools
            import operator


            def project_qkv(x, W_q, W_k, W_v):
                """x @ W for each of the three matrices."""
                return tuple(map(functools.partial(operator.matmul, x), (W_q, W_k, W_v)))
        '''),
        "dot_product_scores": _c('''
            def dot_product_scores(Q, K):
                """Every query times every key, entry by entry, then summed: (..., T_q, T_k, d_k) -> (..., T_q, T_k)."""
                return (Q.unsqueeze(-2) * K.unsqueeze(-3)).sum(dim=-1)
        '''),
    },
    [],
    "functools.partial(operator.matmul) mapped over the weights; scores by broadcasting and summing instead of a matmul",
)

_entry(
    "qkv_input_fused_cellmagic", "qkv",
    {
        "project_qkv": _c('''
            def project_qkv(x, W_q, W_k, W_v):
                """One product with the three matrices side by side, then split."""
                input = x
                d_k, d_v = W_q.shape[1], W_v.shape[1]
                fused = input @ torch.cat([W_q, W_k, W_v], dim=1)  # (B, T, 2 d_k + d_v)
                Q, K, V = fused.split([d_k, d_k, d_v], dim=-1)
                return Q, K, V
        '''),
        "dot_product_scores": _c('''
            def dot_product_scores(Q, K):
                return torch.matmul(Q, K.mT)  # .mT: the last two dims swapped
        '''),
    },
    [("after:try_project_code", _c('''
        %%time
        Qb, Kb, Vb = project_qkv(torch.randn(16, 64, 32), torch.randn(32, 8), torch.randn(32, 8), torch.randn(32, 4))
        print(Qb.shape, Kb.shape, Vb.shape)
    ''')),
     ("after:try_scores_code", _c('''
        print(S)
        assert S.shape == (3, 3)
        assert abs(S[0, 0].item() - 1.10) < 1e-9
    '''))],
    "a variable named input, one fused product split into Q, K, V, Tensor.mT; a %%time cell and a print/assert cell",
)

# ------------------------------------------------------------ RNN
_entry(
    "rnn_warnings_nograd_norm", "rnn",
    {"rnn_forward": _c('''
        import warnings


        def state_norm(h):
            """The largest norm of a batch of states, for a report: no gradient needed."""
            with torch.no_grad():
                return torch.linalg.vector_norm(h, dim=-1).max().item()


        def rnn_forward(x, h0, W_xh, W_hh, b, report=False):
            """Every hidden state of a tanh RNN, (B, T, d_h)."""
            B, T, _ = x.shape
            if T == 0:
                warnings.warn("an empty sequence has no hidden states", RuntimeWarning)
                return x.new_zeros(B, 0, W_hh.shape[-1])
            h, states = h0, []
            for t in range(T):
                h = torch.tanh(x[:, t] @ W_xh + h @ W_hh + b)
                states.append(h)
            if report:
                print(f"|h_T| at most {state_norm(h):.4f}")
            return torch.stack(states, dim=1)
    ''')},
    [("after:try_it_code", _c('''
        rnn_forward(x, h0, W_xh, W_hh, b, report=True)
        print("norm of the last state:", state_norm(states[:, -1]))
    '''))],
    "imports warnings (warn only for an empty sequence, never tested); a helper under torch.no_grad reporting a norm; an optional report argument",
)

_entry(
    "rnn_input_loop_var", "rnn",
    {"rnn_forward": _c('''
        def rnn_forward(x, h0, W_xh, W_hh, b):
            """The input projections of every token at once; only the recurrence loops."""
            h, states = h0, []
            for input in (x @ W_xh + b).unbind(dim=1):  # input: (B, d_h), token t's share of the sum
                h = torch.tanh(input + h @ W_hh)
                states.append(h)
            return torch.stack(states, 1)
    ''')},
    [],
    "the loop variable is named input; x @ W_xh + b hoisted out of the loop and unbound along time",
)

_entry(
    "rnn_itertools_accumulate", "rnn",
    {"rnn_forward": _c('''
        import functools
        import itertools
        import warnings

        warnings.filterwarnings("ignore", message="an empty sequence")  # my own warning text, elsewhere


        def _cell(W_xh, W_hh, b, h, x_t):
            return torch.tanh(x_t @ W_xh + h @ W_hh + b)


        def rnn_forward(x, h0, W_xh, W_hh, b):
            """h_1 .. h_T as a running fold: itertools.accumulate starting from h0, h0 itself dropped."""
            step = functools.partial(_cell, W_xh, W_hh, b)
            states = itertools.accumulate(x.unbind(1), step, initial=h0)
            return torch.stack(list(itertools.islice(states, 1, None)), dim=1)
    ''')},
    [],
    "itertools.accumulate with functools.partial, itertools.islice; warnings.filterwarnings at import",
)

# ------------------------------------------------------------ encoder-decoder (cross-attention)
_entry(
    "xattn_einsum", "encoder_decoder",
    {
        "scaled_dot_product_attention": SDPA_EINSUM,
        "cross_attention": _c('''
            def cross_attention(x, context, W_q, W_k, W_v, mask=None):
                """Queries from x, keys and values from context, all with einsum."""
                Q = torch.einsum("...qd,dk->...qk", x, W_q)
                K = torch.einsum("...sc,ck->...sk", context, W_k)
                V = torch.einsum("...sc,cv->...sv", context, W_v)
                return scaled_dot_product_attention(Q, K, V, mask)
        '''),
    },
    [],
    "einsum for the projections and the attention; a logsumexp softmax",
)

_entry(
    "xattn_baddbmm_cellmagic", "encoder_decoder",
    {
        "scaled_dot_product_attention": SDPA_BADDBMM,
        "cross_attention": _c('''
            def cross_attention(x, context, W_q, W_k, W_v, mask=None):
                keys, values = torch.matmul(context, W_k), torch.matmul(context, W_v)
                return scaled_dot_product_attention(torch.matmul(x, W_q), keys, values, mask=mask)
        '''),
    },
    [("after:try_it_code", _c('''
        %%time
        out, w = cross_attention(torch.randn(4, 16, 8), torch.randn(4, 40, 12), torch.randn(8, 8), torch.randn(12, 8), torch.randn(12, 6))
        print(out.shape, w.shape)
    '''))],
    "attention on folded 3-D batches with torch.baddbmm (a variable named input); an added %%time cell",
)

_entry(
    "xattn_namespace_getattr_selftest", "encoder_decoder",
    {
        "cross_attention": _c('''
            from types import SimpleNamespace


            def cross_attention(x, context, W_q, W_k, W_v, mask=None):
                """Which sequence feeds which role, spelt out in two namespaces."""
                source = SimpleNamespace(q=x, k=context, v=context)
                weight = SimpleNamespace(q=W_q, k=W_k, v=W_v)
                Q, K, V = (getattr(source, r) @ getattr(weight, r) for r in "qkv")
                return scaled_dot_product_attention(Q, K, V, mask=mask)
        '''),
    },
    [("end", _c('''
        import torch.nn.functional as F

        # my own check against PyTorch's attention (only in this cell)
        g = torch.Generator().manual_seed(0)
        xs, ctx = torch.randn(2, 3, 4, generator=g, dtype=torch.float64), torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
        Wq = torch.randn(4, 8, generator=g, dtype=torch.float64)
        Wk = torch.randn(6, 8, generator=g, dtype=torch.float64)
        Wv = torch.randn(6, 3, generator=g, dtype=torch.float64)
        mine, _ = cross_attention(xs, ctx, Wq, Wk, Wv)
        torch.testing.assert_close(mine, F.scaled_dot_product_attention(xs @ Wq, ctx @ Wk, ctx @ Wv))
        print("agrees with F.scaled_dot_product_attention")
    '''))],
    "the roles looked up with getattr on SimpleNamespaces; a torch.testing self-test against F.scaled_dot_product_attention in an added cell",
)

# ------------------------------------------------------------ beyond the block
_entry(
    "sampling_gumbel_warnings_selftest", "sampling",
    {"sample_next_token": _c('''
        import warnings


        def sample_next_token(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
            """The Gumbel-max trick: argmax(log p + Gumbel noise) is a draw from p."""
            if temperature == 0:
                return torch.argmax(logits, dim=-1)
            if temperature < 0.05:
                warnings.warn("a very low temperature: nearly greedy")
            z = logits / temperature
            if top_k is not None and top_k < z.shape[-1]:
                kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
                z = torch.where(z < kth, torch.full_like(z, float("-inf")), z)
            logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
            if top_p is not None:
                p_sorted, order = torch.sort(logp.exp(), dim=-1, descending=True)
                before = torch.cumsum(p_sorted, dim=-1) - p_sorted
                keep = torch.empty_like(before, dtype=torch.bool).scatter_(-1, order, before < top_p)
                logp = logp.masked_fill(~keep, float("-inf"))
            u = torch.rand(logp.shape, generator=generator, dtype=logp.dtype).clamp_(1e-12, 1 - 1e-12)
            return torch.argmax(logp - torch.log(-torch.log(u)), dim=-1)
    ''')},
    [("end", _c('''
        # my own check: frequencies near torch.multinomial's (only here, never in the answer)
        g = torch.Generator().manual_seed(1)
        lg = torch.tensor([2.0, 1.0, 0.5, 0.0])
        mine = torch.bincount(sample_next_token(lg.expand(20000, 4), generator=g), minlength=4) / 20000
        ref = torch.bincount(torch.multinomial(torch.softmax(lg, -1), 20000, replacement=True), minlength=4) / 20000
        assert (mine - ref).abs().max() < 0.02, (mine, ref)
        print("frequencies agree")
    '''))],
    "the Gumbel-max trick on torch.rand (a different draw than multinomial), a warnings.warn, a self-test against torch.multinomial in an added cell",
)

_entry(
    "tiled_helper_cell_time_selftest", "tiled_attention",
    {"tiled_attention": _c('''
        def _fold(state, Q, K_b, V_b, start, causal):
            """Add one block of keys to (output sum, running max, running total), rescaling the old."""
            s = torch.einsum("...qd,...kd->...qk", Q, K_b) / Q.shape[-1] ** 0.5
            if causal:
                q = torch.arange(Q.shape[-2])[:, None]
                k = torch.arange(start, start + K_b.shape[-2])[None, :]
                s = s.masked_fill(k > q, float("-inf"))
            block_max = s.amax(dim=-1, keepdim=True)
            if state is None:
                p = torch.exp(s - block_max)
                return p @ V_b, block_max, p.sum(-1, keepdim=True)
            out, m_old, total = state
            m = torch.maximum(m_old, block_max)
            p = torch.exp(s - m)
            r = torch.exp(m_old - m)
            return out * r + p @ V_b, m, total * r + p.sum(-1, keepdim=True)


        def tiled_attention(Q, K, V, block_size=64, causal=False):
            """Blocks of keys, folded in one at a time by a helper of my own."""
            state = None
            for start in range(0, K.shape[-2], block_size):
                state = _fold(state, Q, K[..., start:start + block_size, :], V[..., start:start + block_size, :],
                              start, causal)
            out, _, total = state
            return out / total
    ''')},
    [("after:try_it_code", "%time out = tiled_attention(*torch.randn(3, 2, 256, 16), block_size=32)\n"),
     ("end", _c('''
        import torch.nn.functional as F

        # my own check against PyTorch's attention (only in this cell)
        q, k, v = torch.randn(3, 2, 50, 8, dtype=torch.float64)
        torch.testing.assert_close(tiled_attention(q, k, v, 16, causal=True),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True))
        print("agrees with F.scaled_dot_product_attention")
    '''))],
    "the running state folded in by a helper of the student's own; scores by einsum; a %time line; a self-test against F.scaled_dot_product_attention",
)

_entry(
    "alibi_loops_float16_selftest", "alibi",
    {"alibi_bias": _c('''
        def _slope(h, n_heads):
            """Head h's slope as a Python float: 2^(-8 (h + 1) / n_heads)."""
            return 2 ** (-8 * (h + 1) / n_heads)


        def alibi_bias(n_heads, T, dtype=torch.float32):
            """Row by row: query i's row is the distances i, i - 1, ..., 1, 0 times -m_h, then zeros."""
            rows = []
            for i in range(T):
                back = torch.arange(i, -1, -1, dtype=torch.float64)  # i - j for j = 0 .. i
                row = torch.cat([back, torch.zeros(T - i - 1, dtype=torch.float64)])
                rows.append(row)
            distance = torch.stack(rows)  # (T, T)
            slopes = torch.tensor([_slope(h, n_heads) for h in range(n_heads)], dtype=torch.float64)
            return torch.einsum("h,ij->hij", -slopes, distance).to(dtype=dtype)
    ''')},
    [("after:try_it_code", "print(alibi_bias(2, 3, dtype=torch.float16))  # half precision: not graded, but it runs\n"),
     ("end", _c('''
        # my own check against the formula, entry by entry (only here)
        b = alibi_bias(6, 9, dtype=torch.float64)
        for h in range(6):
            for i in range(9):
                for j in range(9):
                    want = -(2 ** (-8 * (h + 1) / 6)) * (i - j) if j <= i else 0.0
                    assert abs(b[h, i, j].item() - want) < 1e-12, (h, i, j)
        print("agrees with the formula")
    '''))],
    "rows built one query at a time by torch.cat, slopes from a helper of the student's own, an einsum outer product; a float16 print and an entry-by-entry self-test in added cells",
)

_entry(
    "induction_diagonal_getattr_selftest", "induction_heads",
    {"induction_score": _c('''
        def induction_score(weights, period):
            """The diagonal period - 1 below the main one, over the second copy's queries."""
            diag = getattr(torch, "diagonal")(weights, offset=-(period - 1), dim1=-2, dim2=-1)  # (..., T - period + 1)
            return diag[..., 1:].mean(dim=-1)
    ''')},
    [("end", _c('''
        # my own check against a plain loop (only here)
        w = torch.softmax(torch.randn(2, 3, 12, 12, dtype=torch.float64), -1)
        loop = torch.stack([w[..., i, i - 6 + 1] for i in range(6, 12)], -1).mean(-1)
        torch.testing.assert_close(induction_score(w, 6), loop)
        print("agrees with the loop")
    '''))],
    "torch.diagonal with a negative offset, looked up with getattr; a self-test against a loop in an added cell",
)

_entry(
    "modern_setattr_einsum_selftest", "modern_block",
    {
        "RMSNorm": _c('''
            class RMSNorm(nn.Module):
                """x * rsqrt(mean(x^2) + eps) * weight, the weight made with setattr."""

                def __init__(self, d_model, eps=1e-6):
                    super().__init__()
                    self.eps = eps
                    setattr(self, "weight", nn.Parameter(torch.ones(d_model)))

                def forward(self, x):
                    return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight
        '''),
        "SwiGLU": _c('''
            class SwiGLU(nn.Module):
                """The three layers named in a loop."""

                def __init__(self, d_model, d_hidden):
                    super().__init__()
                    for name, (n_in, n_out) in {"W1": (d_model, d_hidden), "W3": (d_model, d_hidden),
                                                "W2": (d_hidden, d_model)}.items():
                        setattr(self, name, nn.Linear(n_in, n_out, bias=False))

                def forward(self, x):
                    gate = self.W1(x)
                    return self.W2(gate * torch.sigmoid(gate) * self.W3(x))
        '''),
        "GroupedQueryAttention": _c('''
            class GroupedQueryAttention(nn.Module):
                """Queries grouped by their key/value head: an einsum over (kv head, group), no repeat."""

                def __init__(self, d_model, n_heads, n_kv_heads):
                    super().__init__()
                    self.h, self.kv, self.d_k = n_heads, n_kv_heads, d_model // n_heads
                    self.W_q = nn.Linear(d_model, d_model, bias=False)
                    self.W_k = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
                    self.W_v = nn.Linear(d_model, n_kv_heads * self.d_k, bias=False)
                    self.W_o = nn.Linear(d_model, d_model, bias=False)

                def forward(self, x, mask=None):
                    B, T, _ = x.shape
                    g = self.h // self.kv
                    q = self.W_q(x).view(B, T, self.kv, g, self.d_k)  # head h = kv * g + j
                    k = self.W_k(x).view(B, T, self.kv, self.d_k)
                    v = self.W_v(x).view(B, T, self.kv, self.d_k)
                    s = torch.einsum("bqcgd,bkcd->bcgqk", q, k) / math.sqrt(self.d_k)  # (B, kv, g, T, T)
                    s = s.reshape(B, self.h, T, T)
                    if mask is not None:
                        s = s + mask
                    w = torch.exp(s - s.amax(-1, keepdim=True))
                    w = w / w.sum(-1, keepdim=True)
                    out = torch.einsum("bcgqk,bkcd->bqcgd", w.view(B, self.kv, g, T, T), v)
                    return self.W_o(out.reshape(B, T, self.h * self.d_k)), w
        '''),
    },
    [("end", _c('''
        # my own checks against PyTorch (only in this cell)
        x = torch.randn(2, 5, 16)
        mine, ref = RMSNorm(16), nn.RMSNorm(16, eps=1e-6)
        torch.testing.assert_close(mine(x), ref(x))
        gqa = GroupedQueryAttention(16, 4, 2)
        q = gqa.W_q(x).view(2, 5, 4, 4).transpose(1, 2)
        k = gqa.W_k(x).view(2, 5, 2, 4).transpose(1, 2)
        v = gqa.W_v(x).view(2, 5, 2, 4).transpose(1, 2)
        want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2).reshape(2, 5, 16)
        torch.testing.assert_close(gqa(x)[0], gqa.W_o(want))
        print("agrees with nn.RMSNorm and scaled_dot_product_attention(enable_gqa=True)")
    '''))],
    "weights and layers made with setattr (one in a loop), silu written as z * sigmoid(z), GQA as an einsum over (kv head, group) with no repeat; self-tests against nn.RMSNorm and F.scaled_dot_product_attention",
)

__all__ = ["HONEST"]
