"""gdn_fwd, stage 04: the algebraic reformulation. A gate-free solve, and w and u never formed.

What it adds over s03, the previous milestone: the algebra. s03's preparation (chunk_kkt,
kkt_solve, chunk_w_u) forms w and u, which cross HBM into the fused kernel; here it shrinks to the
gate-free inverse of gate_free_solve.s01, and the fused kernel rebuilds the WY product itself. Why:
the solve no longer needs the gate, w and u (512 bytes a token and value head) never make a round
trip, and one 64 x 64 exp tile a chunk serves both the output's mask and WY. With D = diag(exp(g))
(g the chunk-local cumulative gate) the gated matrix is D L D^-1, so (I + A)^-1 = Gamma * A_r
elementwise and

    v_new = u - w S = (Gamma * Ab) (V - D K S),    Ab = A_r diag(beta)   (gate_free_solve)

One CTA per (sequence, value head, 64-column tile of V) walks the sequence's chunks in order, as
in s03. Per chunk of C = 64 tokens, with the state S (K x 64, fp32 registers):

    U  = K S,   O = Q S,   P = Q K^T             three products issued back to back, one wait
    W  = V - diag(exp(g)) U                      (rows past the sequence end zeroed)
    Gamma_ij = exp(g_i - g_j) on j <= i          ONE 64 x 64 exp tile per chunk, for both:
    P <- scale P * Gamma,   WY = Gamma * Ab      (WY = Ab where the solve kept the gate)
    V~ = WY W
    O  = scale diag(exp(g)) O + P V~
    S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~

Every exponent is a non-positive difference of log2(e)-scaled gates (exp2), rows past a sequence
end carrying the sequence's last real gate; scale goes into the P pass and the Q S rows, beta is
already inside Ab. Per chunk and value head the kernel reads q, k, v and Ab (bf16: 64 values a
token instead of w's 128) and g, instead of q, k, w, u, g; w and u no longer make a round trip
through HBM (512 bytes a token and value head written, then read). Buffers and pipeline are s03's
(TMA, 2 stages, a producer warpgroup, gates loaded by the consumers one chunk ahead); the state
update, whose K tile the pipeline hands back after its last use, is the synchronous product that
ends the chunk, with P V~ issued asynchronously before it.

Precision: where gate_free_solve.s01 found a chunk with beta ||k||^2 > 2 on some row (A_r could
overflow; never for L2-normalized keys with beta <= 2) it solved the gated matrix instead and
flagged it; this kernel reads the flag per (chunk, value head) and then uses Ab as it is, so no
input gives a silently wrong result (``tests/test_reformulation.py``: near-duplicate keys with beta
near 1, keys of norm 3, decays down to -20 a token, against float64). Relative L2 errors measured
on the GPU (profiles/reformulation_lab.py errors; the bf16 PyTorch reference in brackets, the test
bound is twice it), s04 against s03: o 6.6e-3 vs 5.6e-3 [7.1e-3] and final state 4.7e-3 vs 4.0e-3
[5.6e-3] on near-duplicate keys; o 2.0e-2 vs 1.3e-2 [4.0e-2] on the unnormalized keys (half the
heads flagged); 2.5e-3 for both [1.1e-1] under very strong decay and 3.5e-3 for both [6.0e-3] on
a public problem. The extra error on near-duplicate keys is the bf16 rounding of the WY tile
Gamma * Ab (a CPU emulation with that tile in fp32 halves it); storing Ab in fp32 instead of bf16
changed the emulated errors by less than 1 %.

Measured effect (one H200, CUDA events, median of 20 after 3 warm-up calls, all in one run of
profiles/reformulation_lab.py timing; ms):

    (H, HV) tokens       s04 kernel  s03 kernel  fwd_intra (w, u)  FLA fwd  s03 run  promoted
    (16, 64) 1 x 32768   2.286       2.027       1.430             4.203    3.556    3.366
    (2, 8)   1 x 32768   2.222       1.917       0.200             1.281    2.168    2.138
    (16, 32) 8 x 4096    1.113       0.947       0.719             2.570    1.834    1.653

(promoted = the library's forward at the time: cumsum, chunk_fwd_intra.s01, s03's kernel; the s04
kernel timed there computed the Gamma tile after the wait for Q K^T; it now does so while U and
Q S run, a change the GPU tests passed and that is still to be timed). The reformulated kernel is
13-17 % slower than s03's although it reads fewer bytes: s03 was latency-bound along the chunk
chain (Nsight Compute), s04 is not profiled yet, and its chain has one more dependent product (K S, then WY W, then the state update,
where s03 has W S and the update), one more shared-memory round trip and its barriers. So the
reformulation pays only where the preparation it keeps (cumsum + gate_free_solve) undercuts
chunk_fwd_intra by more than 0.26 / 0.31 / 0.17 ms. In that run ``run`` took 6.00 / 2.59 / 2.91 ms
because of a slow first version of the solve (gate_free_solve.s01's docstring). With the fixed
solve, in the benchmark (``python -m flashqla bench``, one H200, CUDA-graph replay, commit 9ef1cd8,
all rows in one run; ``profiles/results/gdn_fwd.csv``) ``run`` is the fastest stage on most of
the problems timed: (16, 64) 1 x 32768 2.81 ms (s03 3.66, s05 2.90, FLA 3.99, FlashQLA 1.54),
(16, 64) 8 x 4096 2.75 (s03 3.57, FLA 3.52, FlashQLA 1.24), (16, 32) 8 x 4096 1.49 (s03 1.89,
FLA 1.78, FlashQLA 0.64); on (16, 32) 1 x 32768 2.58 against s05's 2.12. The gain over s03 is the
preparation: the gate-free solve replaces chunk_kkt, kkt_solve and chunk_w_u. Next: the chain in a warpgroup of its own (s05's organization), where the
extra product can overlap the output work.

Taught in: notebooks/04_reformulation.py.
"""

