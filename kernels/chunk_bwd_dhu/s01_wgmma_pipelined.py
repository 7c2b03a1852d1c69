"""chunk_bwd_dhu, stage 01: the sequential step of the chunked backward, dh on chip, walked in reverse.

What it computes (``flashqla.reference.chunk_bwd_dhu``): for every sequence and value head, walking
the chunks of C = 64 tokens from the last to the first, with dS the K x V gradient of the state
that leaves the chunk (dL/d final state for the last chunk, 0 without it),

    dh[chunk]  = dS                                       (bf16, the layout of chunk_h's h)
    dV2        = dV_local + diag(exp(g_C - g_cum)) K dS   (dL/dv_new, stored in bf16)
    dS        <- exp(g_C) dS + scale Q^T diag(exp(g_cum)) dO - W^T dV2

g_C being g_cum at the chunk's last real token; after the first chunk dS is dL/dh0. It is the
transpose of chunk_h's walk: v_new = u - w S feeds -W^T dV2 back into dS, o = scale diag(exp g) Q S
feeds the Q term, and S_next = exp(g_C) S + K^T diag(exp(g_C - g)) V~ sends dS back both to the
previous state and to V~.

How: the structure of chunk_h.s01, reversed. One CTA per (sequence, value head, V tile of BV =
64 columns: the recurrence is independent per column of dS). The fp32 tile dS [K, BV] lives in
the registers of one warpgroup for the whole walk; the three products are wgmma with operands in
shared memory: K dS (64 x BV x K, dS passed in bf16), and the update Q^T dO' + W^T (-dV2)
(K x BV x 64 each, the Q and W tiles read transposed; dO' = scale diag(exp g) dO). ``T.Pipelined``
over the chunks (index c counted down) gives a TMA producer warpgroup that loads the next chunk's
Q, K, W, dO and dV_local tiles into double buffers while the consumer computes. A partial last
chunk (the first one walked) loads full 64-row tiles and zeroes its rows >= n by selects on the
per-row factors (never exp of a garbage gate times 0), so they add nothing to dS and are not stored.
Exponents are all <= 0 (g_C <= g_cum_i <= 0 inside a chunk).

The output dh needs exactly the real number of chunk rows, which for varlen depends on
``cu_seqlens`` on the device: like chunk_h.s01, ``run`` reads ``first_chunk[-1]`` once on the host
(one synchronization). The kernel itself does not need it.

Measured effect (one H200, CUDA events around ``run``, median of 20 after 3 warm-up calls; FLA
0.6.0's Triton ``chunk_gated_delta_rule_bwd_dhu`` on the same inputs in the same run,
``profiles/gdn_bwd_s01_lab.py``; K = V = 128, h0 and dht given):

    (H, HV)   tokens        this stage   FLA
    (16, 64)  1 x 32768     1.62 ms      1.91
    (2, 8)    1 x 32768     1.57 ms      1.21

Correct on the public test shapes (and within 2.7e-3 / 3.5e-3 relative of FLA's dh / dv2 at these
shapes, both stored in bf16); 1.18x FLA on (16, 64), 0.77x on (2, 8). Both rows are latency-bound,
like chunk_h.s01: (16, 64) has 128 CTAs for 132 SMs, (2, 8) only 16, each walking 512 chunks at
about 3.1 us a chunk. On that path per chunk: three wgmma waited for in full, the shared-memory
round trips of dS and dV2, and the stores; Q^T dO' does not depend on dS and could overlap it.
A second run gave 1.61 / 1.57 ms (FLA 1.90 / 1.23).

Taught in: notebooks/07_backward.py, as a kernel of gdn_bwd.s01.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# wgmma_ss: K dS, Q^T dO' and W^T dV2 (PTX wgmma.mma_async, bf16 -> f32, operands in shared
# memory); tma_load: the Q, K, W, dO, dV_local tiles (cp.async.bulk.tensor); mbarrier: the
# producer/consumer pipeline; exp2f: the decays
SOURCE_MUST_CONTAIN = ("wgmma_ss", "tma_load", "mbarrier", "exp2f")

CHUNK_SIZE = 64       # C: tokens per chunk; one 64-row wgmma tile
HEAD_DIM = 128        # K = V = 128 only
BV = 64               # V columns of dS per CTA
THREADS = 128         # the consumer warpgroup (TileLang adds the producer one)
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}  # a Qwen3.5 GDN layer (35B, 9B, 4B at TP1)


def chunk_bwd_dhu_kernel(H: int, HV: int):
    """The T.prim_func for H key heads and HV value heads; any token, sequence or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H  # value head i_hv reads q/k head i_hv // group
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # N + 1
    num_rows = T.dynamic("num_rows")          # real chunks, rows of dh
    num_ht = T.dynamic("num_ht")              # N, or 1 (unread) without dht
    num_h0 = T.dynamic("num_h0")              # N, or 1 (unwritten) without dh0

    @T.prim_func
    def chunk_bwd_dhu(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        dv_local: T.Tensor((num_tokens, HV, V), "bfloat16"),   # chunk_bwd_dv_local's output
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the sequences
        first_chunk: T.Tensor((num_bounds,), "int32"),         # row of dh of each sequence's chunk 0
        dht: T.Tensor((num_ht, HV, K, V), "float32"),          # dL/d final state
        use_dht: T.int32,
        scale: T.float32,
        dh: T.Tensor((num_rows, HV, K, V), "bfloat16"),
        dh0: T.Tensor((num_h0, HV, K, V), "float32"),          # dL/d initial state
        store_dh0: T.int32,
        dv2: T.Tensor((num_tokens, HV, V), "bfloat16"),        # dL/dv_new
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
            num_c = T.ceildiv(eos - bos, BT)

            w_shared = T.alloc_shared((BT, K), "bfloat16")
            q_shared = T.alloc_shared((BT, K), "bfloat16")
            k_shared = T.alloc_shared((BT, K), "bfloat16")
            do_shared = T.alloc_shared((BT, BV), "bfloat16")
            dvl_shared = T.alloc_shared((BT, BV), "bfloat16")
            g_shared = T.alloc_shared((BT,), "float32")
            ds_shared = T.alloc_shared((K, BV), "bfloat16")     # dS in bf16: wgmma operand, dh row
            dos_shared = T.alloc_shared((BT, BV), "bfloat16")   # scale diag(exp(g_cum)) dO
            dv2_shared = T.alloc_shared((BT, BV), "bfloat16")   # -dV2
            ds_frag = T.alloc_fragment((K, BV), "float32")      # dS, fp32, all along
            dv2_frag = T.alloc_fragment((BT, BV), "float32")
            g_last = T.alloc_local((1,), "float32")

            # dS <- dht[n] (or 0)
            if use_dht != 0:
                T.copy(dht[i_n, i_hv, :, v0:v0 + BV], ds_frag)
            else:
                T.clear(ds_frag)

            for cc in T.Pipelined(num_c, num_stages=2):
                c = num_c - 1 - cc                               # chunks from the last one back
                t0 = bos + c * BT
                n = T.min(eos - t0, BT)                          # real rows of the chunk, 1..64
                # W, Q, K, dO, dV_local <- full 64-row tiles (TMA); rows >= n are neutralized
                # below. W (read by the last product) comes first: TileLang's producer writes
                # g_shared once the consumer releases the first copy's buffer
                T.copy(w[t0:t0 + BT, i_hv, :], w_shared)
                T.copy(q[t0:t0 + BT, i_h, :], q_shared)
                T.copy(k[t0:t0 + BT, i_h, :], k_shared)
                T.copy(do[t0:t0 + BT, i_hv, v0:v0 + BV], do_shared)
                T.copy(dv_local[t0:t0 + BT, i_hv, v0:v0 + BV], dvl_shared)
                # g <- log2(e) g_cum, 0 past the end
                for i in T.Parallel(BT):
                    g_shared[i] = T.if_then_else(i < n, g_cum[t0 + i, i_hv] * LOG2E, 0)

                # dh[row0 + c] <- dS (bf16), plain 16-byte stores from the shared copy
                T.copy(ds_frag, ds_shared)
                T.copy(ds_shared, dh[row0 + c, i_hv, :, v0:v0 + BV], annotations={"disable_tma": True})

                # dV2 <- dV_local + diag(exp(g_C - g_cum)) K dS   (64 x BV x K, wgmma), rows >= n: 0
                T.gemm(k_shared, ds_shared, dv2_frag, clear_accum=True)
                g_last[0] = g_shared[n - 1]
                for i, j in T.Parallel(BT, BV):
                    dv2_frag[i, j] = T.if_then_else(
                        i < n, dvl_shared[i, j] + dv2_frag[i, j] * T.exp2(g_last[0] - g_shared[i]), 0)
                for i, j in T.Parallel(BT, BV):
                    if i < n:
                        dv2[t0 + i, i_hv, v0 + j] = dv2_frag[i, j]
                # dO' <- scale diag(exp(g_cum)) dO, rows >= n: 0;  -dV2 to shared for W^T
                for i, j in T.Parallel(BT, BV):
                    dos_shared[i, j] = T.if_then_else(
                        i < n, do_shared[i, j] * (scale * T.exp2(g_shared[i])), 0)
                for i, j in T.Parallel(BT, BV):
                    dv2_shared[i, j] = -dv2_frag[i, j]

                # dS <- exp(g_C) dS + Q^T dO' + W^T (-dV2)   (K x BV x 64 each, wgmma, transposed A)
                for d, j in T.Parallel(K, BV):
                    ds_frag[d, j] = ds_frag[d, j] * T.exp2(g_last[0])
                T.gemm(q_shared, dos_shared, ds_frag, transpose_A=True)
                T.gemm(w_shared, dv2_shared, ds_frag, transpose_A=True)

            # dh0[n] <- dS
            if store_dh0 != 0:
                T.copy(ds_frag, dh0[i_n, i_hv, :, v0:v0 + BV])

    return chunk_bwd_dhu


@functools.cache
def _compiled(H: int, HV: int):
    return compile_hopper(chunk_bwd_dhu_kernel(H, HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, w, g_cum, initial_state, dht, do, dv_local, scale=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE):
    """q, k [B, T, H, K] bf16, w [B, T, HV, K] bf16, g_cum [B, T, HV] fp32, initial_state
    [N, HV, K, V] or None (only whether it is given matters), dht [N, HV, K, V] fp32 or None,
    do, dv_local [B, T, HV, V] bf16 -> (dh [B', NT, HV, K, V] bf16, dh0 [N, HV, K, V] fp32 or
    None, dv2 [B, T, HV, V] bf16).

    For varlen, reads the number of real chunks (``first_chunk[-1]``) on the host once: one
    device synchronization, to size dh. Equal-length batches need none.
    """
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_bwd_dhu.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"chunk_bwd_dhu.s01: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"chunk_bwd_dhu.s01: `do` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"chunk_bwd_dhu.s01: `do` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    fp32 = {"device": device, "dtype": torch.float32}
    q_flat = q.to(**bf16).contiguous().view(B * T, H, K)
    k_flat = k.to(**bf16).contiguous().view(B * T, H, K)
    w_flat = w.to(**bf16).contiguous().view(B * T, HV, K)
    do_flat = do.to(**bf16).contiguous().view(B * T, HV, V)
    dvl_flat = dv_local.to(**bf16).contiguous().view(B * T, HV, V)
    g_flat = g_cum.to(**fp32).contiguous().view(B * T, HV)
    bounds = seq_bounds(cu_seqlens, B, T, device)
    _, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N = bounds.shape[0] - 1
    if cu_seqlens is None:
        dh = torch.empty(B, -(-T // CHUNK_SIZE), HV, K, V, **bf16)
    else:
        dh = torch.empty(1, int(first_chunk[-1]), HV, K, V, **bf16)  # the one host synchronization
    dv2 = torch.empty(B * T, HV, V, **bf16)
    dht_in = dht.to(**fp32).contiguous() if dht is not None else None
    dh0 = torch.empty(N, HV, K, V, **fp32) if initial_state is not None else None
    if B * T and N:
        kernel = _compiled(H, HV)
        with nvtx_range("chunk_bwd_dhu.s01"):
            # without dht / dh0 the kernel gets a one-row stand-in that it neither reads nor writes
            kernel(q_flat, k_flat, w_flat, g_flat, do_flat, dvl_flat, bounds, first_chunk,
                   dht_in if dht_in is not None else torch.empty(1, HV, K, V, **fp32),
                   int(dht_in is not None), scale, dh.view(-1, HV, K, V),
                   dh0 if dh0 is not None else torch.empty(1, HV, K, V, **fp32), int(dh0 is not None),
                   dv2)
    elif dh0 is not None:  # no tokens: the gradient passes through
        dh0.copy_(dht_in if dht_in is not None else torch.zeros_like(dh0))
    return dh, dh0, dv2.view(B, T, HV, V)
