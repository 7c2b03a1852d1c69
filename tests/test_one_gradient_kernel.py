"""gdn_bwd.s06: chunk_bwd_dqkwg and s05's wy_bwd (and the finish) as one chunk-parallel kernel.

CPU: the stage's contract and its errors; the float64 composition the kernel computes (part A's
dk and dg_cum plus part B's, reverse cumsum in the chunk: ``reference.chunk_bwd_dqkwg``, then
``reference.wy_bwd_ab``) equals the reference backward's dk and dg at 1e-12 with beta = 0 tokens,
flagged chunks and varlen, and fails when one part is dropped.
GPU (gpu, hopper): the stage against float64 (``check_op``) on the public shape set at its rule,
split at a forced segment length and unsplit; without h0 or dht; with beta = 0 tokens and with
keys the solve flags; dq and dv bit for bit s05's (the fused kernel runs their products as s05's
kernels do; dk, dg, dbeta round differently, see the stage's docstring); bitwise equal from run
to run; a CUDA-graph replay equals the eager call.
"""

import functools

import pytest
import torch

from flashqla import autocp
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import Problem, adversarial_inputs, cast_floats, check_op, op_inputs, run_on_threads
from test_bwd_autocp import GPU_PROBLEMS, check_graph_replay, check_segmented_stage_contract, gpu_inputs
from test_wy_from_solve import PROBLEMS

S06 = load("gdn_bwd", 6)
S05 = S06.S05

F64 = torch.float64
TOL = 1e-12
CASES = ["varlen", "batch", "unnormalized_keys"]


@functools.cache
def fused_and_reference(label, parts=("a", "b")):
    """(dk, dg) of the composition the fused kernel computes, in float64, from ``parts`` ("a":
    chunk_bwd_dqkwg's, "b": wy_bwd_ab's), and (dk, dg) of ``chunk_gated_delta_rule_bwd_ref``. Every
    fifth token's beta is 0; Ab and gated from the solve's policy (``flagged_solve``)."""
    x = cast_floats(PROBLEMS[label].inputs() if label in PROBLEMS else
                    adversarial_inputs(label, H=1, HV=2, lengths=(100, 1, 30), device="cpu"), F64)
    x["beta"] = x["beta"].clone()
    x["beta"][:, ::5] = 0
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(x["v"].shape, generator=gen, dtype=F64)
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    g_cum = ref.chunk_local_cumsum(g, cu)
    Ai = ref.kkt_solve(ref.chunk_kkt(k, g_cum, beta, cu), cu)
    w, u = ref.chunk_w_u(k, v, beta, Ai, g_cum, cu)
    h, v_new, _ = ref.chunk_h(k, w, u, g_cum, h0, False, cu)
    dv_local = ref.chunk_bwd_dv_local(q, k, do, g_cum, None, cu)
    dh, _, dv2 = ref.chunk_bwd_dhu(q, k, w, g_cum, h0, None, do, dv_local, None, cu)
    _, dk_a, dw, dg_a = ref.chunk_bwd_dqkwg(q, k, v_new, g_cum, h, dv2, do, dh, None, cu)
    Ab, gated = ref.flagged_solve(k, g_cum, beta, cu)
    dk_b, _, _, dg_b = ref.wy_bwd_ab(k, v, beta, Ab, gated, g_cum, dw, dv2, cu)
    dk = (dk_a if "a" in parts else 0) + (dk_b if "b" in parts else 0)
    dg = ref.chunk_local_reverse_cumsum((dg_a if "a" in parts else 0) + (dg_b if "b" in parts else 0), cu)
    _, dk_ref, _, dg_ref, _, _ = ref.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, None, None, h0, cu)
    return (dk, dg), (dk_ref, dg_ref)


def worst_error(label, parts=("a", "b")):
    got, want = fused_and_reference(label, parts)
    return max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want))


@pytest.mark.parametrize("label", CASES)
def test_fused_composition_equals_reference(label):
    """dk = dk_a + dk_b and dg = reverse cumsum of dg_a + dg_b per chunk, the sums the fused kernel
    takes on chip, give the reference backward's dk and dg in float64."""
    assert worst_error(label) < TOL