import functools

import torch

from flashqla import stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# wgmma: the six products (tl::wgmma_ss, PTX wgmma.mma_async); tma_load: q, k, v, Ab tiles by TMA
# (tl::tma_load, PTX cp.async.bulk.tensor) into the double-buffered shared memory; exp2f: the one
# decay tile per chunk and the row decays, no other exponential
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
BLOCK_V = 64          # BV: value columns of the state owned by one CTA
THREADS = 256         # two consumer warpgroups (TileLang adds a producer warpgroup)
NUM_STAGES = 2        # chunk c + 1's q, k, v, Ab load (TMA) while chunk c computes
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32, K=128, V=128)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def fused_reform_kernel(H: int, HV: int, K: int, V: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V; any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, BV = CHUNK_SIZE, BLOCK_V
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def gdn_fused_reform(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ab: T.Tensor((num_tokens, HV, C), "bfloat16"),         # gate_free_solve: rows per token
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        gated: T.Tensor((num_chunks, HV), "int32"),            # 1: ab already holds the gate
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        first_chunk: T.Tensor((num_bounds,), "int32"),         # each sequence's first chunk row
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]
            v0 = i_v * BV

            q_s = T.alloc_shared((C, K), "bfloat16")
            k_s = T.alloc_shared((C, K), "bfloat16")
            v_s = T.alloc_shared((C, BV), "bfloat16")
            ab_s = T.alloc_shared((C, C), "bfloat16")
            g_s = T.alloc_shared((C,), "float32")
            h_s = T.alloc_shared((K, BV), "bfloat16")
            w_s = T.alloc_shared((C, BV), "bfloat16")
            wy_s = T.alloc_shared((C, C), "bfloat16")
            p_s = T.alloc_shared((C, C), "bfloat16")
            vn_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            h_f = T.alloc_fragment((K, BV), "float32")
            x_f = T.alloc_fragment((C, BV), "float32")         # U, then W, then V_d
            vn_f = T.alloc_fragment((C, BV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            gam_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            g_f = T.alloc_fragment((C,), "float32")
            keep = T.alloc_var("int32")                        # this chunk's gated flag

            # v_s and ab_s are read in the accumulator layout (8 rows of 128 bytes per warp access)
            T.annotate_layout({v_s: tilelang.layout.make_swizzled_layout(v_s),
                               ab_s: tilelang.layout.make_swizzled_layout(ab_s)})

            # S <- h0 (this CTA's BV columns of it)
            T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
            # log2(e) g of chunk 0 (see the loop)
            for i in T.Parallel(C):
                g_f[i] = T.if_then_else(bos < eos, g_cum[T.min(bos + i, eos - 1), i_hv] * LOG2E, 0)

            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=NUM_STAGES):
                t0 = bos + c * C
                n = T.min(eos - t0, C)                          # real rows of this chunk, 1..64
                # full 64-row tiles by TMA; rows >= n (next sequence or zero fill) are masked below
                T.copy(ab[t0:t0 + C, i_hv, :], ab_s)
                T.copy(v[t0:t0 + C, i_hv, v0:v0 + BV], v_s)
                T.copy(k[t0:t0 + C, i_h, :], k_s)
                T.copy(q[t0:t0 + C, i_h, :], q_s)
                # g <- log2(e) g_cum of this chunk, rows >= n padded with the last real row, so
                # every exponent below (g_i - g_j for i >= j, g_C - g_i, g_i, g_C) is <= 0; the
                # consumers load gates and flag into registers, not through the pipeline (s03)
                T.copy(g_f, g_s)
                for i in T.Parallel(C):
                    g_f[i] = g_cum[T.min(t0 + C + i, eos - 1), i_hv] * LOG2E
                keep = gated[row0 + c, i_hv]
                # S (fp32 registers) -> bf16 in shared memory, the wgmma operand
                T.copy(h_f, h_s)
                # U <- K S, O <- Q S (async), P <- Q K^T: three products back to back, one wait;
                # Gamma <- exp(g_i - g_j) on j <= i < n, 0 elsewhere (the one exp tile of the
                # chunk) while the first two run
                T.wgmma_gemm(k_s, h_s, x_f, clear_accum=True)
                T.wgmma_gemm(q_s, h_s, o_f, clear_accum=True)
                for i, j in T.Parallel(C, C):
                    gam_f[i, j] = T.if_then_else((j <= i) & (i < n), T.exp2(g_s[i] - g_s[j]), 0)
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                # W <- V - diag(exp(g)) U, rows >= n zero (their V~ rows are then zero too)
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = T.if_then_else(i < n, v_s[i, j] - T.exp2(g_s[i]) * x_f[i, j], 0)
                T.copy(x_f, w_s)
                # P <- scale (Q K^T * Gamma), WY <- Gamma * Ab (masked Ab for a gated chunk)
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = scale * p_f[i, j] * gam_f[i, j]
                    wy_s[i, j] = T.if_then_else(
                        (j <= i) & (i < n),
                        ab_s[i, j] * T.if_then_else(keep != 0, 1.0, gam_f[i, j]), 0)
                T.copy(p_f, p_s)
                # V~ <- WY W   (64 x BV x 64)
                T.gemm(wy_s, w_s, vn_f, clear_accum=True)
                # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads;
                # O <- scale diag(exp(g)) Q S
                for i, j in T.Parallel(C, BV):
                    x_f[i, j] = vn_f[i, j] * T.exp2(g_s[C - 1] - g_s[i])
                    o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[i]))
                T.copy(vn_f, vn_s)
                T.copy(x_f, vd_s)
                # O <- O + P V~ (async), then S <- exp(g_C) S + K^T V_d, which waits for both
                for i, j in T.Parallel(K, BV):
                    h_f[i, j] = h_f[i, j] * T.exp2(g_s[C - 1])
                T.wgmma_gemm(p_s, vn_s, o_f)
                T.gemm(k_s, vd_s, h_f, transpose_A=True)
                # o[t0 : t0 + n] <- O, the chunk's own rows only, straight from the registers
                for i, j in T.Parallel(C, BV):
                    if i < n:
                        o[t0 + i, i_hv, v0 + j] = o_f[i, j]

            T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

    return gdn_fused_reform


