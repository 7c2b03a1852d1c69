"""chunk_h, stage 01: the sequential step of the chunked forward, the state h on chip.

What it computes (``flashqla.reference.chunk_h``): for every sequence and value head, walking the
chunks of C = 64 tokens in order, with S the K x V state entering the chunk,

    h[chunk]  = S                                   (stored in bf16, FLA's layout [B', NT, HV, K, V])
    V~        = U - W S                             (v_new, stored in bf16)
    S        <- exp(g_C) S + (K diag(exp(g_C - g_cum)))^T V~

g_C being g_cum at the chunk's last real token. This is the only step of the forward that is
sequential in time: one chain of ceil(T_n / 64) steps per (sequence, value head).

How: one CTA per (sequence, value head, V tile of BV = 64 columns). The fp32 state tile S
[K, BV] lives in the registers of one warpgroup for the whole walk (64 floats a thread); both
products are wgmma: W S (64 x BV x K, S passed through shared memory in bf16, as FLA does) and
the update K^T V~ (K x BV x 64, the key tile read transposed from shared memory). ``T.Pipelined``
over the chunks makes TileLang split the CTA into two warpgroups (256 threads): a producer that
TMA-loads the next chunk's K, W and U tiles (and its gates) into double buffers, and the consumer
above, the two synchronized by mbarriers; the state is the only thing carried from one
iteration to the next. h leaves by plain 16-byte stores from the bf16 copy of S that W S reads
anyway. (A TMA store from that buffer was tried first: its issuing thread must wait until the
buffer has been read before its warpgroup may start W S, a wait on the sequential path. Measured
in the same run, the plain stores win on (2, 8) and varlen and lose ~5% on the others, below.)
A partial last chunk loads the full 64-row tiles (rows past the end are the next sequence's
tokens, or TMA's zero fill past the last token) and neutralizes them afterwards: the decay
factor of those rows is set to 0 by a select (never exp of a garbage gate times 0), so their
rows of V~ contribute nothing to S, and their v_new rows are not stored.

The output h needs exactly the real number of chunk rows, which for varlen depends on
``cu_seqlens`` on the device: ``run`` reads ``first_chunk[-1]`` once on the host (one
synchronization, so varlen calls cannot be captured in a CUDA graph). The kernel itself does not
need it: each CTA finds its first row in ``first_chunk``.

Measured effect (one H200, CUDA events around ``run``, median of 20 after 3 warm-up calls; the
FLA 0.6.0 Triton ``chunk_gated_delta_rule_fwd_h`` on the same inputs in the same run; K = V = 128,
initial and final state):

    (H, HV)   tokens           this stage   FLA     TMA-store h (first version)   BV = 32
    (16, 64)  1 x 32768        1.66 ms      1.05    1.61                          1.41
    (2, 8)    1 x 32768        1.49 ms      0.72    1.63                          1.07
    (16, 32)  8 x 4096         0.90 ms      0.58    0.85                          0.70
    (16, 32)  8 x 4096 varlen  0.82 ms      0.56    0.92                          0.77

Correct (relative error about 3e-3 on h, 1.4e-3 on v_new against float64, bounds 1.7e-2 and
3.9e-3) and 1.5-2.1x slower than FLA. Every row is latency-bound: (16, 64) has 128 CTAs for 132
SMs, each walking 512 chunks at about 3.2 us a chunk, (2, 8) only 16 CTAs. What is on that path
per chunk: two wgmma waited for in full, two shared-memory round trips of S and V~ with barriers,
and the stores. BV = 32 (twice the CTAs, half the work per step; compiled and timed from this
code, not run through the tests) is 6-28% faster on every row: the first thing to try next.
An earlier run of the TMA-store version gave 2.02 / 1.87 / 1.16 / 1.14 ms on the same rows (FLA
1.02 / 0.70 / 0.74 / 0.57): runs differ by up to ~25%, so compare only within one run.

Taught in: notebooks/03_forward_kernels.py, as a kernel of gdn_fwd.s02.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# wgmma_ss: W S and K^T V~ (PTX wgmma.mma_async, bf16 -> f32, both operands in shared memory);
# tma_load: the K, W, U tiles (cp.async.bulk.tensor); mbarrier: the producer/consumer pipeline;
# exp2f: the decays exp2(log2(e) (g_C - g_cum))
SOURCE_MUST_CONTAIN = ("wgmma_ss", "tma_load", "mbarrier", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
BV = 64               # V columns of the state per CTA
THREADS = 128         # the consumer warpgroup (TileLang adds the producer one)
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def chunk_h_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token, sequence or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads key head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # N + 1
    num_rows = T.dynamic("num_rows")          # real chunks, rows of h
    num_h0 = T.dynamic("num_h0")              # N, or 1 (unread) without an initial state
    num_ht = T.dynamic("num_ht")              # N, or 1 (unwritten) without a final state

    @T.prim_func
    def chunk_h_fwd(
        k: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        u: T.Tensor((num_tokens, HV, V), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # row of h of each sequence's chunk 0
        h0: T.Tensor((num_h0, HV, K, V), "float32"),
        use_h0: T.int32,
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),
        ht: T.Tensor((num_ht, HV, K, V), "float32"),
        store_ht: T.int32,
    ):
        # one flat grid axis (x has no 65535 limit), V tiles of one (sequence, head) adjacent
        with T.Kernel((num_bounds - 1) * HV * (V // BV), threads=THREADS) as bx:
            i_v = bx % (V // BV)
            i_hv = (bx // (V // BV)) % HV
            i_n = bx // ((V // BV) * HV)
            i_h = i_hv // group
            v0 = i_v * BV
            bos = bounds[i_n]
            eos = bounds[i_n + 1]
            row0 = first_chunk[i_n]

            w_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            u_shared = T.alloc_shared((BT, BV), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            s_shared = T.alloc_shared((K, BV), "bfloat16")      # S in bf16: wgmma operand, h row
            vd_shared = T.alloc_shared((BT, BV), "bfloat16")    # diag(exp(g_C - g_cum)) V~
            s_frag = T.alloc_fragment((K, BV), "float32")       # the state S, fp32, all along
            vn_frag = T.alloc_fragment((BT, BV), "float32")
            g_last = T.alloc_local((1,), "float32")

            # S <- h0[n] (or 0)
            if use_h0 != 0:
                T.copy(h0[i_n, i_hv, :, v0:v0 + BV], s_frag)
            else:
                T.clear(s_frag)

            for c in T.Pipelined(T.ceildiv(eos - bos, BT), num_stages=2):
                t0 = bos + c * BT
                n = T.min(eos - t0, BT)                          # real rows of the chunk, 1..64
                # K, W, U <- full 64-row tiles (TMA); rows >= n are neutralized below. K comes
                # first: TileLang's producer writes g_shared once the consumer releases the first
                # copy's buffer, and K (read by the last product) is released after g's last use
                T.copy(k[t0:t0 + BT, i_h, :], k_shared)
                T.copy(w[t0:t0 + BT, i_hv, :], w_shared)
                T.copy(u[t0:t0 + BT, i_hv, v0:v0 + BV], u_shared)
                # g <- log2(e) g_cum, 0 past the end
                for i in T.Parallel(BT):
                    g_shared[i] = T.if_then_else(i < n, g_cum[t0 + i, i_hv] * LOG2E, 0)

                # h[row0 + c] <- S (bf16), plain 16-byte stores from the shared copy: a TMA store
                # would have to be waited for before W S could read the buffer
                T.copy(s_frag, s_shared)
                T.copy(s_shared, h[row0 + c, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})

                # V~ <- U - W S   (64 x BV x K, wgmma)
                T.gemm(w_shared, s_shared, vn_frag, clear_accum=True)
                for i, j in T.Parallel(BT, BV):
                    vn_frag[i, j] = u_shared[i, j] - vn_frag[i, j]
                for i, j in T.Parallel(BT, BV):
                    if i < n:
                        v_new[t0 + i, i_hv, v0 + j] = vn_frag[i, j]

                # V~ <- diag(exp(g_C - g_cum)) V~, rows >= n set to 0 (whatever they hold)
                g_last[0] = g_shared[n - 1]
                for i, j in T.Parallel(BT, BV):
                    vd_shared[i, j] = T.if_then_else(
                        i < n, vn_frag[i, j] * T.exp2(g_last[0] - g_shared[i]), 0)

                # S <- exp(g_C) S + K^T V~   (K x BV x 64, wgmma with K read transposed)
                for d, j in T.Parallel(K, BV):
                    s_frag[d, j] = s_frag[d, j] * T.exp2(g_last[0])
                T.gemm(k_shared, vd_shared, s_frag, transpose_A=True)

            # ht[n] <- S
            if store_ht != 0:
                T.copy(s_frag, ht[i_n, i_hv, :, v0:v0 + BV])

    return chunk_h_fwd


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_h_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(k, w, u, g_cum, initial_state=None, output_final_state=False, cu_seqlens=None,
        chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, w [B, T, HV, K] bf16, u [B, T, HV, V] bf16, g_cum [B, T, HV] fp32,
    initial_state [N, HV, K, V] fp32 -> (h [B', NT, HV, K, V] bf16, v_new [B, T, HV, V] bf16,
    final state [N, HV, K, V] fp32 or None).

    For varlen, reads the number of real chunks (``first_chunk[-1]``) on the host once: one
    device synchronization, to size h. Equal-length batches need none.
    """
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_h.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = k.shape
    HV, V = u.shape[2], u.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_h.s01: `k` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_h.s01: `u` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"chunk_h.s01: `u` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of k; got HV = {HV}")
    device = k.device
    bf16 = {"device": device, "dtype": torch.bfloat16}
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    w_flat = w.to(**bf16).contiguous().view(B * T, HV, K)
    u_flat = u.to(**bf16).contiguous().view(B * T, HV, V)
    g_flat = g_cum.to(device=device, dtype=torch.float32).contiguous().view(B * T, HV)
    bounds = seq_bounds(cu_seqlens, B, T, device)
    _, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N = bounds.shape[0] - 1
    if cu_seqlens is None:
        h = torch.empty(B, -(-T // CHUNK_SIZE), HV, K, V, **bf16)
    else:
        h = torch.empty(1, int(first_chunk[-1]), HV, K, V, **bf16)  # the one host synchronization
    v_new = torch.empty(B * T, HV, V, **bf16)
    fp32 = {"device": device, "dtype": torch.float32}
    h0 = initial_state.to(**fp32).contiguous() if initial_state is not None else None
    ht = torch.empty(N, HV, K, V, **fp32) if output_final_state else None
    if B * T and N:
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_h.s01"):
            # without h0 / ht the kernel gets a one-row stand-in that it neither reads nor writes
            kernel(k_flat, w_flat, u_flat, g_flat, bounds, first_chunk,
                   h0 if h0 is not None else torch.empty(1, HV, K, V, **fp32), int(h0 is not None),
                   h.view(-1, HV, K, V), v_new,
                   ht if ht is not None else torch.empty(1, HV, K, V, **fp32), int(ht is not None))
    elif ht is not None:  # no tokens: the state passes through
        ht.copy_(h0 if h0 is not None else torch.zeros_like(ht))
    return h, v_new.view(B, T, HV, V), ht
