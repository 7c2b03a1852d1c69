"""Every stage under kernels/, found by itself: a compile test on any machine, a GPU test on the GPU.

The GPU test runs the stage on the public shape set and asserts flashqla.testing.check_op: each
output within TOLERANCE_FACTOR x the error of the same math in bf16 PyTorch, against float64.
"""

import functools
import re
import zlib

import pytest

from flashqla.stages import discover
from flashqla.testing import PUBLIC_HEADS, Problem, check_op, op_inputs, warm_up

STAGES = discover()
TILELANG_STAGES = [s for s in STAGES if hasattr(s.module, "kernel_source")]

# Single sequences and varlen mixes with lengths that are not multiples of 64 (one of length 1),
# with and without initial state; g = 0 and strong-decay heads are part of every Problem.
GPU_PROBLEMS = [
    problem
    for H, HV in PUBLIC_HEADS
    for problem in (
        Problem(H, HV, (1000,)),
        Problem(H, HV, (1, 200, 777, 64, 130)),
        Problem(H, HV, (333, 333), varlen=False, initial_state=False),
    )
]


@pytest.mark.parametrize("stage", TILELANG_STAGES, ids=lambda s: s.id)
def test_compiles_for_hopper(stage):
    source = stage.module.kernel_source()
    for needle in stage.module.SOURCE_MUST_CONTAIN:
        assert needle in source, f"{stage.name}: generated CUDA lacks `{needle}`"


@pytest.mark.parametrize("stage", TILELANG_STAGES, ids=lambda s: s.id)
def test_register_budgets_move_the_right_way(stage):
    """setmaxnreg.inc may only raise, and .dec only lower, the count each thread starts with
    (65536 registers / the launch's threads, at most 255, a multiple of 8). The other way is an
    illegal instruction on the GPU (s09's first draft allocated 112 to a role holding 128)."""
    kernels = stage.module.kernel_source().split("__launch_bounds__(")[1:]
    for kernel in kernels:
        threads = int(re.match(r"\s*(\d+)", kernel).group(1))
        start = min(255, 65536 // threads) // 8 * 8
        for way, count in re.findall(r"warpgroup_reg_(alloc|dealloc)<(\d+)>", kernel):
            assert (int(count) >= start) if way == "alloc" else (int(count) <= start), (
                f"{stage.name}: warpgroup_reg_{way}<{count}> with {threads} threads, which start "
                f"with {start} registers each")


@pytest.fixture(scope="module")
def compiled_stages(request):
    """Compile every selected stage for every public head configuration, in parallel, once."""
    warm_up({item.callspec.params["stage"] for item in request.session.items
             if item.originalname == "test_stage_matches_reference"})


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("stage", STAGES, ids=lambda s: s.id)
def test_stage_matches_reference(stage, problem, compiled_stages):
    reason = stage.missing()
    if reason:
        pytest.skip(f"{stage.name}: {reason}")
    inputs = op_inputs(stage.op, problem.inputs(device="cuda", seed=zlib.crc32(problem.label.encode())))
    check_op(stage.op, stage.module.run, inputs)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", GPU_PROBLEMS, ids=lambda p: p.label)
@pytest.mark.parametrize("BV", [32, 64, 128])
@pytest.mark.parametrize("stage_id", ["gdn_fwd.s14", "gdn_fwd.s16"])
def test_every_kernel_width_matches_reference(stage_id, BV, problem):
    """gdn_fwd.s14 and s16 forced to each width: ``block_v`` takes 128 only with many CTAs, which
    the public shape set above has only for (16, 48) and (16, 64)."""
    stage = next(s for s in STAGES if s.id == stage_id)
    inputs = op_inputs(stage.op, problem.inputs(device="cuda", seed=zlib.crc32(problem.label.encode())))
    check_op(stage.op, functools.partial(stage.module.run, BV=BV), inputs)


@pytest.mark.parametrize("number,columns", [(15, ("s12 f32", "s12 f64", "s14 f128")),
                                            (17, ("s12 f32", "s16 f64", "s16 f128"))],
                         ids=["s15", "s17"])
def test_width_rules_pick_the_fastest_measured(number, columns):
    """gdn_fwd.s15's and s17's width rules, on the lengths of every problem of the committed
    kernel_width.csv, pick the fastest of their kernels at 32, 64 and 128 measured there (4 x H100,
    51893cc), and s14's equal-length rule does not on 28672 + 4096 of (16, 48) and (16, 64)."""
    from flashqla import bench
    from flashqla.stages import load

    s14, stage = load("gdn_fwd", 14), load("gdn_fwd", number)
    rows = bench.read_csv(bench.RESULTS / "kernel_width.csv")
    assert len(rows) == len(bench.PROBLEMS)
    for row in rows:
        _, HV, lengths = bench.heads_and_lengths(row["problem"])
        ms = {bv: float(row[c]) for bv, c in zip((32, 64, 128), columns)}
        pick = stage.block_v([-(-n // stage.CHUNK_SIZE) for n in lengths], HV, 128, 132)
        assert pick == min(ms, key=ms.get), (row["problem"], pick, ms)
        if len(lengths) == 2 and HV >= 48:
            assert s14.block_v(2, HV, 128, 132) == 128 and ms[128] > 1.15 * ms[pick]


def test_width_rule_check_catches_stale_steps():
    """The check above can fail: s15's steps (s14's table) on s17's kernels pick a slower width
    somewhere ((8, 24) 8 x 4096: 64, where s16 at 128 is faster)."""
    from flashqla import bench
    from flashqla.stages import load

    s15 = load("gdn_fwd", 15)
    wrong = []
    for row in bench.read_csv(bench.RESULTS / "kernel_width.csv"):
        _, HV, lengths = bench.heads_and_lengths(row["problem"])
        ms = {32: float(row["s12 f32"]), 64: float(row["s16 f64"]), 128: float(row["s16 f128"])}
        if s15.block_v([-(-n // s15.CHUNK_SIZE) for n in lengths], HV, 128, 132) != min(ms, key=ms.get):
            wrong.append(row["problem"])
    assert wrong
