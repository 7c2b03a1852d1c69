"""The warp-specialized fused reverse (gdn_bwd.s07): what the generic stage tests (tests/test_stages.py:
the stage at its own rule against float64 on the public shape set) do not cover.

CPU: the new kernel's per-chunk arithmetic in float64, in its roles' order (the chain's dS step,
then the gradients from the chain's -dV~ and dS' snapshot; the columns of diag(beta) E as the rows
of the transposed product M^T Ai with K K^T symmetric), with the rows past a partial chunk's end
holding the next tokens' values (what a full 64-row TMA box reads) instead of zeros, against
``chunk_gated_delta_rule_bwd_ref`` at 1e-12; it fails when dO's row mask in the chain is dropped.
A model of the kernel's mbarrier protocol (each role's waits, arrivals, reads, writes and TMA
loads in program order, the gradient role as its two warpgroups, loads landing at random later
times, phase parities as the kernel computes them, dW written over W's tile) runs the interleavings
a random scheduler picks to their end, and every read sees the chunk it expects; with any one wait
removed, or -dV~ published before the chain's last read of W, it deadlocks or reads a stale,
overwritten or in-flight buffer. The stage's contract and errors. With --all-stages (it
compiles): the kernel uses no TileLang template that scans with the block's first threads.
GPU (gpu, hopper): the stage against float64 (``check_op``) on the public shape set split at a
forced segment length and unsplit; without h0 or dht; with beta = 0 tokens; bitwise equal from
run to run; a CUDA-graph replay equals the eager call.
"""

import functools
import random

import pytest
import torch

from flashqla import autocp
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import PUBLIC_HEADS, Problem, cast_floats, check_op, op_inputs, rel_l2, run_on_threads
from test_bwd_autocp import GPU_PROBLEMS, check_graph_replay, check_segmented_stage_contract, gpu_inputs

S07 = load("gdn_bwd", 7)
F64 = torch.float64


