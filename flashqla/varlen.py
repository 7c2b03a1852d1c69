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

Building the table takes about 20 small launches (~0.3 ms of host time), so the last table is
kept and returned again while the same ``cu_seqlens`` tensor, unmodified, comes back (every GDN
layer of a model step passes the same one), as FLA does with its chunk indices. A table that
came from the cache launches nothing. Inside CUDA-graph capture the table is always built anew, in
the graph: a graph must own the memory it reads, and a cached table is freed when a later call
replaces it.
"""

from __future__ import annotations

import weakref

import torch


def seq_bounds(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int,
               device: torch.device) -> torch.Tensor:
    """int32 [N + 1]: where each sequence starts in the packed tokens, then the total."""
    if cu_seqlens is None:
        return torch.arange(batch + 1, dtype=torch.int32, device=device) * seqlen
    return cu_seqlens.to(device=device, dtype=torch.int32)


def num_chunk_rows(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, chunk_size: int) -> int:
    """NT, the rows of ``chunk_table``: exact for a batch, an upper bound for varlen (no sync)."""
    if cu_seqlens is None:
        return batch * -(-seqlen // chunk_size)
    return seqlen // chunk_size + cu_seqlens.shape[0] - 1


def capturing(device) -> bool:
    """Whether work for ``device`` is being captured into a CUDA graph now: a cached tensor must not
    be handed to the graph then (the graph must own what it reads; the cache frees on replacement)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


_last_table: dict = {}


def chunk_table(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, chunk_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(bounds int32 [NT, 2], first_chunk int32 [N + 1]); see the module docstring."""
    if capturing(device):
        return _build_chunk_table(cu_seqlens, batch, seqlen, chunk_size, device)
    key = (None if cu_seqlens is None else (id(cu_seqlens), cu_seqlens._version),
           batch, seqlen, chunk_size, str(device))
    if _last_table.get("key") == key and (cu_seqlens is None or _last_table["cu"]() is cu_seqlens):
        return _last_table["value"]
    value = _build_chunk_table(cu_seqlens, batch, seqlen, chunk_size, device)
    _last_table.update(key=key, value=value,
                       cu=None if cu_seqlens is None else weakref.ref(cu_seqlens))
    return value


def _build_chunk_table(cu_seqlens, batch, seqlen, chunk_size, device):
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
