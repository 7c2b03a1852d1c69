"""fused_recurrent, stage 02: every load of a CTA in flight before its first wait, and 32 one-warp
CTAs an SM (8 value columns a CTA, 64 registers a lane).

What it computes: fused_recurrent.s01's op, with its options and layouts unchanged (FLA's
``fused_recurrent_gated_delta_rule``: q/k l2norm, the raw gate -exp(A_log) softplus(g + dt_bias),
sigmoid(beta) and 2 sigmoid(beta), the V-first state layout, a state pool read and written in place
through ``ssm_state_indices``). Per token

    h   <- exp(g_t) h
    e_t  = beta_t (v_t - h^T k_t)
    h   <- h + k_t e_t^T
    o_t  = h^T (scale q_t)

What changed, and why. At T = 1 decode is a stream: each 64 KB fp32 state is read once and written
once, so a kernel reaches the copy roof only with enough state bytes in flight on every SM. A CTA
holds its state registers from its first load to its last store, so two things set the bytes in
flight: how many CTAs an SM holds (registers), and how much of a CTA's life is spent waiting for
something other than its state. s01 loses on both. Its compile (ptxas, nvcc 13.0, sm_90a) gives a
lane 159 registers, 12 CTAs (12 warps, 96 KB of state) an SM; and its SASS issues the 16 state
loads first, then stages the tokens with three round trips one after another: each q/k load is
stored to shared memory before the next is issued, then v the same way, then g and beta, and only
then the barrier. At T = 1 the CTA waits for three dependent trips to memory before its first token,
all the while holding its 8 KB of state.

Here the token block is fetched in one trip, beside the state: lanes 0 .. BT - 1 load their token's
raw g and beta (and A_log, dt_bias) into registers, and q, k (only the rows of tokens that exist:
one at T = 1) and this CTA's columns of v go to shared memory by cp.async, which needs no
registers and does not block the issuing lane (v's BT x BV block goes whole, as TileLang lowers no
narrower async copy: at T = 1 seven 16-byte rows of other sequences' v, beside the CTA's 8 KB of
state read and written); one ``cp.async.wait_group 0`` and the barrier, then the
lanes activate their tokens' gates into shared memory. And a CTA owns BV = 8 value columns (16 CTAs
a state, FLA's split): a lane holds 4 columns x 8 rows (32 fp32 state registers; lane = 2 r + c
owns columns 4 c .. 4 c + 3 and rows 64 j + 4 r + s, j < 2, s < 4), the sums over K take 4 xor
shuffles (lanes 2, 4, 8, 16 apart), and ``__launch_bounds__(32, 32)`` asks ptxas for 64 registers,
so the SM holds 32 CTAs, its limit. BT = 8 tokens a block keeps shared memory at 4.3 KB a CTA
(plus 1 KB the hardware reserves), 170 KB for 32.

The compile (ptxas, nvcc 13.0, sm_90a; ``cuobjdump --dump-resource-usage``), default and FLA's layer
variant alike: BV = 8, 64 registers, no spills (no local memory, no stack), 32 CTAs an SM: 128 KB of
state in flight an SM against s01's 96 KB. Without the launch bound ptxas takes 106 registers (18
CTAs an SM). The SASS: 8 LDG.E.128 of the state, then the g and beta LDGs, the LDGSTS of q, k and
v, one DEPBAR and the barrier: one trip before the first token. BV = 16 (``run(..., BV=16)``,
s01's width) compiles to 128 registers with no spills at 16 CTAs an SM, also 128 KB in flight,
with half the CTAs; the lab times both widths.

Measured effect (``python profiles/decode_lab.py --stages``, ``profiles/results/decode_stages.csv``:
one H100, commit d126b76, s01, s02 at BV = 8 and 16 and FLA 0.6.0's fused_recurrent in one run,
CUDA-graph replay, 32 points: (16, 32) and (16, 64), batch 1 to 256, T = 1 and 4, plain and layer
calls). Against FLA: s01 0.84-1.60x (geomean 1.05x, behind on 16 points), s02 at BV = 8 0.82-1.72x
(1.07x, 13), s02 at BV = 16 0.91-1.82x (1.13x, 11). At BV = 16 the loads-first staging alone takes
0.79-1.04x s01's time (geomean 0.93x): 0.81-0.97x on batch 1 and 8 (latency: one trip to memory
instead of three) and 0.79-0.88x on the layer call at T = 4 from batch 64, but 0.97-1.04x on plain
calls from batch 64, where the state stream is the whole cost; at T = 1 there it stays 0.91-0.94x
FLA (71-90 % of the copy roof; FLA's kernel up to 99.5 %). BV = 8 (32 CTAs an SM) is ahead on the
layer calls at T = 4 from batch 8 (1.10-1.14x FLA) but behind on plain T = 1 from batch 64
(0.82-0.85x); not profiled (at BV = 8 twice the CTAs load the same q and k, each for half the
state bytes). Promoted at BV = 16 (``flashqla.recurrent``).
"""

