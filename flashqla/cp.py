"""Context parallelism across GPUs: the packed tokens sharded over the ranks of a torch.distributed
group, a sequence free to span ranks, forward and backward exact.

Build a context once per ``cu_seqlens`` (FLA 0.6.0's ``fla.ops.cp.build_cp_context``) and pass it:

    ctx = flashqla.cp.build_cp_context(cu_seqlens, group)           # the global bounds, every rank
    o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cp_context=ctx)   # this rank's shard

The math. A sequence's recurrence over any span of its tokens is affine in the state entering it:
the state leaving the span is M h + Z, with M (K x K per value head) the product over the span's
tokens of exp(g_t) (I - beta_t k_t k_t^T) (``reference.sequence_transition``; equally the state
leaving the span from h = I with v = 0) and Z the state
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

Per call and rank, forward: (1) the boundary pass, first on every rank: for the last piece of
each held slot whose sequence goes on to a later slot, its Z (the state leaving that piece alone
from its initial state) and, when it spans its slot, its M (the same with v = 0 from h0 = I: the
state is then M itself, a K x K matrix); (2) one all_gather of those (Z, M) pairs; (3) the scan
for the first piece of each held slot that continues a sequence; (4) the local forward over the
shard (its pieces as varlen sequences) from the true initial states. No rank waits for another's
local pass: every rank's boundary pass needs only its own shard. The backward mirrors it with the
forward's M (saved with the inputs and the pieces' initial states): dZ of each continuing first
piece (the gradient of the state entering it from its own do and dht), an all_gather, the
reverse scan, the local backward with per-piece dht. The scans run in slot order, the same on
every rank, in float32 (float64 for float64 inputs), so no result depends on timing; in float64
every output and gradient matched a single-process run to at most 3e-15 relative
(``tests/test_cp.py``, 2 and 4 gloo ranks).
Exchanged per rank: held slots x HV x K x (V + K) numbers forward, HV x K x V backward, one
all_gather each (8.4 MB and 4.2 MB a slot at (HV, K, V) = (64, 128, 128) in float32).

What runs. The local passes (the boundary ones included) are the only switch between the two
paths, ``LocalPasses``: on an SM90 GPU with bf16 q, k, v and K = V = 128 (``api.use_kernels``,
FLASHQLA_BACKEND read at every call) they are the promoted kernels, ``flashqla.fwd.forward``
(AutoCP deciding the split of each call) and ``flashqla.bwd.backward``, and for the boundary
passes ``fwd.final_state`` and ``bwd.initial_state_grad``: AutoCP forced to split the piece, the
segment states computed as the library's forward and backward compute them, then the fused kernel
over the last segment alone (forward: 5 or 6 kernels for Z, 2 more for M) or the walk over the
first segment alone (backward: 6 or 7 kernels), never the outputs or the chunk-parallel
gradients; a piece too short to split runs the whole library pass. Otherwise
the chunked PyTorch reference in float32 (float64 for float64 inputs) on the inputs' device,
whose final state and dh0 over the piece are exact. Either runs on any world size (1 included),
over gloo or NCCL. The call copies nothing between host and device: the context holds the bounds
on the host and its index tensors and the kernels' int32 bounds on the device, built once, and the
boundary passes' plans come from the pieces' host lengths. Under torch.compile the call runs
eagerly (a graph break).

A warm-up variant (AutoCP's idea across ranks) would replace the scan, for heads whose log decay
over the tail of the previous slot reaches a threshold, by that tail run from zero (wrong by at
most exp(threshold) times the state's norm where the tail starts): those heads would need no M
and no chain through more than one slot, and g = 0 heads would keep the exact scan.

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
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from flashqla import checks
from flashqla.nvtx import nvtx_range
from flashqla.varlen import remember_bounds

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
    indices of the empty sequences this rank owns. Built once on ``cu_seqlens``'s device, so a call
    copies nothing from the host: ``kernel_cu_seqlens`` (the local bounds in int32, the kernels'
    dtype; ``local_bounds`` their host values) and ``index``, int64 row lists: ``first_pieces`` /
    ``first_seqs`` (the pieces where a sequence starts, and those sequences), ``last_pieces`` /
    ``last_seqs`` (where one ends), ``empty``."""

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
    kernel_cu_seqlens: Tensor
    local_bounds: list[int]
    index: dict[str, Tensor]

    @property
    def num_tokens(self) -> int:
        """Tokens of the local shard."""
        return self.part_len * len(self.slots)

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
    cu_dev = cu_cpu.to(cu_seqlens.device)
    rows = {}
    for end, skip in (("first", "incoming"), ("last", "outgoing")):
        kept = [(p, piece.seq) for p, piece in enumerate(pieces) if not getattr(piece, skip)]
        rows[f"{end}_pieces"], rows[f"{end}_seqs"] = [p for p, _ in kept], [n for _, n in kept]
    rows["empty"] = list(empty)
    index = {name: torch.tensor(r, dtype=torch.int64).to(cu_seqlens.device) for name, r in rows.items()}
    return CPContext(group, world, rank, layout, L, len(bounds) - 1, slots, tuple(pieces), empty,
                     cu_dev, cu_cpu, cu_dev if cu_dev.dtype == torch.int32 else cu_dev.to(torch.int32),
                     local, index)


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
    out = x.new_empty(ctx.world_size * x.shape[0], *x.shape[1:])
    dist.all_gather_into_tensor(out, x.contiguous(), group=ctx.group)
    return out.view(ctx.world_size, *x.shape)


