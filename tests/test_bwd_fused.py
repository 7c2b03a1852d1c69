"""The fused reverse backward (gdn_bwd.s04): what the generic stage tests (tests/test_stages.py: the
stage at its own rule against float64 on the public shape set) do not cover.

CPU: the stage's contract and its errors.
GPU (gpu, hopper): the stage against float64 (``check_op``) on the public shape set split at a
forced segment length (``cp=2``) and unsplit (``cp=False``); with and without h0 and dht, split and
not; bitwise equal from run to run; a CUDA-graph replay equals the eager call.
"""

import functools
import inspect
import zlib

import pytest
import torch

from flashqla import autocp
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import PUBLIC_HEADS, Problem, check_op, op_inputs, run_on_threads

S04 = load("gdn_bwd", 4)


def test_stage_contract():
    params = list(inspect.signature(S04.run).parameters)
    want = list(inspect.signature(ref.chunk_gated_delta_rule_bwd_ref).parameters)
    assert params == want + ["cp"]
    assert S04.NEEDS == ("hopper",) and S04.SOURCE_MUST_CONTAIN
    x = op_inputs("gdn_bwd", Problem(2, 4, (70,), K=128, V=128).inputs())
    for name, change, message in [
            ("chunk_size", 32, "`chunk_size` must be 64"),
            ("q", x["q"][..., :64], "`q` must have head dim K = 128"),
            ("v", x["v"][..., :64], "`v` must have head dim V = 128"),
            ("v", torch.cat([x["v"]] * 2, 2)[:, :, :3], "multiple of the H = 2 heads of q; got HV = 3"),
            ("cp", "auto", "`cp` must be None, True, False or a segment length in chunks; got 'auto'")]:
        with pytest.raises(ValueError, match=message):
            S04.run(**dict(x, **{name: change}))


# ---- on the GPU -------------------------------------------------------------------------------

GPU_PROBLEMS = [problem for H, HV in PUBLIC_HEADS for problem in (
    Problem(H, HV, (1000,)),
    Problem(H, HV, (1, 200, 777, 64, 130)),
    Problem(H, HV, (333, 333), varlen=False, initial_state=False))]


def gpu_inputs(problem, seed=None):
    seed = zlib.crc32(problem.label.encode()) if seed is None else seed
    return op_inputs("gdn_bwd", problem.inputs(device="cuda", seed=seed))


@pytest.fixture(scope="module")
def compiled():
    """The stage's kernels, split and not, for every public head layout, compiled on threads first
    (s02's prep, s03's segment kernels, and the three new kernels: about 80 TileLang kernels)."""
    run_on_threads([functools.partial(S04.run, **gpu_inputs(Problem(H, HV, (700, 70))), cp=cp)
                    for H, HV in PUBLIC_HEADS for cp in (2, False)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_stage_matches_reference(problem, cp, compiled):
    check_op("gdn_bwd", functools.partial(S04.run, cp=cp), gpu_inputs(problem))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("initial_state", [True, False], ids=["h0", "h0=None"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "dht=None"])
@pytest.mark.parametrize("cp", [2, False], ids=["cp_2", "cp_off"])
def test_without_h0_or_dht(initial_state, with_dht, cp, compiled):
    """dht = None is a zero final-state gradient (the unsplit kernel skips its load, the split
    one chains zeros); without h0 there is no dh0."""
    x = gpu_inputs(Problem(4, 16, (1, 200, 777, 64, 130), initial_state=initial_state), seed=6)
    if not with_dht:
        x["dht"] = None
    check_op("gdn_bwd", functools.partial(S04.run, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("cp", [4, False], ids=["cp_4", "cp_off"])
def test_bitwise_deterministic(cp, compiled):
    x = gpu_inputs(Problem(4, 16, (3000, 1, 700, 2500)), seed=2)
    first = S04.run(**x, cp=cp)
    for _ in range(3):
        again = S04.run(**x, cp=cp)
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
    split = S04.S03.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), x["q"].device, cp)
    assert (split is not None) == (cp is not False)
    eager = S04.run(**x, cp=cp)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = S04.run(**x, cp=cp)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b)
    x["do"].mul_(-1)                                                # new inputs, same tensors
    graph.replay()
    flipped = S04.run(**x, cp=cp)
    torch.cuda.synchronize()
    for a, b in zip(captured, flipped):
        assert torch.equal(a, b)