import functools
from typing import NamedTuple

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range

NEEDS = ("hopper",)
# __shfl_xor_sync: the sums over K across a column's 16 lanes; exp2f: the decay; *(float4*)(h0: the
# state read as 16-byte vectors; cp_async_gs_conditional: q, k, v staged by cp.async, only the tokens
# that exist; __launch_bounds__(32, 32): 64 registers a lane, 32 CTAs an SM
SOURCE_MUST_CONTAIN = ("__shfl_xor_sync", "exp2f", "*(float4*)(h0", "cp_async_gs_conditional",
                       "__launch_bounds__(32, 32)")

HEAD_DIM = 128                           # K = V = 128 only
LANES = 32                               # one warp a CTA
COLS = 4                                 # adjacent state columns a lane owns (one float4, K-first)
QUAD = 4                                 # adjacent rows in one of its float4s (V-first)
WIDTHS = (8, 16)                         # value columns a CTA (BV): 16 or 8 CTAs a state
DEFAULT_BV = 8                           # 32 fp32 state registers a lane
MIN_CTAS_PER_SM = {8: 32, 16: 16}        # BV -> the launch bound: 64 or 128 registers a lane
BT = 8                                   # tokens staged in shared memory at a time
SUMS = 2 * COLS + 3                      # h^T k, h^T q (4 columns each), k.q, ||k||^2, ||q||^2
LOG2E = 1.4426950408889634
SOFTPLUS_LINEAR = 20.0                   # softplus(x) = x above this (FLA's and torch's threshold)
L2NORM_EPS = 1e-6
DEFAULT_SHAPE = dict(H=16, HV=32)        # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)

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


