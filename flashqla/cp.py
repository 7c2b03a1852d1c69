"""Context parallelism across GPUs: the packed tokens sharded over the ranks of a torch.distributed
group, a sequence free to span ranks, forward and backward exact.

Build a context once per ``cu_seqlens`` (FLA 0.6.0's ``fla.ops.cp.build_cp_context``) and pass it:

    ctx = flashqla.cp.build_cp_context(cu_seqlens, group)           # the global bounds, every rank
    o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=ctx)   # this rank's shard

The math. A sequence's recurrence over any span of its tokens is affine in the state entering it:
the state leaving the span is M h + Z, with M (K x K per value head) the product over the span's
tokens of exp(g_t) (I - beta_t k_t k_t^T) (``reference.sequence_transition``) and Z the state
leaving it from h = 0. Cut the T packed tokens into P equal slots (P = world size, or 2 x world
size zigzag). A sequence over slots s0 < ... < s1 has a piece in each; with Z_s the state leaving
its piece of slot s from zero (from the sequence's initial state on s0) and M_s that piece's
transition, the state entering its piece of slot s > s0 is the scan

    h_{s0 + 1} = Z_{s0},   h_{s + 1} = M_s h_s + Z_s

and each rank's output is its local forward from those states. Backward, with dZ_s the gradient
of the state entering the piece of slot s from that slot's own do (and dht on s1), linear in
them and free of the states, the gradient of the state leaving the piece of slot s < s1 is

    dh_{s1 - 1} = dZ_{s1},   dh_{s - 1} = M_s^T dh_s + dZ_s

and the local backward with it as that piece's dht gives every gradient of the shard. Only the
slots a sequence fills end to end (s0 < s < s1, "spanning") need M: Z_{s0} starts the scan and
dZ_{s1} the reverse one.

Per call and rank, forward: (1) the boundary pass: for the last piece of each held slot whose
sequence goes on to a later slot, its Z and, when it spans its slot, its M; (2) one all_gather
of those (Z, M) pairs; (3) the scan for the first piece of each held slot that continues a
sequence; (4) the local forward from the true initial states. The backward mirrors it: dZ of
each continuing first piece, an all_gather, the reverse scan, the local backward. The scans run
in slot order, the same on every rank, so no result depends on timing; in float64 every output
and gradient matched a single-process run to at most 3e-15 relative (``tests/test_cp.py``, 2 and
4 gloo ranks). Exchanged per direction and rank: held slots x HV x K x (V + K) numbers in one
all_gather, 8.4 MB a slot at (HV, K, V) = (64, 128, 128) in float32.

What runs. Every local pass is the chunked PyTorch reference in float32 (float64 for float64
inputs) on the inputs' device, on any world size (1 included), over gloo or NCCL; the kernels do
not run context parallelism (``FLASHQLA_BACKEND=kernels`` raises, auto warns once). The call
copies nothing from the device to the host: the context holds the bounds. Under torch.compile
the call runs eagerly (a graph break). A warm-up variant (AutoCP's idea across ranks) would
replace the scan, for heads whose log decay over the tail of the previous slot reaches a
threshold, by that tail run from zero (wrong by at most exp(threshold) times the state's norm
where the tail starts): those heads would need no M and no chain through more than one slot,
and g = 0 heads would keep the exact scan.

Layouts (FLA's). ``contiguous``: rank r holds slot r, tokens [r L, (r + 1) L), L = T / world
size. ``zigzag``: rank r holds slots r and 2 W - 1 - r, L = T / (2 W), concatenated [front;
back] (balanced causal work for attention layers sharing the split). T must be a multiple of
the slot count.

Per-sequence tensors stay global, [N, HV, K, V] for the N sequences of ``cu_seqlens``, like a
replicated parameter: ``initial_state`` is the same on every rank and read by the rank holding a
sequence's first token; the final state on a rank holds the rows of the sequences whose last
token it holds and zeros elsewhere (an all_reduce gives each rank all rows); the gradient of
``initial_state`` on a rank holds the rows of the sequences that start there (summed over ranks,
as DDP does for a replicated tensor, it is the single-process gradient). An empty sequence
belongs to the rank whose slot holds its position. q, k, v, g, beta and their gradients are the
rank's shard, [1, L x held slots, ...].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from flashqla import checks, reference
from flashqla.nvtx import nvtx_range

LAYOUTS = ("contiguous", "zigzag")
_INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Piece:
    """The tokens [start, end) of the local buffer that belong to global sequence ``seq``, within
    slot ``slot``; the sequence's first token lies in slot ``first_slot``, its last in ``last_slot``."""

    seq: int
    start: int
    end: int
    slot: int
    first_slot: int
    last_slot: int

    @property
    def incoming(self) -> bool:
        """The sequence began on an earlier slot: the true initial state comes from the scan."""
        return self.first_slot < self.slot

    @property
    def outgoing(self) -> bool:
        """The sequence goes on to a later slot: its dht comes from the reverse scan."""
        return self.last_slot > self.slot

    @property
    def spanning(self) -> bool:
        return self.incoming and self.outgoing


