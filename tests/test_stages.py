"""Every stage under kernels/, found by itself: a compile test on any machine, a GPU test on the GPU.

The compile tests run the milestones (``flashqla.stages.MILESTONES``) by default and every stage
with ``--all-stages``; the GPU test runs every stage.

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


def _compile_selected(stage, config):
    if not (stage.milestone or config.getoption("--all-stages")):
        pytest.skip("a lab-log stage: its compile test runs with --all-stages")


@pytest.mark.parametrize("stage", TILELANG_STAGES, ids=lambda s: s.id)
def test_compiles_for_hopper(stage, pytestconfig):
    _compile_selected(stage, pytestconfig)
    source = stage.module.kernel_source()
    for needle in stage.module.SOURCE_MUST_CONTAIN:
        assert needle in source, f"{stage.name}: generated CUDA lacks `{needle}`"


@pytest.mark.parametrize("stage", TILELANG_STAGES, ids=lambda s: s.id)
def test_register_budgets_move_the_right_way(stage, pytestconfig):
    """setmaxnreg.inc may only raise, and .dec only lower, the count each thread starts with
    (65536 registers / the launch's threads, at most 255, a multiple of 8). The other way is an
    illegal instruction on the GPU (s09's first draft allocated 112 to a role holding 128)."""
    _compile_selected(stage, pytestconfig)
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
             if item.originalname == "test_stage_matches_reference" and "stage" in item.callspec.params})


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


# ---- gdn_fwd.s27: s26's kernels as programmatic dependents
S27_SHAPES = {"table": (64,), "cumsum": (32,), "solve": (16, 64, 4), "solve_tf32": (16, 32, 2), "windows": (32,),
              "warmup": (16, 32), "chain": (32,), "fused_narrow": (2, 8, 128, 128, 32),
              "fused": (16, 32, 128, 128, 64)}
# each kernel's own stage compile (module, its compile function; None: flashqla.varlen's chunk table):
# what s27 must match, PDL aside
S27_STAGE_COMPILE = {"table": (None, "_table_compiled"), "cumsum": (("chunk_local_cumsum", 2), "_compiled"), "solve": (("gate_free_solve", 6), "_compiled"),
                     "solve_tf32": (("gate_free_solve", 8), "_compiled"), "windows": (("gdn_fwd", 18), "_windows"),
                     "warmup": (("gdn_fwd", 23), "_compiled"), "chain": (("gdn_fwd", 24), "_chain"),
                     "fused_narrow": (("gdn_fwd", 12), "_compiled"), "fused": (("gdn_fwd", 16), "_compiled")}


def _s27_matches_its_stage(name, monkeypatch):
    import tilelang

    from flashqla import varlen
    from flashqla.stages import load

    calls = []
    monkeypatch.setattr(tilelang, "compile", lambda func, **options: calls.append((func.script(), options)))
    load("gdn_fwd", 27)._compiled.__wrapped__(name, *S27_SHAPES[name])
    stage, compile_fn = S27_STAGE_COMPILE[name]
    getattr(varlen if stage is None else load(*stage), compile_fn).__wrapped__(*S27_SHAPES[name])
    (mine, my_options), (theirs, their_options) = calls
    assert my_options == their_options
    waits = list(re.finditer(r"\n( +)T\.pdl_sync\(\)\n\1T\.pdl_trigger\(\)(?=\n)", mine))
    assert len(waits) == 1 and mine[:waits[0].start()] + mine[waits[0].end():] == theirs
    assert 0 < mine.index('with T.sblock("tilelang_root")') < waits[0].start()


@pytest.mark.parametrize("name", sorted(S27_SHAPES))
def test_s27_kernel_is_its_stage_kernel_waiting_first(name, monkeypatch):
    """Each kernel of gdn_fwd.s27 is its stage's program with griddepcontrol wait and
    launch_dependents as the first statements of its root block, and nothing else changed, compiled
    with its stage's pass configs (tilelang.compile replaced by a recorder: nothing is compiled)."""
    _s27_matches_its_stage(name, monkeypatch)


@pytest.mark.parametrize("name, wrong", [("fused", None), ("cumsum", {"tl.enable_fast_math": True})])
def test_s27_kernel_check_catches_other_options(name, wrong, monkeypatch):
    """The check above fails for an s27 kernel compiled with options its stage does not use."""
    from flashqla.stages import load

    s27 = load("gdn_fwd", 27)
    monkeypatch.setitem(s27.KERNELS, name, (s27.KERNELS[name][0], wrong))
    with pytest.raises(AssertionError):
        _s27_matches_its_stage(name, monkeypatch)


def test_dependent_launch_needs_one_kernel():
    """flashqla.hopper.dependent_launch refuses a program that is not one kernel, naming the argument."""
    import tilelang.language as T

    from flashqla.hopper import dependent_launch

    @T.prim_func
    def two_kernels(x: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            x[T.get_thread_binding()] = 1.0
        with T.Kernel(1, threads=128) as _:
            x[T.get_thread_binding()] = 2.0

    with pytest.raises(ValueError, match="`prim_func` must have one kernel"):
        dependent_launch(two_kernels)


def test_min_ctas_per_sm_needs_one_annotation_and_a_positive_count():
    """flashqla.hopper.min_ctas_per_sm rewrites the one ``T.annotate_min_blocks_per_sm`` of a kernel
    and refuses a kernel without one, or a count that is not a positive int, naming the argument."""
    import tilelang.language as T

    from flashqla.hopper import min_ctas_per_sm

    @T.prim_func
    def unannotated(x: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            x[T.get_thread_binding()] = 1.0

    @T.prim_func
    def annotated(x: T.Tensor((128,), "float32")):
        with T.Kernel(1, threads=128) as _:
            T.annotate_min_blocks_per_sm(4)
            x[T.get_thread_binding()] = 1.0

    assert '"tl.min_blocks_per_sm", 6' in min_ctas_per_sm(annotated, 6).script()
    with pytest.raises(ValueError, match="`prim_func` must annotate its CTAs an SM once"):
        min_ctas_per_sm(unannotated, 6)
    with pytest.raises(ValueError, match="`n` must be a positive int"):
        min_ctas_per_sm(annotated, 0)
