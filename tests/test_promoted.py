"""The library runs what the workbench tested: each kernel in flashqla.fwd and flashqla.bwd builds the
same TileLang program as the stage it was promoted from and is compiled with the same options, the
API takes the kernel path exactly where it should, the split rules are the stages', and (GPU) the
forward and the backward, split by AutoCP or not, pass the gdn_fwd and gdn_bwd checks and give, bit
for bit, what the stages they promote (gdn_fwd.s44, gdn_bwd.s03) give."""

import functools
import itertools
import sys

import pytest
import torch

from flashqla import autocp, bwd, fwd
from flashqla.api import kernel_unsupported
from flashqla.stages import load
from flashqla.testing import Problem, check_op, op_inputs, run_on_threads

PROMOTED = [  # (library builder, stage, the stage's builder, a shape)
    (fwd.chunk_local_cumsum_kernel, ("chunk_local_cumsum", 3), "chunk_local_cumsum_kernel", (32,)),
    (fwd.chunk_local_cumsum_kernel, ("chunk_local_cumsum", 3), "chunk_local_cumsum_kernel", (24,)),
    (fwd.gate_free_solve_kernel, ("gate_free_solve", 15), "gate_free_solve_kernel", (16, 64, 4)),
    (fwd.gate_free_solve_kernel, ("gate_free_solve", 15), "gate_free_solve_kernel", (16, 48, 3, True)),
    (fwd.gate_free_solve_with_cumsum_kernel, ("gate_free_solve", 16), "cumsum_solve_kernel", (16, 32, 2)),
    (fwd.gate_free_solve_with_cumsum_kernel, ("gate_free_solve", 16), "cumsum_solve_kernel", (16, 16, 1)),
    (fwd.windows_kernel, ("gdn_fwd", 18), "windows_kernel", (32,)),
    (fwd.warmup_kernel, ("gdn_fwd", 44), "warmup_kernel", (16, 32)),
    (fwd.warmup_kernel, ("gdn_fwd", 44), "warmup_kernel", (2, 8)),
    (fwd.chain_kernel, ("gdn_fwd", 24), "chain_kernel", (32,)),
    (fwd.chain_kernel, ("gdn_fwd", 24), "chain_kernel", (8,)),
    (fwd.fused_reform_kernel, ("gdn_fwd", 12), "fused_reform_kernel", (16, 32, 128, 128, 64)),
    (fwd.fused_reform_kernel, ("gdn_fwd", 12), "fused_reform_kernel", (2, 8, 128, 128, 32)),
    (fwd.fused_reform_kernel, ("gdn_fwd", 12), "fused_reform_kernel", (4, 16, 128, 128, 16)),
    (fwd.fused_state_value_kernel, ("gdn_fwd", 34), "fused_state_value_kernel", (16, 64, 128, 128, 128)),
    (fwd.fused_state_value_kernel, ("gdn_fwd", 34), "fused_state_value_kernel", (16, 32, 128, 128, 64)),
    (fwd.fused_state_in_registers_kernel, ("gdn_fwd", 40), "fused_state_value_kernel", (16, 48, 128, 128, 64)),
    (fwd.fused_state_in_registers_kernel, ("gdn_fwd", 40), "fused_state_value_kernel", (2, 8, 128, 128, 64)),
    # the backward (kernels/gdn_bwd/s02_fused_walks.py and the stages it runs); the walk with the
    # library's BV
    (bwd.prep_kernel, ("gdn_bwd", 2), "prep_kernel", (16, 32)),
    (bwd.walk_kernel, ("gdn_bwd", 2), "walk_kernel", (16, 32, bwd.BV)),
    (bwd.chunk_bwd_dqkwg_kernel, ("chunk_bwd_dqkwg", 1), "chunk_bwd_dqkwg_kernel", (16, 32)),
    (bwd.wy_bwd_kernel, ("wy_bwd", 1), "wy_bwd_kernel", (16, 32)),
    (bwd.finish_kernel, ("gdn_bwd", 2), "finish_kernel", (16, 32)),
    # backward AutoCP (kernels/gdn_bwd/s03_autocp_walks.py)
    (bwd.bwd_windows_kernel, ("gdn_bwd", 3), "bwd_windows_kernel", (32,)),
    (bwd.dh_warmup_kernel, ("gdn_bwd", 3), "dh_warmup_kernel", (16, 32)),
    (bwd.dh_warmup_kernel, ("gdn_bwd", 3), "dh_warmup_kernel", (2, 8)),
]
# how a stage compiles a kernel, where it is not ``_compiled(*shape)``: gdn_bwd.s02 and s03 have one
# function per kernel, each taking (H, HV) (the walk's BV is the stage's) or (HV,) (s03's windows);
# gdn_fwd.s18's windows kernel takes (HV,)
STAGE_COMPILE = {"prep_kernel": "_prep", "walk_kernel": "_walk", "finish_kernel": "_finish",
                 "windows_kernel": "_windows", "chain_kernel": "_chain",
                 "bwd_windows_kernel": "_windows", "dh_warmup_kernel": "_dh_warmup"}
