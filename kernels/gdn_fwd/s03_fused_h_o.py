"""gdn_fwd, stage 03: the state recurrence and the output in ONE kernel, fed by TMA, pipelined.

What it adds over s02, the previous milestone: fusion. chunk_h and chunk_o become one kernel, so
the per-chunk states h (K x V per chunk and value head) and v_new never reach HBM: each CTA keeps
its state on chip and emits o directly. Why: in s02 every intermediate crosses HBM twice, and h
(K V bf16 per chunk and value head) and v_new are the largest of them. The preparation
(chunk_local_cumsum, chunk_kkt, kkt_solve, chunk_w_u) still runs as the separate stages of s02.

One CTA per (sequence, value head, 64-column tile of V) walks the sequence's chunks in order. Per
chunk of C = 64 tokens (the last one may be partial), with the state S (K x 64, fp32 registers):

    V~ = U - W S                                   (zeroed on rows past the sequence end)
    O  = scale (diag(exp(g)) Q S + (Q K^T * Gamma, lower incl. diagonal) V~)
    S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~

All five products run on wgmma, S entering them as bf16 in shared memory. Q K^T does not depend
on S; it is issued right behind the state update (and Q S behind it) and all three are waited
for once, so the tensor cores run them back to back. q, k, w, u of chunk c + 1 arrive by TMA
(full 64-row boxes; TileLang's T.Pipelined with 2 stages gives a producer warpgroup and
mbarriers) while chunk c computes. A box may read into the next sequence (or zero-filled rows
past the tensor): those rows get v_new = 0, and their gates are replaced by the sequence's last
real gate, so every exponent is a non-positive difference (exp2 of log2(e)-scaled values) and no
garbage is ever exponentiated; their o rows are not stored. The gates are loaded by the
consumers into registers one chunk ahead, not through the pipeline: TileLang ties a pipelined
non-TMA buffer to the first TMA group and would hand it back to the producer right after W S,
while the gates are still in use. Every async wgmma is followed by a synchronous one before the
pipeline releases its buffers (TileLang releases right after a buffer's last use).

Measured effect (one H200, CUDA events, median of 20; fused kernel alone, w, u, g_cum given):

    (H, HV) tokens       s03 kernel   state chain only   FLA h + o kernels   s03 run   FLA fwd
    (16, 64) 1 x 32768   1.82 ms      0.87 ms            0.93 + 1.18 ms      4.28 ms   3.70 ms
    (16, 64) 1 x 2048    0.133 ms     0.070 ms           0.153 + 0.197 ms    0.94 ms   0.56 ms
    (2, 8)   1 x 32768   1.89 ms      0.88 ms            0.88 + 0.27 ms      2.71 ms   1.47 ms
    (16, 32) 8 x 4096    0.96 ms      0.46 ms            0.58 + 0.59 ms      2.92 ms   1.86 ms

The fused kernel beats FLA's two kernels except at (2, 8), but ``run`` as a whole is slower than
FLA's forward everywhere: the preparation stages take 0.8-2.5 ms. Each CTA is latency-bound, about
3.6 us per chunk whether it holds 64 or 32 value columns (170 TFLOP/s at (16, 64)); the output
work runs in the same warps as the chain and doubles it (chain only: 1.7 us per chunk). Variants
timed (kernel, (16, 64) / (2, 8) 1 x 32768): BV = 64 with two consumer warpgroups 2.12 / 2.06 ms
(kept), one warpgroup 2.57 / 2.45 ms, BV = 32 with one warpgroup 4.13 / 1.99 ms (twice the CTAs,
one per SM: two waves at (16, 64)); prefetching the gates, swizzling the u tile and storing o
from registers then took 2.01 -> 1.82 ms (same run). Next: a warpgroup for the chain and one for
the output, so that they overlap.

In the benchmark (``python -m flashqla bench``, one H200, all rows in one run, CUDA-graph replay,
with the chunk table cached per cu_seqlens): ``run`` takes 3.46 ms on (16, 64) 1 x 32768 (FLA
6.14, FlashQLA 1.54), 2.08 ms on (2, 8) 1 x 32768 (FLA 1.00, FlashQLA 0.39) and 1.69 ms on
(16, 32) 8 x 4096 (FLA 2.47, FlashQLA 0.63): 1.46-1.77x FLA with many heads, 0.48x with few,
0.19-0.44x FlashQLA. Nsight Compute (``profiles/ncu_lab.py``, (16, 64) 1 x 8192,
``profiles/results/ncu_gdn_fwd_s03.csv``): the fused kernel runs 484 us at 160 TFLOP/s on the
tensor cores (tensor pipe busy 18 % of the time), DRAM at 20 % of peak, 18.6 % achieved occupancy
(one 384-thread CTA per SM: 168 registers a thread, 153 KB of shared memory), top stall
long_scoreboard: it is neither compute- nor memory-bound but latency-bound along the chunk chain.

Taught in: notebooks/03_forward_kernels.py.
"""

