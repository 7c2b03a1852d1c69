"""chunk_local_cumsum, stage 02: s01 with each head's chunk split over eight threads (a two-level scan).

What changed: s01 gives a head's whole chunk to one thread: 64 loads, then 63 dependent adds,
each followed by its store, in one warp a CTA. Here a CTA (still one per chunk) has HV x P
threads, P = 8: thread (j, h) owns the L = 64 / P = 8 consecutive tokens j L .. j L + 7 of head
h. It loads them, scans them in registers, writes its segment's total to shared memory, and after
one barrier adds the totals of the segments before it:

    g_cum[j L + r, h] = (t_0,h + ... + t_{j-1},h) + (g[j L, h] + ... + g[j L + r, h]),
    t_j,h = g[j L, h] + ... + g[j L + 7, h]     (the segment total),

both sums taken left to right, so the result is deterministic (not bitwise s01's: the grouping
differs, within fp32 rounding of the reference). Thread index = j HV + h, so at every step a warp
reads and writes whole 32-byte sectors of consecutive rows (HV a multiple of 8: every public head
layout). Threads are rounded up to whole warps (HV x 8 is already whole for HV a multiple of 4);
a padding thread has j >= P, so the row guard (j L + r < n, n <= 64) skips all its loads and
stores, and it still meets the barrier. A chunk shorter than 64 tokens (n = end - start) loads
zeros past its end, which leave the totals unchanged; an empty row [T, T) of the varlen table
loads and stores nothing. The totals sit head by head (t_j,h at h P + j), so a thread reads its
head's eight in two 16-byte shared-memory loads; the price is a bank conflict on the one store
of a total (8-way at HV >= 32).

Also: the compile turns off TileLang's safe-memory legalization, which wrapped every g access of
s01 in a check against num_tokens, compiled to a branch around each load and store. The chunk
table's rows lie in [0, num_tokens] by construction (``flashqla.varlen.chunk_table``), so the row
guard alone keeps every access in bounds. The whole kernel is then 106-131 SASS instructions
(s01: 2,168 at HV = 32, 255 of them branches), loads and stores predicated, no branch but the
exit, 23-24 registers (s01: 73-80), no local memory (nvcc 13.0, sm_90a, HV 2 to 64).

Why (napkin math, (H, HV) = (8, 32), one sequence of 2048 tokens, 32 chunks): s01 runs 32 CTAs of
one warp: 64 loads in flight per thread, then a critical path of 63 dependent fp32 adds
(about 4 cycles each) threaded through 64 guarded stores, all in one warp's instruction stream
an SM. s02 runs the same 32 CTAs with 256 threads (8 warps an SM, 8 loads in flight per thread,
the same bytes in flight in all), and the dependent adds on the path are 7 (local scan) + at most
7 (the offset) + 1: 15 instead of 63, plus one barrier and two shared-memory round trips (ptxas
issues the two 16-byte loads one after the other). Both stages still wait for the chunk table's
row before the first load of g: two global-memory latencies in a row. At HV = 64 the CTA has 512
threads; shared memory is P x HV x 4 bytes (2 KiB at HV = 64).

Measured effect (one H100, commit 677241e; the kernel alone, 50 launches captured in one CUDA
graph, the replay's time / 50): 1.6-2.5 us against s01's 4.0-7.3, on the 1 x 2048 and 1 x 8192
problems of all eight head layouts (s01 6.7-7.3 us at HV 32 and 64, 4.0-4.3 at HV 8 to 48; s02
1.6-2.1 at 1 x 2048, 1.8-2.5 at 1 x 8192). Its GPU tests pass (commit c5feab3: the public shapes
against the float64 reference). The library runs it from gdn_fwd.s26 on (commit 98a6f05).
(A first timing, of one launch per graph replay, gave 17-18 us for both: that harness's launch
overhead, not the kernels.)

Taught in: Lab log (book page lab_log); background in notebooks/03_forward_kernels.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# the segment's 8 gates held in registers; segment totals exchanged through shared memory
SOURCE_MUST_CONTAIN = ("float x[8]", "__shared__", "__syncthreads()")

CHUNK_SIZE = 64
DEFAULT_SHAPE = dict(HV=32)
SEGMENTS = 8                                   # P: threads a head, each owning 64 / P tokens


def chunk_local_cumsum_kernel(HV: int):
    """The T.prim_func for HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, P = CHUNK_SIZE, SEGMENTS
    L = BT // P                                # tokens a segment
    threads = 32 * -(-(HV * P) // 32)          # whole warps
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_local_cumsum_fwd(
        g: T.Tensor((num_tokens, HV), "float32"),              # [B*T, HV], sequences packed
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        g_cum: T.Tensor((num_tokens, HV), "float32"),
    ):
        with T.Kernel(num_chunks, threads=threads) as i_c:
            tid = T.get_thread_binding()
            h = tid % HV                                       # this thread's value head
            j = tid // HV                                      # its segment; >= P on padding threads
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos                     # chunk length, 0..64
            x = T.alloc_local((L,), "float32")
            totals = T.alloc_shared((HV * P,), "float32")      # t_j,h at h P + j
            t = T.alloc_local((P,), "float32")                 # t_0,h .. t_{P-1},h
            off = T.alloc_var("float32")
            # x_r <- g[bos + j L + r, h], zero past the chunk's end
            for r in T.unroll(L):
                x[r] = 0.0
                if j * L + r < n:
                    x[r] = g[bos + j * L + r, h]
            # x_r <- x_0 + ... + x_r: the prefix within the segment; x_{L-1} is its total
            for r in T.unroll(1, L):
                x[r] = x[r] + x[r - 1]
            if tid < P * HV:
                totals[h * P + j] = x[L - 1]
            T.sync_threads()
            # off = t_0,h + ... + t_{j-1},h: what the chunk's earlier segments add up to. Head h's
            # P totals are contiguous: two 16-byte loads, where one 4-byte load per total (each
            # under its guard jj < j) had ptxas wait out seven shared-memory latencies in turn.
            for jj in T.vectorized(P):
                t[jj] = totals[h * P + jj]
            off = 0.0
            for jj in T.unroll(P - 1):
                if jj < j:
                    off = off + t[jj]
            for r in T.unroll(L):
                if j * L + r < n:
                    g_cum[bos + j * L + r, h] = off + x[r]

    return chunk_local_cumsum_fwd


@functools.cache
def _compiled(HV: int):
    # the row guard j L + r < n keeps g's accesses in [0, num_tokens): the chunk table's rows do
    return compile_hopper(chunk_local_cumsum_kernel(HV),
                          pass_configs={"tl.disable_safe_memory_legalize": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(g, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """g [B, T, HV] fp32 -> g_cum [B, T, HV] fp32 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_local_cumsum.s02: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, HV = g.shape
    device = g.device
    g_flat = g.to(torch.float32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    g_cum = torch.empty(B * T, HV, dtype=torch.float32, device=device)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(HV)
        with nvtx_range("chunk_local_cumsum.s02"):
            kernel(g_flat, bounds, g_cum)
    return g_cum.view(B, T, HV)