def _pairs(z: Tensor, m: Tensor, ctx: CPContext, slots) -> list[tuple[Tensor, Tensor]]:
    """The exchanged (Z or dZ [HV, K, V], M [HV, K, K]) of ``slots``, from [world size, held
    slots, ...] each."""
    return [(z[ctx.place(s)], m[ctx.place(s)]) for s in slots]


def _copy_rows(dst: Tensor, dst_rows: Tensor, src: Tensor, src_rows: Tensor) -> None:
    """dst[dst_rows] = src[src_rows] with the context's index tensors (on cu_seqlens's device, so
    ``.to`` moves nothing where that is the states' device): one copy, no host sync."""
    if dst_rows.numel():
        dst.index_copy_(0, dst_rows.to(dst.device), src.index_select(0, src_rows.to(src.device)))


@dataclass(frozen=True)
class LocalPasses:
    """The functions every local pass calls, the only difference between the kernel path and the
    reference path (the api's ``_kernel_forward`` / ``_reference`` and their backwards, and the
    boundary passes over one piece [1, T, ...]):

    forward(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens) -> (o, final state)
    backward(q, k, v, g, beta, do, dht, scale, h0, cu_seqlens) -> (dq, dk, dv, dg, dbeta, dh0)
    final_state(q, k, v, g, beta, scale, h0, transition) -> (Z [1, HV, K, V], M [1, HV, K, K]
        with ``transition``, else None)
    initial_state_grad(q, k, v, g, beta, do, dht, scale) -> dZ [1, HV, K, V]

    ``host_bounds``: forward and backward take the local bounds as the host tensor (the
    reference) or as the context's int32 device tensor (the kernels)."""

    forward: Callable
    backward: Callable
    final_state: Callable
    initial_state_grad: Callable
    host_bounds: bool


def _kernel_final_state(q, k, v, g, beta, scale, h0, transition):
    """``flashqla.fwd.final_state`` (a CPU test puts ``_reference_final_state`` here)."""
    from flashqla import api
    fwd, _ = api._kernel_modules()
    with nvtx_range("fwd.final_state"):
        return fwd.final_state(q, k, v, g, beta, scale, h0, transition)


def _kernel_initial_state_grad(q, k, v, g, beta, do, dht, scale):
    """``flashqla.bwd.initial_state_grad`` (a CPU test puts ``_reference_initial_state_grad`` here)."""
    from flashqla import api
    _, bwd = api._kernel_modules()
    with nvtx_range("bwd.initial_state_grad"):
        return bwd.initial_state_grad(q, k, v, g, beta, do, dht, scale)


