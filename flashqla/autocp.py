"""AutoCP: long sequences cut into segments that run in parallel on one GPU. The segment plans, and
the rule and phases in PyTorch.

The chain over chunks is the only sequential part of the forward: one chain per (sequence, value
head), so a few heads on one long sequence leave most SMs idle. Cut every sequence into segments
of L chunks; the fused kernel then runs one chain per (segment, head), all at once, as a varlen
problem whose "sequences" are the segments, once every segment's initial state is known
(``flashqla.reference``, section "Context parallelism"):

    exact       h_{j+1} = M_j h_j + Z_j: M_j the product of segment j's chunk transitions (K x K),
                Z_j its final state from zero; a short sequential loop over the segments
    warm-up     h_{j+1} ~ the chain run from zero over the last w chunks of segment j, wrong by
                M_w h_a, at most exp(sum of g over those chunks) ||h_a|| when g_t <= 0 and
                0 <= beta_t ||k_t||^2 <= 2 (normalized keys and beta <= 1 satisfy it)

Per (segment, value head) w is the number of chunks, counted back from the segment start, until
the cumulative log decay falls to ``THRESHOLD`` (FlashQLA's -10: error <= e^-10 ~ 4.5e-5 of the
state where the window starts). Heads that do not reach it within the previous segment or
MAX_WARMUP_CHUNKS (g = 0 heads, nearly non-decaying ones) take the exact path, as do heads whose
previous segment has a token breaking the bound's conditions (unnormalized keys, beta > 1, g > 0):
that fallback is decided on the device, per (segment, head), so nothing is assumed about the
caller.

What is where. ``flashqla.fwd`` decides the split (its own ``segment_chunks``) and runs the phases
as kernels; it takes from here the plan (``host_plan`` from lengths the host knows, ``plan`` built
on the device inside a CUDA-graph capture that has none kept, ``slot_chunks``), THRESHOLD,
MIN_SEGMENT_CHUNKS and MAX_WARMUP_CHUNKS. ``flashqla.bwd`` does the same for the backward (its own
``segment_chunks``, the forward's plan and phases for the states, ``backward_windows`` below as a
kernel for the state gradients). ``segment_chunks`` below (the rule of the AutoCP stages
gdn_fwd.s06 to s15), ``bound_violations``, ``warmup`` and ``segment_initial_states`` are the rule
and the phases in PyTorch that the AutoCP stages build with and are tested against.

A plan is a pure function of host integers (tokens, sequences, heads, SM count) and device tensors;
``plan`` reads no device value on the host, so a forward using it can be captured in a CUDA graph,
and the same inputs give the same plan every time. The number of segments depends on the lengths,
which live on the device, so, like ``flashqla.varlen``'s chunk table, the segment table has a
host-known number of rows (an upper bound) and its rows past the real segments are empty, [T, T).

Segments are numbered two ways. ``bounds`` lists them packed in token order (segment rows, what the
fused kernel reads as cu_seqlens). The warm-up and the chaining work on slots j * N + n, "segment j
of sequence n", J slots per sequence (J a host-known bound), so that chaining step j reads
contiguous memory; slots past a sequence's last segment do nothing. Segments start on chunk
boundaries of their sequence (all but a sequence's last have L x 64 tokens), so a segment's chunks
are consecutive rows of ``flashqla.varlen.chunk_table`` for the whole sequences: ``first_chunk``
gives the first, for kernels that read per-chunk data computed before the split (the solve's
``gated`` flags, which the fused kernel reads).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from dataclasses import dataclass

import torch

from flashqla.caches import stream_key
from flashqla.varlen import capturing, seq_bounds

THRESHOLD = -10.0          # cumulative log decay at which a warm-up window is long enough
MIN_SEGMENT_CHUNKS = 8     # shortest segment (512 tokens): shorter ones cost more to start than they save
MAX_SEGMENTS = 32          # most segments per sequence: the length of the sequential chaining loop
MAX_WARMUP_CHUNKS = 64     # longest warm-up (4096 tokens, |g| >= 0.0025 a token); beyond it: exact
MIN_SEGMENTS = 3           # fewest segments of an automatic split: two lost (see segment_chunks)
MIN_SAVED_CHUNKS = 100     # fixed device cost of the plan, phase 1's start and the chaining, in
                           # chunk steps of the fused kernel (s07's): CP must save more than that.
                           # Between the model's 80 on (2, 8) 1 x 8192, where CP lost (0.96x), and
                           # its 128 on (4, 16) and (16, 16) 1 x 32768, where it won (1.05-1.14x)
WARMUP_STEPS = 2           # phase 1's cost per chunk of a segment, in chunk steps of the fused
                           # kernel; fitted with s07's as the chain (segment_chunks' docstring), not
                           # refitted to s10's, the promoted chain (forward 1.05-1.13x s07's): with
                           # it the split of (16, 16) 1 x 32768 lost (s11, 0.97x s10)
NARROW_STEP = 0.77         # a chunk step of gdn_fwd.s12's chain at BV 32, in its steps at BV 64: s12
                           # against s10 (no split either) on the single sequences of (2, 8), (4, 16),
                           # (16, 16) x 32768 tokens took 0.76-0.79x the time (4 x H200, 4e37c66)
CHUNK_SIZE = 64


def segment_chunks(num_tokens: int, num_seqs: int, max_seq_tokens: int, num_heads: int,
                   num_sms: int, ctas_per_head: int, force: bool | int | None = None,
                   unsplit_step: float = 1.0) -> int:
    """The decision rule: chunks per segment L, or 0 for no split. Host integers only.

    Without CP the chain kernel runs lanes = num_heads x ctas_per_head CTAs per sequence, each as
    long as its sequence; the longest (max_seq_tokens, a bound for varlen) sets the time. With
    segments of L chunks there are at most chunks / L + num_seqs of them (one partial segment per
    sequence), and they all run in one wave when lanes (chunks / L + num_seqs) <= SMs: L is the
    smallest such length, but at least MIN_SEGMENT_CHUNKS and 1 / MAX_SEGMENTS of the longest
    sequence, then evened out over the J segments of the longest sequence. Cost model, in chunk
    steps of the fused kernel: phase 3 takes L, phase 1 WARMUP_STEPS L (the g = 0 heads' window is
    the whole previous segment, walked with K extra state columns, the transition M, after
    chunk_fwd_intra's w and u), plus a fixed cost of MIN_SAVED_CHUNKS; without CP, the longest
    sequence's chunks. Automatic (``force`` None): split when J >= MIN_SEGMENTS = 3 and
    longest - (1 + WARMUP_STEPS) L >= MIN_SAVED_CHUNKS.

    The constants, from the committed runs (H200, CUDA-graph replay; the bench's heads include
    g = 0 heads, so phase 1 is at its longest). ``profiles/results/autocp.csv``, (2, 8), s03's
    kernel as the chain: s03 alone takes 0.20 ms + 4.03 us a chunk, s06 with L = 16, 32, 64, 128
    takes 0.20 ms + (2.2 L + 33 to 47) steps, so phase 1 costs 1.2 steps of s03's chain a chunk
    and the fixed cost is about 40 steps. s07's chain takes a step in 1 / 1.77 of s03's time
    (``gdn_fwd.csv``, (16, 64) 1 x 32768), so phase 1, the same kernel, costs about 2 of its steps.
    Every split the committed runs timed agrees with this rule: on (16, 16) s08 (s07's chain)
    against s07 gained 1.04x on 1 x 32768, which it splits, and lost 0.81x on 1 x 8192 and on
    28672 + 4096, which it no longer splits (nor does it those on s05's chain, where s06 lost
    0.85x and 0.94x; it gained 1.15x on 1 x 32768); autocp.csv's forced splits on (2, 8) won from
    4096 tokens and lost at 2048 (tests/test_autocp.py checks all of them against the CSVs). Two
    segments lose: on (16, 32) 1 x 32768 (s05's chain, ``gdn_fwd.csv`` at commit 9ef1cd8) they took
    2.46 ms against 2.12 without CP. The rerun at commit 3198fc1 (2 x H200) added (2, 8) and
    (4, 16): CP won on (2, 8) 1 x 32768 and 28672 + 4096 (1.52-1.95x), (4, 16) 1 x 32768 (1.14x on
    s07's chain, 1.30x on s05's) and again (16, 16) 1 x 32768 (1.05x), and lost on (2, 8) 1 x 8192
    (0.96x on s07's chain, 0.97x on s05's): with the s07-family chains the fixed cost is more than the
    40 s03 steps above (40 of s03's are ~71 of s07's), so MIN_SAVED_CHUNKS is 100, between the
    model's savings of the losing case (80) and the winning ones (128 and more). autocp.csv's forced
    splits of 4096 and 8192 tokens won with s03's slower chain; with s07's they do not.

    ``unsplit_step``: a chunk step of the launch without CP in the split's steps; NARROW_STEP where
    that launch runs narrower CTAs than the split's (gdn_fwd.s13: BV 32 on one wave, the segments
    at BV 64), which makes the split's saving smaller. Without it, s12's BV 32 on (4, 16) and
    (16, 16) 1 x 32768 would be split as at BV 64, where the unsplit BV 32 launch is faster (s12
    1.08 and 1.10 ms against s11's split 1.28 and 1.43; 4 x H200, 4e37c66).

    ``force``: False never splits, True splits with this L even when J = 1, an int is L itself.
    (Eager calls add about 1.4 ms of host time that this does not count.)
    """
    if force is False or num_tokens == 0:
        return 0
    if not isinstance(force, bool) and isinstance(force, int):
        if force < 1:
            raise ValueError(f"autocp: `force` as segment length must be >= 1 chunk; got {force}")
        return force
    chunks = -(-num_tokens // CHUNK_SIZE)
    longest = -(-max_seq_tokens // CHUNK_SIZE)
    lanes = num_heads * ctas_per_head
    free = num_sms - lanes * num_seqs                  # SMs that idle without CP
    fit = -(-lanes * chunks // free) if free > 0 else longest
    L = max(MIN_SEGMENT_CHUNKS, -(-longest // MAX_SEGMENTS), fit)
    J = -(-longest // L)
    L = -(-longest // J)                               # J segments of (nearly) equal length
    if force is None and (J < MIN_SEGMENTS
                          or unsplit_step * longest - (1 + WARMUP_STEPS) * L < MIN_SAVED_CHUNKS):
        return 0
    return L


@dataclass(frozen=True)
class Plan:
    """Where the segments are. S = segment rows (a bound), J = slots per sequence, N = sequences."""

    segment_chunks: int         # L: chunks per segment (the last one of a sequence may be shorter)
    num_seqs: int               # N
    max_segments: int           # J: segments of the longest possible sequence
    bounds: torch.Tensor        # int32 [S + 1]: the segments as cu_seqlens; rows past the last real one [T, T)
    slot_of_segment: torch.Tensor  # int64 [S]: slot j * N + n of each segment row (0 for empty rows)
    last_segment: torch.Tensor  # int64 [N]: row of each sequence's last segment (an empty sequence has one)
    slot_start: torch.Tensor    # int32 [J * N]: first token of segment j of sequence n (its end if none)
    slot_warm: torch.Tensor     # bool [J * N]: segment j >= 1 exists, so segment j - 1 has L full chunks
    first_chunk: torch.Tensor   # int32 [S + 1]: chunk_table row of each segment row's first chunk (the
                                # sequence's first row + j L); the real chunk count past the real rows
    slot_chunk: torch.Tensor | None = None  # int32 [J * N]: chunk_table row of the chunk at each
                                # slot's start (``slot_chunks``); host_plan's plans only
    row_of_slot: torch.Tensor | None = None  # int32 [J * N]: the segment row of slot j * N + n, -1
                                # where sequence n has no segment j (slot_of_segment's inverse)


PLAN_STREAMS = 8  # streams whose last device-built plan is kept
_last_plan: dict = {}  # stream_key -> (key, plan, weakref to cu_seqlens or None)
_last_plan_lock = threading.Lock()


def plan(cu_seqlens: torch.Tensor | None, batch: int, seqlen: int, num_heads: int, num_sms: int,
         ctas_per_head: int, device: torch.device, force: bool | int | None = None,
         unsplit_step: float = 1.0) -> Plan | None:
    """The segment table for inputs [batch, seqlen] (or varlen ``cu_seqlens`` with batch 1), or None
    when ``segment_chunks`` decides not to split (``unsplit_step``: see there). Built on the device;
    each stream's last plan is returned again to calls on that stream for the same, unmodified
    ``cu_seqlens`` tensor, and built anew inside CUDA-graph capture (as
    ``flashqla.varlen.chunk_table``)."""
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    num_tokens = batch * seqlen
    longest = seqlen if cu_seqlens is None else num_tokens
    L = segment_chunks(num_tokens, num_seqs, longest, num_heads, num_sms, ctas_per_head, force,
                       unsplit_step)
    if not L or num_seqs == 0:
        return None
    if capturing(device):
        return _build_plan(cu_seqlens, batch, seqlen, L, device)  # the graph owns what it reads
    key = (None if cu_seqlens is None else (id(cu_seqlens), cu_seqlens._version),
           batch, seqlen, L, str(device))
    stream = stream_key(device)
    with _last_plan_lock:
        hit = _last_plan.get(stream)
    if hit is not None and hit[0] == key and (cu_seqlens is None or hit[2]() is cu_seqlens):
        return hit[1]
    value = _build_plan(cu_seqlens, batch, seqlen, L, device)
    with _last_plan_lock:
        _last_plan.pop(stream, None)
        _last_plan[stream] = (key, value, None if cu_seqlens is None else weakref.ref(cu_seqlens))
        while len(_last_plan) > PLAN_STREAMS:
            del _last_plan[next(iter(_last_plan))]
    return value


HOST_PLAN_CACHE = 8    # plans of host-known lengths kept for eager calls (graph-held ones: always)
_host_plans: dict = {}  # (bounds, L, device) -> (plan, stream_keys it was handed to)
_graph_plans: list = []
_host_plans_lock = threading.Lock()


def host_plan(bounds: list[int], L: int, device: torch.device) -> Plan | None:
    """The plan of sequences whose ``bounds`` (the values of cu_seqlens) the host knows, with L
    chunks a segment: built on the host by ``_build_plan`` and copied to ``device`` once (a
    blocking copy: complete before any stream reads it), then kept for the same (bounds, L), and
    marked in use by each stream it is handed to (``flashqla.caches``). Inside CUDA-graph capture
    a copy is not allowed: the kept plan is handed to the graph, and from then on kept for the
    process's life (the graph reads it at every replay), or None when there is none (the caller
    then builds one on the device, ``plan``)."""
    key = (tuple(bounds), L, str(torch.device(device)))
    with _host_plans_lock:
        hit = _host_plans.get(key)
        if capturing(device):
            if hit is not None and all(hit[0] is not v for v in _graph_plans):
                _graph_plans.append(hit[0])
            return None if hit is None else hit[0]
        if hit is None:
            cu = torch.tensor(bounds, dtype=torch.int64)
            built = _build_plan(cu, 1, bounds[-1], L, "cpu",
                                longest=max((e - b for b, e in zip(bounds, bounds[1:])), default=0))
            built = dataclasses.replace(built, slot_chunk=slot_chunks(cu, 1, bounds[-1], L, built.max_segments, "cpu"))
            value = Plan(**{f: (x.to(device) if torch.is_tensor(x) else x) for f, x in vars(built).items()})
            hit = _host_plans[key] = (value, {stream_key(device)})
            while len(_host_plans) > HOST_PLAN_CACHE:
                del _host_plans[next(iter(_host_plans))]  # the oldest (a graph's stays in _graph_plans)
        value, streams = hit
        stream = stream_key(device)
        if stream not in streams:  # another stream reads it: its memory waits for that stream's work
            streams.add(stream)
            current = torch.cuda.current_stream(device)
            for x in vars(value).values():
                if torch.is_tensor(x):
                    x.record_stream(current)
    return value


def slot_chunks(cu_seqlens, batch: int, seqlen: int, L: int, J: int, device) -> torch.Tensor:
    """int32 [J * N]: the ``flashqla.varlen.chunk_table`` row of the chunk where slot j * N + n
    starts, the sequence's first row + j L (a warm-up window's chunks are the rows before it)."""
    seq_row0 = _first_rows(seq_bounds(cu_seqlens, batch, seqlen, device).long())[:-1]
    return (seq_row0[None, :] + L * torch.arange(J, device=seq_row0.device)[:, None]).reshape(-1).to(torch.int32)


def _first_rows(seqs: torch.Tensor) -> torch.Tensor:
    """[N + 1]: each sequence's first row of ``flashqla.varlen.chunk_table`` (sequence by sequence,
    ceil(len / 64) each), then the rows in all, from the sequence bounds ``seqs`` [N + 1]."""
    seq_rows = ((seqs[1:] - seqs[:-1] + CHUNK_SIZE - 1) // CHUNK_SIZE).cumsum(0)
    return torch.cat([seq_rows.new_zeros(1), seq_rows])


def _build_plan(cu_seqlens, batch, seqlen, L, device, longest: int | None = None) -> Plan:
    """``plan``'s tables; ``longest``: the longest sequence where the caller knows it (J from it),
    else seqlen (a batch) or all the tokens (varlen, a bound)."""
    seqs = seq_bounds(cu_seqlens, batch, seqlen, device).long()     # [N + 1]
    N, T, span = seqs.shape[0] - 1, batch * seqlen, CHUNK_SIZE * L
    if longest is None:
        longest = seqlen if cu_seqlens is None else T
    J = max(1, -(-longest // span))
    # rows: sum over sequences of max(1, ceil(len / span)) <= floor(T / span) + N
    rows = N * J if cu_seqlens is None else T // span + N
    count = ((seqs[1:] - seqs[:-1] + span - 1) // span).clamp(min=1)  # segments of each sequence
    first = torch.cat([count.new_zeros(1), count.cumsum(0)])        # [N + 1] first row of each
    r = torch.arange(rows, device=device)
    seq = torch.searchsorted(first[1:], r, right=True)              # N past the real rows
    real = seq < N
    seq_c = seq.clamp(max=N - 1)
    j = r - first[seq_c]
    start = torch.where(real, torch.minimum(seqs[seq_c] + span * j, seqs[seq_c + 1]), T)
    bounds = torch.cat([start, torch.full((1,), T, dtype=start.dtype, device=device)])
    jj = torch.arange(J, device=device)[:, None]                    # slots [J, N]
    slot_start = torch.minimum(seqs[None, :-1] + span * jj, seqs[None, 1:])
    slot_warm = (jj >= 1) & (jj < count[None])
    # chunk rows as flashqla.varlen.chunk_table numbers them: sequence by sequence, ceil(len / 64) each
    seq_row0 = _first_rows(seqs)                                            # [N + 1]
    first_chunk = torch.cat([torch.where(real, seq_row0[seq_c] + L * j, seq_row0[N]), seq_row0[N:]])
    # slot_of_segment's inverse, scattered without a sync: rows past the real ones go to a spare slot
    row_of_slot = torch.full((J * N + 1,), -1, dtype=torch.int32, device=device)
    row_of_slot.scatter_(0, torch.where(real, j * N + seq_c, J * N), r.to(torch.int32))
    return Plan(L, N, J, bounds.to(torch.int32), torch.where(real, j * N + seq_c, 0),
                first[1:] - 1, slot_start.reshape(-1).to(torch.int32), slot_warm.reshape(-1),
                first_chunk.to(torch.int32), row_of_slot=row_of_slot[:-1])


def bound_violations(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """k [B, T, H, K], g, beta [B, T, HV] -> int32 [HV B T + 1]: exclusive prefix counts, over the
    tokens of value head 0, then head 1, ..., of the tokens where the warm-up bound's conditions
    fail (g_t > 0, beta_t ||k_t||^2 outside [0, 2], or NaN). One flat integer scan: fast and
    deterministic (a scan along the token axis of [B T, HV] walks the tokens one at a time,
    milliseconds at 65536 tokens)."""
    B, T, H, _ = k.shape
    HV = g.shape[2]
    kk = torch.linalg.vector_norm(k.reshape(B * T, H, -1), dim=-1,
                                  dtype=torch.promote_types(k.dtype, torch.float32)).square()
    kk = kk.t()[:, None, :].expand(H, HV // H, B * T).reshape(HV, B * T)  # value head i: key head i // (HV // H)
    step = beta.reshape(B * T, HV).t() * kk
    ok = (g.reshape(B * T, HV).t() <= 0) & (step >= 0) & (step <= 2)  # NaN compares False: not ok
    bad = (~ok).to(torch.int32).reshape(-1).cumsum(0, dtype=torch.int32)
    return torch.cat([bad.new_zeros(1), bad])


def warmup(p: Plan, g_cum: torch.Tensor, violations: torch.Tensor, threshold: float = THRESHOLD):
    """Per slot and value head: (window start int32 [J N, HV], exact int32 [J N, HV], warm-up
    chunks int32 [J N, HV]).

    g_cum [B T, HV] is the chunk-local cumulative sum of g, so at a chunk's last token it is the
    chunk's log decay. For segment j >= 1 of a sequence, w is the fewest chunks before its start
    whose log decays sum to <= threshold; exact (window = the whole previous segment, L chunks)
    when no w <= min(L, MAX_WARMUP_CHUNKS) does, or when ``violations`` (``bound_violations``)
    counts a token of the previous segment. Slots without a warm-up (first segments, slots past
    a sequence's end) get an empty window, w = 0. The running sums are a float64 product with a
    triangular matrix of ones (deterministic; torch flags float cumsum on CUDA as not).
    """
    L, W = p.segment_chunks, min(p.segment_chunks, MAX_WARMUP_CHUNKS)
    num_tokens, HV = g_cum.shape
    s = p.slot_start.long()                                         # [J N] segment starts
    back = torch.arange(W, device=s.device)
    last = (s[:, None] - CHUNK_SIZE * back - 1).clamp(min=0)        # last token of the i-th chunk back
    ones = torch.ones(W, W, dtype=torch.float64, device=s.device).triu()
    decay = g_cum[last].transpose(1, 2).double() @ ones             # [J N, HV, W] over the last i + 1 chunks
    short = (decay > threshold).sum(2)                              # chunks that stay above it
    head = num_tokens * torch.arange(HV, device=s.device)
    before = (s - CHUNK_SIZE * L).clamp(min=0)
    bad = violations[s[:, None] + head] - violations[before[:, None] + head] > 0  # [J N, HV]
    warm = p.slot_warm[:, None]
    exact = warm & ((short == W) | bad)
    chunks = torch.where(warm, torch.where(exact, L, short + 1), 0)
    return ((s[:, None] - CHUNK_SIZE * chunks).to(torch.int32), exact.to(torch.int32),
            chunks.to(torch.int32))


def segment_initial_states(p: Plan, h0: torch.Tensor, z: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Phase 2, the chaining: h0 [N, HV, K, V] and the warm-up's Z [J N, HV, K, V], M [J N, HV, K, K]
    (fp32, slot j * N + n) -> the initial state of every segment row, [S, HV, K, V]:
    h_0 = h0 of the sequence, h_j = Z_j + M_j h_{j-1}, one batched matmul per step j over all
    (sequence, head) pairs (warm-up heads have M = 0 and get Z)."""
    N, J = p.num_seqs, p.max_segments
    HV, K, V = h0.shape[1:]
    hs = torch.empty(J, N * HV, K, V, dtype=h0.dtype, device=h0.device)
    hs[0].copy_(h0.reshape(N * HV, K, V))
    zs, ms = z.view(J, N * HV, K, V), m.view(J, N * HV, K, K)
    for j in range(1, J):
        torch.baddbmm(zs[j], ms[j], hs[j - 1], out=hs[j])
    return hs.view(J * N, HV, K, V).index_select(0, p.slot_of_segment)


def backward_windows(p: Plan, g_cum: torch.Tensor, violations: torch.Tensor,
                     threshold: float = THRESHOLD, has_dht: bool = True):
    """Backward AutoCP's windows, on backward slots: (win_start, win_end, exact int32 [J N, HV],
    dht_row int32 [J N]).

    The backward chains the segments from each sequence's last one back to its first, so its slots
    count from the end: backward slot r N + n (r >= 1) walks segment j = J_n - r of sequence n
    (J_n its segments) in reverse, from zero at ``win_end``, to its first token ``win_start``, and
    gives the gradient of the state leaving segment j - 1; slot r then reads slot r - 1's result
    (a reverse chain over contiguous slots, run by the forward's chain kernel unchanged). The
    window is the fewest chunks from the segment's start whose log decays (g_cum at each chunk's
    last real token) sum to <= threshold, within the segment's real chunks and MAX_WARMUP_CHUNKS,
    wrong by at most exp(that sum) of the true gradient where it ends (``flashqla.reference.
    segment_state_grads``); the whole segment where no such window exists or where ``violations``
    (``bound_violations``) counts a token of the segment. ``exact``: the chain needs the segment's
    transition M_j^T, wherever the walk takes the whole segment (then dZ_j + M_j^T dht_j is exact),
    unless the segment is the sequence's last and there is no dht (``has_dht`` False: the gradient
    leaving it is zero). Slots without a segment to walk (r = 0, r >= J_n) get an empty window at the
    sequence's end. ``dht_row``: the segment row whose dht backward slot r holds, segment J_n - 1 - r
    (-1 for r >= J_n), where the chain writes it. Device ops only: no synchronization."""
    L, N, J = p.segment_chunks, p.num_seqs, p.max_segments
    span, W = CHUNK_SIZE * L, min(p.segment_chunks, MAX_WARMUP_CHUNKS)
    num_tokens, HV = g_cum.shape
    device = g_cum.device
    first_row = p.row_of_slot[:N].long()                             # each sequence's first segment row
    count = p.last_segment - first_row + 1                           # J_n
    bos, eos = p.slot_start[:N].long(), p.bounds.long()[p.last_segment + 1]
    r = torch.arange(J, device=device)[:, None]                      # [J, 1]
    j = count[None] - r                                              # [J, N]: the segment walked
    warm = ((r >= 1) & (j >= 1)).reshape(-1, 1)                      # [J N, 1]
    s = torch.where(warm, (bos + span * j).reshape(-1, 1), eos.repeat(J)[:, None])
    seq_end = eos.repeat(J)[:, None]
    e = torch.minimum(s + span, seq_end)
    real = (e - s + CHUNK_SIZE - 1) // CHUNK_SIZE                    # the segment's chunks
    i = torch.arange(W, device=device)
    last = (torch.minimum(s + CHUNK_SIZE * (i + 1), e) - 1).clamp(min=0)   # [J N, W] chunk i's last token
    ones = torch.ones(W, W, dtype=torch.float64, device=device).triu()
    decay = g_cum[last].transpose(1, 2).double() @ ones              # [J N, HV, W] over chunks 0..i
    w_max = real.clamp(max=W)                                        # [J N, 1]
    short = ((decay > threshold) & (i < w_max[..., None])).sum(2)    # chunks that stay above it
    head = num_tokens * torch.arange(HV, device=device)
    bad = violations[e + head] - violations[s + head] > 0            # [J N, HV]
    whole = warm & ((short == w_max) | bad)
    win_end = torch.where(warm, torch.minimum(s + CHUNK_SIZE * torch.where(whole, real, short + 1), e), s)
    exact = warm & (win_end == e) & ((e < seq_end) | has_dht)
    dht_row = torch.where(r < count, first_row + count - 1 - r, -1).reshape(-1)
    return (s.expand(-1, HV).to(torch.int32), win_end.to(torch.int32), exact.to(torch.int32),
            dht_row.to(torch.int32))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host query, no synchronization)."""
    device = torch.device(device)
    return _num_sms(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
