"""The input checks that the public functions share. Each raises a ValueError naming the function,
the argument and what was expected, before any work is done."""

from __future__ import annotations

import torch


def fail(fn: str, name: str, expected: str, got) -> None:
    raise ValueError(f"{fn}: `{name}` must be {expected}; got {got}")


def check_tensor(fn: str, name: str, x, shape: int | tuple, dtypes) -> None:
    """``x`` is a tensor of one of ``dtypes`` with ``shape`` (an int: that many dimensions)."""
    if not isinstance(x, torch.Tensor):
        fail(fn, name, "a torch.Tensor", type(x).__name__)
    if isinstance(shape, int):
        if x.dim() != shape:
            fail(fn, name, f"{shape}-D", f"shape {tuple(x.shape)}")
    elif tuple(x.shape) != tuple(shape):
        fail(fn, name, f"of shape {tuple(shape)}", f"shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        fail(fn, name, "one of " + ", ".join(str(d) for d in dtypes), x.dtype)


def check_qkv(fn: str, q, k, v, dtypes) -> tuple[int, int, int, int, int, int]:
    """q, k [B, T, H, K] and v [B, T, HV, V] of one dtype, non-empty heads, HV a multiple of H
    (grouped value attention): (B, T, H, K, HV, V)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(fn, name, x, 4, dtypes)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        fail(fn, "k", f"the shape of q [B, T, H, K] = {tuple(q.shape)}", f"shape {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        fail(fn, "k and v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    if v.shape[:2] != (B, T):
        fail(fn, "v", f"[B, T, HV, V] with B, T = {B}, {T} as in q", f"shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if min(H, K, HV, V) == 0:
        fail(fn, "q and v", "non-empty head dimensions (H, K, HV, V >= 1)", f"H={H}, K={K}, HV={HV}, V={V}")
    if HV % H:
        fail(fn, "v", f"a number of value heads HV that is a multiple of the H = {H} heads of q and k "
             "(grouped value attention)", f"HV = {HV}")
    return B, T, H, K, HV, V


def check_bound_values(fn: str, name: str, cu: list[int], T: int) -> None:
    """Host integers of sequence bounds: from 0, non-decreasing, to T."""
    if cu[0] != 0:
        fail(fn, name, "starting at 0", f"{name}[0] = {cu[0]}")
    if any(b < a for a, b in zip(cu, cu[1:])):
        fail(fn, name, "non-decreasing", cu if len(cu) <= 16 else "a decreasing step")
    if cu[-1] != T:
        fail(fn, name, f"ending at T = {T}", f"{name}[-1] = {cu[-1]}")