def _reference_final_state(q, k, v, g, beta, scale, h0, transition):
    """The reference forward's final state over the piece; M: the same with v = 0 from h0 = I."""
    from flashqla import api
    z = api._reference(q, k, v, g, beta, scale, h0, True, None)[1]
    if not transition:
        return z, None
    hv, kd = v.shape[2], q.shape[3]
    eye = torch.eye(kd, dtype=h0.dtype, device=h0.device).expand(1, hv, kd, kd)
    return z, api._reference(q, k, v.new_zeros(*v.shape[:3], kd), g, beta, scale, eye, True, None)[1]


def _reference_initial_state_grad(q, k, v, g, beta, do, dht, scale):
    """The reference backward's dh0 over the piece (which reads no initial state: zeros stand in)."""
    from flashqla import api
    return api._reference_backward(q, k, v, g, beta, do, dht, scale, torch.zeros_like(dht), None)[5]


def local_passes(q: Tensor, v: Tensor, training: bool) -> LocalPasses:
    """The kernels where they run this call (``api.use_kernels``: FLASHQLA_BACKEND and
    ``kernel_unsupported``; in ``training``, ``api.backward_on_kernels``: the backward's kernels
    compile for these heads too), else the reference in float32 (float64 for float64 inputs)."""
    from flashqla import api
    if api.backward_on_kernels(q, v) if training else api.use_kernels(q, v):
        return LocalPasses(api._kernel_forward, api._kernel_backward, _kernel_final_state,
                           _kernel_initial_state_grad, host_bounds=False)
    return LocalPasses(api._reference, api._reference_backward, _reference_final_state,
                       _reference_initial_state_grad, host_bounds=True)


def _bounds(ctx: CPContext, passes: LocalPasses) -> Tensor:
    """The local cu_seqlens the passes take (the kernels' host reads find the context's values)."""
    if passes.host_bounds:
        return ctx.cu_seqlens_cpu
    remember_bounds(ctx.kernel_cu_seqlens, ctx.local_bounds)
    return ctx.kernel_cu_seqlens


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _forward(x, initial_state, ctx, passes):
    """x = (q, k, v, g, beta, scale), initial_state [N, HV, K, V] in the state dtype or None ->
    (o, final state [N, HV, K, V] with this rank's rows, each piece's true initial state, the
    gathered (Z, M) [world size, held slots, HV, K, V + K])."""
    q, k, v, g, beta, scale = x
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    state = dict(dtype=_state_dtype(q), device=q.device)
    cu = _bounds(ctx, passes)
    h0 = torch.zeros(len(ctx.pieces), hv, kd, vd, **state)     # each piece's initial state
    if initial_state is not None:
        _copy_rows(h0, ctx.index["first_pieces"], initial_state, ctx.index["first_seqs"])
    with nvtx_range("cp.fwd.boundary"):
        send = torch.zeros(len(ctx.slots), hv, kd, vd + kd, **state)
        for p, piece in enumerate(ctx.pieces):
            if not piece.outgoing:
                continue
            i, sl = ctx.slots.index(piece.slot), slice(piece.start, piece.end)
            # Z: the piece's final state from its initial state (zero when it continues a
            # sequence); M when it spans its slot: the final state with v = 0 from h0 = I
            z, m = passes.final_state(*(t[:, sl] for t in (q, k, v, g, beta)), scale, h0[p:p + 1],
                                      piece.spanning)
            send[i, ..., :vd] = z[0]
            if m is not None:
                send[i, ..., vd:] = m[0]
    with nvtx_range("cp.fwd.exchange"):
        got = _all_gather(send, ctx)
    for p, piece in enumerate(ctx.pieces):
        if piece.incoming:
            h0[p] = fold_states(_pairs(got[..., :vd], got[..., vd:], ctx, range(piece.first_slot, piece.slot)))
    with nvtx_range("cp.fwd.local"):
        o, ht = passes.forward(*x, h0, True, cu)
    final = torch.zeros(ctx.num_seqs, hv, kd, vd, **state)
    _copy_rows(final, ctx.index["last_seqs"], ht, ctx.index["last_pieces"])
    if initial_state is not None:                     # an empty sequence's final state is its initial one
        _copy_rows(final, ctx.index["empty"], initial_state, ctx.index["empty"])
    return o, final, h0, got


