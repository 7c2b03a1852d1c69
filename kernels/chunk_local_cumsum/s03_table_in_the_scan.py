"""chunk_local_cumsum, stage 03: s02's scan, with each CTA finding its own chunk from the sequence
bounds and writing the chunk table that the kernels after it read.

What changed from s02: the kernel takes the sequence bounds (``flashqla.varlen.seq_bounds``, int32
[N + 1]) instead of the chunk table, and builds the table itself. A CTA is still one row of the
table (``num_chunk_rows`` of them: floor(T / 64) + N for varlen, an upper bound). Before its scan
each CTA counts every sequence's chunks, ceil(length / 64), a thread taking N / threads sequences
in turn, prefix-sums the counts over its threads (Hillis-Steele in shared memory, log2(threads)
barriers), and the thread whose sequences hold row i_c writes that chunk's [start, end) to shared
memory ([T, T) past the real chunks, as in ``varlen.chunk_table``). Every CTA writes its row of the
table; CTA 0 also writes ``first_chunk`` [N + 1]. The scan itself is s02's, token for token, so
g_cum is s02's bit for bit.

Why: inside a CUDA graph, where the chunk table cannot come from the host's cache (a graph must own
what it reads), the library built it with a kernel of its own before the cumsum: one CTA of 1024
threads, 3.3-3.8 us of device time on every forward (``results/timeline.csv``, one H100, commit
ab90d41), on the path of every kernel after it, where FlashQLA's forward starts with its cumsum
(its chunk indices are cached on the host and handed to its graph). Here that work is a prologue
of the cumsum, whose CTAs each repeat it: N + 1 bounds loaded, about N / threads + 2 log2(threads)
steps, for the short problems where it matters (N = 1) a few hundred cycles.

Measured effect (one H100, commit 4c2e89f, inside gdn_fwd.s29's forward in a CUDA graph): 2.0 us
on (2, 8) 1x2048, 2.4 on (4, 16), 2.9 on (8, 32), where the table kernel took 3.3-3.6 and s02
4.0-4.6 after it; the forward's span is 2.4-2.7 us shorter. Its tests passed there: the public
shapes against the float64 reference; g_cum bit for bit s02's and the table and first_chunk equal
to ``varlen``'s PyTorch table (``tests/test_varlen.py``).

Taught in: Lab log (book page lab_log); background in notebooks/03_forward_kernels.py.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import num_chunk_rows, seq_bounds

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("float x[8]", "__shared__", "__syncthreads()", "first_chunk[")

CHUNK_SIZE = 64
DEFAULT_SHAPE = dict(HV=32)
SEGMENTS = 8                                   # P: threads a head, each owning 64 / P tokens (s02)


def chunk_local_cumsum_kernel(HV: int):
    """The T.prim_func for HV value heads; any token, sequence or row count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT, P = CHUNK_SIZE, SEGMENTS
    L = BT // P                                # tokens a segment
    threads = 32 * -(-(HV * P) // 32)          # whole warps
    num_tokens = T.dynamic("num_tokens")
    num_bounds = T.dynamic("num_bounds")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def chunk_local_cumsum_table(
        g: T.Tensor((num_tokens, HV), "float32"),              # [B*T, HV], sequences packed
        bounds: T.Tensor((num_bounds,), "int32"),              # [N + 1]: where each sequence starts
        g_cum: T.Tensor((num_tokens, HV), "float32"),
        table: T.Tensor((num_rows, 2), "int32"),               # out: [start, end) of every chunk
        first_chunk: T.Tensor((num_bounds,), "int32"),         # out: each sequence's first row
    ):
        with T.Kernel(num_rows, threads=threads) as i_c:
            tid = T.get_thread_binding()
            h = tid % HV                                       # this thread's value head
            j = tid // HV                                      # its segment; >= P on padding threads
            n_seqs = num_bounds - 1
            per = T.ceildiv(n_seqs, threads)                   # sequences [tid per, (tid + 1) per) are tid's
            scan_s = T.alloc_shared((threads,), "int32")
            row_s = T.alloc_shared((2,), "int32")              # this CTA's chunk: [start, end)
            mine = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            x = T.alloc_local((L,), "float32")
            totals = T.alloc_shared((HV * P,), "float32")      # t_j,h at h P + j
            t = T.alloc_local((P,), "float32")                 # t_0,h .. t_{P-1},h
            off = T.alloc_var("float32")
            # row_s <- [T, T): a row past the real chunks, unless a thread finds it below
            if tid == 0:
                row_s[0] = num_tokens
                row_s[1] = num_tokens
            # mine <- the chunks of this thread's sequences, ceil(length / C) each
            mine[0] = 0
            for i in T.serial(per):
                if tid * per + i < n_seqs:
                    mine[0] = mine[0] + T.ceildiv(bounds[tid * per + i + 1] - bounds[tid * per + i], BT)
            # scan_s <- inclusive prefix sums of mine over the threads (Hillis-Steele)
            scan_s[tid] = mine[0]
            for d in [1 << e for e in range((threads - 1).bit_length())]:  # a Python loop: unrolled
                T.sync_threads()
                step[0] = scan_s[tid] + T.if_then_else(tid >= d, scan_s[T.max(tid - d, 0)], 0)
                T.sync_threads()
                scan_s[tid] = step[0]
            T.sync_threads()
            # walk this thread's sequences from the chunks before them: CTA 0 writes first_chunk;
            # the sequence holding row i_c gives row_s its chunk, clipped to the sequence's end
            mine[0] = scan_s[tid] - mine[0]
            for i in T.serial(per):
                if tid * per + i < n_seqs:
                    step[0] = T.ceildiv(bounds[tid * per + i + 1] - bounds[tid * per + i], BT)
                    if i_c == 0:
                        first_chunk[tid * per + i] = mine[0]
                    if mine[0] <= i_c and i_c < mine[0] + step[0]:
                        row_s[0] = bounds[tid * per + i] + (i_c - mine[0]) * BT
                        row_s[1] = T.min(bounds[tid * per + i] + (i_c - mine[0] + 1) * BT,
                                         bounds[tid * per + i + 1])
                    mine[0] = mine[0] + step[0]
            if i_c == 0 and tid == threads - 1:
                first_chunk[n_seqs] = scan_s[threads - 1]
            T.sync_threads()
            bos = row_s[0]
            n = row_s[1] - bos                                 # chunk length, 0..64
            if tid == 0:
                table[i_c, 0] = bos
                table[i_c, 1] = row_s[1]
            # from here s02's scan: x_r <- g[bos + j L + r, h], zero past the chunk's end
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
            # off = t_0,h + ... + t_{j-1},h: what the chunk's earlier segments add up to
            for jj in T.vectorized(P):
                t[jj] = totals[h * P + jj]
            off = 0.0
            for jj in T.unroll(P - 1):
                if jj < j:
                    off = off + t[jj]
            for r in T.unroll(L):
                if j * L + r < n:
                    g_cum[bos + j * L + r, h] = off + x[r]

    return chunk_local_cumsum_table


@functools.cache
def _compiled(HV: int):
    # s02's option: the row guard keeps g's accesses in [0, num_tokens), the sequence guard the
    # bounds' in [0, N]
    return compile_hopper(chunk_local_cumsum_kernel(HV),
                          pass_configs={"tl.disable_safe_memory_legalize": True})


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def cumsum_and_table(g, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """g [B, T, HV] fp32 -> (g_cum [B T, HV] fp32, table int32 [NT, 2], first_chunk int32 [N + 1]):
    the cumsum and ``flashqla.varlen.chunk_table``'s maps, from one kernel."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_local_cumsum.s03: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, HV = g.shape
    device = g.device
    g_flat = g.to(torch.float32).contiguous().view(B * T, HV)
    bounds = seq_bounds(cu_seqlens, B, T, device)
    g_cum = torch.empty(B * T, HV, dtype=torch.float32, device=device)
    table = torch.empty(num_chunk_rows(cu_seqlens, B, T, CHUNK_SIZE), 2, dtype=torch.int32, device=device)
    first_chunk = torch.zeros(bounds.shape[0], dtype=torch.int32, device=device)
    if B * T == 0:  # no tokens: every row is [0, 0), every sequence starts at row 0
        table.zero_()
    elif table.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        with nvtx_range("chunk_local_cumsum.s03"):
            _compiled(HV)(g_flat, bounds, g_cum, table, first_chunk)
    return g_cum, table, first_chunk


def run(g, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """g [B, T, HV] fp32 -> g_cum [B, T, HV] fp32 (see the module doc)."""
    B, T, HV = g.shape
    return cumsum_and_table(g, cu_seqlens, chunk_size)[0].view(B, T, HV)
