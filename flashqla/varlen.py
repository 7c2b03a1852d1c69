"""Sequence and chunk maps for the kernels, built on the device with no host synchronization.

A kernel sees its sequences packed along one token axis (an equal-length batch [B, T] is B
sequences of T tokens back to back). Two maps serve every kernel:

    seq_bounds   int32 [N + 1]    token offsets of the sequences (``cu_seqlens``, or 0, T, 2T, ...)
    chunk_table  int32 [NT, 2]    [start, end) of every chunk of C tokens, sequence by sequence,
                 int32 [N + 1]    and the index of each sequence's first chunk

Chunks restart at every sequence start, so a sequence's last chunk holds 1 to C tokens. Chunk i of
the table is FLA's chunk i (the row of ``h`` [B', NT, HV, K, V] it owns). The number of real chunks
depends on the lengths, which live on the device; reading them would be a synchronization (and
would break CUDA-graph capture), so for varlen NT is the bound floor(T / C) + N (each sequence
adds at most one partial chunk) and the rows past the real chunks are empty, [T, T): a CTA given
one loads nothing and stores nothing. Without cu_seqlens NT = B ceil(T / C) exactly.

On a GPU one small TileLang kernel builds the table (``TABLE_THREADS`` threads in one CTA: a scan of
the sequences' chunk counts, then a binary search per row); on the CPU the same table comes from
PyTorch ops (``_build_chunk_table_torch``, also the kernel's test oracle), about 20 of them, which
on a GPU would be 20 launches. The last table of each CUDA stream is kept and returned again
to calls on that stream while the same ``cu_seqlens`` tensor, unmodified, comes back (every GDN
layer of a model step passes the same one), as FLA does with its chunk indices. A table that came
from the cache launches nothing; one stream never reads a table another stream's kernel writes
(``flashqla.caches``).
Inside CUDA-graph capture the table is always built anew, in the graph: a graph must own the
memory it reads, a cached table is freed when a later call replaces it, and a graph replayed
after ``cu_seqlens`` was edited in place must read the new lengths. That is one launch in the
graph, where the PyTorch ops were about 20 (each a few microseconds of a replay).
"""

from __future__ import annotations

import threading
import weakref

import torch

from flashqla.caches import cache_once, stream_key

TABLE_THREADS = 1024  # the table kernel's one CTA


def seq_bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int,
               device: torch.device) -> torch.Tensor:
    """int32 [N + 1]: where each sequence starts in the packed tokens, then the total."""
    if cu_seqlens is None:
        return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen
    return cu_seqlens.to(device=device, dtype=torch.int32)


HOST_BOUNDS_CACHE = 64  # cu_seqlens tensors whose values are kept on the host (FLA keeps 4 tables)
_host_bounds: dict = {}
_host_bounds_lock = threading.Lock()


def host_bounds(cu_seqlens: torch.Tensor) -> list[int] | None:
    """``cu_seqlens`` as host integers, or None inside CUDA-graph capture for a tensor not read
    before. Reading the values is a device-to-host copy, which synchronizes and which a capture
    forbids, so each (tensor, version) is read once and kept (``remember_bounds`` keeps values the
    caller already has on the host): the eager call before a capture (a graph replays what its
    eager runs checked) leaves the values for the capture. A tensor edited in place has a new
    version and is read again."""
    key = (id(cu_seqlens), cu_seqlens._version)
    with _host_bounds_lock:
        hit = _host_bounds.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        return hit[1]
    if capturing(cu_seqlens.device):
        return None
    value = cu_seqlens.tolist()
    remember_bounds(cu_seqlens, value)
    return value


def remember_bounds(cu_seqlens: torch.Tensor, value: list[int]) -> None:
    """Keep ``value``, the host integers of ``cu_seqlens`` (FLA's ``cu_seqlens_cpu``), for
    ``host_bounds``, so that it never reads the device tensor."""
    with _host_bounds_lock:
        _host_bounds[(id(cu_seqlens), cu_seqlens._version)] = (weakref.ref(cu_seqlens), value)
        while len(_host_bounds) > HOST_BOUNDS_CACHE:
            del _host_bounds[next(iter(_host_bounds))]  # the oldest


