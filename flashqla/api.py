"""The public entry point: a drop-in for FLA's ``chunk_gated_delta_rule``.

Until a GPU kernel is promoted, every call runs the chunked PyTorch reference in float32 (float64
when the inputs are float64) on the inputs' device, and autograd differentiates straight through
it, so training code can use it today.

NaN and inf: inputs are not scanned (that would cost a pass over them and a host sync). A NaN or
inf in q, k, v, g or beta at some token poisons, for the value heads that read it, the output of
every token of that chunk (earlier tokens of the chunk included, as the chunk is one matrix
product), of every later token of the sequence, and the final state; other sequences and other
head groups are unaffected. g = -inf (a hard reset) yields NaN: pass a large finite negative value
instead. A NaN or inf in ``initial_state`` poisons that sequence and head from its first token.
"""

from __future__ import annotations

import math

import torch

from flashqla import reference
from flashqla.nvtx import nvtx_range

# Activations the reference path accepts; the state is float32 (float64 for float64 inputs).
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fail(name: str, expected: str, got) -> None:
    raise ValueError(f"chunk_gated_delta_rule: `{name}` must be {expected}; got {got}")


def _check_tensor(name, x, ndim, dtypes) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(name, "a torch.Tensor", type(x).__name__)
    if x.dim() != ndim:
        _fail(name, f"{ndim}-D", f"shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        _fail(name, "one of " + ", ".join(str(d) for d in dtypes), x.dtype)


def check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens) -> None:
    """Raise ValueError naming the first bad argument, before any work."""
    for name, x, ndim in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 3), ("beta", beta, 3)):
        _check_tensor(name, x, ndim, _ACT_DTYPES)
    B, T, H, K = q.shape
    if k.shape != q.shape:
        _fail("k", f"the shape of q [B, T, H, K] = {tuple(q.shape)}", f"shape {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        _fail("k and v", f"the dtype of q ({q.dtype})", f"k {k.dtype}, v {v.dtype}")
    if v.shape[:2] != (B, T):
        _fail("v", f"[B, T, HV, V] with B, T = {B}, {T} as in q", f"shape {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if K == 0 or V == 0 or H == 0:
        _fail("q and v", "non-empty head dimensions (H, K, V >= 1)", f"H={H}, K={K}, V={V}")
    if HV % H:
        _fail("v", f"a number of value heads HV that is a multiple of the H = {H} heads of q and k "
              "(grouped value attention)", f"HV = {HV}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            _fail(name, f"[B, T, HV] = {(B, T, HV)}", f"shape {tuple(x.shape)}")
    devices = {x.device for x in (q, k, v, g, beta)}
    if initial_state is not None:
        devices.add(initial_state.device)
    if len(devices) > 1:
        _fail("q, k, v, g, beta, initial_state", "on one device", sorted(str(d) for d in devices))
    if scale is not None and not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        _fail("scale", "None or a finite Python number", repr(scale))

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in (torch.int32, torch.int64):
            _fail("cu_seqlens", "an int32 or int64 tensor",
                  getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__))
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail("cu_seqlens", "1-D with at least 2 entries [0, ..., T]", f"shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            _fail("q", "batch size 1 when cu_seqlens is given (sequences are packed along T)", f"B = {B}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0:
            _fail("cu_seqlens", "starting at 0", f"cu_seqlens[0] = {cu[0]}")
        if any(b < a for a, b in zip(cu, cu[1:])):
            _fail("cu_seqlens", "non-decreasing", cu if len(cu) <= 16 else "a decreasing step")
        if cu[-1] != T:
            _fail("cu_seqlens", f"ending at T = {T}", f"cu_seqlens[-1] = {cu[-1]}")
        N = len(cu) - 1
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, (torch.float32, torch.float64))
        if tuple(initial_state.shape) != (N, HV, K, V):
            _fail("initial_state", f"[N, HV, K, V] = {(N, HV, K, V)} (N = number of sequences)",
                  f"shape {tuple(initial_state.shape)}")


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Gated DeltaNet, FLA-compatible.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H; all of one dtype.
        g: [B, T, HV] per-token log decay (<= 0). beta: [B, T, HV] step size, in (0, 1].
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, HV, K, V] float32 (or float64), N = B, or the number of sequences with cu_seqlens.
        output_final_state: also return the state after the last token of every sequence.
        use_qk_l2norm_in_kernel: L2-normalize q and k over K (eps 1e-6) first.
        cu_seqlens: int32/int64 [N + 1] sequence boundaries over T, with B = 1.

    Returns:
        o: [B, T, HV, V] in v's dtype; final_state: [N, HV, K, V] float32 (float64 for float64
        inputs), or None.
    """
    check_inputs(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    out_dtype = v.dtype
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    with nvtx_range("fwd.reference"):
        q, k, v, g, beta = (x.to(work) for x in (q, k, v, g, beta))
        if use_qk_l2norm_in_kernel:
            q, k = reference.l2norm(q), reference.l2norm(k)
        o, final_state = reference.chunk_gated_delta_rule_ref(
            q, k, v, g, beta, scale=scale,
            initial_state=None if initial_state is None else initial_state.to(work),
            output_final_state=output_final_state, cu_seqlens=cu_seqlens)
    return o.to(out_dtype), final_state
