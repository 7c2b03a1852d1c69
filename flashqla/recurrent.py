"""Decode: ``flashqla.fused_recurrent_gated_delta_rule``, a drop-in for FLA's function of that name.

FLA's layers call it at inference for inputs of up to 64 tokens (decoding, speculative tokens), with
the state carried from call to call. It takes fla-core 0.6.0's arguments in FLA's order, and two
more for serving engines that keep the states of many requests in one pool:

inplace_final_state write each sequence's final state into ``initial_state`` (no new tensor) and
return ``initial_state`` ssm_state_indices int32/int64 [N]: sequence n starts from state
``initial_state[idx[n]]`` of a pool [S, HV, K, V]; a slot outside [0, S) marks a padding entry,
which starts from zeros and, in place, writes nothing

On an SM90 GPU (H100, H200) with bfloat16 q, k, v and K = V = 128 it runs one TileLang kernel,
promoted unchanged from ``kernels/fused_recurrent/s02_loads_first.py`` at one width, ``BV`` below
(the stage's docstring explains its design; ``tests/test_recurrent.py`` asserts both build the same
program). At T = 1 decode streams the state: each 64 KB fp32 state is read once and written once,
so the kernel's job is to keep enough state bytes in flight on every SM and add nothing to them.

The layout. One warp a CTA, and one CTA per (BV = 16 value columns, sequence, value head): 8 CTAs
a state. A lane owns 4 adjacent columns of 16 rows (64 fp32 state registers): lane = 4 r + c owns
columns 4 c .. 4 c + 3 of the CTA's 16 and rows 32 j + 4 r + s (j, s < 4), held in registers for the
call's tokens. Both state layouts load and store as 16-byte vectors (K-first: a lane's 4 columns of
one row are one float4, a warp instruction 8 rows x 64 bytes; V-first: its 4 rows of one column, a
warp instruction 4 columns x 128 contiguous bytes). The sums over K (h^T k, h^T q for the lane's
columns, k . q, and ||k||^2, ||q||^2 with the l2norm) are summed over its rows, then over the 8 lanes
of a column group by 3 xor shuffles (lanes 4, 8, 16 apart); the output needs no second pass over h
(o = scale (exp(g) h^T q + e (k . q))).

The loads. A CTA issues its state's float4 loads first, then fetches its block of BT = 8 tokens in
one trip beside them: lanes 0 .. BT - 1 load their token's raw g and beta (and A_log, dt_bias) into
registers; q, k (only the tokens that exist: one at T = 1) and the CTA's BT x BV block of v (whole:
at T = 1 seven 32-byte rows more than it needs) go to shared memory by cp.async, which holds no
registers; one ``cp.async.wait_group 0`` and a barrier, then the lanes activate their tokens' gates
(log2 decay, step size) into shared memory. So a CTA waits for one trip to memory, its state and its
tokens together, before its first token.

Registers and CTAs an SM. ``__launch_bounds__(32, 16)`` asks ptxas (nvcc 13.0, sm_90a) for 128
registers a lane; it compiles with no spills, so an SM holds 16 CTAs: 128 KB of state in flight an
SM. Shared memory is about 4.4 KB a CTA (q and k 4 KB, v 256 B, the gates).

Measured (``profiles/decode_lab.py --stages``, ``profiles/results/decode_stages.csv``: one H100,
commit d126b76, FLA 0.6.0's ``fused_recurrent_gated_delta_rule`` in the same run, CUDA-graph replay;
(16, 32) and (16, 64), batch 1 to 256, T = 1 and 4, plain calls and FLA's layer call): 0.91-1.82x
FLA's speed, geomean 1.13x; behind FLA on 11 of the 32 points, all at T = 1: batch 64 and 256
(0.91-0.94x; this kernel moves the state at 71-90 % of the copy roof, FLA's at up to 99.5 %) and the
layer call at batch 1 and 8 (0.91-0.97x, 5-30 us). At batch 64 and up it is within 1.11-1.45x of the
HBM floor (the state read and written once, at the copy roof).

Where TileLang adds bounds checks. Shapes are dynamic, so every global load and store that TileLang
cannot prove in bounds is guarded (a load outside returns 0; a cp.async outside fills zeros): a
wrong ``cu_seqlens`` cannot make the kernel read or write outside its tensors. Optional tensors the
call lacks are passed with no rows and never read; a slot outside [0, S) (padding) starts from zeros
and is not written back.

FLA's in-kernel options (the q/k l2norm, the raw gate, the beta sigmoid, the V-first state layout)
are applied inside the kernel. g, beta, A_log, dt_bias and the states may be float32, bfloat16 or
float16; the final state is float32 (in place: the pool's dtype). The kernel path can be captured in
a CUDA graph: ``cu_seqlens`` (and, in place, ``ssm_state_indices``) are checked on the host once per
tensor version, outside capture.

Everything else (CPU tensors, other GPUs, other dtypes or head dims, and calls that need gradients:
the kernel has no backward) runs ``flashqla.reference.fused_recurrent_gated_delta_rule_ref`` in
float32 (float64 for float64 inputs), autocast off, after a one-time warning that says why.
Per-key or per-value decays (FLA's ``gk``, ``gv``) and per-value beta are not supported: they raise.
"""