def num_chunk_rows(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, chunk_size: int) -> int:
    """NT, the rows of ``chunk_table``: exact for a batch, an upper bound for varlen (no sync)."""
    if cu_seqlens is None:
        return batch * -(-seqlen // chunk_size)
    return seqlen // chunk_size + cu_seqlens.shape[0] - 1


def capturing(device) -> bool:
    """Whether work for ``device`` is being captured into a CUDA graph now: a cached tensor must not
    be handed to the graph then (the graph must own what it reads; the cache frees on replacement)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


TABLE_STREAMS = 8  # streams whose last chunk table is kept
_last_table: dict = {}  # stream_key -> (key, table, weakref to cu_seqlens or None)
_last_table_lock = threading.Lock()


def chunk_table(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, chunk_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds int32 [NT, 2], first_chunk int32 [N + 1]); see the module docstring."""
    if capturing(device):
        return _build_chunk_table(cu_seqlens, batch, seqlen, chunk_size, device)
    key = (None if cu_seqlens is None else (id(cu_seqlens), cu_seqlens._version),
           batch, seqlen, chunk_size, str(device))
    stream = stream_key(device)
    with _last_table_lock:
        hit = _last_table.get(stream)
    if hit is not None and hit[0] == key and (cu_seqlens is None or hit[2]() is cu_seqlens):
        return hit[1]
    value = _build_chunk_table(cu_seqlens, batch, seqlen, chunk_size, device)
    with _last_table_lock:
        _last_table.pop(stream, None)
        _last_table[stream] = (key, value, None if cu_seqlens is None else weakref.ref(cu_seqlens))
        while len(_last_table) > TABLE_STREAMS:
            del _last_table[next(iter(_last_table))]  # the stream that built one longest ago
    return value


def _build_chunk_table(cu_seqlens, batch, seqlen, chunk_size, device):
    from flashqla.hopper import hopper_gpu_missing

    if torch.device(device).type != "cuda" or hopper_gpu_missing() is not None:
        return _build_chunk_table_torch(cu_seqlens, batch, seqlen, chunk_size, device)
    bounds = seq_bounds(cu_seqlens, batch, seqlen, device)
    table = torch.empty(num_chunk_rows(cu_seqlens, batch, seqlen, chunk_size), 2, dtype=torch.int32,
                        device=device)
    first_chunk = torch.empty(bounds.shape[0], dtype=torch.int32, device=device)
    _table_compiled(chunk_size)(bounds, batch * seqlen, table, first_chunk)
    return table, first_chunk


def _table_kernel(chunk_size: int):
    """The T.prim_func: seq_bounds int32 [N + 1] and the token total -> table int32 [NT, 2],
    first_chunk int32 [N + 1] (any N, NT), as ``_build_chunk_table_torch`` computes them."""
    import tilelang.language as T  # imported here: importing flashqla must not pull in TileLang

    C, P = chunk_size, TABLE_THREADS
    num_bounds = T.dynamic("num_bounds")
    num_rows = T.dynamic("num_rows")

    @T.prim_func
    def chunk_table_build(
        bounds: T.Tensor((num_bounds,), "int32"),
        total: T.int32,                                        # rows past the real chunks: [total, total)
        table: T.Tensor((num_rows, 2), "int32"),
        first_chunk: T.Tensor((num_bounds,), "int32"),
    ):
        with T.Kernel(1, threads=P):
            tx = T.get_thread_binding()
            n_seqs = num_bounds - 1
            per = T.ceildiv(n_seqs, P)                         # sequences [tx per, (tx + 1) per) are tx's
            scan_s = T.alloc_shared((P,), "int32")
            mine = T.alloc_local((1,), "int32")
            step = T.alloc_local((1,), "int32")
            lo = T.alloc_local((1,), "int32")
            hi = T.alloc_local((1,), "int32")
            # mine <- the chunks of this thread's sequences, ceil(length / C) each
            mine[0] = 0
            for i in T.serial(per):
                if tx * per + i < n_seqs:
                    mine[0] = mine[0] + T.ceildiv(bounds[tx * per + i + 1] - bounds[tx * per + i], C)
            # scan_s <- inclusive prefix sums of mine over the threads (Hillis-Steele, log2 P steps)
            scan_s[tx] = mine[0]
            for d in [1 << e for e in range(P.bit_length() - 1)]:  # a Python loop: unrolled
                T.sync_threads()
                step[0] = scan_s[tx] + T.if_then_else(tx >= d, scan_s[T.max(tx - d, 0)], 0)
                T.sync_threads()
                scan_s[tx] = step[0]
            T.sync_threads()
            # first_chunk[j] <- chunks before sequence j; first_chunk[N] <- all of them
            mine[0] = scan_s[tx] - mine[0]
            for i in T.serial(per):
                if tx * per + i < n_seqs:
                    first_chunk[tx * per + i] = mine[0]
                    mine[0] = mine[0] + T.ceildiv(bounds[tx * per + i + 1] - bounds[tx * per + i], C)
            if tx == P - 1:
                first_chunk[n_seqs] = scan_s[P - 1]
            T.sync_threads()
            # row r: its sequence (how many of first_chunk[1 .. N] are <= r: a binary search), then
            # [start, end) of its chunk there, or [total, total) past the real chunks
            for it in T.serial(T.ceildiv(num_rows, P)):
                if it * P + tx < num_rows:
                    lo[0] = 0
                    hi[0] = n_seqs
                    for _ in T.serial(32):
                        if lo[0] < hi[0]:
                            if first_chunk[(lo[0] + hi[0]) // 2 + 1] <= it * P + tx:
                                lo[0] = (lo[0] + hi[0]) // 2 + 1
                            else:
                                hi[0] = (lo[0] + hi[0]) // 2
                    if lo[0] < n_seqs:
                        table[it * P + tx, 0] = bounds[lo[0]] + (it * P + tx - first_chunk[lo[0]]) * C
                        table[it * P + tx, 1] = T.min(
                            bounds[lo[0]] + (it * P + tx - first_chunk[lo[0]] + 1) * C, bounds[lo[0] + 1])
                    else:
                        table[it * P + tx, 0] = total
                        table[it * P + tx, 1] = total

    return chunk_table_build


@cache_once
def _table_compiled(chunk_size: int):
    from flashqla.hopper import compile_hopper

    return compile_hopper(_table_kernel(chunk_size))


def table_kernel_source(chunk_size: int = 64) -> str:
    """The CUDA C++ generated for the table kernel (sm_90a; no GPU needed)."""
    return _table_compiled(chunk_size).get_kernel_source()


def _build_chunk_table_torch(cu_seqlens, batch, seqlen, chunk_size, device):
    bounds = seq_bounds(cu_seqlens, batch, seqlen, device).long()
    total = batch * seqlen
    n_seqs = bounds.shape[0] - 1
    n_chunks = (bounds[1:] - bounds[:-1] + chunk_size - 1) // chunk_size      # per sequence
    first_chunk = torch.cat([n_chunks.new_zeros(1), n_chunks.cumsum(0)])      # [N + 1]
    rows = torch.arange(num_chunk_rows(cu_seqlens, batch, seqlen, chunk_size), device=device)
    seq = torch.searchsorted(first_chunk[1:], rows, right=True)               # N past the end
    seq_c = seq.clamp(max=max(n_seqs - 1, 0))
    start = bounds[seq_c] + (rows - first_chunk[seq_c]) * chunk_size
    end = torch.minimum(start + chunk_size, bounds[seq_c + 1])
    real = seq < n_seqs
    table = torch.stack([torch.where(real, start, total), torch.where(real, end, total)], 1)
    return table.to(torch.int32), first_chunk.to(torch.int32)