@pytest.mark.parametrize("parts", [("a",), ("b",)], ids=["without_wy_part", "without_dqkwg_part"])
def test_composition_check_fails_without_a_part(parts):
    """The check above can fail: either part alone is far from the reference."""
    assert worst_error("varlen", parts) > 1e-3


def test_stage_contract():
    check_segmented_stage_contract(S06)


# ---- on the GPU -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled():
    """The stage's kernels (and s05's, for the bitwise comparison), split and not, for every public
    head layout, compiled on threads first."""
    from flashqla.testing import PUBLIC_HEADS

    run_on_threads([functools.partial(stage.run, **gpu_inputs(Problem(H, HV, (700, 70))), cp=cp)
                    for stage in (S06, S05) for H, HV in PUBLIC_HEADS for cp in (2, False)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [True, 2, False], ids=["cp_rule", "cp_2", "cp_off"])
def test_stage_matches_reference(problem, cp, compiled):
    check_op("gdn_bwd", functools.partial(S06.run, cp=cp), gpu_inputs(problem))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_dq_dv_bitwise_s05(problem, cp, compiled):
    """dq (part A's products, summed over the group in the same order) and dv (part B's Ai^T dU,
    on the same bf16 dW-free inputs) equal s05's bit for bit; dh0 too (the same walk). Catches a
    fused-kernel buffer that another step overwrote before its last reader (the aliasing by hand)."""
    x = gpu_inputs(problem)
    mine, theirs = S06.run(**x, cp=cp), S05.run(**x, cp=cp)
    for name, i in (("dq", 0), ("dv", 2), ("dh0", 5)):
        if theirs[i] is not None:
            assert torch.equal(mine[i], theirs[i]), f"{name} differs from gdn_bwd.s05's"


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "h0=None"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "dht=None"])
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_without_h0_or_dht(initial_state, with_dht, cp, compiled):
    x = gpu_inputs(Problem(4, 16, (1, 200, 777, 64, 130), initial_state=initial_state), seed=6)
    if not with_dht:
        x["dht"] = None
    check_op("gdn_bwd", functools.partial(S06.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_beta_zero_tokens(cp, compiled):
    """Every fifth token's beta and a run of one head's are 0 (s05's case): T_b's columns there are
    0 and part B, which never divides by beta, stays finite and right."""
    inputs = Problem(4, 16, (1, 200, 777, 64, 130)).inputs(device="cuda", seed=8)
    inputs["beta"][:, ::5] = 0
    inputs["beta"][:, 300:400, 3] = 0
    check_op("gdn_bwd", functools.partial(S06.run, cp=cp), op_inputs("gdn_bwd", inputs))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_flagged_chunks(cp, compiled):
    """Unnormalized keys (beta ||k||^2 = 9 on odd heads): the solve flags those chunks and stores
    the gated inverse, which part B reads as T_b without Gamma."""
    x = op_inputs("gdn_bwd", adversarial_inputs("unnormalized_keys", H=2, HV=8, lengths=(1000, 1, 300)))
    check_op("gdn_bwd", functools.partial(S06.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [4, False], ids=["cp_4", "cp_off"])
def test_bitwise_deterministic(cp, compiled):
    x = gpu_inputs(Problem(4, 16, (3000, 1, 700, 2500)), seed=2)
    first = S06.run(**x, cp=cp)
    for _ in range(3):
        again = S06.run(**x, cp=cp)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem,cp", [(Problem(2, 8, (16384,)), None), (Problem(2, 8, (16000, 3000, 192)), 8),
                                        (Problem(2, 8, (1000, 3000, 192)), False)],
                         ids=["rule", "varlen_cp8", "varlen_cp_off"])
def test_cuda_graph_replay_equals_eager(problem, cp, compiled):
    """After one eager call (which reads cu_seqlens once), the whole backward captures, and its replay
    gives the eager bits, again after the inputs change in place."""
    x = gpu_inputs(problem, seed=3)
    B, T = x["q"].shape[:2]
    split = S06.S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, cp)
    assert (split is not None) == (cp is not False)
    check_graph_replay(S06, x, cp)