def ws_reverse_f64(x, drop=None):
    """The ws reverse kernel's arithmetic in float64 for one sequence (B = 1, no cu_seqlens), per
    (value head, BV value columns), the chunks backwards, as ``ws_reverse_kernel``'s chain and
    gradient roles order it; the column-block parts summed as the finish sums them. Tile rows past
    a chunk's end hold other tokens' values (random), as the kernel's TMA boxes do. ``drop``: a
    mask left out (the mutant check)."""
    q, k, v, g, beta, do, dht, h0 = (x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht", "initial_state"))
    _, T, H, K = q.shape
    HV, V, C, BV = v.shape[2], v.shape[3], S07.CHUNK_SIZE, S07.BV
    G, scale = HV // H, K ** -0.5
    g_cum = ref.chunk_local_cumsum(g)
    Ai = ref.kkt_solve(ref.chunk_kkt(k, g_cum, beta))
    w, u = ref.chunk_w_u(k, v, beta, Ai, g_cum)
    h, v_new, _ = ref.chunk_h(k, w, u, g_cum, h0, False)
    dq, dk = torch.zeros(T, H, K, dtype=F64), torch.zeros(T, H, K, dtype=F64)
    dv, dg, dbeta = torch.zeros(T, HV, V, dtype=F64), torch.zeros(T, HV, dtype=F64), torch.zeros(T, HV, dtype=F64)
    dh0 = torch.zeros(HV, K, V, dtype=F64)
    rows, cols = torch.arange(C)[:, None], torch.arange(C)[None, :]
    gen = torch.Generator().manual_seed(11)

    def tile(t, sl, n):  # rows of the chunk; from row n on, what a full box reads past the end
        out = torch.randn((C,) + t.shape[1:], generator=gen, dtype=F64)
        out[:n] = t[sl]
        return out
    for hv in range(HV):
        for v0 in range(0, V, BV):
            cs = slice(v0, v0 + BV)
            dS = dht[0, hv, :, cs].clone()
            for c in reversed(range(-(-T // C))):
                t0, n = c * C, min(T - c * C, C)
                sl = slice(t0, t0 + n)
                Q, Kc, W = (tile(t[0, :, i], sl, n) for t, i in ((q, hv // G), (k, hv // G), (w, hv)))
                dO, Vn, Vv = (tile(t[0, :, hv, cs], sl, n) for t in (do, v_new, v))
                A = tile(Ai[0, :, hv], sl, n)
                e = torch.exp(torch.cat([g_cum[0, sl, hv], g_cum[0, t0 + n - 1, hv].repeat(C - n)]))
                b = torch.zeros(C, dtype=F64)
                b[:n] = beta[0, sl, hv]
                S, real = h[0, c, hv, :, cs], rows < n
                gam = e[:, None] / e[None, :]                   # exp(g_i - g_j)
                # ---- the chain: dS' snapshot, dO', P^T, dV~, the dS step
                dSp = dS.clone()
                dOp = dO * (scale * e)[:, None]
                if drop != "dO' rows":
                    dOp = torch.where(real, dOp, 0.)
                PT = torch.where((rows <= cols) & (cols < n), scale * (Kc @ Q.T) * gam.T, 0.)
                y = (Kc @ dSp) * (e[-1] / e)[:, None] + PT @ dO
                dS = dS * e[-1] + Q.T @ dOp
                ndv = torch.where(real, -y, 0.)
                dS = dS + W.T @ ndv
                # ---- the gradients, from the snapshot and -dV~
                dK = torch.where(real, (Vn @ dSp.T) * (e[-1] / e)[:, None], 0.)
                r_ki, r_s = (dK * Kc).sum(1), (S * dSp).sum()
                dP = torch.where((cols <= rows) & real, scale * (dO @ Vn.T) * gam, 0.)
                dQ = (dO @ S.T) * (scale * e)[:, None] + dP @ Kc
                r_q = (dQ * Q).sum(1)
                dK = dK + dP.T @ Q
                dgc = r_q - (dK * Kc).sum(1)
                dg_last = r_ki.sum() + e[-1] * r_s
                dW = ndv @ S.T
                Y = -(A.T @ ndv)
                r_v = (Y * Vv).sum(1)
                dAi = torch.where((cols < rows) & real, -b[None, :] * (dW @ (-Kc * e[:, None]).T + ndv @ Vv.T), 0.)
                M = dAi @ A.T
                KK = Kc @ Kc.T
                dA = torch.where((cols < rows) & real, -(A.T @ M) * gam, 0.)
                D = b[:, None] * dA
                r_e = (dA * KK).sum(1)
                # [j, i] = beta_i dA~[i, j] (K K^T)[j, i], from M^T Ai: j < i < n
                Et = torch.where((rows < cols) & (cols < n), -(M.T @ A) * gam.T * KK * b[None, :], 0.)
                r_et = Et.sum(1)
                X = A.T @ dW
                dK = dK + X * (b * e)[:, None] + D @ Kc + D.T @ Kc
                r_k = (X * Kc).sum(1)
                dgc = dgc + b * (e * r_k + r_e) - r_et
                dgc[n - 1] += dg_last
                dgc[n:] = 0
                dbeta[sl, hv] += (e * r_k + r_v + r_e)[:n]
                dg[sl, hv] += dgc.flip(0).cumsum(0).flip(0)[:n]
                dq[sl, hv // G] += dQ[:n]
                dk[sl, hv // G] += dK[:n]
                dv[sl, hv, cs] = (Y * b[:, None])[:n]
            dh0[hv, :, cs] = dS
    return dq[None], dk[None], dv[None], dg[None], dbeta[None], dh0[None]


@functools.cache
def inputs_and_reference():
    """A varlen-free sequence of 150 tokens (a partial last chunk), GVA group 2, h0 and dht."""
    x = cast_floats(op_inputs("gdn_bwd", Problem(2, 4, (150,), varlen=False).inputs(seed=7)), F64)
    want = ref.chunk_gated_delta_rule_bwd_ref(*(x[n] for n in ("q", "k", "v", "g", "beta", "do", "dht")),
                                              None, x["initial_state"])
    return x, want


def test_ws_chunk_formulas_are_the_backward_in_float64():
    x, want = inputs_and_reference()
    for name, got, w in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), ws_reverse_f64(x), want):
        assert rel_l2(got, w) < 1e-12, name


def test_ws_chunk_formula_check_fails_without_the_dO_row_mask():
    """The rows past a partial chunk's end hold other tokens: dO' must be masked before Q^T dO'."""
    x, want = inputs_and_reference()
    assert rel_l2(ws_reverse_f64(x, drop="dO' rows")[5], want[5]) > 1e-3


# ---- the mbarrier protocol --------------------------------------------------------------------

class Barrier:
    """An mbarrier: ``count`` arrivals complete the phase; wait(parity) passes once the phase with
    that parity has completed (a fresh barrier counts as having completed phase parity 1)."""

    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.pending, self.phase = self.count, self.phase + 1

    def passed(self, parity):
        return self.phase % 2 != parity


def protocol(num_c, drop=None):
    """The roles of ``ws_reverse_kernel`` as op lists in program order, the gradient role as its two
    warpgroups g0 and g1 (one of them holds the thread that issues the loads; the model puts it in
    g0, the check is symmetric): ("wait", barrier, parity),
    ("arrive", barrier, threads), ("write", buffer, chunk), ("read", buffer, chunk), ("load", buffer,
    (chunk, barrier)): a TMA load, which lands later and then counts as one more arrival on its
    barrier (the transaction bytes; its arrive count has one more). Buffers: ring A
    slots a0, a1 (their W tiles w0, w1 apart: the gradients write dW over W, ("dW", chunk)),
    ring B halves b1 (V~, S) and b2 (V, Ai, beta), the hand-offs ds and dv.
    ``drop``: (role, barrier), that role's waits on it left out."""
    chain, grads = [], {"g0": [], "g1": []}
    for g, ops in grads.items():
        issue = g == "g0"
        for c in range(min(num_c, 2)):
            ops += ([("load", f"a{c}", (c, f"a_loaded{c}"))] if issue else []) + [("arrive", f"a_loaded{c}", 128)]
        if num_c:
            ops += ([("load", "b1", (0, "b1_loaded"))] if issue else []) + [("arrive", "b1_loaded", 128)]
            ops += ([("load", "b2", (0, "b2_loaded"))] if issue else []) + [("arrive", "b2_loaded", 128)]
        for it in range(num_c):
            st = it % 2
            ops += [("wait", f"a_loaded{st}", (it // 2) % 2), ("wait", "b1_loaded", it % 2),
                    ("wait", "ds_ready", it % 2), ("read", "ds", it), ("read", "b1", it), ("read", f"a{st}", it),
                    ("arrive", "ds_free", 128), ("read", f"a{st}", it), ("read", "b1", it),
                    ("wait", "dv_ready", it % 2), ("read", "dv", it), ("read", "b1", it),
                    ("write", f"w{st}", ("dW", it)), ("arrive", "b1_read", 128), ("wait", "b1_read", it % 2)]
            if it + 1 < num_c:
                ops += ([("load", "b1", (it + 1, "b1_loaded"))] if issue else []) + [("arrive", "b1_loaded", 128)]
            ops += [("wait", "b2_loaded", it % 2), ("read", "b2", it), ("read", "dv", it),
                    ("arrive", "dv_free", 128), ("read", f"a{st}", it), ("read", f"w{st}", ("dW", it)),
                    ("read", "b2", it),
                    ("arrive", "chunk_read", 128), ("wait", "chunk_read", it % 2)]
            if it + 1 < num_c:
                ops += ([("load", "b2", (it + 1, "b2_loaded"))] if issue else []) + [("arrive", "b2_loaded", 128)]
            if it + 2 < num_c:
                ops += (([("load", f"a{st}", (it + 2, f"a_loaded{st}"))] if issue else [])
                        + [("arrive", f"a_loaded{st}", 128)])
    for it in range(num_c):
        st = it % 2
        chain += [("wait", f"a_loaded{st}", (it // 2) % 2), ("read", f"a{st}", it),
                  ("wait", "ds_free", it % 2 ^ 1), ("write", "ds", it), ("arrive", "ds_ready", 128),
                  ("read", f"a{st}", it), ("wait", "dv_free", it % 2 ^ 1), ("write", "dv", it),
                  ("read", f"a{st}", it), ("read", f"w{st}", it), ("arrive", "dv_ready", 128)]
    roles = {"chain": chain, **grads}
    if drop:
        role, name = drop
        roles[role] = [op for op in roles[role] if not (op[0] == "wait" and op[1] == name)]
    return roles


BARRIERS = {"a_loaded0": 257, "a_loaded1": 257, "b1_loaded": 257, "b2_loaded": 257, "b1_read": 256,
            "chunk_read": 256, "ds_ready": 128, "ds_free": 256, "dv_ready": 128, "dv_free": 256}


def run_protocol(num_c, seed, drop=None, roles=None):
    """Runs the roles (``protocol``'s, or ``roles``) under a random scheduler; returns None, or what
    went wrong: a deadlock, or a read that found another chunk's data (a stale or overwritten buffer)."""
    roles = roles or protocol(num_c, drop)
    bars = {name: Barrier(count) for name, count in BARRIERS.items()}
    data, pc, in_flight = {}, {r: 0 for r in roles}, []
    rng = random.Random(seed)
    land = rng.choice([0.01, 0.1, 0.5])  # how soon loads land, relative to the roles' steps
    while any(pc[r] < len(ops) for r, ops in roles.items()) or in_flight:
        ready = [r for r, ops in roles.items() if pc[r] < len(ops)
                 and not (ops[pc[r]][0] == "wait" and not bars[ops[pc[r]][1]].passed(ops[pc[r]][2]))]
        if not ready and not in_flight:
            return f"deadlock at {pc}"
        if in_flight and (not ready or rng.random() < land):  # a load lands
            name, (chunk, bar) = in_flight.pop(rng.randrange(len(in_flight)))
            data[name] = chunk
            if name[0] == "a":  # a ring A slot's load brings its W tile too
                data["w" + name[1:]] = chunk
            bars[bar].arrive()
            continue
        r = rng.choice(ready)
        op, name, arg = roles[r][pc[r]]
        pc[r] += 1
        if op == "load":
            data[name] = "in flight"
            if name[0] == "a":
                data["w" + name[1:]] = "in flight"
            in_flight.append((name, arg))
        elif op == "arrive":
            for _ in range(arg):
                bars[name].arrive()
        elif op == "write":
            data[name] = arg
        elif op == "read" and data.get(name) != arg:
            return f"{r} read {name} of chunk {data.get(name)} for chunk {arg}"
    return None


@pytest.mark.parametrize("num_c", [1, 2, 3, 6])
def test_barrier_protocol_runs_to_the_end_and_reads_the_right_chunks(num_c):
    for seed in range(200):
        assert run_protocol(num_c, seed) is None, seed


@pytest.mark.parametrize("drop", [("chain", "dv_free"), ("chain", "ds_free"), ("chain", "a_loaded1"),
                                  ("g0", "b1_read"), ("g0", "chunk_read"), ("g0", "dv_ready"), ("g1", "dv_ready"),
                                  ("g1", "b2_loaded"), ("g1", "b1_loaded")])
def test_barrier_protocol_check_fails_without_a_wait(drop):
    assert any(run_protocol(6, seed, drop) for seed in range(200))


def test_barrier_protocol_check_fails_when_dv_is_published_before_the_last_read_of_w():
    """dW is written over W's slot: the chain must publish -dV~ only after its W^T (-dV~)."""
    def early(num_c):
        roles = protocol(num_c)
        chain = roles["chain"]
        for i in [i for i, op in enumerate(chain) if op[0] == "read" and op[1][0] == "w"]:
            chain[i], chain[i + 1] = chain[i + 1], chain[i]  # arrive dv_ready, then read W
        return roles
    assert any(run_protocol(6, seed, roles=early(6)) for seed in range(200))


def test_stage_contract():
    check_segmented_stage_contract(S07)


def test_no_scan_on_the_blocks_first_threads(pytestconfig):
    """T.cumsum's template (CumSum1D) scans with threads 0..31 of the block and returns on every
    other: in this kernel those are the chain's, so the gradient role must not use it. The same
    check finds it in s04's kernel, whose two math warpgroups start at thread 0."""
    if not pytestconfig.getoption("--all-stages"):
        pytest.skip("compiles two kernels: runs with --all-stages")
    assert "CumSum" not in S07.kernel_source()
    assert "CumSum" in S07.S04._fused(**S07.DEFAULT_SHAPE).get_kernel_source()


# ---- on the GPU -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """The stage's kernels, split and not, for every public head layout, compiled on threads first."""
    run_on_threads([functools.partial(S07.run, **gpu_inputs(Problem(H, HV, (700, 70))), cp=cp)
                    for H, HV in PUBLIC_HEADS for cp in (2, False)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_ws_matches_reference(problem, cp, compiled):
    check_op("gdn_bwd", functools.partial(S07.run, cp=cp), gpu_inputs(problem))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "h0=None"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "dht=None"])
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_without_h0_or_dht(initial_state, with_dht, cp, compiled):
    x = gpu_inputs(Problem(4, 16, (1, 200, 777, 64, 130), initial_state=initial_state), seed=6)
    if not with_dht:
        x["dht"] = None
    check_op("gdn_bwd", functools.partial(S07.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_beta_zero_tokens(cp, compiled):
    """Every fifth token's beta and a run of one head's are 0."""
    inputs = Problem(4, 16, (1, 200, 777, 64, 130)).inputs(device="cuda", seed=8)
    inputs["beta"][:, ::5] = 0
    inputs["beta"][:, 300:400, 3] = 0
    check_op("gdn_bwd", functools.partial(S07.run, cp=cp), op_inputs("gdn_bwd", inputs))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [4, False], ids=["cp_4", "cp_off"])
def test_bitwise_deterministic(cp, compiled):
    x = gpu_inputs(Problem(4, 16, (3000, 1, 700, 2500)), seed=2)
    first = S07.run(**x, cp=cp)
    for _ in range(3):
        again = S07.run(**x, cp=cp)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,cp", [(Problem(2, 8, (16384,)), None), (Problem(2, 8, (16000, 3000, 192)), 8),
                                        (Problem(2, 8, (1000, 3000, 192)), False)],
                         ids=["rule", "varlen_cp8", "varlen_cp_off"])
def test_cuda_graph_replay_equals_eager(problem, cp, compiled):
    x = gpu_inputs(problem, seed=3)
    B, T = x["q"].shape[:2]
    split = S07.S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, cp)
    assert (split is not None) == (cp is not False)
    check_graph_replay(S07, x, cp)