def fused_recurrent_kernel(H: int, HV: int, variant: Variant = Variant(), BV: int = DEFAULT_BV):
    """The T.prim_func for H key heads, HV value heads, K = V = 128, ``variant`` and BV value
    columns a CTA (``WIDTHS``); any token, sequence or slot count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    if BV not in WIDTHS:
        raise ValueError(f"fused_recurrent.s02: `BV` must be one of {WIDTHS}; got {BV!r}")
    K = V = HEAD_DIM
    x = variant
    group = HV // H                          # value head i_hv reads q/k head i_hv // group
    col_groups = BV // COLS                  # lanes side by side in the columns
    row_groups = LANES // col_groups         # lanes sharing columns: 16 (BV = 8) or 8 (BV = 16)
    quads = HEAD_DIM // (row_groups * QUAD)  # a lane's rows: 4 row_groups j + 4 r + s, s < QUAD
    rows = quads * QUAD                      # 8 (BV = 8) or 16 (BV = 16)
    shuffles = row_groups.bit_length() - 1   # xor steps that sum over the row groups
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
        """The register of (row QUAD row_groups j + QUAD r + s, column COLS c' + c): float4s along
        the stored rows."""
        return (j * COLS + c) * QUAD + s if x.state_v_first else (j * QUAD + s) * COLS + c

    def row(j, s, lr):
        return j * row_groups * QUAD + lr * QUAD + s

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
            T.annotate_min_blocks_per_sm(MIN_CTAS_PER_SM[BV])
            i_h = i_hv // group
            lane = T.get_thread_binding()
            lc = lane % col_groups               # columns col0 .. col0 + 3
            lr = lane // col_groups              # rows QUAD row_groups j + QUAD lr + s
            col0 = i_v * BV + lc * COLS

            q_s = T.alloc_shared((BT, K), "bfloat16")
            k_s = T.alloc_shared((BT, K), "bfloat16")
            v_s = T.alloc_shared((BT, BV), "bfloat16")
            g_s = T.alloc_shared((BT,), "float32")   # log2 of the decay
            b_s = T.alloc_shared((BT,), "float32")   # the step size beta
            h = T.alloc_local((rows * COLS,), "float32")
            gb = T.alloc_local((4,), "float32")      # lane i < BT: token i's raw g, beta; A_log, dt_bias
            q_t = T.alloc_local((rows,), "float32")
            k_t = T.alloc_local((rows,), "float32")
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

            # h <- the initial state (zeros without one, or for a padding slot): rows * COLS / 4
            # float4 loads, issued first, waited for by the first token's sums
            for r in T.unroll(rows * COLS):
                h[r] = 0.0
            if x.h0:
                if present:
                    for j in T.unroll(quads):
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
                    for j in T.unroll(quads):
                        for s in T.vectorized(QUAD):
                            k_t[j * QUAD + s] = k_s[i, row(j, s, lr)]
                            q_t[j * QUAD + s] = q_s[i, row(j, s, lr)]
                    # sums <- h^T k, h^T q (the lane's 4 columns), k.q (||k||^2, ||q||^2) over its
                    # rows, then over the row_groups lanes of the column group
                    for r in T.unroll(SUMS):
                        sums[r] = 0.0
                    for j in T.unroll(quads):
                        for s in T.unroll(QUAD):
                            for c in T.unroll(COLS):
                                sums[c] += h[at(j, s, c)] * k_t[j * QUAD + s]
                                sums[COLS + c] += h[at(j, s, c)] * q_t[j * QUAD + s]
                            sums[2 * COLS] += k_t[j * QUAD + s] * q_t[j * QUAD + s]
                            if x.l2norm:
                                sums[2 * COLS + 1] += k_t[j * QUAD + s] * k_t[j * QUAD + s]
                                sums[2 * COLS + 2] += q_t[j * QUAD + s] * q_t[j * QUAD + s]
                    for m in T.unroll(shuffles):
                        for r in T.unroll(SUMS):
                            sums[r] += T.shfl_xor(sums[r], col_groups << m)
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
                    for j in T.unroll(quads):
                        for s in T.unroll(QUAD):
                            for c in T.unroll(COLS):
                                h[at(j, s, c)] = decay * h[at(j, s, c)] + rk * k_t[j * QUAD + s] * e[c]

            # the final state <- h: a new fp32 tensor, or back into the slot it came from
            if x.store == "new":
                for j in T.unroll(quads):
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
                    for j in T.unroll(quads):
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
def _compiled(H: int, HV: int, variant: Variant = Variant(), BV: int = DEFAULT_BV):
    return compile_hopper(fused_recurrent_kernel(H, HV, variant, BV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape and variant (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


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


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None,
        use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
        inplace_final_state=False, ssm_state_indices=None, BV=DEFAULT_BV):
    """q, k [B, T, H, K] bf16, v [B, T, HV, V] bf16, g, beta [B, T, HV] (fp32, bf16 or fp16; either
    may be None), states fp32, bf16 or fp16 -> (o [B, T, HV, V] bf16, final state fp32, initial_state
    in place, or None); BV value columns a CTA (``WIDTHS``). Inputs are assumed checked
    (``flashqla.fused_recurrent_gated_delta_rule``)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM or V != HEAD_DIM:
        raise ValueError(f"fused_recurrent.s02: `q` and `v` must have head dims K = V = {HEAD_DIM}; "
                         f"got K = {K}, V = {V}")
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
        scale = K ** -0.5 if scale is None else float(scale)
        kernel = _compiled(H, HV, variant, BV)
        with nvtx_range("fused_recurrent.s02"):
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
