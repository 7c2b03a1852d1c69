"""gdn_bwd, stage 07: s04's fused reverse kernel warp-specialized: the dS chain runs a chunk ahead.

What changed from s04: s04's fused reverse kernel ran, per chunk, the sequential dS step and then
all of the chunk's gradient products in the same two warpgroups, synchronously (loads, products,
no overlap), so the next chunk's dS step waited for the whole gradient work of this one. Here the
same kernel (same math, same grid: one CTA per (segment row, value head, 64 value columns)) has
two warp roles: a chain warpgroup that does only the dS recurrence and hands its results over
shared memory, and two gradient warpgroups that compute the chunk's gradients one chunk behind
it, and issue the TMA loads of both rings. Everything else is s04's (prep, AutoCP plan, segment
states and gradients, forward walk, finish), imported from it.
Why: every fusion of the backward so far lost, because it put the gradient work on the chain's
path. s04 ran 0.73x / 0.66x s03's time on (2, 8) 1x8192 / 1x32768 (gdn_train_s04.csv), and at
c8873d0 (gdn_train_s05_s06.csv, one H100, CUDA graph replay, forward + backward) s05 and s06 ran
12.13 and 12.90 ms on (16, 64) 1x32768 against s03's 10.85 (FLA 16.32, FlashQLA 7.43), 2.01 and
2.15 ms on (2, 8) 1x32768 against 1.88 (FLA 3.83, FlashQLA 1.13). The lesson (BACKWARD.md 5,
s06_warp_specialized / s07_chain_ahead): only dS' -> K dS' (+ P^T dO) -> W^T dV~ (+ Q^T dO') is
sequential; the rest of a chunk's work can run beside the next chunk's chain.

Kernels in launch order (C = 64, K = V = 128; all but the fourth are s04's):

    prep             s02's: g_cum, Ai (FLA's gated T), w, u
    segment states   s03's (where s03's rule splits): h_seg of every row
    segment grads    s03's (where split): dht_seg of every row
    forward walk     s04's: h[chunk] (bf16) and V~ = v_new, per (row, value head, 64 columns)
    ws reverse       ``ws_reverse_kernel``, per (row, value head, 64 columns), chunks backwards:
                     s04's formulas (its docstring), dq, dk, dbeta, dg as per-column-block parts
    finish           s04's: the parts summed over the GVA group and the column blocks

The ws reverse kernel, 384 threads (one CTA an SM: 225 KiB of shared memory):

    role        threads     setmaxnreg  per chunk (chunk it = the row's it-th from the end)
    chain       [0, 128)    136 (dec)   dS' (128 x 64 fp32, 64 registers a thread) all along;
                                        snapshot dS' (bf16) -> ds_s; dO' = scale diag(exp g) dO,
                                        P^T = scale (K Q^T * Gamma^T) (j <= i < n); X = K dS';
                                        dS = exp(g_C) dS' + Q^T dO'; dV~ = diag(exp(g_C - g)) X
                                        + P^T dO; -dV~ (rows < n) -> ndv_s; dS += W^T (-dV~)
    gradients   [128, 384)  184 (inc)   chunk it - 1's (while the chain does chunk it): dk =
                                        diag(exp(g_C - g)) V~ dS'^T, <S, dS'>, dP, dq, dP^T Q from
                                        ds_s; then from ndv_s: dW (into W's slot), dv, dAi, M,
                                        dA~, E, X = Ai^T dW, D K + D^T K, dbeta, dg (reverse cumsum
                                        in the chunk); and the TMA loads of the rings

    Products a chunk, in units of a 64^3 product (0.52 MFLOP): chain 9 (K Q^T, K dS', Q^T dO',
    W^T dV~: 2 each, P^T dO: 1), 4.7 MFLOP; gradients 26, 13.6 MFLOP. The gradient role bounds a
    CTA's chunk rate; the chain's 4.7 no longer adds to it (s04: 36 units, 18.9 MFLOP, in one
    instruction stream; here one more, M^T Ai, and one fewer, s04's second X). At one CTA an SM
    and a bf16 wgmma rate of 790 / 132 = 6.0 TFLOP/s an SM, 13.6 MFLOP is 2.3 us a chunk at best
    (estimate). Every K-wide product of the gradient role runs as two 64 x 64 halves (dk in two
    fragments): one fragment layout for all of the role's tiles. With 64 x 128 tiles ptxas wanted
    about 227 registers a thread for the role (uncapped) and spilled 164 bytes at 176; with the
    halves, 24 bytes at 176 and 16 at 184 (below).

Barriers (mbarriers, phase parity from the chunk index):

    bar_a_loaded[2]   ring A slot (q, k, w, dO, log2(e) g) filled: TMA bytes + the gradient role
    bar_b1_loaded     V~, S filled;  bar_b2_loaded  V, Ai, beta filled (same)
    bar_b1_read       the gradient role's two warpgroups done reading V~ and S: the next chunk's
                      load may start (halfway through the chunk, after dW)
    bar_chunk_read    ... done with V, Ai, beta and the ring A slot (after a generic-proxy fence:
                      dW was written into W's slot): the next loads of ring B and of the slot
    bar_ds_ready / bar_ds_free   the dS' snapshot: chain -> gradients (after their dk and
                      <S, dS'>) -> chain (the next chunk's snapshot)
    bar_dv_ready / bar_dv_free   -dV~, published after the chain's last read of W: chain ->
                      gradients (after dv and dAi) -> chain

    The chain waits only for ring A and for the two free barriers of the hand-offs, which the
    gradient role arrives on early in its chunk: it runs a chunk ahead of the gradients. No
    producer warpgroup: each load can only start when the gradient role is done with the slot
    (it is every slot's last reader), so the gradient role issues it itself at that point (one
    elected thread), and the 128 threads a producer would hold give its registers 184 instead of
    176. Ring B has one slot (a second needs 40 KiB): its V~ and S come back halfway through a
    chunk, its V, Ai and beta only at the chunk's end, a load latency on the gradient role's path.

Shared memory (bytes; swizzled tiles 1 KiB aligned; TileLang's planner off, as gdn_fwd.s05):

    ai_s 8192 (ring B)   b_s 256 (ring B)   cum_s 256   d_s 8192 (M)   do_s 2 x 8192 (ring A)
    dop_s 8192 (chain)   ds_s 16384 (snapshot)   g_s 2 x 256 (ring A)   h_s 16384 (ring B)
    k_s 2 x 16384 (ring A)   ndv_s 8192   p_s 8192 (dP, dAi, D)   pt_s 8192 (chain)
    q_s 2 x 16384 (ring A)   rows_s 512   v_s 8192 (ring B)   vn_s 8192 (ring B)
    w_s 2 x 16384 (ring A: W, then dW)   12 x 1024 reduction workspaces (the row sums cross
    the two gradient warpgroups)   = 228,352 dynamic + 2,048 static (225 KiB of 227).

Rows past a chunk's end: the TMA boxes are whole 64-row boxes, so in the row's last chunk rows
>= n hold the next tokens (or zeros past the tensor). Every product whose rows mix into real
outputs masks them: dO' and -dV~ rows, the masks of P^T, dP, dAi, dA~ (all i < n), dk's V~ term;
the rest multiplies them by zeros or is not stored. tests/test_ws_reverse.py replays the kernel's
arithmetic in float64 with random rows there.

TileLang templates that index threads from 0 cannot run in a role that does not start at thread
0: T.cumsum's scan returns for every thread >= 32 (the chain's here), so dg's reverse cumsum in
the chunk is a 64-step loop of the gradient role's own; its row sums (T.reduce_sum) and wgmma
tiles take the role's thread offset (read in the generated CUDA).

Precision against s04: the same bf16 operands except two fp32 improvements: the columns of
diag(beta) E (s04: through a transposed fp32 shared tile) are the rows of the transposed product
-(M^T Ai) * Gamma^T times K K^T (symmetric) and beta, all fp32 factors; dAi's diag(exp g) scales
dW K^T in fp32 (s04 rounded -diag(exp g) K to bf16).

Registers (ptxas for sm_90a, nvcc 13.0, TileLang's flags, ``cuobjdump -res-usage`` and the SASS's
highest register per role; the same at each of the 8 public head layouts): 168 a thread at
launch; the chain uses 128 of its 136, no local memory; the gradient role 182 of its 184 and 16
bytes of stack: three loop-invariant addresses, stored once before the chunk loop and reloaded
by 4 LDL a thread a chunk (the only spill).

Measured effect: not yet measured. GPU commands (next session): ``python -m pytest -q
-p no:cacheprovider -m gpu tests/test_ws_reverse.py``, ``python -m pytest -q -p no:cacheprovider
-m gpu tests/test_stages.py -k "gdn_bwd and s07"``, then ``python -m flashqla bench --mode
gdn_train --csv profiles/results/gdn_train_s07.csv
--problems "(2, 8) 1x32768" "(16, 64) 1x32768" "(16, 64) 4096+4096+4096+4096+4096+4096+4096+4096"
--rows "fwd + gdn_bwd/s03_autocp_walks" "fwd + gdn_bwd/s04_fused_reverse"
"fwd + gdn_bwd/s07_warp_specialized"``.

Taught in: not taught (lab log).
"""