import functools

import torch

from flashqla import stages
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import seq_bounds

NEEDS = ("hopper",)
# wgmma: the five products (tl::wgmma_ss, PTX wgmma.mma_async); tma_load: q, k, w, u tiles by TMA
# (tl::tma_load, PTX cp.async.bulk.tensor) into the double-buffered shared memory
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load")

CHUNK_SIZE = 64       # C: tokens per chunk, one 64-row wgmma tile
BLOCK_V = 64          # BV: value columns of the state owned by one CTA
THREADS = 256         # two consumer warpgroups (TileLang adds a producer warpgroup)
NUM_STAGES = 2        # chunk c + 1's q, k, w, u load (TMA) while chunk c computes
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32, K=128, V=128)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)
# the preparation, as in s02: g -> g_cum -> A -> Ai -> w, u
PREP_STAGES = (("chunk_local_cumsum", 1), ("chunk_kkt", 2), ("kkt_solve", 1), ("chunk_w_u", 1))


def fused_h_o_kernel(H: int, HV: int, K: int, V: int):
    """The T.prim_func for H key heads, HV value heads, head dims K, V; any token or sequence count."""
    import tilelang  # imported here: loading a stage must not pull in TileLang
    import tilelang.language as T

    C, BV = CHUNK_SIZE, BLOCK_V
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")
    num_bounds = T.dynamic("num_bounds")

    @T.prim_func
    def gdn_fused_h_o(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        bounds: T.Tensor((num_bounds,), "int32"),              # sequence starts, then the total
        scale: T.float32,
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
    ):
        with T.Kernel(V // BV, HV, num_seqs, threads=THREADS) as (i_v, i_hv, i_n):
            i_h = i_hv // group
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            v0 = i_v * BV

            q_s = T.alloc_shared((C, K), "bfloat16")
            k_s = T.alloc_shared((C, K), "bfloat16")
            w_s = T.alloc_shared((C, K), "bfloat16")
            u_s = T.alloc_shared((C, BV), "bfloat16")
            g_s = T.alloc_shared((C,), "float32")
            h_s = T.alloc_shared((K, BV), "bfloat16")
            p_s = T.alloc_shared((C, C), "bfloat16")
            vn_s = T.alloc_shared((C, BV), "bfloat16")
            vd_s = T.alloc_shared((C, BV), "bfloat16")
            h_f = T.alloc_fragment((K, BV), "float32")
            vn_f = T.alloc_fragment((C, BV), "float32")
            vd_f = T.alloc_fragment((C, BV), "float32")
            p_f = T.alloc_fragment((C, C), "float32")
            o_f = T.alloc_fragment((C, BV), "float32")
            g_f = T.alloc_fragment((C,), "float32")

            # u_s is read in the accumulator layout (8 rows of 128 bytes per warp access): swizzle it
            T.annotate_layout({u_s: tilelang.layout.make_swizzled_layout(u_s)})

            # S <- h0 (this CTA's BV columns of it)
            T.copy(h0[i_n, i_hv, :, v0:v0 + BV], h_f)
            # gates of chunk 0 (see the loop)
            for i in T.Parallel(C):
                g_f[i] = T.if_then_else(bos < eos, g_cum[T.min(bos + i, eos - 1), i_hv], 0)

            for c in T.Pipelined(T.ceildiv(eos - bos, C), num_stages=NUM_STAGES):
                t0 = bos + c * C
                n = T.min(eos - t0, C)                          # real rows of this chunk, 1..64
                # full 64-row tiles by TMA; rows >= n (next sequence or zero fill) are masked below
                T.copy(w[t0:t0 + C, i_hv, :], w_s)
                T.copy(u[t0:t0 + C, i_hv, v0:v0 + BV], u_s)
                T.copy(k[t0:t0 + C, i_h, :], k_s)
                T.copy(q[t0:t0 + C, i_h, :], q_s)
                # g <- g_cum of this chunk, rows >= n padded with the last real row, so every
                # exponent below, g_i - g_j with i >= j or g_C - g_i, is <= 0. The consumers load
                # the gates into registers one chunk ahead (a pipelined shared buffer would be
                # handed back to the producer with w_s, right after W S, while still in use)
                T.copy(g_f, g_s)
                for i in T.Parallel(C):
                    g_f[i] = g_cum[T.min(t0 + C + i, eos - 1), i_hv]
                # S (fp32 registers) -> bf16 in shared memory, the wgmma operand
                T.copy(h_f, h_s)
                # V~ <- U - W S, zero rows >= n (they then add nothing to the state);
                # V_d <- diag(exp(g_C - g)) V~, the decayed copy the state update reads
                T.gemm(w_s, h_s, vn_f, clear_accum=True)
                for i, j in T.Parallel(C, BV):
                    vn_f[i, j] = T.if_then_else(i < n, u_s[i, j] - vn_f[i, j], 0)
                    vd_f[i, j] = vn_f[i, j] * T.exp2((g_s[C - 1] - g_s[i]) * LOG2E)
                T.copy(vn_f, vn_s)
                T.copy(vd_f, vd_s)
                # S <- exp(g_C) S + K^T diag(exp(g_C - g)) V~, then O <- Q S (the incoming S, still
                # in h_s) and P <- Q K^T: three products issued back to back, one wait
                for i, j in T.Parallel(K, BV):
                    h_f[i, j] = h_f[i, j] * T.exp2(g_s[C - 1] * LOG2E)
                T.wgmma_gemm(k_s, vd_s, h_f, transpose_A=True)
                T.wgmma_gemm(q_s, h_s, o_f, clear_accum=True)
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                # P <- scale (Q K^T * Gamma), lower triangle incl. the diagonal
                for i, j in T.Parallel(C, C):
                    p_f[i, j] = T.if_then_else(j <= i, scale * p_f[i, j] * T.exp2((g_s[i] - g_s[j]) * LOG2E), 0)
                T.copy(p_f, p_s)
                # O <- scale exp(g) Q S + P V~
                for i, j in T.Parallel(C, BV):
                    o_f[i, j] = o_f[i, j] * (scale * T.exp2(g_s[i] * LOG2E))
                T.gemm(p_s, vn_s, o_f)
                # o[t0 : t0 + n] <- O, the chunk's own rows only, straight from the registers
                for i, j in T.Parallel(C, BV):
                    if i < n:
                        o[t0 + i, i_hv, v0 + j] = o_f[i, j]

            T.copy(h_f, ht[i_n, i_hv, :, v0:v0 + BV])

    return gdn_fused_h_o


@functools.cache
def _compiled(H: int, HV: int, K: int, V: int):
    return compile_hopper(fused_h_o_kernel(H, HV, K, V))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def fused_h_o(q, k, w, u, g_cum, initial_state, cu_seqlens, scale):
    """The fused kernel alone: [B, T, ...] inputs (w, u bf16, g_cum fp32) -> (o, final state)."""
    B, T, H, K = q.shape
    HV, V = u.shape[2], u.shape[3]
    device = q.device
    bounds = seq_bounds(cu_seqlens, B, T, device)
    N = bounds.shape[0] - 1
    if initial_state is None:
        initial_state = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device)
    if B * T:
        kernel = _compiled(H, HV, K, V)
        with nvtx_range("gdn_fwd.s03"):
            kernel(q.reshape(B * T, H, K), k.reshape(B * T, H, K), w.reshape(B * T, HV, K),
                   u.reshape(B * T, HV, V), g_cum.reshape(B * T, HV),
                   initial_state.to(torch.float32).contiguous(), bounds, scale, o, ht)
    else:
        ht.copy_(initial_state)
    return o.view(B, T, HV, V), ht


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked GDN forward (``flashqla.reference.chunk_gated_delta_rule_ref``) -> (o, final state)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_fwd.s03: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != 128:
        raise ValueError(f"gdn_fwd.s03: `q` must have head dim K = 128; got K = {K}")
    if V != 128:
        raise ValueError(f"gdn_fwd.s03: `v` must have head dim V = 128; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s03: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    scale = K ** -0.5 if scale is None else scale
    q, k, v = (x.to(torch.bfloat16).contiguous() for x in (q, k, v))
    g, beta = (x.to(torch.float32).contiguous() for x in (g, beta))
    cumsum, kkt, solve, w_u = (stages.load(op, number).run for op, number in PREP_STAGES)
    g_cum = cumsum(g, cu_seqlens, chunk_size)
    A = kkt(k, g_cum, beta, cu_seqlens, chunk_size)
    Ai = solve(A, cu_seqlens, chunk_size)
    w, u = w_u(k, v, beta, Ai, g_cum, cu_seqlens, chunk_size)
    o, ht = fused_h_o(q, k, w.contiguous(), u.contiguous(), g_cum.contiguous(), initial_state,
                      cu_seqlens, scale)
    return o, (ht if output_final_state else None)