IDS = [f"{op}.s{n:02d}.{name}{shape}".replace(" ", "") for _, (op, n), name, shape in PROMOTED]


@pytest.mark.parametrize("builder, stage, stage_builder, shape", PROMOTED, ids=IDS)
def test_promoted_kernel_is_the_stage_kernel(builder, stage, stage_builder, shape):
    assert builder(*shape).script() == getattr(load(*stage), stage_builder)(*shape).script()


def test_solve_storing_wy_differs_only_in_its_store():
    """The solve storing WY (``store_wy``, gdn_fwd.s36's idea on gate_free_solve.s15's kernel: above,
    compiled as gdn_fwd.s42 compiles it) is another program than the one storing Ab."""
    assert fwd.gate_free_solve_kernel(16, 48, 3, True).script() != fwd.gate_free_solve_kernel(16, 48, 3).script()


def test_store_wy_is_the_stage_rule():
    """The library splits, and stores WY in the solve (running gdn_fwd.s40's kernel), exactly where
    gdn_fwd.s44 does (WY: BV 64, unsplit, three or four heads a CTA; the rule weighing that launch at
    WY_STEP), on the benchmark's 40 problems (132 SMs) and two more: WY on (16, 48) and (16, 64)
    from 1x2048 to 28672+4096, and (2, 8) 8x4096 (the other batches of 8 run at BV 128)."""
    s44 = load("gdn_fwd", 44)
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(autocp, "num_sms", lambda device: 132)
    from flashqla.bench import PROBLEMS, short_label

    stored = set()
    try:
        for p in PROBLEMS + [Problem(16, 48, (1500, 77)), Problem(16, 64, (1000, 300))]:
            # only shapes and lengths matter to the rules: zero-stride stand-ins, no data
            x = dict(q=torch.zeros(()).expand(1, sum(p.lengths), p.H, 128),
                     v=torch.zeros(()).expand(1, sum(p.lengths), p.HV, 128),
                     cu_seqlens=torch.tensor([0, *itertools.accumulate(p.lengths)], dtype=torch.int32))
            B, T, H = x["q"].shape[:3]
            # what fwd.forward decides (kept per lengths: asked twice, the second answer is the kept one)
            for _ in range(2):
                bounds, (R, BV, wy, L) = fwd.launch_decisions(x["cu_seqlens"], B, T, H, p.HV, 128, 132, None)
            plan = fwd.segment_plan(x["cu_seqlens"], B, T, p.HV, 132, "cpu", L, bounds)
            mine = wy and plan is None
            BV44, plan44, stored44 = s44.launch(x["q"], x["v"], x["cu_seqlens"], None)
            assert (BV, mine) == (BV44, stored44), p.label
            assert (plan is None) == (plan44 is None) and (plan is None or plan.segment_chunks == plan44.segment_chunks)
            if mine and p in PROBLEMS:
                stored.add(short_label(p.label))
    finally:
        monkeypatch.undo()
    assert stored == {f"({h}) {n}" for h in ("16, 48", "16, 64") for n in ("1x2048", "1x8192", "1x32768", "28672+4096")
                      } | {"(2, 8) 8x4096"}