import functools

import torch

from flashqla import autocp
from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.stages import load
from flashqla.varlen import chunk_table, seq_bounds

NEEDS = ("hopper",)
# gdn_bwd_ws_reverse: the new kernel; warpgroup_reg_alloc / _dealloc: the roles' setmaxnreg
# budgets; tma_load, expect_transaction: the tile rings by TMA on mbarriers; bar_ds_ready,
# bar_dv_ready: the chain's hand-offs to the gradient role
SOURCE_MUST_CONTAIN = ("gdn_bwd_ws_reverse", "warpgroup_reg_alloc", "warpgroup_reg_dealloc",
                       "tma_load", "expect_transaction", "bar_ds_ready", "bar_dv_ready")

S04 = load("gdn_bwd", 4)         # prep, plan, segment states and gradients, forward walk, finish
S02, S03 = S04.S02, S04.S03
CHUNK_SIZE = S04.CHUNK_SIZE      # C = 64
HEAD_DIM = S04.HEAD_DIM          # K = V = 128
BV = S04.BV                      # 64 value columns a CTA, as s04 (the finish sums NVT parts)
NVT = S04.NVT
LOG2E = 1.4426950408889634
DEFAULT_SHAPE = {"H": 16, "HV": 32}

# ---- warp roles, in thread order (one if / elif chain: see gdn_fwd.s05)
WARPGROUP = 128
CHAIN_END = 1 * WARPGROUP   # [0, 128)   chain: dS' in fp32 registers, dV~ and the dS step
THREADS = 3 * WARPGROUP     # [128, 384) gradients: dq, dk, dW, dv, dbeta, dg of the chunk behind,
GRAD_THREADS = THREADS - CHAIN_END  # and the loads (TMA, the gates and beta)
# ---- register budgets (setmaxnreg, per thread): 384 threads start with 168 each
REGS_START = 65536 // THREADS // 8 * 8
REGS_CHAIN = 136      # dS' (64 fp32 a thread), one 64 x 64 product (32): 128 used
REGS_GRAD = 184       # dk (2 x 16), x, a 64 x 64 product, K K^T (16 each) and the addresses: 182
#                       used, 16 bytes spilled (loop-invariant addresses)
assert REGS_CHAIN * WARPGROUP + REGS_GRAD * GRAD_THREADS <= REGS_START * THREADS
# ---- buffering
STAGES = 2            # ring A (q, k, w, dO, g): read by the chain at chunk it, the gradients at it - 1