@functools.cache
def _compiled(H: int, HV: int, K: int, V: int):
    return compile_hopper(fused_reform_kernel(H, HV, K, V))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def fused_reform(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale):
    """The fused kernel alone: [B, T, ...] inputs (ab bf16 and gated from gate_free_solve.s01's
    ``solve``, g_cum fp32) -> (o [B, T, HV, V] bf16, final state [N, HV, K, V] fp32)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device = q.device
    bounds = seq_bounds(cu_seqlens, B, T, device)
    _, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N = bounds.shape[0] - 1
    if initial_state is None:
        initial_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device)
    if B * T:
        kernel = _compiled(H, HV, K, V)
        with nvtx_range("gdn_fwd.s04"):
            kernel(q.reshape(B * T, H, K), k.reshape(B * T, H, K), v.reshape(B * T, HV, V),
                   ab.reshape(B * T, HV, CHUNK_SIZE), g_cum.reshape(B * T, HV), gated,
                   initial_state.to(torch.float32).contiguous(), bounds, first_chunk, scale, o, ht)
    else:
        ht.copy_(initial_state)
    return o.view(B, T, HV, V), ht


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s04: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s04: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s04: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s04: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    g_cum = stages.load("chunk_local_cumsum", 1).run(g, cu_seqlens, chunk_size)
    ab, gated = stages.load("gate_free_solve", 1).solve(k, beta, g_cum, cu_seqlens)
    o, ht = fused_reform(q, k, v, ab, g_cum, gated, initial_state, cu_seqlens, scale)
    return o, (ht if output_final_state else None)