def test_solve_groups_value_heads_as_its_stage():
    """The solve's CTAs take gate_free_solve.s11's number of value heads (s06's ``cta_heads``, or two
    or one where three or four leave fewer than three CTAs an SM): the copies of the kernels above
    are only the stages' at that number; and the forward runs s08's kernel exactly where
    gate_free_solve.s11 does."""
    stage, by_forward = load("gate_free_solve", 6), load("gate_free_solve", 11)
    changed = set()
    for H, HV in [(2, 8), (4, 16), (8, 24), (8, 32), (16, 16), (16, 32), (16, 48), (16, 64), (1, 8), (2, 12)]:
        assert fwd.cta_heads(H, HV) == stage.cta_heads(H, HV)
        for num_chunks, sms in [(32, 132), (33, 132), (128, 132), (129, 132), (512, 132), (1, 114), (0, 132)]:
            R = fwd.solve_heads(H, HV, num_chunks, sms)
            assert R == by_forward.heads_per_cta(H, HV, num_chunks, sms)
            assert (R <= fwd.SOLVE_TF32_MAX_HEADS) == (by_forward.BY_GRID.stage_for(R) is by_forward.BY_HEADS.TENSOR_CORE)
            if R != fwd.cta_heads(H, HV):
                changed.add(R)
    assert changed == {1, 2}


# the kernel of gdn_fwd.s27 (s34's after its prologue, as programmatic dependents) that each forward
# stage's builder is compiled as
S27_KERNEL = {("gdn_fwd", 18): "windows", ("gdn_fwd", 24): "chain", ("gdn_fwd", 12): "fused_narrow"}


def compile_as_s34(stage, shape):
    """Compile a forward stage's builder as the library's forward (gdn_fwd.s44's) compiles it: the
    cumsum as s29, the solve as s42, the cumsum-and-solve kernel as s43 at gate_free_solve.s14's CTAs
    an SM, the wide fused kernel as s34, the kernel with the state in registers as s40, the rest as
    s27."""
    s34 = load("gdn_fwd", 34)
    if stage == ("chunk_local_cumsum", 3):
        return s34.S33.S32.S31.S30.S29._cumsum.__wrapped__(*shape)
    if stage == ("gate_free_solve", 15):
        return load("gdn_fwd", 42)._solve.__wrapped__(*(shape + (False,))[:4])  # store_wy: False unless given
    if stage == ("gate_free_solve", 16):
        return load("gdn_fwd", 43)._cumsum_solve.__wrapped__(*shape)
    if stage == ("gdn_fwd", 34):
        return s34._wide.__wrapped__(*shape)
    if stage == ("gdn_fwd", 40):
        return load("gdn_fwd", 40)._wide.__wrapped__(*shape)
    if stage == ("gdn_fwd", 44):
        return load("gdn_fwd", 44)._warmup.__wrapped__(*shape)
    return s34.S27._compiled.__wrapped__(S27_KERNEL[stage], *shape)


def record_compiles(monkeypatch) -> list:
    """tilelang.compile replaced by a recorder of (program, options): nothing is compiled."""
    import tilelang

    calls = []
    monkeypatch.setattr(tilelang, "compile", lambda func, **options: calls.append((func.script(), options)))
    return calls


@pytest.mark.parametrize("builder, stage, stage_builder, shape", PROMOTED, ids=IDS)
def test_promoted_kernel_compiles_with_the_stage_options(builder, stage, stage_builder, shape,
                                                         monkeypatch):
    """The library compiles each kernel with its stage's target and pass configs (the fused forward
    kernel and the backward's walk are only correct without shared-memory reuse), and the stage
    compiles the same program (for the walk: with the library's BV); each forward kernel as gdn_fwd.s34
    compiles it (a programmatic dependent; the solve at its launch bounds). tilelang.compile is replaced by a recorder: nothing is
    compiled."""
    calls = record_compiles(monkeypatch)
    sys.modules[builder.__module__]._compiled.__wrapped__(builder, *shape)
    module = load(*stage)
    if builder.__module__ == fwd.__name__:
        compile_as_s34(stage, shape)
    elif stage_builder in STAGE_COMPILE:
        getattr(module, STAGE_COMPILE[stage_builder]).__wrapped__(*shape[:2])  # (H, HV) or (HV,)
    else:
        module._compiled.__wrapped__(*shape)
    (library_program, library), (staged_program, staged) = calls
    assert library == staged, (library, staged)
    assert library_program == staged_program


def test_promoted_compile_check_catches_a_missing_dependent_launch(monkeypatch):
    """The compile check above fails for a forward kernel compiled without PDL (as s26 did)."""
    calls = record_compiles(monkeypatch)
    monkeypatch.setattr(fwd, "dependent_launch", lambda func: func)
    fwd._compiled.__wrapped__(fwd.chain_kernel, 32)
    load("gdn_fwd", 27)._compiled.__wrapped__("chain", 32)
    assert calls[0][0] != calls[1][0]


