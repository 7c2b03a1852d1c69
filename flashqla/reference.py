"""Plain-PyTorch references for Gated DeltaNet: the oracle that every kernel stage is checked against.

Everything here is ordinary differentiable PyTorch that runs on any device and in any floating
dtype. Each function computes in the dtype of ``q`` (or of its first tensor argument) and casts
every other tensor to it, so passing float64 tensors gives the oracle and passing bfloat16
tensors gives "the same math in bf16", the baseline the test tolerances are derived from.

Conventions are those of FLA's ``chunk_gated_delta_rule`` (NOTES.md section 1):

    q, k        [B, T, H, K]       H query/key heads
    v           [B, T, HV, V]      HV value heads, HV a multiple of H (GVA: value head i reads q/k head
                                   i // (HV // H))
    g, beta     [B, T, HV]         per-token log decay (g <= 0) and delta-rule step size (0 < beta <= 1)
    state h     [N, HV, K, V]      one K x V matrix per (sequence, value head)
    cu_seqlens  [N + 1] integers   varlen: B == 1 and sequence n is tokens cu_seqlens[n]:cu_seqlens[n+1]

Per token:  h <- exp(g_t) h;  e_t = beta_t (v_t - h^T k_t);  h <- h + k_t e_t^T;  o_t = h^T (scale q_t).

The chunked form is split into the sub-steps that the kernels implement one by one, each with
the inputs and outputs that a kernel of that step has (FLA's names and layouts):

    chunk_local_cumsum   g                          -> g_cum     [B, T, HV]
    chunk_kkt            k, g_cum, beta             -> A         [B, T, HV, C]
    kkt_solve            A                          -> Ai        [B, T, HV, C]
    chunk_w_u            k, v, beta, Ai, g_cum      -> w [B, T, HV, K], u [B, T, HV, V]
    (chunk_fwd_intra     k, v, g_cum, beta          -> w, u: the three steps above in one)
    chunk_h              k, w, u, g_cum, h0         -> h [B', NT, HV, K, V], v_new [B, T, HV, V], h_final
    chunk_o              q, k, v_new, h, g_cum      -> o         [B, T, HV, V]

Rows of ``A`` and ``Ai`` are stored per token: token t holds row (t mod C) of its chunk's C x C
matrix. ``h`` holds the state at the start of every chunk: B' = B and NT = ceil(T / C) for
equal-length batches; B' = 1 and NT = sum over sequences of ceil(T_n / C) for varlen.
"""

from __future__ import annotations

import math

import torch

CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (FLA's in-kernel q/k normalization)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """GVA: [B, T, H, D] -> [B, T, HV, D], value head i reading head i // (HV // H)."""
    return x if x.shape[2] == hv else x.repeat_interleave(hv // x.shape[2], dim=2)


class Chunking:
    """Maps tokens [B, T, ...] to zero-padded chunks [N, NT, C, ...] and back.

    Every sequence (a row of an equal-length batch, or a ``cu_seqlens`` span) is padded at its end
    to ``NT * C`` tokens, NT being the chunk count of the longest sequence. Padding tokens carry
    k = v = g = beta = 0, which leaves the state untouched. A cumulative gate is padded with its
    last real value instead (``pad_g_cum``), as g = 0 would give: a zero there would put positive
    exponents g_cum_i - g_cum_j between padding rows and real columns, which overflow in float32
    and turn into NaN in the backward pass.
    """

    def __init__(self, batch: int, seqlen: int, cu_seqlens: torch.Tensor | None, chunk_size: int,
                 device: torch.device):
        if cu_seqlens is None:
            bounds = [b * seqlen for b in range(batch + 1)]
        else:
            bounds = [int(x) for x in cu_seqlens.tolist()]
        self.varlen = cu_seqlens is not None
        self.batch, self.seqlen, self.chunk_size = batch, seqlen, chunk_size
        self.lengths = [bounds[n + 1] - bounds[n] for n in range(len(bounds) - 1)]
        self.num_chunks = max([math.ceil(n / chunk_size) for n in self.lengths] + [0])
        seq = torch.repeat_interleave(torch.arange(len(self.lengths)), torch.tensor(self.lengths))
        starts = torch.tensor(bounds[:-1], dtype=torch.long)
        self.seq = seq.to(device)
        self.pos = (torch.arange(bounds[-1]) - starts[seq]).to(device)
        real = torch.tensor(self.lengths)[:, None] - torch.arange(self.num_chunks) * chunk_size
        self.chunk_valid = (real > 0).to(device)                         # [N, NT]
        self.chunk_last = (real.clamp(1, chunk_size) - 1).to(device)     # [N, NT] last real token

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, *rest] -> [N, NT, C, *rest], zero-padded."""
        rest = x.shape[2:]
        flat = x.reshape(-1, *rest)
        out = flat.new_zeros(self.num_seqs, self.num_chunks * self.chunk_size, *rest)
        out = out.index_put((self.seq, self.pos), flat)
        return out.view(self.num_seqs, self.num_chunks, self.chunk_size, *rest)

    def pad_g_cum(self, g_cum: torch.Tensor) -> torch.Tensor:
        """g_cum [B, T, HV] -> [N, NT, C, HV], padding carrying each chunk's last real value."""
        padded = self.pad(g_cum)
        pos = torch.arange(self.chunk_size, device=padded.device)
        idx = torch.minimum(pos, self.chunk_last[..., None])              # [N, NT, C]
        return padded.gather(2, idx[..., None].expand_as(padded))

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """[N, NT, C, *rest] -> [B, T, *rest]."""
        rest = y.shape[3:]
        flat = y.reshape(self.num_seqs, self.num_chunks * self.chunk_size, *rest)[self.seq, self.pos]
        return flat.reshape(self.batch, self.seqlen, *rest)

    def pack_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """Per-chunk values [N, NT, *rest] -> [B', NT', *rest] (FLA's layout of ``h``)."""
        packed = y[self.chunk_valid]
        return packed.reshape(1 if self.varlen else self.batch, -1, *y.shape[2:])

    def unpack_chunks(self, y: torch.Tensor) -> torch.Tensor:
        """[B', NT', *rest] -> [N, NT, *rest], zeros for chunks past a sequence's end."""
        rest = y.shape[2:]
        out = y.new_zeros(self.num_seqs, self.num_chunks, *rest)
        return out.index_put((self.chunk_valid,), y.reshape(-1, *rest))


def _chunking(x: torch.Tensor, cu_seqlens, chunk_size: int) -> Chunking:
    return Chunking(x.shape[0], x.shape[1], cu_seqlens, chunk_size, x.device)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[N, NT, C, HV, *rest] -> [N, NT, HV, C, *rest]."""
    return x.transpose(2, 3)


def _tokens_first(x: torch.Tensor) -> torch.Tensor:
    """[N, NT, HV, C, *rest] -> [N, NT, C, HV, *rest]."""
    return x.transpose(2, 3)


def _decay_matrix(g_cum: torch.Tensor, diagonal: int) -> tuple[torch.Tensor, torch.Tensor]:
    """g_cum [..., C] -> (Gamma [..., C, C], mask [C, C]), Gamma_ij = exp(g_cum_i - g_cum_j).

    mask = tril(ones, diagonal): diagonal -1 is strictly lower (j < i), 0 includes j == i.
    Exponents are taken only where the mask holds (1 elsewhere), so they are all <= 0 for g <= 0.
    """
    c = g_cum.shape[-1]
    mask = torch.ones(c, c, dtype=torch.bool, device=g_cum.device).tril(diagonal)
    diff = g_cum[..., :, None] - g_cum[..., None, :]
    return torch.exp(torch.where(mask, diff, torch.zeros_like(diff))), mask


def naive_recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
                                     output_final_state=False, cu_seqlens=None):
    """The definition: one token after another. Returns (o [B, T, HV, V], final state [N, HV, K, V] or None).

    Sequential in T: T steps of O(HV K V) work each, nothing to parallelize across time.
    """
    dt = q.dtype
    hv, kd = v.shape[2], q.shape[3]
    scale = kd ** -0.5 if scale is None else scale
    tok = _chunking(q, cu_seqlens, 1)  # one token per "chunk": pads each sequence to the longest
    qs, ks = (tok.pad(expand_heads(x, hv).to(dt))[:, :, 0] for x in (q, k))  # [N, Tmax, HV, K]
    vs = tok.pad(v.to(dt))[:, :, 0]                                           # [N, Tmax, HV, V]
    gs, bs = (tok.pad(x.to(dt))[:, :, 0] for x in (g, beta))                  # [N, Tmax, HV]
    h = qs.new_zeros(tok.num_seqs, hv, kd, v.shape[3]) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(tok.num_chunks):
        h = torch.exp(gs[:, t])[..., None, None] * h                          # h <- exp(g_t) h
        pred = torch.einsum("nhkv,nhk->nhv", h, ks[:, t])                      # h^T k_t
        e = bs[:, t, :, None] * (vs[:, t] - pred)                              # e_t = beta_t (v_t - h^T k_t)
        h = h + ks[:, t, :, :, None] * e[:, :, None, :]                        # h <- h + k_t e_t^T
        outs.append(torch.einsum("nhkv,nhk->nhv", h, qs[:, t] * scale))        # o_t = h^T (scale q_t)
    o = torch.stack(outs, 1) if outs else vs.new_zeros(vs.shape)
    o = tok.unpad(o[:, :, None])
    return o, (h if output_final_state else None)


def chunk_local_cumsum(g, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """g [B, T, HV] -> g_cum [B, T, HV]: cumulative sum of g restarting at every chunk and sequence start."""
    ch = _chunking(g, cu_seqlens, chunk_size)
    return ch.unpad(ch.pad(g).cumsum(2))


def chunk_kkt(k, g_cum, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K], g_cum, beta [B, T, HV] -> A [B, T, HV, C].

    A = StrictLower(diag(beta) K K^T * Gamma) per chunk, Gamma_ij = exp(g_cum_i - g_cum_j).
    """
    dt = k.dtype
    hv = beta.shape[2]
    ch = _chunking(k, cu_seqlens, chunk_size)
    kc = _heads_first(ch.pad(expand_heads(k, hv)))                  # [N, NT, HV, C, K]
    gc = _heads_first(ch.pad_g_cum(g_cum.to(dt)))                 # [N, NT, HV, C]
    bc = _heads_first(ch.pad(beta.to(dt)))
    gamma, strict = _decay_matrix(gc, -1)
    kkt = bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * gamma    # diag(beta) K K^T * Gamma
    a = torch.where(strict, kkt, torch.zeros_like(kkt))
    return ch.unpad(_tokens_first(a))


def kkt_solve(A, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """A [B, T, HV, C] -> Ai = (I + A)^-1 per chunk, same layout.

    This is the UT transform: the product of the chunk's C rank-one updates (I - beta_t k_t k_t^T,
    with their decays) is I - K^T ... written with one triangular inverse. A unit-lower-triangular
    solve; PyTorch has no bfloat16 solver, so it runs in at least float32 and rounds back.
    """
    ch = _chunking(A, cu_seqlens, chunk_size)
    a = _heads_first(ch.pad(A))                                        # [N, NT, HV, C, C]
    work = torch.promote_types(a.dtype, torch.float32)
    eye = torch.eye(chunk_size, dtype=work, device=a.device)
    ai = torch.linalg.solve_triangular(eye + a.to(work), eye.expand_as(a), upper=False,
                                       unitriangular=True)
    return ch.unpad(_tokens_first(ai.to(a.dtype)))


def chunk_w_u(k, v, beta, Ai, g_cum, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """-> w = Ai diag(beta exp(g_cum)) K  [B, T, HV, K],  u = Ai diag(beta) V  [B, T, HV, V] (per chunk)."""
    dt = k.dtype
    hv = v.shape[2]
    ch = _chunking(k, cu_seqlens, chunk_size)
    kc = _heads_first(ch.pad(expand_heads(k, hv)))                  # [N, NT, HV, C, K]
    vc = _heads_first(ch.pad(v.to(dt)))                             # [N, NT, HV, C, V]
    ai = _heads_first(ch.pad(Ai.to(dt)))                            # [N, NT, HV, C, C]
    gc = _heads_first(ch.pad_g_cum(g_cum.to(dt)))
    bc = _heads_first(ch.pad(beta.to(dt)))
    w = ai @ ((bc * torch.exp(gc))[..., None] * kc)
    u = ai @ (bc[..., None] * vc)
    return ch.unpad(_tokens_first(w)), ch.unpad(_tokens_first(u))


def chunk_fwd_intra(k, v, g_cum, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K], v [B, T, HV, V], g_cum, beta [B, T, HV] -> (w, u): chunk_kkt, kkt_solve and
    chunk_w_u in one step (FLA's name for it), so that A and Ai need never leave a kernel."""
    A = chunk_kkt(k, g_cum, beta, cu_seqlens, chunk_size)
    Ai = kkt_solve(A, cu_seqlens, chunk_size)
    return chunk_w_u(k, v, beta, Ai, g_cum, cu_seqlens, chunk_size)


def chunk_h(k, w, u, g_cum, initial_state=None, output_final_state=False, cu_seqlens=None,
            chunk_size=CHUNK_SIZE):
    """The only sequential step: walk the chunks of every sequence in order.

    k [B, T, H, K], w [B, T, HV, K], u [B, T, HV, V], g_cum [B, T, HV], initial_state [N, HV, K, V]
    -> h [B', NT, HV, K, V] (state entering each chunk), v_new [B, T, HV, V], final state or None.

        v_new  = u - w h
        h_next = exp(g_cum_last) h + K^T diag(exp(g_cum_last - g_cum)) v_new
    """
    dt = k.dtype
    hv, kd, vd = u.shape[2], k.shape[3], u.shape[3]
    ch = _chunking(k, cu_seqlens, chunk_size)
    kc = _heads_first(ch.pad(expand_heads(k, hv)))                  # [N, NT, HV, C, K]
    wc, uc = (_heads_first(ch.pad(x.to(dt))) for x in (w, u))
    gc = _heads_first(ch.pad_g_cum(g_cum.to(dt)))                   # [N, NT, HV, C]
    h = kc.new_zeros(ch.num_seqs, hv, kd, vd) if initial_state is None else initial_state.to(dt)
    states, v_new = [], []
    for c in range(ch.num_chunks):
        states.append(h)
        vn = uc[:, c] - wc[:, c] @ h                                # v_new = u - w h
        g_last = gc[:, c, :, -1]                                    # g_cum at the chunk's end
        kd_ = kc[:, c] * torch.exp(g_last[..., None] - gc[:, c])[..., None]
        h = torch.exp(g_last)[..., None, None] * h + kd_.transpose(-1, -2) @ vn  # S <- exp(g_C) S + K^T V~
        v_new.append(vn)
    if ch.num_chunks:
        hs = ch.pack_chunks(torch.stack(states, 1))
        vn_all = ch.unpad(_tokens_first(torch.stack(v_new, 1)))
    else:
        hs = kc.new_zeros(ch.batch if not ch.varlen else 1, 0, hv, kd, vd)
        vn_all = u.to(dt)
    return hs, vn_all, (h if output_final_state else None)


def chunk_o(q, k, v_new, h, g_cum, scale=None, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """o = scale (diag(exp(g_cum)) Q h + (Q K^T * Gamma, lower incl. diagonal) v_new) per chunk.

    q, k [B, T, H, K], v_new [B, T, HV, V], h [B', NT, HV, K, V], g_cum [B, T, HV] -> o [B, T, HV, V].
    """
    dt = q.dtype
    hv = v_new.shape[2]
    scale = q.shape[3] ** -0.5 if scale is None else scale
    ch = _chunking(q, cu_seqlens, chunk_size)
    qc, kc = (_heads_first(ch.pad(expand_heads(x.to(dt), hv))) for x in (q, k))  # [N, NT, HV, C, K]
    vc = _heads_first(ch.pad(v_new.to(dt)))                                        # [N, NT, HV, C, V]
    gc = _heads_first(ch.pad_g_cum(g_cum.to(dt)))                                  # [N, NT, HV, C]
    hc = ch.unpack_chunks(h.to(dt))                                                # [N, NT, HV, K, V]
    gamma, causal = _decay_matrix(gc, 0)
    qk = qc @ kc.transpose(-1, -2) * gamma
    qk = torch.where(causal, qk, torch.zeros_like(qk))             # (Q K^T * Gamma), lower incl. diagonal
    o = scale * (torch.exp(gc)[..., None] * (qc @ hc) + qk @ vc)   # inter-chunk + intra-chunk
    return ch.unpad(_tokens_first(o))


def chunk_gated_delta_rule_ref(q, k, v, g, beta, scale=None, initial_state=None,
                               output_final_state=False, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """The chunked form, as the composition of the sub-steps above. Same result as the naive recurrence.

    Returns (o [B, T, HV, V], final state [N, HV, K, V] or None), computed in q's dtype.
    """
    dt = q.dtype
    k, v, g, beta = (x.to(dt) for x in (k, v, g, beta))
    g_cum = chunk_local_cumsum(g, cu_seqlens, chunk_size)
    A = chunk_kkt(k, g_cum, beta, cu_seqlens, chunk_size)
    Ai = kkt_solve(A, cu_seqlens, chunk_size)
    w, u = chunk_w_u(k, v, beta, Ai, g_cum, cu_seqlens, chunk_size)
    h, v_new, final_state = chunk_h(k, w, u, g_cum, initial_state, output_final_state, cu_seqlens,
                                    chunk_size)
    o = chunk_o(q, k, v_new, h, g_cum, scale, cu_seqlens, chunk_size)
    return o, final_state