@dataclass(frozen=True, eq=False)
class CPContext:
    """What one rank needs for one ``cu_seqlens``, host integers included (``build_cp_context``).

    ``cu_seqlens`` and ``cu_seqlens_cpu`` are the local bounds (FLA's): the pieces of the held
    slots, back to back; ``pieces`` the same with their global sequences; ``empty`` the global
    indices of the empty sequences this rank owns."""

    group: object
    world_size: int
    rank: int
    layout: str
    part_len: int
    num_seqs: int
    slots: tuple[int, ...]
    pieces: tuple[Piece, ...]
    empty: tuple[int, ...]
    cu_seqlens: Tensor
    cu_seqlens_cpu: Tensor

    @property
    def num_tokens(self) -> int:
        """Tokens of the local shard."""
        return self.part_len * len(self.slots)

    def rows(self, end: str) -> tuple[list[int], list[int]]:
        """(local piece indices, their global sequences) of the pieces where their sequence
        starts (``end`` "first") or ends ("last")."""
        rows = [(p, piece.seq) for p, piece in enumerate(self.pieces)
                if not (piece.incoming if end == "first" else piece.outgoing)]
        return [p for p, _ in rows], [n for _, n in rows]

    def place(self, slot: int) -> tuple[int, int]:
        """(rank, index among its held slots) of ``slot``."""
        if self.layout == "contiguous" or slot < self.world_size:
            return slot, 0
        return 2 * self.world_size - 1 - slot, 1


def _fail(name: str, expected: str, got) -> None:
    checks.fail("build_cp_context", name, expected, got)


def _group(group) -> tuple[object, int, int]:
    """(group, world size, rank); no group and no initialized torch.distributed is one rank."""
    initialized = dist.is_available() and dist.is_initialized()
    if group is None and not initialized:
        return None, 1, 0
    if not initialized:
        _fail("group", "None unless torch.distributed is initialized", type(group).__name__)
    group = dist.group.WORLD if group is None else group
    rank = dist.get_rank(group)
    if rank < 0:
        _fail("group", "a process group that this process belongs to", "a group without it")
    return group, dist.get_world_size(group), rank