def test_promoted_compile_check_catches_a_backward_kernel_without_dependent_launch(monkeypatch):
    """... and for the backward's dh warm-up compiled without PDL (gdn_bwd.s03 launches it as a
    programmatic dependent, among the forward's AutoCP kernels)."""
    calls = record_compiles(monkeypatch)
    monkeypatch.setattr(bwd, "DEPENDENT", ())
    bwd._compiled.__wrapped__(bwd.dh_warmup_kernel, 2, 8)
    load("gdn_bwd", 3)._dh_warmup.__wrapped__(2, 8)
    assert calls[0][0] != calls[1][0]


def test_promoted_compile_check_catches_other_launch_bounds(monkeypatch):
    """The compile check above fails for the solve compiled at s08's four CTAs an SM, not s14's."""
    calls = record_compiles(monkeypatch)
    monkeypatch.setattr(fwd, "SOLVE_CTAS_PER_SM", {1: 4, 2: 4})
    fwd._compiled.__wrapped__(fwd.gate_free_solve_with_cumsum_kernel, 16, 16, 1)
    compile_as_s34(("gate_free_solve", 16), (16, 16, 1))
    assert calls[0][0] != calls[1][0]


def test_block_v_is_the_stage_rule():
    """The fused kernel's BV per launch is gdn_fwd.s34's rule on the lengths (s15's on s33's steps),
    also where equal lengths are assumed; every width is taken somewhere."""
    s34 = load("gdn_fwd", 34)
    def stage_rule(chunks, hv, sms):
        return s34.S27.S18.PIPELINE.block_v(chunks, hv, 128, sms, s34.STEP)
    for chunks, hv, sms in [([512], 8, 132), ([512], 64, 132), ([448, 64], 64, 132), ([448, 64], 24, 132),
                            ([64] * 8, 64, 132), ([64] * 8, 24, 132), ([64] * 8, 8, 132), ([1, 300, 7], 32, 114),
                            ([32], 8, 132), ([32], 16, 132), ([32], 24, 132)]:
        assert fwd.block_v(chunks, hv, 128, sms) == stage_rule(chunks, hv, sms)
    for num_seqs, hv, sms in [(1, 8, 132), (1, 64, 132), (2, 64, 132), (8, 24, 132), (8, 64, 132), (3, 16, 114)]:
        assert fwd.block_v([1] * num_seqs, hv, 128, sms) == stage_rule([1] * num_seqs, hv, sms)
    assert {fwd.block_v([32], 16, 128, 132), fwd.block_v([512], 24, 128, 132), fwd.block_v([512], 64, 128, 132),
            fwd.block_v([64] * 8, 64, 128, 132)} == {16, 32, 64, 128}


def test_segment_chunks_is_the_stage_rule():
    """AutoCP's split per launch is gdn_fwd.s44's rule (s25's form at s44's costs), forced or
    decided, at the steps of every width and at WY_STEP."""
    s44 = load("gdn_fwd", 44)
    cases = [([512], 8, 132, 0.85), ([512], 16, 132, 0.85), ([448, 64], 8, 132, 0.85), ([128], 8, 132, 0.85),
             ([128], 32, 132, 0.85), ([64] * 8, 64, 132, 1.37), ([512], 32, 114, 1.0), ([3, 700, 1, 40], 4, 132, 0.85),
             ([512], 48, 132, fwd.WY_STEP), ([448, 64], 64, 132, fwd.WY_STEP)]
    assert fwd.WY_STEP == s44.WY_STEP
    for chunks, hv, sms, step in cases:
        for force in (None, False, True, 5):
            assert fwd.segment_chunks(chunks, hv, sms, step, force) == s44.segment_chunks(chunks, hv, sms, step, force)
    assert {fwd.segment_chunks(c, hv, sms, step) for c, hv, sms, step in cases} >= {0, 16, 32, 64}


BWD_RULE_CASES = [([128], 8, 132), ([512], 8, 132), ([512], 16, 132), ([512], 64, 132), ([448, 64], 8, 132),
                  ([64] * 8, 8, 132), ([188, 1, 32, 11], 8, 132), ([3, 700, 1, 40], 4, 132), ([512], 32, 114),
                  ([0], 8, 132)]


