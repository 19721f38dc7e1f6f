"""causal_mask: the answers the generic harness (test_declarations.py) runs besides the declaration's own
mistakes: unusual correct answers, which must pass everywhere, and wrong answers that no mistake
names (a built-in called, a wrong type or dtype, a finite mask), each with the test cells it fails in
the notebook (its visible cases) and in the trusted re-check (the secret ones)."""
from __future__ import annotations

import numpy as np
import torch
from torch.nn.modules import transformer as torch_transformer

from course import as_student_code
from firstprinciples import reference

correct = as_student_code(reference.causal_mask)  # what a correct student writes


def via_masked_fill(T):
    future = torch.ones(T, T, dtype=torch.bool).triu(diagonal=1)
    return torch.zeros(T, T).masked_fill(future, float("-inf"))


def via_arange(T):
    i = torch.arange(T)
    return torch.where(i[None, :] > i[:, None], float("-inf"), 0.0).to(torch.float32)


def via_loops(T):
    return torch.tensor([[0.0 if s <= t else float("-inf") for s in range(T)] for t in range(T)])


def via_triu_indices(T):
    # the indices of the entries above the diagonal, written into a matrix of zeros
    mask = torch.zeros(T, T)
    rows, cols = torch.triu_indices(T, T, offset=1)
    mask[rows, cols] = float("-inf")
    return mask


def via_numpy_then_torch(T):
    # built in NumPy, returned as a torch tensor
    return torch.from_numpy(np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1))


def transposed_lower_triangle(T):
    # -inf strictly below the diagonal, transposed: a non-contiguous view
    return torch.full((T, T), float("-inf")).tril(diagonal=-1).T


_TABLE = torch.full((256, 256), float("-inf")).triu(diagonal=1)


def slice_of_a_precomputed_table(T):
    # every mask is the top-left corner of one big mask (T <= 256), returned as a copy
    return _TABLE[:T, :T].clone()


CORRECT = {"reference": correct, "masked_fill": via_masked_fill, "arange": via_arange, "loops": via_loops,
           "triu_indices": via_triu_indices, "built in NumPy": via_numpy_then_torch,
           "transposed lower triangle": transposed_lower_triangle, "slice of a precomputed mask": slice_of_a_precomputed_table}


def calls_reference(T):
    return reference.causal_mask(T)


def calls_torch_mask(T):
    return torch.nn.Transformer.generate_square_subsequent_mask(T)


def calls_torch_mask_by_alias(T):
    return torch_transformer._generate_square_subsequent_mask(T)


def calls_torch_mask_and_hides_it(T):
    torch.nn.Transformer.generate_square_subsequent_mask(T)  # result thrown away
    return correct(T)


def float64_mask(T):
    return correct(T).double()


def minus_1e4(T):
    return torch.triu(torch.full((T, T), -1e4), diagonal=1)


def lowest_float(T):
    return torch.triu(torch.full((T, T), torch.finfo(torch.float32).min), diagonal=1)


def via_numpy(T):
    return correct(T).numpy()


def as_list(T):
    return correct(T).tolist()


_SEED_4 = correct(4)


def hard_coded_four(T):
    return _SEED_4.clone()


def all_zeros(T):
    # the right type, dtype and shape, and no mask at all
    return torch.zeros(T, T)


ALL = {"test_seed_mask", "test_shapes_and_dtype", "test_values", "test_no_peeking"}
MASK = {"test_seed_mask", "test_values"}

# name: (answer, the test cells it fails in the notebook, those it fails in the re-check)
WRONG = {
    "calls the reference": (calls_reference, ALL, ALL),
    "calls nn.Transformer.generate_square_subsequent_mask": (calls_torch_mask, ALL, ALL),
    "calls torch's helper by an alias": (calls_torch_mask_by_alias, ALL, ALL),
    "calls torch's mask and throws it away": (calls_torch_mask_and_hides_it, ALL, ALL),
    # float32 scores + a float64 mask: float64 weights, which cannot multiply float32 values
    "float64 mask": (float64_mask, ALL, ALL),
    "-1e4 instead of -inf": (minus_1e4, MASK, MASK),
    "float32's lowest value instead of -inf": (lowest_float, MASK, MASK),
    "returns numpy": (via_numpy, ALL, ALL),
    "returns a list": (as_list, ALL, ALL),
    # the re-check's seed test draws another small T too: a typed-in 4 x 4 matrix earns nothing there
    "always the 4 x 4 mask": (hard_coded_four, ALL - {"test_seed_mask"}, ALL),
    # test_shapes_and_dtype compares no values, in the notebook as in the re-check
    "all zeros": (all_zeros, MASK | {"test_no_peeking"}, MASK | {"test_no_peeking"}),
}