def ws_reverse_kernel(H: int, HV: int):
    """Per (row, value head, BV value columns): s04's fused reverse, its chunks backwards, the dS
    chain in one warpgroup and the gradients (and the loads) in two (the module doc)."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, K, V = CHUNK_SIZE, HEAD_DIM, HEAD_DIM
    group = HV // H
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")      # rows + 1
    num_rows = T.dynamic("num_rows")          # rows of h (the chunk table's)
    num_ht = T.dynamic("num_ht")              # rows, or 1 (unread) without dht
    num_dh0 = T.dynamic("num_dh0")            # rows, or 1 (unwritten) without dh0

    @T.prim_func
    def gdn_bwd_ws_reverse(
        q: T.Tensor((num_tokens, H, K), "bfloat16"),           # [B*T, H, K], sequences packed
        k: T.Tensor((num_tokens, H, K), "bfloat16"),
        v: T.Tensor((num_tokens, HV, V), "bfloat16"),
        w: T.Tensor((num_tokens, HV, K), "bfloat16"),          # Ai diag(beta exp g) K
        v_new: T.Tensor((num_tokens, HV, V), "bfloat16"),      # V~ = U - W S
        do: T.Tensor((num_tokens, HV, V), "bfloat16"),         # dL/do
        Ai: T.Tensor((num_tokens, HV, BT), "bfloat16"),        # row (t mod C) of FLA's gated T
        g_cum: T.Tensor((num_tokens, HV), "float32"),          # chunk-local cumsum of g
        beta: T.Tensor((num_tokens, HV), "float32"),
        h: T.Tensor((num_rows, HV, K, V), "bfloat16"),         # state entering each chunk
        bounds: T.Tensor((num_bounds,), "int32"),              # token offsets of the rows
        first_chunk: T.Tensor((num_bounds,), "int32"),         # h row of each row's chunk 0
        dht: T.Tensor((num_ht, HV, K, V), "float32"),          # dL/d final state of each row
        use_dht: T.int32,
        scale: T.float32,
        dq_p: T.Tensor((NVT, num_tokens, HV, K), "bfloat16"),  # parts: the finish sums them
        dk_p: T.Tensor((NVT, num_tokens, HV, K), "bfloat16"),
        dv: T.Tensor((num_tokens, HV, V), "bfloat16"),
        dbeta_p: T.Tensor((NVT, num_tokens, HV), "float32"),
        dg_p: T.Tensor((NVT, num_tokens, HV), "float32"),
        dh0: T.Tensor((num_dh0, HV, K, V), "float32"),         # dL/d initial state of each row
        store_dh0: T.int32,
    ):
        with T.Kernel(num_bounds - 1, HV, NVT, threads=THREADS) as (i_n, i_hv, i_v):
            i_h = i_hv // group
            v0 = i_v * BV
            # scalars held in variables (TileLang would inline each expression at every use); each
            # role reads its row's bounds itself (nothing held across setmaxnreg)
            bos = T.alloc_var("int32")
            eos = T.alloc_var("int32")
            num_c = T.alloc_var("int32")
            t0 = T.alloc_var("int32")
            n = T.alloc_var("int32")
            t1 = T.alloc_var("int32")
            n1 = T.alloc_var("int32")

            # ring A, STAGES slots (TMA -> chain and gradients): the tiles both read
            q_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            k_s = T.alloc_shared((STAGES, BT, K), "bfloat16")
            w_s = T.alloc_shared((STAGES, BT, K), "bfloat16")      # W (chain); the gradients: then dW
            do_s = T.alloc_shared((STAGES, BT, BV), "bfloat16")
            g_s = T.alloc_shared((STAGES, BT), "float32")          # log2(e) g_cum, rows >= n: the last real
            # ring B, one slot (TMA -> gradients): the tiles only the gradients read; b1 = V~, S,
            # b2 = V, Ai, beta (b1 is free, and reloaded, halfway through a chunk)
            vn_s = T.alloc_shared((BT, BV), "bfloat16")            # V~
            v_s = T.alloc_shared((BT, BV), "bfloat16")             # V
            ai_s = T.alloc_shared((BT, BT), "bfloat16")
            h_s = T.alloc_shared((K, BV), "bfloat16")              # S = h[chunk]
            b_s = T.alloc_shared((BT,), "float32")                 # beta, rows >= n: 0
            # hand-offs (chain -> gradients)
            ds_s = T.alloc_shared((K, BV), "bfloat16")             # dS' in bf16: the chain's operand too
            ndv_s = T.alloc_shared((BT, BV), "bfloat16")           # -dV~, rows >= n zero
            # the chain's own operands
            dop_s = T.alloc_shared((BT, BV), "bfloat16")           # dO' = scale diag(exp g) dO, rows < n
            pt_s = T.alloc_shared((BT, BT), "bfloat16")            # P^T
            # the gradients' own
            p_s = T.alloc_shared((BT, BT), "bfloat16")             # dP, then dAi, then D = diag(beta) dA~
            d_s = T.alloc_shared((BT, BT), "bfloat16")             # M = dAi Ai^T
            rows_s = T.alloc_shared((2, BT), "float32")            # dg_cum's dqkwg terms, dg_C's terms
            cum_s = T.alloc_shared((BT,), "float32")               # dg_cum
            dg_last = T.alloc_local((1,), "float32")
            # chain registers
            s_f = T.alloc_fragment((K, BV), "float32")             # dS', fp32, all along
            y_f = T.alloc_fragment((BT, BV), "float32")            # K Q^T, then K dS', then dV~ (BV = BT)
            # gradient registers: 64 x 64 tiles only (BV = BT; K-wide ones in two halves)
            dk0_f = T.alloc_fragment((BT, BT), "float32")          # dk of the chunk (this block's part),
            dk1_f = T.alloc_fragment((BT, BT), "float32")          # K columns 0..63 and 64..127
            x_f = T.alloc_fragment((BT, BT), "float32")            # a half of a 64 x K product
            e_f = T.alloc_fragment((BT, BT), "float32")            # the 64 x 64 products
            kk_f = T.alloc_fragment((BT, BT), "float32")           # K K^T (symmetric)
            r_last = T.alloc_fragment((BT,), "float32")           # row sums: of dg_C's terms,
            r_dg = T.alloc_fragment((BT,), "float32")             # q.dq - k.dk,
            r_u = T.alloc_fragment((BT,), "float32")              # exp(g) r_k + r_e, and r_v, r_et
            r_v = T.alloc_fragment((BT,), "float32")              # (s04's names)
            r_et = T.alloc_fragment((BT,), "float32")
            dgr_f = T.alloc_fragment((BT,), "float32")            # dg: dg_cum reverse-cumsummed in the chunk

            # ---- mbarriers, named for what they guard; arrive counts: each arriving thread once
            bar_a_loaded = T.alloc_barrier([GRAD_THREADS] * STAGES)        # ring A slot filled (+ TMA bytes)
            bar_b1_loaded = T.alloc_barrier([GRAD_THREADS])                # V~, S filled (+ TMA bytes)
            bar_b2_loaded = T.alloc_barrier([GRAD_THREADS])                # V, Ai, beta filled (+ TMA bytes)
            bar_b1_read = T.alloc_barrier([GRAD_THREADS])                  # gradients done reading V~, S
            bar_chunk_read = T.alloc_barrier([GRAD_THREADS])               # ... and V, Ai, beta, the ring A slot
            bar_ds_ready = T.alloc_barrier([WARPGROUP])                    # dS' snapshot published
            bar_ds_free = T.alloc_barrier([GRAD_THREADS])                  # gradients done reading it
            bar_dv_ready = T.alloc_barrier([WARPGROUP])                    # -dV~ published (W read)
            bar_dv_free = T.alloc_barrier([GRAD_THREADS])                  # gradients done reading it

            tx = T.get_thread_binding()
            if tx < CHAIN_END:  # ---- the chain warpgroup: the critical path, nothing else
                T.set_max_nreg(REGS_CHAIN, 0)
                bos = bounds[i_n]
                eos = bounds[i_n + 1]
                num_c = T.ceildiv(eos - bos, BT)
                if use_dht != 0:
                    T.copy(dht[i_n, i_hv, :, v0:v0 + BV], s_f)
                else:
                    T.clear(s_f)
                for it in T.serial(num_c):
                    st = it % STAGES
                    n = T.min(eos - (bos + (num_c - 1 - it) * BT), BT)   # real rows of the chunk
                    T.barrier_wait(bar_a_loaded[st], (it // STAGES) % 2)
                    # dS' (bf16) -> the snapshot: the gradients' operand and the chain's K dS'
                    T.barrier_wait(bar_ds_free, it % 2 ^ 1)
                    T.copy(s_f, ds_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_ds_ready)
                    # dO' <- scale diag(exp g) dO, rows >= n zero (the TMA box reads past them)
                    for i, j in T.Parallel(BT, BV):
                        dop_s[i, j] = T.if_then_else(i < n, do_s[st, i, j] * (scale * T.exp2(g_s[st, i])), 0)
                    # P^T[j, i] <- scale (K Q^T)[j, i] exp(g_i - g_j), j <= i < n (exponent clamped: no inf)
                    T.gemm(k_s[st, :, :], q_s[st, :, :], y_f, transpose_B=True, clear_accum=True)
                    for j, i in T.Parallel(BT, BT):
                        pt_s[j, i] = T.if_then_else((j <= i) & (i < n),
                                                    scale * y_f[j, i] * T.exp2(T.min(g_s[st, i] - g_s[st, j], 0)), 0)
                    # X <- K dS';  dS <- exp(g_C) dS' + Q^T dO'
                    T.gemm(k_s[st, :, :], ds_s, y_f, clear_accum=True)
                    for d, j in T.Parallel(K, BV):
                        s_f[d, j] = s_f[d, j] * T.exp2(g_s[st, BT - 1])
                    T.gemm(q_s[st, :, :], dop_s, s_f, transpose_A=True)
                    # dV~ <- diag(exp(g_C - g)) X + P^T dO
                    for i, j in T.Parallel(BT, BV):
                        y_f[i, j] = y_f[i, j] * T.exp2(g_s[st, BT - 1] - g_s[st, i])
                    T.gemm(pt_s, do_s[st, :, :], y_f)
                    # -dV~ (bf16, rows >= n zero), once the gradients read the last;  dS <- dS + W^T (-dV~)
                    T.barrier_wait(bar_dv_free, it % 2 ^ 1)
                    for i, j in T.Parallel(BT, BV):
                        ndv_s[i, j] = T.if_then_else(i < n, -y_f[i, j], 0)
                    T.gemm(w_s[st, :, :], ndv_s, s_f, transpose_A=True)
                    # W is read: the gradients may write dW into its slot
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_dv_ready)
                # dh0 of the row <- dS (a row without chunks: dht)
                if store_dh0 != 0:
                    T.copy(s_f, dh0[i_n, i_hv, :, v0:v0 + BV])

            else:  # ---- the gradient warpgroups, a chunk behind the chain; they load the tiles too
                T.set_max_nreg(REGS_GRAD, 1)
                bos = bounds[i_n]
                eos = bounds[i_n + 1]
                num_c = T.ceildiv(eos - bos, BT)
                # chunk it's tiles (it = 0: the row's last chunk), full 64-row boxes: rows >= n hold
                # other tokens and are masked where they are used.  Ring A (q, k, w, dO, g) for
                # chunks 0 and 1 and ring B (V~, S; V, Ai, beta) for chunk 0 first; later ones where
                # this role has read the slot's previous chunk, below
                for c in T.serial(T.min(num_c, STAGES)):
                    t1 = bos + (num_c - 1 - c) * BT
                    n1 = T.min(eos - t1, BT)
                    T.tma_copy(q[t1:t1 + BT, i_h, :], q_s[c, :, :], barrier=bar_a_loaded[c])
                    T.tma_copy(k[t1:t1 + BT, i_h, :], k_s[c, :, :], barrier=bar_a_loaded[c])
                    T.tma_copy(w[t1:t1 + BT, i_hv, :], w_s[c, :, :], barrier=bar_a_loaded[c])
                    T.tma_copy(do[t1:t1 + BT, i_hv, v0:v0 + BV], do_s[c, :, :], barrier=bar_a_loaded[c])
                    for i in T.Parallel(BT):  # log2(e) g, rows >= n: the last real row's
                        g_s[c, i] = g_cum[t1 + T.min(i, n1 - 1), i_hv] * LOG2E
                    T.barrier_arrive(bar_a_loaded[c])
                if num_c > 0:
                    t1 = bos + (num_c - 1) * BT
                    n1 = T.min(eos - t1, BT)
                    T.tma_copy(v_new[t1:t1 + BT, i_hv, v0:v0 + BV], vn_s, barrier=bar_b1_loaded)
                    T.tma_copy(h[first_chunk[i_n] + num_c - 1, i_hv, :, v0:v0 + BV], h_s, barrier=bar_b1_loaded)
                    T.barrier_arrive(bar_b1_loaded)
                    T.tma_copy(v[t1:t1 + BT, i_hv, v0:v0 + BV], v_s, barrier=bar_b2_loaded)
                    T.tma_copy(Ai[t1:t1 + BT, i_hv, :], ai_s, barrier=bar_b2_loaded)
                    for i in T.Parallel(BT):  # beta, rows >= n: 0
                        b_s[i] = T.if_then_else(i < n1, beta[t1 + T.min(i, n1 - 1), i_hv], 0)
                    T.barrier_arrive(bar_b2_loaded)
                for it in T.serial(num_c):
                    st = it % STAGES
                    t0 = bos + (num_c - 1 - it) * BT
                    n = T.min(eos - t0, BT)
                    t1 = t0 - BT                                  # the next chunk back
                    T.barrier_wait(bar_a_loaded[st], (it // STAGES) % 2)
                    T.barrier_wait(bar_b1_loaded, it % 2)
                    T.barrier_wait(bar_ds_ready, it % 2)
                    # dk's K columns in two halves hk (every 64 x K product as two 64 x 64 ones: one
                    # fragment layout for all the role's tiles)
                    # dk <- diag(exp(g_C - g)) V~ dS'^T (rows < n);  r_last <- rows of dk * K
                    for dk_f, hk in ((dk0_f, 0), (dk1_f, BT)):
                        T.gemm(vn_s, ds_s[hk:hk + BT, :], dk_f, transpose_B=True, clear_accum=True)
                        for i, d in T.Parallel(BT, BT):
                            dk_f[i, d] = T.if_then_else(i < n, dk_f[i, d] * T.exp2(g_s[st, BT - 1] - g_s[st, i]), 0)
                        for i, d in T.Parallel(BT, BT):
                            x_f[i, d] = dk_f[i, d] * k_s[st, i, hk + d]
                        T.reduce_sum(x_f, r_last, dim=1, clear=hk == 0)
                    # r_last += exp(g_C) rows of S * dS' (rows d and d + 64 paired): its sum is dg_C's
                    # two terms, sum_i k_i.dk_i (the V~ term) + exp(g_C) <S, dS'>
                    for i, j in T.Parallel(BT, BV):
                        e_f[i, j] = T.exp2(g_s[st, BT - 1]) * (
                            T.cast(h_s[i, j], "float32") * T.cast(ds_s[i, j], "float32")
                            + T.cast(h_s[i + BT, j], "float32") * T.cast(ds_s[i + BT, j], "float32"))
                    T.reduce_sum(e_f, r_last, dim=1, clear=False)
                    T.barrier_arrive(bar_ds_free)
                    # dP <- scale (dO V~^T * Gamma), c <= i < n
                    T.gemm(do_s[st, :, :], vn_s, e_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(BT, BT):
                        p_s[i, j] = T.if_then_else((j <= i) & (i < n),
                                                   scale * e_f[i, j] * T.exp2(T.min(g_s[st, i] - g_s[st, j], 0)), 0)
                    for dk_f, hk in ((dk0_f, 0), (dk1_f, BT)):
                        # dq <- scale diag(exp g) dO S^T + dP K;  r_dg <- rows of dq * Q
                        T.gemm(do_s[st, :, :], h_s[hk:hk + BT, :], x_f, transpose_B=True, clear_accum=True)
                        for i, d in T.Parallel(BT, BT):
                            x_f[i, d] = x_f[i, d] * (scale * T.exp2(g_s[st, i]))
                        T.gemm(p_s, k_s[st, :, hk:hk + BT], x_f)
                        for i, d in T.Parallel(BT, BT):
                            if i < n:
                                dq_p[i_v, t0 + i, i_hv, hk + d] = x_f[i, d]
                        for i, d in T.Parallel(BT, BT):
                            x_f[i, d] = x_f[i, d] * q_s[st, i, hk + d]
                        T.reduce_sum(x_f, r_dg, dim=1, clear=hk == 0)
                        # dk += dP^T Q;  r_dg -= rows of dk * K: dg_cum's dqkwg terms q.dq - k.dk
                        T.gemm(p_s, q_s[st, :, hk:hk + BT], dk_f, transpose_A=True)
                        for i, d in T.Parallel(BT, BT):
                            x_f[i, d] = -dk_f[i, d] * k_s[st, i, hk + d]
                        T.reduce_sum(x_f, r_dg, dim=1, clear=False)
                    for i in T.Parallel(BT):
                        rows_s[0, i] = r_dg[i]
                        rows_s[1, i] = r_last[i]
                    dg_last[0] = 0
                    for i in T.serial(BT):
                        dg_last[0] = dg_last[0] + rows_s[1, i]

                    # ---- the chain's -dV~ of this chunk
                    T.barrier_wait(bar_dv_ready, it % 2)
                    # dW <- (-dV~) S^T, into W's slot (the chain read W before publishing -dV~)
                    for hk in (0, BT):
                        T.gemm(ndv_s, h_s[hk:hk + BT, :], x_f, transpose_B=True, clear_accum=True)
                        T.copy(x_f, w_s[st, :, hk:hk + BT])
                    # V~ and S read: the next chunk's, once every thread of the role is here
                    T.barrier_arrive(bar_b1_read)
                    T.barrier_wait(bar_b1_read, it % 2)
                    if it + 1 < num_c:
                        T.tma_copy(v_new[t1:t1 + BT, i_hv, v0:v0 + BV], vn_s, barrier=bar_b1_loaded)
                        T.tma_copy(h[first_chunk[i_n] + num_c - 2 - it, i_hv, :, v0:v0 + BV], h_s,
                                   barrier=bar_b1_loaded)
                        T.barrier_arrive(bar_b1_loaded)
                    # Y <- Ai^T dV~ = -(Ai^T (-dV~));  dv <- diag(beta) Y;  r_v <- rows of Y * V
                    T.barrier_wait(bar_b2_loaded, it % 2)
                    T.gemm(ai_s, ndv_s, e_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(BT, BV):
                        e_f[i, j] = -e_f[i, j]
                    for i, j in T.Parallel(BT, BV):
                        if i < n:
                            dv[t0 + i, i_hv, v0 + j] = e_f[i, j] * b_s[i]
                    for i, j in T.Parallel(BT, BV):
                        e_f[i, j] = e_f[i, j] * v_s[i, j]
                    T.reduce_sum(e_f, r_v, dim=1)
                    # dAi <- (dW K^T) diag(beta exp g) + (dV~ V^T) diag(beta), strictly lower, rows < n:
                    # -(dW K^T) diag(exp g) + (-dV~) V^T in one accumulator, then times -beta_j
                    T.gemm(w_s[st, :, :], k_s[st, :, :], e_f, transpose_B=True, clear_accum=True)
                    for i, j in T.Parallel(BT, BT):
                        e_f[i, j] = -e_f[i, j] * T.exp2(g_s[st, j])
                    T.gemm(ndv_s, v_s, e_f, transpose_B=True)
                    T.barrier_arrive(bar_dv_free)  # -dV~ read for the last time: the chain may write the next
                    for i, j in T.Parallel(BT, BT):
                        p_s[i, j] = T.if_then_else((j < i) & (i < n), -b_s[j] * e_f[i, j], 0)
                    # M <- dAi Ai^T
                    T.gemm(p_s, ai_s, e_f, transpose_B=True, clear_accum=True)
                    T.copy(e_f, d_s)
                    # K K^T (fp32: the factor of E, not rounded)
                    T.gemm(k_s[st, :, :], k_s[st, :, :], kk_f, transpose_B=True, clear_accum=True)
                    # dA~ <- -(Ai^T M) * Gamma, strictly lower, rows < n;  D <- diag(beta) dA~ (over dAi,
                    # read);  E <- dA~ * K K^T;  r_u <- rows of E (r_e)
                    T.gemm(ai_s, d_s, e_f, transpose_A=True, clear_accum=True)
                    for i, j in T.Parallel(BT, BT):
                        e_f[i, j] = T.if_then_else((j < i) & (i < n),
                                                   -e_f[i, j] * T.exp2(T.min(g_s[st, i] - g_s[st, j], 0)), 0)
                    for i, j in T.Parallel(BT, BT):
                        p_s[i, j] = b_s[i] * e_f[i, j]
                    for i, j in T.Parallel(BT, BT):
                        e_f[i, j] = e_f[i, j] * kk_f[i, j]
                    T.reduce_sum(e_f, r_u, dim=1)
                    # (diag(beta) E)^T[j, i] = beta_i dA~[i, j] (K K^T)[j, i]  (K K^T symmetric), with
                    # dA~^T = -(M^T Ai) * Gamma^T;  r_et <- its rows (the columns of diag(beta) E, no
                    # transpose through memory)
                    T.gemm(d_s, ai_s, e_f, transpose_A=True, clear_accum=True)
                    for j, i in T.Parallel(BT, BT):
                        e_f[j, i] = T.if_then_else((j < i) & (i < n),
                                                   -e_f[j, i] * T.exp2(T.min(g_s[st, i] - g_s[st, j], 0))
                                                   * kk_f[j, i] * b_s[i], 0)
                    T.reduce_sum(e_f, r_et, dim=1)
                    for dk_f, hk in ((dk0_f, 0), (dk1_f, BT)):
                        # X <- Ai^T dW;  r_u += exp(g) rows of X * K (exp(g) r_k);  dk += diag(beta exp g) X
                        T.gemm(ai_s, w_s[st, :, hk:hk + BT], x_f, transpose_A=True, clear_accum=True)
                        for i, d in T.Parallel(BT, BT):
                            dk_f[i, d] = dk_f[i, d] + x_f[i, d] * (b_s[i] * T.exp2(g_s[st, i]))
                            x_f[i, d] = x_f[i, d] * k_s[st, i, hk + d] * T.exp2(g_s[st, i])
                        T.reduce_sum(x_f, r_u, dim=1, clear=False)
                        # dk += D K + D^T K
                        T.gemm(p_s, k_s[st, :, hk:hk + BT], dk_f)
                        T.gemm(p_s, k_s[st, :, hk:hk + BT], dk_f, transpose_A=True)
                        for i, d in T.Parallel(BT, BT):
                            if i < n:
                                dk_p[i_v, t0 + i, i_hv, hk + d] = dk_f[i, d]

                    # dbeta <- exp(g) r_k + r_e + r_v = r_u + r_v;  dg_cum <- the dqkwg terms (+ dg_C at
                    # the last real row) + beta r_u - r_et;  dg <- its reverse cumsum in the chunk
                    for i in T.Parallel(BT):
                        if i < n:
                            dbeta_p[i_v, t0 + i, i_hv] = r_u[i] + r_v[i]
                        cum_s[i] = T.if_then_else(
                            i < n,
                            rows_s[0, i] + T.if_then_else(i == n - 1, dg_last[0], 0) + b_s[i] * r_u[i] - r_et[i], 0)
                    # (not T.cumsum: its template scans with threads 0..31 of the block, the chain's here)
                    for i in T.Parallel(BT):
                        dgr_f[i] = 0
                    for j in T.serial(BT):
                        for i in T.Parallel(BT):
                            dgr_f[i] = dgr_f[i] + T.if_then_else(i <= j, cum_s[j], 0)
                    for i in T.Parallel(BT):
                        if i < n:
                            dg_p[i_v, t0 + i, i_hv] = dgr_f[i]
                    # V, Ai, beta and the ring A slot read (dW written into the slot by the generic
                    # proxy: fenced before TMA overwrites it): the next chunks' tiles, once
                    # every thread of the role is here (the chain read the slot before -dV~ came)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_chunk_read)
                    T.barrier_wait(bar_chunk_read, it % 2)
                    if it + 1 < num_c:
                        n1 = T.min(eos - t1, BT)
                        T.tma_copy(v[t1:t1 + BT, i_hv, v0:v0 + BV], v_s, barrier=bar_b2_loaded)
                        T.tma_copy(Ai[t1:t1 + BT, i_hv, :], ai_s, barrier=bar_b2_loaded)
                        for i in T.Parallel(BT):
                            b_s[i] = T.if_then_else(i < n1, beta[t1 + T.min(i, n1 - 1), i_hv], 0)
                        T.barrier_arrive(bar_b2_loaded)
                    if it + STAGES < num_c:
                        t1 = t0 - STAGES * BT
                        n1 = T.min(eos - t1, BT)
                        T.tma_copy(q[t1:t1 + BT, i_h, :], q_s[st, :, :], barrier=bar_a_loaded[st])
                        T.tma_copy(k[t1:t1 + BT, i_h, :], k_s[st, :, :], barrier=bar_a_loaded[st])
                        T.tma_copy(w[t1:t1 + BT, i_hv, :], w_s[st, :, :], barrier=bar_a_loaded[st])
                        T.tma_copy(do[t1:t1 + BT, i_hv, v0:v0 + BV], do_s[st, :, :], barrier=bar_a_loaded[st])
                        for i in T.Parallel(BT):
                            g_s[st, i] = g_cum[t1 + T.min(i, n1 - 1), i_hv] * LOG2E
                        T.barrier_arrive(bar_a_loaded[st])

    return gdn_bwd_ws_reverse


@functools.cache
def _ws_reverse(H: int, HV: int):
    # no shared-memory reuse: the planner would treat the role branches as sequential (gdn_fwd.s05);
    # fast math: each exp2 one ex2.approx
    return compile_hopper(ws_reverse_kernel(H, HV), {"tl.disable_shared_memory_reuse": True,
                                                     "tl.enable_fast_math": True})


def kernel_source() -> str:
    """The CUDA C++ of this stage's new kernel, generated for sm_90a at the default shape."""
    return _ws_reverse(**DEFAULT_SHAPE).get_kernel_source()