def test_bwd_segment_chunks_is_the_stage_rule():
    """Backward AutoCP's split is gdn_bwd.s03's rule, forced or decided; the cases split at L 16 and
    32 and not at all."""
    s03 = load("gdn_bwd", 3)
    for chunks, hv, sms in BWD_RULE_CASES:
        for force in (None, False, True, 5):
            assert bwd.segment_chunks(chunks, hv, sms, force) == s03.segment_chunks(chunks, hv, sms, force)
    assert {bwd.segment_chunks(c, hv, sms) for c, hv, sms in BWD_RULE_CASES} >= {0, 16, 32}
    with pytest.raises(ValueError, match="`cp` as segment length must be >= 1 chunk; got 0"):
        bwd.segment_chunks([512], 8, 132, 0)


@pytest.mark.parametrize("constant, value", [("WALK_LANES", 1), ("MIN_GAIN", 2.0), ("SEGMENT_LADDER", (8, 32))])
def test_bwd_rule_check_catches_a_changed_rule(constant, value, monkeypatch):
    """The check above fails for a copy of the rule with one constant changed."""
    s03 = load("gdn_bwd", 3)
    monkeypatch.setattr(bwd, constant, value)
    assert any(bwd.segment_chunks(c, hv, sms, force) != s03.segment_chunks(c, hv, sms, force)
               for c, hv, sms in BWD_RULE_CASES for force in (None, True))


def test_a_changed_kernel_is_caught():
    """The check above can fail: two different kernels print different programs."""
    assert fwd.warmup_kernel(16, 32).script() != fwd.warmup_kernel(16, 64).script()


@pytest.mark.parametrize("module, constant, value, builder, stage, stage_builder, shape", [
    (fwd, "FUSED_THREADS", 256, fwd.fused_reform_kernel, ("gdn_fwd", 12), "fused_reform_kernel", (16, 32, 128, 128, 64)),
    (fwd, "REGS_CHAIN", 200, fwd.fused_reform_kernel, ("gdn_fwd", 12), "fused_reform_kernel", (16, 32, 128, 128, 32)),
    (fwd, "REGS_WIDE_STATE", 160, fwd.fused_state_value_kernel, ("gdn_fwd", 34), "fused_state_value_kernel", (16, 64, 128, 128, 128)),
    (fwd, "GROWTH_LIMIT", 4.0, fwd.gate_free_solve_kernel, ("gate_free_solve", 15), "gate_free_solve_kernel", (16, 64, 4)),
    (fwd, "KKT_STRIDE", 64, fwd.gate_free_solve_with_cumsum_kernel, ("gate_free_solve", 16), "cumsum_solve_kernel", (16, 32, 2)),
    (fwd, "CUMSUM_SEGMENTS", 4, fwd.gate_free_solve_with_cumsum_kernel, ("gate_free_solve", 16), "cumsum_solve_kernel", (16, 16, 1)),
    (fwd, "BLOCK", 32, fwd.warmup_kernel, ("gdn_fwd", 44), "warmup_kernel", (16, 32)),
    (fwd, "REGS_WARMUP_CHAIN", 216, fwd.warmup_kernel, ("gdn_fwd", 44), "warmup_kernel", (16, 32)),
    (fwd, "CHAIN_COLUMNS", 16, fwd.chain_kernel, ("gdn_fwd", 24), "chain_kernel", (32,)),
    (bwd, "STAGES", 3, bwd.walk_kernel, ("gdn_bwd", 2), "walk_kernel", (16, 32, 64)),
    (bwd, "WARPGROUP", 256, bwd.finish_kernel, ("gdn_bwd", 2), "finish_kernel", (16, 32)),
    (bwd, "TWO_WG_THREADS", 128, bwd.wy_bwd_kernel, ("wy_bwd", 1), "wy_bwd_kernel", (16, 32)),
    (bwd, "WINDOW_THREADS", 128, bwd.bwd_windows_kernel, ("gdn_bwd", 3), "bwd_windows_kernel", (32,)),
    (bwd, "MAX_WINDOW", 32, bwd.bwd_windows_kernel, ("gdn_bwd", 3), "bwd_windows_kernel", (32,)),
    (bwd, "STAGES", 3, bwd.dh_warmup_kernel, ("gdn_bwd", 3), "dh_warmup_kernel", (2, 8)),
], ids=["fwd.FUSED_THREADS", "fwd.REGS_CHAIN", "fwd.REGS_WIDE_STATE", "fwd.GROWTH_LIMIT", "fwd.KKT_STRIDE",
        "fwd.CUMSUM_SEGMENTS", "fwd.BLOCK",
        "fwd.REGS_WARMUP_CHAIN", "fwd.CHAIN_COLUMNS", "bwd.STAGES",
        "bwd.WARPGROUP", "bwd.TWO_WG_THREADS", "bwd.WINDOW_THREADS", "bwd.MAX_WINDOW", "bwd.STAGES-dh_warmup"])
