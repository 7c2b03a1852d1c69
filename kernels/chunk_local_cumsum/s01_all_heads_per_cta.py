"""chunk_local_cumsum, stage 01: the chunk-local prefix sum of the gate, all value heads of a chunk in one CTA.

What it computes (``flashqla.reference.chunk_local_cumsum``): for every chunk of C = 64 tokens
(chunks restart at every sequence start) and every value head,

    g_cum_i = g_0 + g_1 + ... + g_i      (i = position in the chunk),

in fp32, from g [B, T, HV] fp32 to g_cum [B, T, HV] fp32.

Why this shape of kernel: the work is tiny (one add per element) and the data are a [tokens, HV]
row-major matrix, so what matters is reading and writing it in whole rows. One CTA per chunk of
the device-built chunk table (``flashqla.varlen.chunk_table``, no host sync) owns all HV heads:
thread h walks the chunk's tokens down column h, so at every token a warp reads and writes 32
consecutive floats (128 bytes, coalesced). A CTA per (chunk, head) would instead read one float
per row, a 4-byte access out of every 32-byte sector. Each thread first loads its 64 values into
registers (64 independent loads in flight), then scans them; rows past the chunk's end are
neither loaded nor stored. An empty chunk row [T, T) of the varlen table does nothing.

Measured effect (one H200, CUDA events, median of 20 after warm-up; FLA 0.6.0 in the same run):
the kernel alone takes 0.016 ms on (H, HV) = (16, 64), 1 x 32768 tokens and on (16, 32),
8 x 4096 (varlen) (8 and 4 MB of g, read from L2 when timed repeatedly); FLA's
``chunk_local_cumsum`` takes 0.102 / 0.075 ms as a single call, 0.058 / 0.055 ms back to back
(launch-bound). ``run`` takes 0.35 / 0.34 ms: almost all of it is the host launching the ~25 small
PyTorch ops of ``flashqla.varlen.chunk_table``, which a chained forward should build once.

Taught in: notebooks/03_forward_kernels.py, as a kernel of gdn_fwd.s02.
"""

import functools

import torch

from flashqla.hopper import compile_hopper
from flashqla.nvtx import nvtx_range
from flashqla.varlen import chunk_table

NEEDS = ("hopper",)
# the chunk's 64 gates of one head held in registers, then scanned there with fp32 adds
SOURCE_MUST_CONTAIN = ("float x[64]", "acc + x[")

CHUNK_SIZE = 64
DEFAULT_SHAPE = dict(HV=32)


def chunk_local_cumsum_kernel(HV: int):
    """The T.prim_func for HV value heads; any token or chunk count."""
    import tilelang.language as T  # imported here: loading a stage must not pull in TileLang

    BT = CHUNK_SIZE
    threads = 32 * -(-HV // 32)  # one thread per head, whole warps
    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")

    @T.prim_func
    def chunk_local_cumsum_fwd(
        g: T.Tensor((num_tokens, HV), "float32"),              # [B*T, HV], sequences packed
        chunk_bounds: T.Tensor((num_chunks, 2), "int32"),      # [start, end) of every chunk
        g_cum: T.Tensor((num_tokens, HV), "float32"),
    ):
        with T.Kernel(num_chunks, threads=threads) as i_c:
            h = T.get_thread_binding()                         # this thread's value head
            bos = chunk_bounds[i_c, 0]
            n = chunk_bounds[i_c, 1] - bos                     # chunk length, 0..64
            x = T.alloc_local((BT,), "float32")
            acc = T.alloc_var("float32")
            if h < HV:
                # x_i <- g[bos + i, h] for the chunk's n rows
                for i in T.unroll(BT):
                    if i < n:
                        x[i] = g[bos + i, h]
                # g_cum[bos + i, h] <- x_0 + ... + x_i
                acc = 0.0
                for i in T.unroll(BT):
                    if i < n:
                        acc = acc + x[i]
                        g_cum[bos + i, h] = acc

    return chunk_local_cumsum_fwd


@functools.cache
def _compiled(HV: int):
    return compile_hopper(chunk_local_cumsum_kernel(HV))


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a at the default shape (no GPU needed)."""
    return _compiled(**DEFAULT_SHAPE).get_kernel_source()


def run(g, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """g [B, T, HV] fp32 -> g_cum [B, T, HV] fp32 (see the module doc)."""
    if chunk_size != CHUNK_SIZE:
        raise ValueError(f"chunk_local_cumsum.s01: `chunk_size` must be {CHUNK_SIZE}; got {chunk_size}")
    B, T, HV = g.shape
    device = g.device
    g_flat = g.to(torch.float32).contiguous().view(B * T, HV)
    bounds, _ = chunk_table(cu_seqlens, B, T, CHUNK_SIZE, device)
    g_cum = torch.empty(B * T, HV, dtype=torch.float32, device=device)
    if bounds.shape[0]:  # every token lies in exactly one chunk, so every row gets written
        kernel = _compiled(HV)
        with nvtx_range("chunk_local_cumsum.s01"):
            kernel(g_flat, bounds, g_cum)
    return g_cum.view(B, T, HV)