import functools
import importlib.util
import math
import numbers
import warnings
from typing import NamedTuple

import torch

from flashqla import checks, reference
from flashqla.hopper import compile_hopper, hopper_gpu_missing
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds

# ---- the kernel (fused_recurrent.s02's at BV, unchanged) ------------------------------------------

HEAD_DIM = 128                           # K = V = 128 only
LANES = 32                               # one warp a CTA
COLS = 4                                 # adjacent state columns a lane owns (one float4, K-first)
QUAD = 4                                 # adjacent rows in one of its float4s (V-first)
BV = 16                                  # value columns a CTA (s02 compiles 8 or 16): V / BV CTAs a state
MIN_CTAS_PER_SM = {8: 32, 16: 16}[BV]    # the launch bound: 64 (BV = 8) or 128 registers a lane
COL_GROUPS = BV // COLS                  # lanes side by side in the columns
ROW_GROUPS = LANES // COL_GROUPS         # lanes sharing columns: 16 (BV = 8) or 8 (BV = 16)
QUADS = HEAD_DIM // (ROW_GROUPS * QUAD)  # a lane's rows: 4 ROW_GROUPS j + 4 r + s, s < QUAD
ROWS = QUADS * QUAD                      # 8 (BV = 8) or 16 (BV = 16)
SHUFFLES = ROW_GROUPS.bit_length() - 1   # xor steps that sum over the row groups
BT = 8                                   # tokens staged in shared memory at a time
SUMS = 2 * COLS + 3                      # h^T k, h^T q (4 columns each), k.q, ||k||^2, ||q||^2
LOG2E = 1.4426950408889634
SOFTPLUS_LINEAR = 20.0                   # softplus(x) = x above this (FLA's and torch's threshold)
L2NORM_EPS = 1e-6


class Variant(NamedTuple):
    """What a launch compiles in: the call's options and the dtypes of its small tensors."""

    state_v_first: bool = False  # states stored [.., V, K] rather than [.., K, V]
    h0: bool = True              # an initial state is read
    store: str = "new"           # the final state: "none", "new" (a new fp32 tensor) or "inplace"
    indexed: bool = False        # sequence n's state is slot indices[n] of h0
    varlen: bool = False         # sequences from bounds (cu_seqlens), else num_seqs x seqlen tokens
    l2norm: bool = False         # q, k <- q / ||q||, k / ||k||
    gate: str = "log"            # g is "log" (the log decay), "raw" (-exp(A_log) softplus(g + dt_bias))
                                 # or "none" (no decay)
    dt_bias: bool = False        # the raw gate has a dt_bias
    beta: str = "given"          # beta is "given", or raw: "sigmoid", "2sigmoid"
    g_dtype: str = "float32"
    beta_dtype: str = "float32"
    a_dtype: str = "float32"     # A_log's
    bias_dtype: str = "float32"  # dt_bias's
    state_dtype: str = "float32" # h0's (the final state in place is written in it)
    bounds_dtype: str = "int32"
    index_dtype: str = "int32"