def test_a_changed_copy_is_caught(module, constant, value, builder, stage, stage_builder, shape,
                                  monkeypatch):
    """flashqla.fwd and flashqla.bwd hold their stages' constants (some renamed): a copy built with
    a different value would no longer print the stage's program."""
    monkeypatch.setattr(module, constant, value)
    assert builder(*shape).script() != getattr(load(*stage), stage_builder)(*shape).script()


@pytest.mark.parametrize("device, dtype, K, V, why", [
    ("cpu", torch.bfloat16, 128, 128, "the inputs are on the cpu"),
    ("cuda", torch.float16, 128, 128, "the kernels take torch.bfloat16"),
    ("cuda", torch.bfloat16, 64, 128, "K = 64 and V = 128; the kernels need K = V = 128"),
    ("cuda", torch.bfloat16, 128, 256, "K = 128 and V = 256"),
    ("cuda", torch.bfloat16, 128, 128, None),
])
def test_kernel_path_only_where_the_kernels_apply(device, dtype, K, V, why, monkeypatch):
    monkeypatch.setattr("flashqla.api.hopper_gpu_missing", lambda: None)  # pretend an H100 is here
    reason = kernel_unsupported(torch.device(device), dtype, K, V)
    assert reason is None if why is None else why in reason


@pytest.fixture(scope="module")
def compiled_forwards():
    """The library's forward and gdn_fwd.s44's, compiled on threads for the heads of the GPU tests
    below: unsplit at the fused kernels' widths (one sequence, nine) and split (windows, warm-up,
    chaining); the solve with one, two (short) and cta_heads (long) heads a CTA."""
    s44 = load("gdn_fwd", 44)
    calls = []
    for H, HV in ((2, 8), (4, 16), (16, 64), (16, 32), (16, 16), (8, 24)):
        for lengths, cp in (((70,), False), ((70,) * 9, False), ((512,), 2), ((9000,), False)):
            x = Problem(H, HV, lengths).inputs("cuda")
            calls += [functools.partial(f, **x, cp=cp) for f in (fwd.forward, s44.forward)]
    run_on_threads(calls)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(2, 8, (24576,)), None),                                # the rule splits: 8 x 3072 tokens
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # varlen, empty segment rows
    (Problem(2, 8, (777, 5000), initial_state=False), 2),           # 42 segments
], ids=["auto", "varlen-L4", "no-h0-L2"])
def test_forward_with_autocp_within_the_bound(problem, cp, compiled_forwards):
    """The library's forward split by AutoCP (the windows and warm-up kernels, the chaining, the
    fused kernel over segments) passes the gdn_fwd check against float64."""
    x = problem.inputs("cuda", seed=1)
    B, T = x["q"].shape[:2]
    assert fwd.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), "cuda", cp,
                          fwd.STEP[32]) is not None
    check_op("gdn_fwd", lambda **kw: fwd.forward(**kw, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp", [
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), False),        # the fused kernel on sequences
    (Problem(4, 16, (3000, 1, 700, 2500, 64, 1300)), 4),            # ... on segments
    (Problem(2, 8, (1000, 1000), varlen=False, initial_state=False), 3),
    (Problem(16, 64, (700, 650, 700, 1, 700)), False),              # BV 128 (s34's kernel)
    (Problem(16, 64, (1000, 300)), False),                          # BV 64 (s34's kernel)
    (Problem(16, 32, (3000, 700)), False),                          # the cumsum-and-solve kernel (2 heads a CTA)
    (Problem(16, 16, (2000, 64, 900)), 3),                          # ... 1 head a CTA, split
    (Problem(2, 8, (2000,)), None),                                 # ... 2 heads a CTA: few chunks
    (Problem(4, 16, (1500, 77)), None),
    (Problem(8, 24, (2000,)), None),                                # ... 1 head a CTA: 3 don't fill
    (Problem(16, 16, (1000,)), None),                               # BV 16 (s12's kernel)
    (Problem(16, 48, (3000,)), None),                               # WY stored by the solve, s40's kernel
    (Problem(8, 32, (2500, 1, 700)), None),                         # ... four heads a CTA, varlen
], ids=["varlen-off", "varlen-L4", "batch-L3", "wide", "mid", "solve-tf32", "solve-tf32-L3",
        "solve-spread", "solve-spread-varlen", "solve-one", "narrowest", "wy-stored", "wy-stored-varlen"])
