"""The public entry point: a drop-in for FLA's ``chunk_gated_delta_rule``.

On an SM90 GPU (H100, H200) with bfloat16 q, k, v and K = V = 128, the forward runs the promoted
TileLang kernels (``flashqla.fwd``, gdn_fwd.s44's: the chunk table, the chunk-local cumsum and the
gate-free solve (its block levels on mma.sync), in one kernel where a CTA solves one or two value
heads, and the warp-specialized
fused state chain + output kernel on the reformulated math, its width (16 to 128 value columns a
CTA) from the sequence lengths, with AutoCP's windows, warm-up (two products a chunk) and
chaining kernels; each launched as a programmatic dependent of the one before) and so does the backward
(``flashqla.bwd``, promoted from ``kernels/gdn_bwd``): autograd saves only the inputs, the backward
recomputes the forward's intermediates, and gradients reach every input, ``initial_state``
included. Neither direction synchronizes with the host, so a training step can be captured in a
CUDA graph (``cu_seqlens`` is checked on the host only outside capture). Everything else (CPU
tensors, other GPUs, other dtypes, other head dims) runs the chunked PyTorch reference in float32
(float64 for float64 inputs) on the inputs' device with autograd, after a one-time warning that
says why.

AutoCP (``flashqla.autocp``): when few (sequence, head) chains would leave most SMs idle (e.g.
(H, HV) = (2, 8) from about 4096 tokens), the forward cuts each sequence into segments whose
chains run in parallel, each from an initial state computed first; the decision takes the
sequence lengths (the one host read of ``cu_seqlens``), the head count and the SM count, and the
plan is built on the host and kept for those lengths. A segment's initial state is exact for
heads whose gates decay slowly (or where a token breaks the bound's conditions); for the others
it is wrong by at most exp(-10) times the norm of the state where its warm-up window starts (the
bound FlashQLA uses). The backward recomputes whole sequences, without AutoCP.

NaN and inf: inputs are not scanned (that would cost a pass over them and a host sync). A NaN or
inf in q, k, v, g or beta at some token poisons, for the value heads that read it, the output of
every token of that chunk (earlier tokens of the chunk included, as the chunk is one matrix
product), of every later token of the sequence, and the final state; other sequences and other
head groups are unaffected. Under AutoCP a warm-up head's later segments start from a state
computed over the last few chunks only, so a NaN or inf in k or v before those chunks does not
reach them (one in g or beta makes the head run exactly, so it does). g = -inf (a hard reset) yields NaN: pass a large finite negative value
instead. A NaN or inf in ``initial_state`` poisons that sequence and head from its first token.
"""

from __future__ import annotations

import importlib.util
import math
import warnings

import torch

from flashqla import reference
from flashqla.hopper import hopper_gpu_missing
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds

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
        N = cu_seqlens.numel() - 1
        # reading the values syncs with the GPU, which a CUDA graph capture forbids: a graph
        # replays what its eager runs checked (``host_bounds`` reads them once per tensor version,
        # and the forward takes its kernel width from the same read)
        cu = host_bounds(cu_seqlens)
        if cu is not None:
            if cu[0] != 0:
                _fail("cu_seqlens", "starting at 0", f"cu_seqlens[0] = {cu[0]}")
            if any(b < a for a, b in zip(cu, cu[1:])):
                _fail("cu_seqlens", "non-decreasing", cu if len(cu) <= 16 else "a decreasing step")
            if cu[-1] != T:
                _fail("cu_seqlens", f"ending at T = {T}", f"cu_seqlens[-1] = {cu[-1]}")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, (torch.float32, torch.float64))
        if tuple(initial_state.shape) != (N, HV, K, V):
            _fail("initial_state", f"[N, HV, K, V] = {(N, HV, K, V)} (N = number of sequences)",
                  f"shape {tuple(initial_state.shape)}")


def kernel_unsupported(device: torch.device, dtype: torch.dtype, K: int, V: int) -> str | None:
    """None when the promoted kernels can run (already checked) inputs like these, otherwise why not."""
    if device.type != "cuda":
        return f"the inputs are on the {device.type}; the kernels need an SM90 CUDA GPU"
    if hopper_gpu_missing():
        return hopper_gpu_missing()
    if dtype != torch.bfloat16:
        return f"q, k, v are {dtype}; the kernels take torch.bfloat16"
    if K != 128 or V != 128:
        return f"K = {K} and V = {V}; the kernels need K = V = 128"
    if importlib.util.find_spec("tilelang") is None:
        return "TileLang is not installed"
    return None


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashqla.chunk_gated_delta_rule: running the PyTorch reference, because {reason}",
                      stacklevel=3)


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """The chunked reference in float32 (float64 for float64 inputs), differentiable."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (x.to(work) for x in (q, k, v, g, beta))
    return reference.chunk_gated_delta_rule_ref(
        q, k, v, g, beta, scale=scale,
        initial_state=None if initial_state is None else initial_state.to(work),
        output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def _kernel_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """The promoted kernels' forward, AutoCP deciding the split (a CPU test puts the reference here
    to run _KernelForward)."""
    from flashqla import fwd  # imported here: importing flashqla must not pull in TileLang

    with nvtx_range("fwd"):
        return fwd.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           cp=None)


def _kernel_backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens):
    """The promoted kernels' backward (the CPU test puts the reference backward here)."""
    from flashqla import bwd  # imported here: importing flashqla must not pull in TileLang

    with nvtx_range("bwd"):
        return bwd.backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens)


class _KernelForward(torch.autograd.Function):
    """Forward and backward on the promoted kernels, saving only the inputs: the backward recomputes
    the forward's intermediates. dq, dk, dv, dg, dbeta come back in their inputs' dtypes, dh0 in
    initial_state's (float32). The l2norm of use_qk_l2norm_in_kernel runs before, under autograd."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens):
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.args = (scale, cu_seqlens)
        return _kernel_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)

    @staticmethod
    def backward(ctx, do, dht):
        inputs = ctx.saved_tensors
        scale, cu_seqlens = ctx.args
        grads = _kernel_backward(*inputs[:5], do, dht, scale, inputs[5], cu_seqlens)
        return (*[d.to(x.dtype) if need and d is not None else None
                  for d, x, need in zip(grads, inputs, ctx.needs_input_grad)], None, None, None)


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
    if use_qk_l2norm_in_kernel:
        q, k = (reference.l2norm(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)
                for x in (q, k))
    reason = kernel_unsupported(q.device, q.dtype, q.shape[3], v.shape[3])
    if reason is None:
        return _KernelForward.apply(q, k, v, g, beta, initial_state, scale, output_final_state,
                                    cu_seqlens)
    _warn_once(reason)
    with nvtx_range("fwd.reference"):
        o, final_state = _reference(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    cu_seqlens)
    return o.to(v.dtype), final_state