def _backward(x, h0, got, do, dht, ctx, passes, want_dh0: bool):
    """The gradients of <do, o> + <dht, final state> (dht with this rank's rows), from the
    forward's h0 and gathered (Z, M): dq, dk, dv, dg, dbeta of the shard and dh0 [N, HV, K, V]
    with the rows of the sequences starting here."""
    q, k, v, g, beta, scale = x
    hv, kd, vd = v.shape[2], q.shape[3], v.shape[3]
    cu = _bounds(ctx, passes)
    dht_local = torch.zeros_like(h0)                  # the gradient of each piece's final state
    _copy_rows(dht_local, ctx.index["last_pieces"], dht, ctx.index["last_seqs"])
    with nvtx_range("cp.bwd.boundary"):
        send = torch.zeros(len(ctx.slots), hv, kd, vd, dtype=h0.dtype, device=h0.device)
        for p, piece in enumerate(ctx.pieces):
            if not piece.incoming:
                continue
            i, sl = ctx.slots.index(piece.slot), slice(piece.start, piece.end)
            # dZ: the gradient of the state entering the piece from its own do and dht (zero
            # when the sequence goes on)
            send[i] = passes.initial_state_grad(*(t[:, sl] for t in (q, k, v, g, beta, do)),
                                                dht_local[p:p + 1], scale)[0]
    with nvtx_range("cp.bwd.exchange"):
        got_dz = _all_gather(send, ctx)
    for p, piece in enumerate(ctx.pieces):
        if piece.outgoing:
            dht_local[p] = fold_state_grads(_pairs(got_dz, got[..., vd:], ctx,
                                                   range(piece.slot + 1, piece.last_slot + 1)))
    with nvtx_range("cp.bwd.local"):
        *grads, dh0_local = passes.backward(q, k, v, g, beta, do, dht_local, scale, h0, cu)
    if not want_dh0:
        return (*grads, None)
    dh0 = torch.zeros_like(dht)
    _copy_rows(dh0, ctx.index["first_seqs"], dh0_local, ctx.index["first_pieces"])
    _copy_rows(dh0, ctx.index["empty"], dht, ctx.index["empty"])
    return (*grads, dh0)


class _Function(torch.autograd.Function):
    """Forward and backward each with one all_gather; saves the inputs, the pieces' true initial
    states and the gathered (Z, M) (the backward reads M and recomputes the rest)."""

    @staticmethod
    def forward(autograd_ctx, q, k, v, g, beta, initial_state, scale, ctx, passes):
        o, final, h0, got = _forward((q, k, v, g, beta, scale), initial_state, ctx, passes)
        autograd_ctx.save_for_backward(q, k, v, g, beta, h0, got)
        autograd_ctx.scale, autograd_ctx.cp, autograd_ctx.passes = scale, ctx, passes
        autograd_ctx.h0_dtype = None if initial_state is None else initial_state.dtype
        return o.to(v.dtype), final

    @staticmethod
    def backward(autograd_ctx, do, dht):
        q, k, v, g, beta, h0, got = autograd_ctx.saved_tensors
        x = (q, k, v, g, beta, autograd_ctx.scale)
        *grads, dh0 = _backward(x, h0, got, do, dht.to(h0.dtype), autograd_ctx.cp, autograd_ctx.passes,
                                autograd_ctx.h0_dtype is not None)
        grads = (d.to(t.dtype) for d, t in zip(grads, (q, k, v, g, beta)))
        return (*grads, None if dh0 is None else dh0.to(autograd_ctx.h0_dtype), None, None, None)


@torch.compiler.disable
def chunk_gated_delta_rule_cp(q, k, v, g, beta, scale: float, initial_state, ctx: CPContext):
    """The checked, preprocessed call of ``chunk_gated_delta_rule(..., cp_context=ctx)`` (the api
    does both): -> (o [1, local T, HV, V] in v's dtype, final state [N, HV, K, V] in float32
    (float64 for float64 q) with this rank's rows), on the kernels or the reference
    (``local_passes``). Under torch.compile it runs eagerly (a graph break)."""
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                               for t in (q, k, v, g, beta, initial_state))
    passes = local_passes(q, v, training)
    if training:
        return _Function.apply(q, k, v, g, beta, initial_state, scale, ctx, passes)
    o, final, _, _ = _forward((q, k, v, g, beta, scale), initial_state, ctx, passes)
    return o.to(v.dtype), final