def test_forward_is_the_stage_forward(problem, cp, compiled_forwards):
    """flashqla.fwd.forward runs gdn_fwd.s44's kernels in s44's order on the same inputs: the same
    bits (the kernels are deterministic, tests/test_autocp.py)."""
    x = problem.inputs("cuda", seed=4)
    want = load("gdn_fwd", 44).forward(**x, cp=cp)
    got = fwd.forward(**x, cp=cp)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- the backward: gdn_bwd.s03 (backward AutoCP where its rule splits, s02's path elsewhere)
BWD_CASES = [  # (problem, cp, dht given, whether it splits)
    (Problem(2, 8, (8192,), varlen=False), None, True, True),        # the rule: L 16, a batch
    (Problem(2, 8, (12000, 1, 2000, 700)), None, True, True),        # the rule: L 16, varlen
    (Problem(2, 8, (3000, 1, 700, 2500, 64, 1300)), 4, True, True),  # varlen, empty segment rows
    (Problem(2, 8, (777, 5000), initial_state=False), 2, False, True),  # no h0, no dht
    (Problem(2, 8, (700, 70)), None, True, False),                   # the rule: no split
]


def bwd_inputs(problem, dht, seed):
    x = op_inputs("gdn_bwd", problem.inputs("cuda", seed=seed))
    return dict(x, dht=x["dht"] if dht else None)


@pytest.fixture(scope="module")
def compiled_backwards():
    """The library's backward and gdn_bwd.s03's, compiled on threads for (2, 8): split after the
    solve of two heads a CTA (short) and of four (long), and unsplit (about 30 TileLang kernels)."""
    s03 = load("gdn_bwd", 3)
    run_on_threads([functools.partial(f, **bwd_inputs(Problem(2, 8, lengths), True, 0), cp=cp)
                    for lengths, cp in (((700,), 2), ((15000,), 2), ((700, 70), False))
                    for f in (bwd.backward, s03.run)])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem, cp, dht, splits", BWD_CASES,
                         ids=["auto-batch", "auto-varlen", "varlen-L4", "no-h0-no-dht-L2", "unsplit"])
def test_backward_is_the_stage_backward(problem, cp, dht, splits, compiled_backwards):
    """flashqla.bwd.backward runs gdn_bwd.s03's kernels on the same plan: the same bits (the kernels
    are deterministic, tests/test_bwd_autocp.py), within the gdn_bwd check against float64."""
    x = bwd_inputs(problem, dht, seed=4)
    B, T = x["q"].shape[:2]
    p = bwd.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), "cuda", cp)
    assert (p is not None) == splits
    want = load("gdn_bwd", 3).run(**x, cp=cp)
    got = bwd.backward(**x, cp=cp)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert (a is None and b is None) or torch.equal(a, b), name
    check_op("gdn_bwd", lambda **kw: bwd.backward(**kw, cp=cp), x)


@pytest.mark.gpu
@pytest.mark.hopper
def test_split_backward_replays_in_a_cuda_graph(compiled_backwards):
    """The split backward, after one eager call (the host read of cu_seqlens, the plan kept), is
    captured in a CUDA graph whose replay gives the eager bits, again after the inputs change."""
    import types

    from test_bwd_autocp import check_graph_replay

    problem, cp, dht, _ = BWD_CASES[1]
    x = bwd_inputs(problem, dht, seed=3)
    B, T = x["q"].shape[:2]
    assert bwd.split_plan(x["cu_seqlens"], B, T, problem.HV, autocp.num_sms("cuda"), "cuda", cp) is not None
    check_graph_replay(types.SimpleNamespace(run=bwd.backward), x, cp)