def build_cp_context(cu_seqlens: Tensor, group=None, *, cu_seqlens_cpu: Tensor | None = None,
                     layout: str = "contiguous") -> CPContext:
    """The context of this rank for the global ``cu_seqlens`` (int32/int64 [N + 1], from 0 to
    the total T, the same on every rank): FLA 0.6.0's ``build_cp_context`` with its keywords
    ``cu_seqlens_cpu`` (the host copy, then nothing is read from the device) and ``layout``
    (``contiguous`` or ``zigzag``, module docstring). ``group`` is a torch.distributed process
    group, the default group when None, or one rank when torch.distributed is not initialized.
    FLA's ``conv1d_kernel_size`` has no use here (no convolution) and is not taken. Reads
    ``cu_seqlens`` on the host once (none with ``cu_seqlens_cpu``)."""
    if layout not in LAYOUTS:
        _fail("layout", " or ".join(repr(x) for x in LAYOUTS), repr(layout))
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dtype not in _INT_DTYPES:
        _fail("cu_seqlens", "an int32 or int64 tensor",
              getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__))
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        _fail("cu_seqlens", "1-D with at least 2 entries [0, ..., T]", f"shape {tuple(cu_seqlens.shape)}")
    name = "cu_seqlens"
    if cu_seqlens_cpu is not None:
        x = cu_seqlens_cpu
        if (not isinstance(x, Tensor) or x.dtype not in _INT_DTYPES or x.shape != cu_seqlens.shape
                or x.device.type != "cpu"):
            _fail("cu_seqlens_cpu", f"an int32 or int64 CPU tensor of cu_seqlens's shape "
                  f"{tuple(cu_seqlens.shape)}",
                  f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, Tensor) else type(x).__name__)
        name = "cu_seqlens_cpu"
    bounds = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
    checks.check_bound_values("build_cp_context", name, bounds, bounds[-1])
    group, world, rank = _group(group)
    num_slots = world * (2 if layout == "zigzag" else 1)
    T = bounds[-1]
    if T == 0 or T % num_slots:
        _fail(name, f"ending at a positive multiple of {num_slots} tokens (the {layout} layout cuts "
              f"{world} rank(s) into {num_slots} equal slots)", f"T = {T}")
    L = T // num_slots
    slots = (rank,) if layout == "contiguous" else (rank, 2 * world - 1 - rank)
    pieces, local = [], [0]
    for i, s in enumerate(slots):
        lo, hi = s * L, (s + 1) * L
        for n in range(len(bounds) - 1):
            a, b = max(bounds[n], lo), min(bounds[n + 1], hi)
            if a < b:  # local offsets: slot i of the held ones starts at i L
                pieces.append(Piece(n, a - lo + i * L, b - lo + i * L, s, bounds[n] // L,
                                    (bounds[n + 1] - 1) // L))
                local.append(b - lo + i * L)
    empty = tuple(n for n in range(len(bounds) - 1)
                  if bounds[n] == bounds[n + 1] and min(bounds[n] // L, num_slots - 1) in slots)
    cu_cpu = torch.tensor(local, dtype=cu_seqlens.dtype)
    return CPContext(group, world, rank, layout, L, len(bounds) - 1, slots, tuple(pieces), empty,
                     cu_cpu.to(cu_seqlens.device), cu_cpu)


def check_context(ctx, cu_seqlens, cu_seqlens_cpu) -> None:
    """``chunk_gated_delta_rule(..., cp_context=ctx)``: ctx is this rank's context, and cu_seqlens
    and cu_seqlens_cpu are None or its own (a ValueError naming the argument)."""
    fn = "chunk_gated_delta_rule"
    if not isinstance(ctx, CPContext):
        checks.fail(fn, "cp_context", "None or a context from flashqla.cp.build_cp_context",
                    type(ctx).__name__)
    rank = ctx.rank if ctx.group is None else dist.get_rank(ctx.group)
    if rank != ctx.rank:
        checks.fail(fn, "cp_context", f"built by this rank ({rank})", f"rank {ctx.rank}'s")
    for name, x, own in (("cu_seqlens", cu_seqlens, ctx.cu_seqlens),
                         ("cu_seqlens_cpu", cu_seqlens_cpu, ctx.cu_seqlens_cpu)):
        if x is not None and x is not own:
            checks.fail(fn, name, f"None or cp_context.{name} with cp_context (the local bounds)",
                        "another tensor")


def check_shard(ctx: CPContext, q: Tensor, v: Tensor, initial_state: Tensor | None, state_v_first: bool,
                dtypes) -> None:
    """After the api's checks of q, k, v, g, beta: q holds this rank's tokens, and initial_state
    has a row per global sequence (a ValueError naming the argument)."""
    fn = "chunk_gated_delta_rule"
    if q.shape[1] != ctx.num_tokens:
        checks.fail(fn, "q", f"this rank's shard [1, {ctx.num_tokens}, H, K] with cp_context "
                    f"({len(ctx.slots)} slot(s) of {ctx.part_len} tokens)", f"shape {tuple(q.shape)}")
    if initial_state is None:
        return
    checks.check_tensor(fn, "initial_state", initial_state, 4, dtypes)
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    want = (ctx.num_seqs, HV, V, K) if state_v_first else (ctx.num_seqs, HV, K, V)
    if tuple(initial_state.shape) != want:
        checks.fail(fn, "initial_state", f"{want} with cp_context: one row per sequence of the "
                    "global cu_seqlens, the same on every rank", f"shape {tuple(initial_state.shape)}")
    if initial_state.device != q.device:
        checks.fail(fn, "initial_state", f"on q's device {q.device}", initial_state.device)


# ---- the scans over slots, in slot order

def fold_states(pairs: list[tuple[Tensor, Tensor]]) -> Tensor:
    """The state entering a slot from the (Z, M) of the slots before it, first to last:
    h <- M h + Z from h = 0."""
    h = torch.zeros_like(pairs[0][0])
    for z, m in pairs:
        h = m @ h + z
    return h


def fold_state_grads(pairs: list[tuple[Tensor, Tensor]]) -> Tensor:
    """The gradient of the state leaving a slot from the (dZ, M) of the slots after it, first to
    last: dh <- M^T dh + dZ from the last one back, dh = 0."""
    dh = torch.zeros_like(pairs[0][0])
    for dz, m in reversed(pairs):
        dh = m.mT @ dh + dz
    return dh


def _all_gather(x: Tensor, ctx: CPContext) -> Tensor:
    """[held slots, ...] from every rank -> [world size, held slots, ...]."""
    if ctx.world_size == 1:
        return x[None]
    out = [torch.empty_like(x) for _ in range(ctx.world_size)]
    dist.all_gather(out, x.contiguous(), group=ctx.group)
    return torch.stack(out)


def _pairs(got: Tensor, ctx: CPContext, slots, vd: int) -> list[tuple[Tensor, Tensor]]:
    """The exchanged (Z or dZ [HV, K, V], M [HV, K, K]) of ``slots``."""
    return [(got[ctx.place(s)][..., :vd], got[ctx.place(s)][..., vd:]) for s in slots]


def _boundary(x, piece, h0, vd, backward_of=None):
    """One exchanged row for ``piece`` [HV, K, V + K]: its Z (forward) or, with ``backward_of`` =
    (do, dht_local row), its dZ, and its M when it spans its slot (zeros: no slot reads it)."""
    sl = slice(piece.start, piece.end)
    q, k, v, g, beta = (t[:, sl] for t in x[:5])
    scale = x[5]
    if backward_of is None:     # Z: the piece's final state from h0
        _, z = reference.chunk_gated_delta_rule_ref(q, k, v, g, beta, scale, h0, True)
    else:                       # dZ: the gradient of the state entering the piece (its dh0)
        do, dht = backward_of
        z = reference.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do[:, sl], dht, scale, h0)[5]
    m = (reference.sequence_transition(k, g, beta)[0] if piece.spanning
         else z.new_zeros(*z.shape[1:3], z.shape[2]))
    return torch.cat([z[0], m], -1)


def _copy_rows(dst: Tensor, dst_rows: list[int], src: Tensor, src_rows: list[int]) -> None:
    """dst[dst_rows] = src[src_rows] for host row lists: one copy, not one per row."""
    if dst_rows:
        dst[torch.tensor(dst_rows, device=dst.device)] = src[torch.tensor(src_rows, device=src.device)]


def _forward(x, initial_state, ctx):
    """x = (q, k, v, g, beta, scale) in the work dtype, initial_state [N, HV, K, V] or None ->
    (o, final state [N, HV, K, V] with this rank's rows, the true initial state of every piece)."""
    q, v = x[0], x[2]
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    h0 = q.new_zeros(len(ctx.pieces), hv, kd, vd)     # each piece's initial state
    if initial_state is not None:
        pieces, seqs = ctx.rows("first")
        _copy_rows(h0, pieces, initial_state, seqs)
    with nvtx_range("cp.fwd.boundary"):
        send = q.new_zeros(len(ctx.slots), hv, kd, vd + kd)
        for p, piece in enumerate(ctx.pieces):
            if piece.outgoing:
                send[ctx.slots.index(piece.slot)] = _boundary(x, piece, h0[p:p + 1], vd)
    with nvtx_range("cp.fwd.exchange"):
        got = _all_gather(send, ctx)
    for p, piece in enumerate(ctx.pieces):
        if piece.incoming:
            h0[p] = fold_states(_pairs(got, ctx, range(piece.first_slot, piece.slot), vd))
    with nvtx_range("cp.fwd.local"):
        o, ht = reference.chunk_gated_delta_rule_ref(*x, h0, True, ctx.cu_seqlens_cpu)
    final = q.new_zeros(ctx.num_seqs, hv, kd, vd)
    pieces, seqs = ctx.rows("last")
    _copy_rows(final, seqs, ht, pieces)
    if initial_state is not None:                     # an empty sequence's final state is its initial one
        _copy_rows(final, list(ctx.empty), initial_state, list(ctx.empty))
    return o, final, h0


def _backward(x, h0, do, dht, ctx, want_dh0: bool):
    """The gradients of <do, o> + <dht, final state> (dht with this rank's rows): dq, dk, dv, dg,
    dbeta of the shard and dh0 [N, HV, K, V] with the rows of the sequences starting here."""
    q, v = x[0], x[2]
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    dht_local = torch.zeros_like(h0)                  # the gradient of each piece's final state
    pieces, seqs = ctx.rows("last")
    _copy_rows(dht_local, pieces, dht, seqs)
    with nvtx_range("cp.bwd.boundary"):
        send = q.new_zeros(len(ctx.slots), hv, kd, vd + kd)
        for p, piece in enumerate(ctx.pieces):
            if piece.incoming:
                send[ctx.slots.index(piece.slot)] = _boundary(
                    x, piece, h0[p:p + 1], vd, backward_of=(do, dht_local[p:p + 1]))
    with nvtx_range("cp.bwd.exchange"):
        got = _all_gather(send, ctx)
    for p, piece in enumerate(ctx.pieces):
        if piece.outgoing:
            later = range(piece.slot + 1, piece.last_slot + 1)
            dht_local[p] = fold_state_grads(_pairs(got, ctx, later, vd))
    with nvtx_range("cp.bwd.local"):
        *grads, dh0_local = reference.chunk_gated_delta_rule_bwd_ref(
            *x[:5], do, dht_local, x[5], h0, ctx.cu_seqlens_cpu)
    if not want_dh0:
        return (*grads, None)
    dh0 = torch.zeros_like(dht)
    pieces, seqs = ctx.rows("first")
    _copy_rows(dh0, seqs, dh0_local, pieces)
    _copy_rows(dh0, list(ctx.empty), dht, list(ctx.empty))
    return (*grads, dh0)


def _work(q, k, v, g, beta, scale, initial_state):
    """(x = (q, k, v, g, beta, scale), initial_state) in the work dtype: float64 for float64 q,
    float32 otherwise (the api's reference path)."""
    wd = torch.float64 if q.dtype == torch.float64 else torch.float32
    x = (*(t.to(wd) for t in (q, k, v, g, beta)), scale)
    return x, None if initial_state is None else initial_state.to(wd)


class _Function(torch.autograd.Function):
    """Forward and backward each with one all_gather; saves the inputs and the pieces' true
    initial states (the backward recomputes the rest)."""

    @staticmethod
    def forward(autograd_ctx, q, k, v, g, beta, initial_state, scale, ctx):
        o, final, h0 = _forward(*_work(q, k, v, g, beta, scale, initial_state), ctx)
        autograd_ctx.save_for_backward(q, k, v, g, beta, h0)
        autograd_ctx.scale, autograd_ctx.cp, autograd_ctx.h0_dtype = scale, ctx, \
            None if initial_state is None else initial_state.dtype
        return o.to(v.dtype), final

    @staticmethod
    def backward(autograd_ctx, do, dht):
        q, k, v, g, beta, h0 = autograd_ctx.saved_tensors
        x, _ = _work(q, k, v, g, beta, autograd_ctx.scale, None)
        *grads, dh0 = _backward(x, h0, do.to(h0.dtype), dht.to(h0.dtype), autograd_ctx.cp,
                                autograd_ctx.h0_dtype is not None)
        grads = (d.to(t.dtype) for d, t in zip(grads, (q, k, v, g, beta)))
        return (*grads, None if dh0 is None else dh0.to(autograd_ctx.h0_dtype), None, None)


@torch.compiler.disable
def chunk_gated_delta_rule_cp(q, k, v, g, beta, scale: float, initial_state, ctx: CPContext):
    """The checked, preprocessed call of ``chunk_gated_delta_rule(..., cp_context=ctx)`` (the api
    does both): -> (o [1, local T, HV, V] in v's dtype, final state [N, HV, K, V] in the work
    dtype with this rank's rows). Under torch.compile it runs eagerly (a graph break)."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                       for t in (q, k, v, g, beta, initial_state)):
        return _Function.apply(q, k, v, g, beta, initial_state, scale, ctx)
    o, final, _ = _forward(*_work(q, k, v, g, beta, scale, initial_state), ctx)
    return o.to(v.dtype), final