def run(q, k, v, g, beta, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
        chunk_size=CHUNK_SIZE, cp=None):
    """(dq, dk [B, T, H, K] bf16, dv [B, T, HV, V] bf16, dg, dbeta [B, T, HV] fp32, dh0
    [N, HV, K, V] fp32 or None); see the module doc. ``cp``: as s03's (None: its rule; False:
    one row per sequence; True: its cheapest split; an int: the segment length in chunks)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"gdn_bwd.s07: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s07: `q` must have head dim K = {HEAD_DIM}; got K = {K}")
    if V != HEAD_DIM:
        raise ValueError(f"gdn_bwd.s07: `v` must have head dim V = {HEAD_DIM}; got V = {V}")
    if HV % H:
        raise ValueError(f"gdn_bwd.s07: `v` must have a number of value heads HV that is a "
                         f"multiple of the H = {H} heads of q; got HV = {HV}")
    if not (cp is None or isinstance(cp, int)):
        raise ValueError(f"gdn_bwd.s07: `cp` must be None, True, False or a segment length in chunks; got {cp!r}")
    if B * T == 0:  # no tokens: every gradient is empty, and dL/dh0 = dht (s02's answer)
        return S02.run(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens, chunk_size)
    device = q.device
    scale = K ** -0.5 if scale is None else float(scale)
    bf16 = {"device": device, "dtype": torch.bfloat16}
    fp32 = {"device": device, "dtype": torch.float32}
    q_flat, k_flat = (x.to(**bf16).contiguous().view(B * T, H, K) for x in (q, k))
    v_flat, do_flat = (x.to(**bf16).contiguous().view(B * T, HV, V) for x in (v, do))
    g_flat, beta_flat = (x.to(**fp32).contiguous().view(B * T, HV) for x in (g, beta))
    seqs = seq_bounds(cu_seqlens, B, T, device)
    table, first_chunk = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    N, NT = seqs.shape[0] - 1, table.shape[0]
    p = S03.split_plan(cu_seqlens, B, T, HV, autocp.num_sms(device), device, cp)
    stand_in = torch.empty(1, HV, K, V, **fp32)  # for an absent h0 / dht / dh0: never read or written
    with nvtx_range("gdn_bwd.s07"):
        # the forward's intermediates, recomputed: g_cum, Ai, w, u (s02's prep)
        g_cum = torch.empty(B * T, HV, **fp32)
        Ai = torch.empty(B * T, HV, CHUNK_SIZE, **bf16)
        w = torch.empty(B * T, HV, K, **bf16)
        u = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s07.prep"):
            S02._prep(H, HV)(k_flat, v_flat, g_flat, beta_flat, table, g_cum, Ai, w, u)
        if p is None:  # one row per sequence, from h0 and dht themselves
            bounds, rows_first, S = seqs, first_chunk, N
            h_rows = initial_state.to(**fp32).contiguous() if initial_state is not None else stand_in
            dht_rows = dht.to(**fp32).contiguous() if dht is not None else stand_in
            use_h0, use_dht = int(initial_state is not None), int(dht is not None)
        else:  # the segment rows, from s03's segment states and gradients
            bounds, rows_first, S = p.bounds, p.first_chunk, p.bounds.shape[0] - 1
            h0 = (initial_state.to(**fp32).contiguous() if initial_state is not None
                  else torch.zeros(N, HV, K, V, **fp32))
            with nvtx_range("gdn_bwd.s07.segment_states"):
                h_rows, solve = S03.segment_states(p, k_flat, v_flat, g_flat, beta_flat, h0, seqs, NT)
            with nvtx_range("gdn_bwd.s07.segment_grads"):
                dht_rows, _ = S03.segment_grads(p, q_flat, k_flat, w, do_flat, g_flat, beta_flat, g_cum,
                                                solve, dht, seqs, scale)
            use_h0, use_dht = 1, 1
        h = torch.empty(NT, HV, K, V, **bf16)
        v_new = torch.empty(B * T, HV, V, **bf16)
        with nvtx_range("gdn_bwd.s07.fwd_walk"):
            S04._fwd_walk(H, HV)(k_flat, w, u, g_cum, bounds, rows_first, h_rows, use_h0, h, v_new)
        dq_p, dk_p = torch.empty(NVT, B * T, HV, K, **bf16), torch.empty(NVT, B * T, HV, K, **bf16)
        dbeta_p, dg_p = torch.empty(NVT, B * T, HV, **fp32), torch.empty(NVT, B * T, HV, **fp32)
        dv = torch.empty(B * T, HV, V, **bf16)
        dh0_rows = torch.empty(S, HV, K, V, **fp32) if initial_state is not None else stand_in
        with nvtx_range("gdn_bwd.s07.ws_reverse"):
            _ws_reverse(H, HV)(q_flat, k_flat, v_flat, w, v_new, do_flat, Ai, g_cum, beta_flat, h, bounds,
                          rows_first, dht_rows, use_dht, scale, dq_p, dk_p, dv, dbeta_p, dg_p, dh0_rows,
                          int(initial_state is not None))
        dq, dk = torch.empty(B * T, H, K, **bf16), torch.empty(B * T, H, K, **bf16)
        dbeta, dg = torch.empty(B * T, HV, **fp32), torch.empty(B * T, HV, **fp32)
        with nvtx_range("gdn_bwd.s07.finish"):
            S04._finish(H, HV)(dq_p, dk_p, dbeta_p, dg_p, dq, dk, dbeta, dg)
    if initial_state is None:
        dh0 = None
    else:
        dh0 = dh0_rows if p is None else dh0_rows.index_select(0, p.row_of_slot[:N])
    return (dq.view(B, T, H, K), dk.view(B, T, H, K), dv.view(B, T, HV, V), dg.view(B, T, HV),
            dbeta.view(B, T, HV), dh0)