def fused_recurrent_kernel(H: int, HV: int, variant: Variant = Variant()):
    """The T.prim_func for H key heads, HV value heads, K = V = 128 and ``variant``; any token,
    sequence or slot count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    K = V = HEAD_DIM
    x = variant
    group = HV // H                          # value head i_hv reads q/k head i_hv // group
    S1, S2 = (V, K) if x.state_v_first else (K, V)
    num_tokens = T.dynamic("num_tokens")
    num_slots = T.dynamic("num_slots")       # h0's states (N, a pool of S, or none)
    num_out = T.dynamic("num_out")           # ht's (N, or none)
    num_g = T.dynamic("num_g")               # tensors a call may lack have their own row counts
    num_a = T.dynamic("num_a")
    num_bias = T.dynamic("num_bias")
    num_bounds = T.dynamic("num_bounds")
    num_index = T.dynamic("num_index")

    def at(j, s, c):
        """The register of (row QUAD ROW_GROUPS j + QUAD r + s, column COLS c' + c): float4s along
        the stored rows."""
        return (j * COLS + c) * QUAD + s if x.state_v_first else (j * QUAD + s) * COLS + c

    def row(j, s, lr):
        return j * ROW_GROUPS * QUAD + lr * QUAD + s

    @T.prim_func
    def fused_recurrent_fwd(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),        # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g: T.Tensor((num_g, HV), x.g_dtype),
        beta: T.Tensor((num_tokens, HV), x.beta_dtype),
        a_log: T.Tensor((num_a,), x.a_dtype),
        dt_bias: T.Tensor((num_bias,), x.bias_dtype),
        bounds: T.Tensor((num_bounds,), x.bounds_dtype),     # cu_seqlens
        indices: T.Tensor((num_index,), x.index_dtype),      # ssm_state_indices
        h0: T.Tensor((num_slots, HV, S1, S2), x.state_dtype),
        ht: T.Tensor((num_out, HV, S1, S2), "float32"),
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        num_seqs: T.int32,
        seqlen: T.int32,                                     # tokens a sequence without bounds
        scale: T.float32,
    ):
        with T.Kernel(V // BV, num_seqs, HV, threads=LANES) as (i_v, i_n, i_hv):
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM)
            i_h = i_hv // group
            lane = T.get_thread_binding()
            lc = lane % COL_GROUPS               # columns col0 .. col0 + 3
            lr = lane // COL_GROUPS              # rows QUAD ROW_GROUPS j + QUAD lr + s
            col0 = i_v * BV + lc * COLS

            q_s = T.alloc_shared((BT, K), "bfloat16")
            k_s = T.alloc_shared((BT, K), "bfloat16")
            v_s = T.alloc_shared((BT, BV), "bfloat16")
            g_s = T.alloc_shared((BT,), "float32")   # log2 of the decay
            b_s = T.alloc_shared((BT,), "float32")   # the step size beta
            h = T.alloc_local((ROWS * COLS,), "float32")
            gb = T.alloc_local((4,), "float32")      # lane i < BT: token i's raw g, beta; A_log, dt_bias
            q_t = T.alloc_local((ROWS,), "float32")
            k_t = T.alloc_local((ROWS,), "float32")
            sums = T.alloc_local((SUMS,), "float32")
            e = T.alloc_local((COLS,), "float32")
            out = T.alloc_local((COLS,), "float32")

            if x.varlen:
                bos = T.cast(bounds[i_n], "int32")
                eos = T.cast(bounds[i_n + 1], "int32")
            else:
                bos = i_n * seqlen
                eos = bos + seqlen
            slot = T.cast(indices[i_n], "int32") if x.indexed else i_n
            present = (slot >= 0) & (slot < num_slots) if x.indexed else True

            # h <- the initial state (zeros without one, or for a padding slot): ROWS * COLS / 4
            # float4 loads, issued first, waited for by the first token's sums
            for r in T.unroll(ROWS * COLS):
                h[r] = 0.0
            if x.h0:
                if present:
                    for j in T.unroll(QUADS):
                        if x.state_v_first:
                            for c in T.unroll(COLS):
                                for s in T.vectorized(QUAD):
                                    h[at(j, s, c)] = T.cast(h0[slot, i_hv, col0 + c, row(j, s, lr)], "float32")
                        else:
                            for s in T.unroll(QUAD):
                                for c in T.vectorized(COLS):
                                    h[at(j, s, c)] = T.cast(h0[slot, i_hv, row(j, s, lr), col0 + c], "float32")

            for blk in T.serial(T.ceildiv(eos - bos, BT)):
                t0 = bos + blk * BT
                n_here = T.min(BT, eos - t0)
                # every load of the block in flight before any is waited for: lane i's raw g and
                # beta (and A_log, dt_bias) into registers, then q and k (only the tokens that
                # exist: one at T = 1) and this CTA's columns of v by cp.async, no registers
                T.sync_threads()
                for r in T.unroll(4):
                    gb[r] = 0.0
                if lane < n_here:
                    if x.gate != "none":
                        gb[0] = T.cast(g[t0 + lane, i_hv], "float32")
                    gb[1] = T.cast(beta[t0 + lane, i_hv], "float32")
                    if x.gate == "raw":
                        gb[2] = T.cast(a_log[i_hv], "float32")
                        if x.dt_bias:
                            gb[3] = T.cast(dt_bias[i_hv], "float32")
                for i in T.unroll(BT):
                    if i < n_here:
                        T.async_copy(q[t0 + i, i_h, :], q_s[i, :])
                        T.async_copy(k[t0 + i, i_h, :], k_s[i, :])
                T.async_copy(v[t0:t0 + BT, i_hv, i_v * BV:(i_v + 1) * BV], v_s)
                T.ptx_wait_group(0)
                # lane i activates token i's gates: log2 of the decay and the step size
                if lane < n_here:
                    gi = gb[0]
                    if x.gate == "raw":  # g <- -exp(A_log) softplus(g + dt_bias), dt_bias 0 if absent
                        gi = gi + gb[3]
                        gi = -T.exp(gb[2]) * T.if_then_else(gi > SOFTPLUS_LINEAR, gi, T.log(1.0 + T.exp(gi)))
                    g_s[lane] = gi * LOG2E
                    bi = gb[1]
                    if x.beta != "given":  # beta <- sigmoid(beta), or twice that
                        bi = 1.0 / (1.0 + T.exp(-bi))
                    b_s[lane] = bi * 2.0 if x.beta == "2sigmoid" else bi
                T.sync_threads()

                for i in T.serial(n_here):
                    # the lane's rows of k_t and q_t
                    for j in T.unroll(QUADS):
                        for s in T.vectorized(QUAD):
                            k_t[j * QUAD + s] = k_s[i, row(j, s, lr)]
                            q_t[j * QUAD + s] = q_s[i, row(j, s, lr)]
                    # sums <- h^T k, h^T q (the lane's 4 columns), k.q (||k||^2, ||q||^2) over its
                    # rows, then over the ROW_GROUPS lanes of the column group
                    for r in T.unroll(SUMS):
                        sums[r] = 0.0
                    for j in T.unroll(QUADS):
                        for s in T.unroll(QUAD):
                            for c in T.unroll(COLS):
                                sums[c] += h[at(j, s, c)] * k_t[j * QUAD + s]
                                sums[COLS + c] += h[at(j, s, c)] * q_t[j * QUAD + s]
                            sums[2 * COLS] += k_t[j * QUAD + s] * q_t[j * QUAD + s]
                            if x.l2norm:
                                sums[2 * COLS + 1] += k_t[j * QUAD + s] * k_t[j * QUAD + s]
                                sums[2 * COLS + 2] += q_t[j * QUAD + s] * q_t[j * QUAD + s]
                    for m in T.unroll(SHUFFLES):
                        for r in T.unroll(SUMS):
                            sums[r] += T.shfl_xor(sums[r], COL_GROUPS << m)
                    decay = T.exp2(g_s[i])
                    rk = T.rsqrt(sums[2 * COLS + 1] + L2NORM_EPS) if x.l2norm else 1.0
                    rq = T.rsqrt(sums[2 * COLS + 2] + L2NORM_EPS) if x.l2norm else 1.0
                    # e = beta (v - exp(g) h^T k);  o = scale (exp(g) h^T q + e (k . q))
                    for c in T.unroll(COLS):
                        e[c] = b_s[i] * (T.cast(v_s[i, lc * COLS + c], "float32") - decay * rk * sums[c])
                        out[c] = scale * rq * (decay * sums[COLS + c] + e[c] * rk * sums[2 * COLS])
                    if lr == 0:
                        for c in T.vectorized(COLS):
                            o[t0 + i, i_hv, col0 + c] = T.cast(out[c], "bfloat16")
                    # h <- exp(g) h + k e^T
                    for j in T.unroll(QUADS):
                        for s in T.unroll(QUAD):
                            for c in T.unroll(COLS):
                                h[at(j, s, c)] = decay * h[at(j, s, c)] + rk * k_t[j * QUAD + s] * e[c]

            # the final state <- h: a new fp32 tensor, or back into the slot it came from
            if x.store == "new":
                for j in T.unroll(QUADS):
                    if x.state_v_first:
                        for c in T.unroll(COLS):
                            for s in T.vectorized(QUAD):
                                ht[i_n, i_hv, col0 + c, row(j, s, lr)] = h[at(j, s, c)]
                    else:
                        for s in T.unroll(QUAD):
                            for c in T.vectorized(COLS):
                                ht[i_n, i_hv, row(j, s, lr), col0 + c] = h[at(j, s, c)]
            if x.store == "inplace":
                if present:
                    for j in T.unroll(QUADS):
                        if x.state_v_first:
                            for c in T.unroll(COLS):
                                for s in T.vectorized(QUAD):
                                    h0[slot, i_hv, col0 + c, row(j, s, lr)] = T.cast(h[at(j, s, c)], x.state_dtype)
                        else:
                            for s in T.unroll(QUAD):
                                for c in T.vectorized(COLS):
                                    h0[slot, i_hv, row(j, s, lr), col0 + c] = T.cast(h[at(j, s, c)], x.state_dtype)

    return fused_recurrent_fwd


@functools.cache
def _compiled(H: int, HV: int, variant: Variant):
    return compile_hopper(fused_recurrent_kernel(H, HV, variant))


_TL_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
             torch.int32: "int32", torch.int64: "int64"}
_no_rows: dict = {}


def _absent(device, *shape, dtype=torch.float32):
    """A tensor with no rows for an argument the call lacks (never read; holds no memory)."""
    key = (str(device), shape, dtype)
    if key not in _no_rows:
        _no_rows[key] = torch.empty(0, *shape, dtype=dtype, device=device)
    return _no_rows[key]


def variant_of(g, beta, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
               use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
               state_v_first, inplace_final_state, ssm_state_indices) -> Variant:
    """The Variant a call compiles (beta given: None is replaced by ones before)."""
    def name(t, default="float32"):
        return default if t is None else _TL_DTYPE[t.dtype]

    return Variant(
        state_v_first=bool(state_v_first), h0=initial_state is not None,
        store="inplace" if inplace_final_state else "new" if output_final_state else "none",
        indexed=ssm_state_indices is not None, varlen=cu_seqlens is not None,
        l2norm=bool(use_qk_l2norm_in_kernel),
        gate="none" if g is None else "raw" if use_gate_in_kernel else "log",
        dt_bias=bool(use_gate_in_kernel) and dt_bias is not None,
        beta=("2sigmoid" if allow_neg_eigval else "sigmoid") if use_beta_sigmoid_in_kernel else "given",
        g_dtype=name(g), beta_dtype=name(beta), a_dtype=name(A_log if use_gate_in_kernel else None),
        bias_dtype=name(dt_bias if use_gate_in_kernel else None), state_dtype=name(initial_state),
        bounds_dtype=name(cu_seqlens, "int32"), index_dtype=name(ssm_state_indices, "int32"))


def _kernel_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                    use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                    use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first, inplace_final_state,
                    ssm_state_indices):
    """fused_recurrent.s02's ``run`` at ``BV``: one launch on checked inputs (scale a float or None)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if beta is None:
        beta = torch.ones(B, T, HV, dtype=torch.float32, device=device)
    variant = variant_of(g, beta, initial_state, output_final_state, cu_seqlens,
                         use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias,
                         use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                         inplace_final_state, ssm_state_indices)
    state = (HV, V, K) if state_v_first else (HV, K, V)
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, *state, dtype=torch.float32, device=device) if variant.store == "new" else None
    if N:
        scale = K ** -0.5 if scale is None else scale
        kernel = _compiled(H, HV, variant)
        with nvtx_range("fused_recurrent"):
            kernel(q.contiguous().view(B * T, H, K), k.contiguous().view(B * T, H, K),
                   v.contiguous().view(B * T, HV, V),
                   _absent(device, HV) if g is None else g.contiguous().view(B * T, HV),
                   beta.contiguous().view(B * T, HV),
                   A_log.contiguous() if variant.gate == "raw" else _absent(device),
                   dt_bias.contiguous() if variant.dt_bias else _absent(device),
                   _absent(device, dtype=torch.int32) if cu_seqlens is None else cu_seqlens.contiguous(),
                   _absent(device, dtype=torch.int32) if ssm_state_indices is None else
                   ssm_state_indices.contiguous(),
                   _absent(device, *state) if initial_state is None else initial_state.contiguous(),
                   _absent(device, *state) if ht is None else ht,
                   o, N, T, scale)
    final = initial_state if inplace_final_state else ht
    return o.view(B, T, HV, V), final


