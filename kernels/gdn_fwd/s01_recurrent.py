"""gdn_fwd, stage 01: the recurrence itself, one token after another, the state on chip.

The first milestone of the course path. What it adds over what comes before it (the float64
references of notebooks 01 and 02, plain PyTorch): the GPU. The recurrence runs as written, token
by token, with the state in registers. Why: it is the definition of GDN, the simplest correct
kernel, and it measures what the chunked form (s02) must remove: every token is a dependent step
of O(K V) work on the CUDA cores, so the time is the length of the chain, not the work.

What it computes (``flashqla.reference.chunk_gated_delta_rule_ref``): for every sequence and value
head, starting from h = initial_state (zeros when None),

    h   <- exp(g_t) h
    e_t  = beta_t (v_t - h^T k_t)
    h   <- h + k_t e_t^T
    o_t  = h^T (scale q_t)

and returns o (bf16) and the final h (fp32) when asked.

Against s00 (FLA's chunked Triton kernels, called as a library, the baseline): nothing is chunked.
This is the definition of GDN run as written, and it shows why the chunked form is needed: every
token is a step of O(K V) work on the CUDA cores (no matrix product, so no tensor cores) that
depends on the step before, so a sequence of T tokens is T steps in a row however many SMs there
are. It is also the seed of a decode kernel, where T = 1 and there is nothing to chunk.
chunk_size is accepted and ignored: the recurrence has no chunks.

How a step is made cheap. One CTA per (sequence, value head, V tile of BV = 16 columns), the
K x BV = 128 x 16 fp32 state in the registers of one warpgroup, 16 values a thread. Each warp owns
4 columns; in a warp, the 8 lanes of a group own one column, lane s its 16 rows [16 s, 16 s + 16).
So h^T k is 16 FMAs in a thread then a sum over 8 lanes (3 xor shuffles), with no shared-memory
round trip and no barrier: the four warps never talk to each other. The output needs no second
pass over h:

    o_t = scale (h_new^T q_t) = scale (exp(g_t) h^T q_t + e_t (k_t . q_t)),

so h^T k, h^T q (on the undecayed h) and k . q are summed over the 8 lanes together (9 shuffles a
token in all) before h is touched. exp(g) is taken as exp2(log2(e) g) (``exp2f``).

Hiding the loads. A step is short, so a load from global memory issued into registers one or two
tokens ahead still stalls it (measured below). The tokens are instead staged in shared memory in
blocks of BT = 32, double-buffered with ``T.Pipelined``; TileLang turns this into two warpgroups:
a producer (q, k, v tiles by TMA, g and beta by cp.async; one mbarrier per buffer and tile for
"loaded", one for "consumed") and the consumer warpgroup above, which reads a token's q, k slice
from shared memory while the next block is in flight. Rows past the sequence end are loaded (zeros
past the tensor end, by TMA) but never used.

Measured effect (one H200, CUDA events, median of 20 after warm-up, ``run`` as called, bf16,
K = V = 128, initial and final state, 1 x 8192 tokens, every number from the same run):
(H, HV) = (16, 32) 2.42 ms, (2, 8) 1.78 ms, i.e. 295 and 217 ns a token. That is 3.6x and 2.9x
slower than FLA's chunked forward (0.67, 0.61 ms) and 5.4x and 6.3x faster than FLA's
``fused_recurrent_gated_delta_rule`` (13.0, 11.3 ms). Four times the value heads cost only 1.36x
the time: the kernel is bound by the latency of the chain of steps, not by work or bandwidth, which
is what the chunked form removes. Register prefetch instead of staging: one token ahead 4.15 /
3.83 ms, two tokens ahead 3.39 / 2.84 ms. BT = 16 or 64, three stages, or BV = 8 with a 64-thread
consumer: within 3%. 16 lanes a column (BV = 8): 2.99 / 1.58 ms; 4 lanes a column (BV = 32):
2.78 / 2.86 ms.

Taught in: notebooks/03_forward_kernels.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import seq_bounds

NEEDS = ("hopper",)
# exp2f: the per-token decay exp2(log2(e) g_t); __shfl_xor_sync: the sums over K across a lane
# group; tma_load: the token blocks staged into shared memory
SOURCE_MUST_CONTAIN = ("exp2f", "__shfl_xor_sync", "tma_load")

HEAD_DIM = 128        # K = V = 128 only
THREADS = 128         # the consumer warpgroup: 4 warps x 4 columns x 8 lanes
GROUP = 8             # lanes sharing one column, each owning K / GROUP rows
BV = THREADS // GROUP # state columns per CTA (16)
BT = 32               # tokens staged per block
STAGES = 2            # blocks in flight
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = dict(H=16, HV=32)  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def recurrent_kernel(H: int, HV: int):
    """The T.prim_func for H key heads, HV value heads, K = V = 128; any token or sequence count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    K = V = HEAD_DIM
    RK = K // GROUP                  # rows of h a thread owns
    LANE_BITS = GROUP.bit_length() - 1  # xor shuffles summing over a lane group
    group = HV // H                  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_seqs = T.dynamic("num_seqs")

    @T.prim_func
    def recurrent_fwd(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g: T.Tensor((num_tokens, HV), "float32"),
        beta: T.Tensor((num_tokens, HV), "float32"),
        bounds: T.Tensor((num_seqs + 1,), "int32"),            # where each sequence starts, then T
        h0: T.Tensor((num_seqs, HV, K, V), "float32"),
        o: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_seqs, HV, K, V), "float32"),
        scale: T.float32,
    ):
        with T.Kernel(V // BV, num_seqs, HV, threads=THREADS) as (i_v, i_n, i_hv):
            i_h = i_hv // group
            tx = T.get_thread_binding()
            col = i_v * BV + tx // GROUP           # the state column this thread owns
            row0 = (tx % GROUP) * RK               # its rows [row0, row0 + RK)
            bos = bounds[i_n]
            eos = bounds[i_n + 1]

            q_s = T.alloc_shared((BT, K), "bfloat16")
            k_s = T.alloc_shared((BT, K), "bfloat16")
            v_s = T.alloc_shared((BT, BV), "bfloat16")
            g_s = T.alloc_shared((BT,), "float32")
            b_s = T.alloc_shared((BT,), "float32")
            h = T.alloc_local((RK,), "float32")
            q_t = T.alloc_local((RK,), "float32")
            k_t = T.alloc_local((RK,), "float32")
            sums = T.alloc_local((6,), "float32")  # h^T k, h^T q, k . q over two halves of the rows

            # h <- initial state (rows [row0, row0 + RK), column col)
            for r in T.unroll(RK):
                h[r] = h0[i_n, i_hv, row0 + r, col]

            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=STAGES):
                # shared <- q, k, v, g, beta of tokens [t0, t0 + BT)
                t0 = bos + c * BT
                T.copy(q[t0 : t0 + BT, i_h, :], q_s)
                T.copy(k[t0 : t0 + BT, i_h, :], k_s)
                T.copy(v[t0 : t0 + BT, i_hv, i_v * BV : i_v * BV + BV], v_s)
                for i in T.Parallel(BT):
                    g_s[i] = g[t0 + i, i_hv]
                    b_s[i] = beta[t0 + i, i_hv]

                for i in T.serial(T.min(BT, eos - t0)):
                    for r in T.vectorized(RK):
                        q_t[r] = q_s[i, row0 + r]
                        k_t[r] = k_s[i, row0 + r]
                    decay = T.exp2(g_s[i] * LOG2E)                  # exp(g_t)

                    # sums <- (h^T k_t, h^T q_t, k_t . q_t) over this thread's rows (two halves
                    # summed apart: two short FMA chains), then over its lane group
                    for j in T.unroll(6):
                        sums[j] = 0
                    for r in T.unroll(RK // 2):
                        for half in T.unroll(2):
                            sums[3 * half] += h[2 * r + half] * k_t[2 * r + half]
                            sums[3 * half + 1] += h[2 * r + half] * q_t[2 * r + half]
                            sums[3 * half + 2] += k_t[2 * r + half] * q_t[2 * r + half]
                    for j in T.unroll(3):
                        sums[j] += sums[3 + j]
                    for m in T.unroll(LANE_BITS):
                        for j in T.unroll(3):
                            sums[j] += T.shfl_xor(sums[j], 1 << m)

                    # e = beta_t (v_t - exp(g_t) h^T k_t)
                    # o_t = scale (exp(g_t) h^T q_t + e (k_t . q_t))
                    e = b_s[i] * (T.cast(v_s[i, tx // GROUP], "float32") - decay * sums[0])
                    if tx % GROUP == 0:
                        o[t0 + i, i_hv, col] = T.cast(scale * (decay * sums[1] + e * sums[2]),
                                                      "bfloat16")
                    # h <- exp(g_t) h + k_t e^T
                    for r in T.unroll(RK):
                        h[r] = decay * h[r] + k_t[r] * e

            # final state <- h
            for r in T.unroll(RK):
                ht[i_n, i_hv, row0 + r, col] = h[r]

    return recurrent_fwd


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(recurrent_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=64):
    """q, k [B, T, H, K] bf16, v [B, T, HV, V] bf16, g, beta [B, T, HV] fp32
    -> (o [B, T, HV, V] bf16, final state [N, HV, K, V] fp32 or None). chunk_size is ignored."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s01: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_fwd.s01: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_fwd.s01: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"gdn_fwd.s01: `cu_seqlens` needs B = 1; got B = {B}")
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is None:
        h0 = torch.zeros(N, HV, K, V, dtype=torch.float32, device=device)
    else:
        h0 = initial_state.to(device=device, dtype=torch.float32).contiguous()
    o = torch.empty(B * T, HV, V, dtype=torch.bfloat16, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device)
    if B * T == 0:
        ht.copy_(h0)
    elif N:
        bounds = seq_bounds(cu_seqlens, B, T, device)
        kernel = _compiled(H, HV)
        with nvtx_range("gdn_fwd.s01"):
            kernel(q.to(torch.bfloat16).contiguous().view(B * T, H, K),
                   k.to(torch.bfloat16).contiguous().view(B * T, H, K),
                   v.to(torch.bfloat16).contiguous().view(B * T, HV, V),
                   g.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV),
                   beta.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV),
                   bounds, h0, o, ht, scale)
    return o.view(B, T, HV, V), (ht if output_final_state else None)