# ---- checks and dispatch --------------------------------------------------------------------------

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_KERNEL_SMALL = (torch.float32, torch.bfloat16, torch.float16)  # g, beta, A_log, dt_bias, states
_INTS = (torch.int32, torch.int64)
_NAME = "fused_recurrent_gated_delta_rule"


def _fail(name: str, expected: str, got) -> None:
    checks.fail(_NAME, name, expected, got)


def _check_tensor(name, x, shape, dtypes) -> None:
    checks.check_tensor(_NAME, name, x, shape, dtypes)


def _scale(scale) -> float | None:
    """None, or the scale as a Python float (a Python or NumPy real, or a 0-d tensor)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor) and scale.dim() == 0 and scale.is_floating_point():
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _fail("scale", "None or a finite real number (or a 0-d floating tensor)", repr(scale))
    return float(scale)


def check_inputs(q, k, v, g, gk, gv, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log,
                 dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                 inplace_final_state, ssm_state_indices) -> None:
    """Raise ValueError naming the first bad argument, before any work."""
    B, T, H, K, HV, V = checks.check_qkv(_NAME, q, k, v, _FLOATS)
    for name, x in (("gk", gk), ("gv", gv)):
        if x is not None:
            _fail(name, "None (per-key and per-value decays are not supported: pass the per-head "
                  "log decay g [B, T, HV])", f"a {type(x).__name__}")
    if use_gate_in_kernel:
        if g is None:
            _fail("g", "the raw gate input [B, T, HV] when use_gate_in_kernel=True", None)
        if A_log is None:
            _fail("A_log", "a tensor [HV] when use_gate_in_kernel=True", None)
        _check_tensor("A_log", A_log, (HV,), _FLOATS)
        if dt_bias is not None:
            _check_tensor("dt_bias", dt_bias, (HV,), _FLOATS)
    for name, x in (("g", g), ("beta", beta)):
        if x is not None:
            _check_tensor(name, x, (B, T, HV), _FLOATS)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail("allow_neg_eigval", "False unless use_beta_sigmoid_in_kernel=True (it doubles the "
              "sigmoid of a raw beta)", True)

    N = B
    if cu_seqlens is not None:
        _check_tensor("cu_seqlens", cu_seqlens, 1, _INTS)
        if cu_seqlens.numel() < 2:
            _fail("cu_seqlens", "1-D with at least 2 entries [0, ..., T]", f"shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            _fail("q", "batch size 1 when cu_seqlens is given (sequences are packed along T)", f"B = {B}")
        N = cu_seqlens.numel() - 1
        cu = host_bounds(cu_seqlens)  # None inside CUDA-graph capture: checked by the eager calls
        if cu is not None:
            checks.check_bound_values(_NAME, "cu_seqlens", cu, T)
    state = (HV, V, K) if state_v_first else (HV, K, V)
    layout = "[.., HV, V, K] (state_v_first)" if state_v_first else "[.., HV, K, V]"
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, _FLOATS)
        rows = initial_state.shape[0] if ssm_state_indices is not None else N
        if tuple(initial_state.shape[1:]) != state or initial_state.shape[0] != rows:
            want = "S slots" if ssm_state_indices is not None else f"N = {N} sequences"
            _fail("initial_state", f"{layout} with {want}: {(rows, *state)}", f"shape {tuple(initial_state.shape)}")
    if ssm_state_indices is not None:
        if initial_state is None:
            _fail("initial_state", "the state pool [S, ...] that ssm_state_indices points into", None)
        _check_tensor("ssm_state_indices", ssm_state_indices, (N,), _INTS)
    if inplace_final_state:
        if initial_state is None:
            _fail("initial_state", "a tensor to write the final states into (inplace_final_state=True)", None)
        if not initial_state.is_contiguous():
            _fail("initial_state", "contiguous when inplace_final_state=True", f"strides {initial_state.stride()}")
        if initial_state.requires_grad and torch.is_grad_enabled():
            _fail("initial_state", "free of autograd when inplace_final_state=True (call under "
                  "torch.no_grad())", "a tensor that requires grad")
        if ssm_state_indices is not None:
            slots = host_bounds(ssm_state_indices)  # None inside capture, as for cu_seqlens
            present = [] if slots is None else [s for s in slots if 0 <= s < initial_state.shape[0]]
            if len(set(present)) != len(present):
                _fail("ssm_state_indices", "distinct slots when inplace_final_state=True (two sequences "
                      "would write one state)", slots if len(slots) <= 16 else "a repeated slot")
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log if use_gate_in_kernel else None,
               "dt_bias": dt_bias if use_gate_in_kernel else None, "initial_state": initial_state,
               "cu_seqlens": cu_seqlens, "ssm_state_indices": ssm_state_indices}
    devices = {str(x.device) for x in tensors.values() if x is not None}
    if len(devices) > 1:
        _fail(", ".join(n for n, x in tensors.items() if x is not None), "on one device", sorted(devices))


def kernel_unsupported(q, v, small, needs_grad: bool) -> str | None:
    """None when the decode kernel can run (already checked) inputs like these, otherwise why not.
    ``small``: the optional tensors the kernel reads in their own dtype (name -> tensor or None)."""
    K, V = q.shape[3], v.shape[3]
    if q.device.type != "cuda":
        return f"the inputs are on the {q.device.type}; the kernel needs an SM90 CUDA GPU"
    if hopper_gpu_missing():
        return hopper_gpu_missing()
    if q.dtype != torch.bfloat16:
        return f"q, k, v are {q.dtype}; the kernel takes torch.bfloat16"
    if K != 128 or V != 128:
        return f"K = {K} and V = {V}; the kernel needs K = V = 128"
    for name, x in small.items():
        if x is not None and x.dtype not in _KERNEL_SMALL:
            return f"`{name}` is {x.dtype}; the kernel takes float32, bfloat16 or float16"
    if needs_grad:
        return "gradients are requested; the decode kernel has no backward"
    if importlib.util.find_spec("tilelang") is None:
        return "TileLang is not installed"
    return None


_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashqla.{_NAME}: running the PyTorch reference, because {reason}", stacklevel=3)


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                                     inplace_final_state=False, ssm_state_indices=None, **kwargs):
    """Gated DeltaNet for a few tokens a sequence, FLA-compatible (fla-core 0.6.0's arguments, in its
    order).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H; all of one dtype.
        g: [B, T, HV] per-token log decay (<= 0), or with use_gate_in_kernel the raw gate input;
            None: no decay.
        gk, gv: must be None (per-key / per-value decays are not supported).
        beta: [B, T, HV] step size, or with use_beta_sigmoid_in_kernel its logit; None: 1.
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, HV, K, V] ([N, HV, V, K] with state_v_first), or with ssm_state_indices a
            pool [S, HV, K, V] of states.
        output_final_state: also return the state after the last token of every sequence.
        use_qk_l2norm_in_kernel: L2-normalize q and k over K (eps 1e-6) first.
        use_gate_in_kernel: g <- -exp(A_log) * softplus(g + dt_bias), A_log and dt_bias [HV]
            (dt_bias may be None).
        use_beta_sigmoid_in_kernel: beta <- sigmoid(beta); allow_neg_eigval: 2 * sigmoid(beta)
            (only with use_beta_sigmoid_in_kernel).
        state_v_first: states (initial and final) are stored [.., V, K].
        cu_seqlens: int32/int64 [N + 1] sequence boundaries over T, with B = 1.
        inplace_final_state: write the final states into initial_state (at their slots) and
            return it as the final state (output_final_state is then not needed).
        ssm_state_indices: int32/int64 [N], the slot of initial_state each sequence starts from
            (and in place writes to; slots must be distinct). A slot outside [0, S) is padding:
            it starts from zeros and is not written.

    Returns:
        o: [B, T, HV, V] in v's dtype; the final state: float32 [N, HV, K, V] ([N, HV, V, K]),
        float64 for float64 inputs, or initial_state itself in place, or None.
    """
    if kwargs:
        hint = " (FLA renamed it state_v_first)" if "transpose_state_layout" in kwargs else ""
        raise ValueError(f"{_NAME}: unexpected keyword arguments {sorted(kwargs)}{hint}; it takes "
                         "fla-core 0.6.0's arguments, inplace_final_state and ssm_state_indices")
    scale = _scale(scale)
    check_inputs(q, k, v, g, gk, gv, beta, initial_state, cu_seqlens, use_gate_in_kernel, A_log,
                 dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval, state_v_first,
                 inplace_final_state, ssm_state_indices)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            use_qk_l2norm_in_kernel, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel,
            allow_neg_eigval, state_v_first, inplace_final_state, ssm_state_indices)
    floats = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in floats)
    reason = kernel_unsupported(q, v, {"g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
                                       "initial_state": initial_state}, needs_grad)
    if reason is None:
        return _kernel_forward(*args)
    _warn_once(reason)
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    with nvtx_range("fused_recurrent.reference"), torch.autocast(q.device.type, enabled=False):
        o, final_state = reference.fused_recurrent_gated_delta_rule_ref(
            *(None if x is None else x.to(work) for x in (q, k, v, g, beta)), scale,
            initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, allow_neg_eigval,
            state_v_first, inplace_final_state, ssm_state_indices)
    return o.to(v.dtype), final_state
