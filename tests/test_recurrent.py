"""flashqla.fused_recurrent_gated_delta_rule (decode): the reference's semantics in float64, a clear
error for every bad input, the library's kernel is fused_recurrent.s02's program at the library's
width BV, and (GPU) the kernel within the derived tolerance over tokens, batches, varlen, head
layouts, FLA's in-kernel options and a state pool updated in place."""

import functools
import math
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from flashqla import recurrent
from flashqla import reference as ref
from flashqla.stages import load
from flashqla.testing import Problem, cast_floats, check_op, rel_l2, run_on_threads

F64 = torch.float64
decode = recurrent.fused_recurrent_gated_delta_rule
STAGE = load("fused_recurrent", 2)
stage_run = functools.partial(STAGE.run, BV=recurrent.BV)  # s02 at the library's width


def _inputs(H=2, HV=4, lengths=(3, 1, 5, 0), varlen=True, K=16, V=16, initial_state=True,
            device="cpu", seed=0, dtype=None) -> dict:
    x = Problem(H, HV, lengths, varlen=varlen, K=K, V=V, initial_state=initial_state).inputs(device, seed)
    return x if dtype is None else cast_floats(x, dtype)


def _raw_gates(x: dict, seed=0) -> dict:
    """FLA's layer inputs for its in-kernel options: raw a and b, A_log = log(U(1, 16)), dt_bias the
    inverse softplus of U(1e-3, 0.1) (its initialization)."""
    gen = torch.Generator(x["v"].device).manual_seed(seed)
    B, T, HV = x["v"].shape[:3]
    dev, dt = x["v"].device, x["g"].dtype

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=dev, dtype=torch.float32)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.float32)

    dt_bias = torch.log(torch.expm1(1e-3 + (0.1 - 1e-3) * rand(HV)))
    return dict(x, g=randn(B, T, HV).to(dt), beta=randn(B, T, HV).to(dt),
                A_log=torch.log(1 + 15 * rand(HV)).to(dt), dt_bias=dt_bias.to(dt))


# ---- the reference (float64) -------------------------------------------------------------------

def test_reference_without_options_is_the_naive_recurrence():
    x = _inputs(dtype=F64)
    o, s = ref.fused_recurrent_gated_delta_rule_ref(**x)
    o_n, s_n = ref.naive_recurrent_gated_delta_rule(**x)
    assert torch.equal(o, o_n) and torch.equal(s, s_n)


def test_reference_options_are_their_formulas():
    x = _raw_gates(_inputs(dtype=F64), seed=1)
    q, k = 3.0 * x["q"], 0.5 * x["k"]
    got = ref.fused_recurrent_gated_delta_rule_ref(
        **{**x, "q": q, "k": k}, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
    g = -torch.exp(x["A_log"]) * F.softplus(x["g"] + x["dt_bias"])
    want = ref.naive_recurrent_gated_delta_rule(
        ref.l2norm(q), ref.l2norm(k), x["v"], g, 2 * torch.sigmoid(x["beta"]), None,
        x["initial_state"], True, x["cu_seqlens"])
    assert rel_l2(got[0], want[0]) < 1e-14 and rel_l2(got[1], want[1]) < 1e-14
    no_bias = ref.fused_recurrent_gated_delta_rule_ref(**{**x, "dt_bias": None}, use_gate_in_kernel=True)
    g0 = -torch.exp(x["A_log"]) * F.softplus(x["g"])
    plain = {n: x[n] for n in ("q", "k", "v", "beta", "initial_state", "cu_seqlens")}
    assert torch.equal(no_bias[0], ref.naive_recurrent_gated_delta_rule(**plain, g=g0)[0])


def test_reference_none_gate_and_beta_and_v_first_layout():
    x = _inputs(dtype=F64)
    o, s = ref.fused_recurrent_gated_delta_rule_ref(**{**x, "g": None, "beta": None})
    ones = torch.ones_like(x["g"])
    o_n, s_n = ref.naive_recurrent_gated_delta_rule(**{**x, "g": 0 * ones, "beta": ones})
    assert torch.equal(o, o_n) and torch.equal(s, s_n)
    o_t, s_t = ref.fused_recurrent_gated_delta_rule_ref(
        **{**x, "initial_state": x["initial_state"].transpose(-1, -2)}, state_v_first=True)
    o_k, s_k = ref.fused_recurrent_gated_delta_rule_ref(**x)
    assert torch.equal(o_t, o_k) and torch.equal(s_t, s_k.transpose(-1, -2))


def test_reference_pool_reads_slots_and_writes_only_present_ones():
    x = _inputs(dtype=F64)                                     # 4 sequences
    pool = torch.randn(6, 4, 16, 16, dtype=F64)
    idx = torch.tensor([4, -1, 0, 6])                          # -1 and 6 (= S) are padding
    h0 = torch.stack([pool[4], torch.zeros_like(pool[0]), pool[0], torch.zeros_like(pool[0])])
    o_w, s_w = ref.naive_recurrent_gated_delta_rule(**{**x, "initial_state": h0})
    before = pool.clone()
    o, s = ref.fused_recurrent_gated_delta_rule_ref(**{**x, "initial_state": pool}, ssm_state_indices=idx,
                                                    inplace_final_state=True)
    assert s is pool and torch.equal(o, o_w)
    assert torch.equal(pool[4], s_w[0]) and torch.equal(pool[0], s_w[2])
    assert torch.equal(pool[[1, 2, 3, 5]], before[[1, 2, 3, 5]])
    o2, s2 = ref.fused_recurrent_gated_delta_rule_ref(**{**x, "initial_state": before}, ssm_state_indices=idx)
    assert torch.equal(o2, o_w) and torch.equal(s2, s_w)


def test_reference_token_by_token_in_place_equals_one_call():
    """Decoding T tokens one call a token, the state carried in place, is one call of T tokens."""
    x = _inputs(lengths=(5, 5), varlen=False, dtype=F64)
    o_all, s_all = ref.fused_recurrent_gated_delta_rule_ref(**x)
    state = x["initial_state"].clone()
    outs = []
    for t in range(5):
        step = {n: x[n][:, t:t + 1] for n in ("q", "k", "v", "g", "beta")}
        outs.append(ref.fused_recurrent_gated_delta_rule_ref(**step, initial_state=state,
                                                             inplace_final_state=True)[0])
    assert rel_l2(torch.cat(outs, 1), o_all) < 1e-14 and rel_l2(state, s_all) < 1e-14


def test_decode_check_catches_a_broken_decode():
    """check_op of this op fails for a decode that forgets the decay or the in-kernel gate."""
    x = _inputs(dtype=torch.float32)
    with pytest.raises(AssertionError, match="wrong answer"):
        check_op("fused_recurrent", lambda **kw: ref.fused_recurrent_gated_delta_rule_ref(
            **{**kw, "g": torch.zeros_like(kw["g"])}), x)
    y = _raw_gates(x)
    with pytest.raises(AssertionError, match="wrong answer"):
        check_op("fused_recurrent", lambda **kw: ref.fused_recurrent_gated_delta_rule_ref(
            **{**kw, "use_gate_in_kernel": False}), dict(y, use_gate_in_kernel=True))


# ---- the public function on the CPU (the reference path) ---------------------------------------

def test_reference_path_results_dtypes_and_warning():
    recurrent._warned.clear()
    x = _inputs()
    with pytest.warns(UserWarning, match="running the PyTorch reference, because the inputs are on the cpu"):
        o, s = decode(**x)
    o_r, s_r = ref.fused_recurrent_gated_delta_rule_ref(**cast_floats(x, torch.float32))
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(o, o_r.to(torch.bfloat16)) and torch.equal(s, s_r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        decode(**x)  # the same reason does not warn twice
    x64 = cast_floats(x, F64)
    o64, s64 = decode(**x64)
    assert o64.dtype == F64 and s64.dtype == F64
    assert decode(**{**x, "output_final_state": False})[1] is None


def test_reference_path_ignores_autocast_and_keeps_gradients():
    x = cast_floats(_inputs(), torch.float32)
    want = decode(**x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(decode(**x)[0], want)
    q = x["q"].clone().requires_grad_()
    decode(**{**x, "q": q})[0].sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_reference_path_in_place_returns_the_pool():
    x = _inputs(lengths=(2, 2), varlen=False)
    pool = torch.randn(3, 4, 16, 16, dtype=torch.bfloat16)
    before = pool.clone()
    idx = torch.tensor([2, 0], dtype=torch.int32)
    o, s = decode(**{**x, "initial_state": pool, "output_final_state": False}, ssm_state_indices=idx,
                  inplace_final_state=True)
    assert s is pool and torch.equal(pool[1], before[1]) and not torch.equal(pool[2], before[2])


def test_fla_positional_order():
    """gk and gv sit between g and beta, as in FLA: a positional beta in their place is refused."""
    x = _inputs()
    o, _ = decode(x["q"], x["k"], x["v"], x["g"], None, None, x["beta"], None, x["initial_state"],
                  cu_seqlens=x["cu_seqlens"])
    assert torch.equal(o, decode(**x)[0])
    with pytest.raises(ValueError, match=re.escape("`gk` must be None")):
        decode(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"])


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _bad(**change):
    x = _inputs(lengths=(3, 1, 5), K=8, V=8)               # B = 1, T = 9, H = 2, HV = 4, N = 3
    x.pop("output_final_state")
    return {**x, **change}


BAD_INPUTS = {
    "unknown keyword": (dict(chunk_size=64), "unexpected keyword arguments ['chunk_size']"),
    "old layout keyword": (dict(transpose_state_layout=True), "FLA renamed it state_v_first"),
    "gk": (dict(gk=_t(1, 9, 4, 8)), "`gk` must be None (per-key and per-value decays are not supported"),
    "gv": (dict(gv=_t(1, 9, 4, 8)), "`gv` must be None"),
    "k shape differs from q": (dict(k=_t(1, 9, 2, 4)), "`k` must be the shape of q"),
    "mixed q/k/v dtypes": (dict(v=_t(1, 9, 4, 8, dtype=torch.float16)), "`k and v` must be the dtype of q"),
    "integer q": (dict(q=torch.ones(1, 9, 2, 8, dtype=torch.int32)), "`q` must be one of"),
    "HV not a multiple of H": (dict(v=_t(1, 9, 3, 8), g=_t(1, 9, 3), beta=_t(1, 9, 3)), "multiple of the H = 2"),
    "g shape": (dict(g=_t(1, 9, 2)), "`g` must be of shape (1, 9, 4)"),
    "per-value beta": (dict(beta=_t(1, 9, 4, 8)), "`beta` must be of shape (1, 9, 4)"),
    "raw gate without g": (dict(g=None, use_gate_in_kernel=True, A_log=_t(4)), "`g` must be the raw gate input"),
    "raw gate without A_log": (dict(use_gate_in_kernel=True), "`A_log` must be a tensor [HV]"),
    "A_log shape": (dict(use_gate_in_kernel=True, A_log=_t(2)), "`A_log` must be of shape (4,)"),
    "dt_bias shape": (dict(use_gate_in_kernel=True, A_log=_t(4), dt_bias=_t(1, 4)), "`dt_bias` must be of shape (4,)"),
    "neg eigval without sigmoid": (dict(allow_neg_eigval=True), "`allow_neg_eigval` must be False unless"),
    "scale NaN": (dict(scale=math.nan), "`scale` must be None or a finite real number"),
    "scale string": (dict(scale="0.1"), "`scale` must be None or a finite real number"),
    "scale vector": (dict(scale=torch.ones(2)), "`scale` must be None or a finite real number"),
    "cu_seqlens float": (dict(cu_seqlens=torch.tensor([0.0, 3.0, 9.0])), "`cu_seqlens` must be one of torch.int32"),
    "cu_seqlens too short": (dict(cu_seqlens=torch.tensor([0])), "`cu_seqlens` must be 1-D with at least 2"),
    "cu_seqlens not from 0": (dict(cu_seqlens=torch.tensor([1, 4, 5, 9])), "`cu_seqlens` must be starting at 0"),
    "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 5, 4, 9])), "`cu_seqlens` must be non-decreasing"),
    "cu_seqlens not ending at T": (dict(cu_seqlens=torch.tensor([0, 3, 4, 8])), "`cu_seqlens` must be ending at T = 9"),
    "initial_state count": (dict(initial_state=_t(2, 4, 8, 8, dtype=torch.float32)), "`initial_state` must be [.., HV, K, V] with N = 3"),
    "initial_state layout": (dict(initial_state=_t(3, 4, 8, 8, dtype=torch.float32)[..., :4], state_v_first=True),
                             "`initial_state` must be [.., HV, V, K] (state_v_first)"),
    "indices without a pool": (dict(initial_state=None, ssm_state_indices=torch.tensor([0, 1, 2])),
                               "`initial_state` must be the state pool"),
    "indices length": (dict(ssm_state_indices=torch.tensor([0, 1])), "`ssm_state_indices` must be of shape (3,)"),
    "indices float": (dict(ssm_state_indices=torch.tensor([0.0, 1.0, 2.0])), "`ssm_state_indices` must be one of"),
    "in place without a state": (dict(initial_state=None, inplace_final_state=True), "`initial_state` must be a tensor to write"),
    "in place into a strided view": (dict(initial_state=_t(3, 4, 8, 8, dtype=torch.float32).transpose(-1, -2),
                                          inplace_final_state=True), "`initial_state` must be contiguous"),
    "in place into one slot twice": (dict(initial_state=_t(5, 4, 8, 8, dtype=torch.float32), inplace_final_state=True,
                                          ssm_state_indices=torch.tensor([1, -1, 1])), "`ssm_state_indices` must be distinct"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_named(case):
    change, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        decode(**_bad(**change))


def test_padding_slots_may_repeat_in_place():
    pool = _t(5, 4, 8, 8, dtype=torch.float32)
    decode(**_bad(initial_state=pool, inplace_final_state=True, ssm_state_indices=torch.tensor([-1, 2, 5])))


def test_in_place_into_a_state_that_needs_grad():
    pool = _t(3, 4, 8, 8, dtype=torch.float32).requires_grad_()
    with pytest.raises(ValueError, match=re.escape("`initial_state` must be free of autograd")):
        decode(**_bad(initial_state=pool, inplace_final_state=True))


def test_mixed_devices():
    with pytest.raises(ValueError, match=re.escape("must be on one device")):
        decode(**_bad(v=_t(1, 9, 4, 8).to("meta")))


@pytest.mark.parametrize("device, change, why", [
    ("cpu", {}, "the inputs are on the cpu"),
    ("cuda", {"dtype": torch.float16}, "the kernel takes torch.bfloat16"),
    ("cuda", {"K": 64}, "K = 64 and V = 128"),
    ("cuda", {"g": torch.float64}, "`g` is torch.float64"),
    ("cuda", {"initial_state": torch.float64}, "`initial_state` is torch.float64"),
    ("cuda", {"grad": True}, "gradients are requested"),
    ("cuda", {"g": torch.bfloat16, "initial_state": torch.float16}, None),
])
def test_kernel_path_only_where_the_kernel_applies(device, change, why, monkeypatch):
    monkeypatch.setattr(recurrent, "hopper_gpu_missing", lambda: None)  # pretend an H100 is here
    q = SimpleNamespace(device=torch.device(device), dtype=change.get("dtype", torch.bfloat16),
                        shape=(1, 1, 2, change.get("K", 128)))
    v = SimpleNamespace(shape=(1, 1, 4, 128))
    small = {n: (torch.empty(0, dtype=change[n]) if n in change else None) for n in ("g", "initial_state")}
    reason = recurrent.kernel_unsupported(q, v, small, change.get("grad", False))
    assert reason is None if why is None else why in reason


# ---- the library's kernel is the stage's -------------------------------------------------------

VARIANTS = [
    STAGE.Variant(),
    STAGE.Variant(state_v_first=True, h0=False, store="none", varlen=True, bounds_dtype="int64"),
    STAGE.Variant(state_v_first=True, store="inplace", indexed=True, l2norm=True, gate="raw", dt_bias=True,
                  beta="2sigmoid", g_dtype="bfloat16", beta_dtype="bfloat16", state_dtype="bfloat16"),
    STAGE.Variant(gate="none", beta="sigmoid", a_dtype="float16", index_dtype="int64"),
]


@pytest.mark.parametrize("variant", range(len(VARIANTS)))
@pytest.mark.parametrize("H, HV", [(16, 32), (2, 8)])
def test_library_kernel_is_the_stage_kernel(variant, H, HV):
    lib_variant = recurrent.Variant(*VARIANTS[variant])
    assert (recurrent.fused_recurrent_kernel(H, HV, lib_variant).script()
            == STAGE.fused_recurrent_kernel(H, HV, VARIANTS[variant], recurrent.BV).script())


def test_library_variants_are_the_stages():
    assert recurrent.Variant._fields == STAGE.Variant._fields
    assert recurrent.Variant() == STAGE.Variant()
    x = _raw_gates(_inputs(dtype=torch.bfloat16))
    args = (x["g"], x["beta"], x["initial_state"], True, x["cu_seqlens"], True, True, x["A_log"],
            x["dt_bias"], True, True, True, False, None)
    assert recurrent.variant_of(*args) == STAGE.variant_of(*args)


@pytest.mark.parametrize("constant, value", [("SOFTPLUS_LINEAR", 15.0), ("MIN_CTAS_PER_SM", 24), ("BT", 16)])
def test_a_changed_kernel_is_caught(constant, value, monkeypatch):
    """The check above can fail: a copy with another constant (the softplus threshold, the launch
    bound, the token block) prints another program."""
    monkeypatch.setattr(recurrent, constant, value)
    v = recurrent.Variant(gate="raw")
    assert (recurrent.fused_recurrent_kernel(16, 32, v).script()
            != STAGE.fused_recurrent_kernel(16, 32, v, recurrent.BV).script())


def test_the_stage_at_the_other_width_is_another_program():
    """... and the library's program is the stage's at one width only."""
    other, = set(STAGE.WIDTHS) - {recurrent.BV}
    assert (recurrent.fused_recurrent_kernel(16, 32).script()
            != STAGE.fused_recurrent_kernel(16, 32, STAGE.Variant(), other).script())


def test_library_kernel_compiles_for_hopper_as_the_stage(monkeypatch):
    """The library compiles its kernel for sm_90a with the stage's options, and the CUDA it gets has
    what the stage is about (this compiles once, about 10 s)."""
    import tilelang

    calls = []
    real = tilelang.compile
    monkeypatch.setattr(tilelang, "compile", lambda func, **options: calls.append((func.script(), options))
                        or real(func, **options))
    source = recurrent._compiled.__wrapped__(16, 32, recurrent.Variant()).get_kernel_source()
    monkeypatch.setattr(tilelang, "compile", lambda func, **options: calls.append((func.script(), options)))
    STAGE._compiled.__wrapped__(16, 32, STAGE.Variant(), recurrent.BV)
    assert calls[0] == calls[1]
    launch_bound = f"__launch_bounds__(32, {STAGE.MIN_CTAS_PER_SM[recurrent.BV]})"  # the stage's at BV
    for needle in [n for n in STAGE.SOURCE_MUST_CONTAIN if "launch_bounds" not in n] + [launch_bound]:
        assert needle in source, f"the library's decode kernel lacks `{needle}`"


# ---- the kernel on the GPU ---------------------------------------------------------------------

GPU_HEADS = ((16, 32), (16, 64), (4, 16), (16, 16))
GPU_SHAPES = [(H, HV, T, B) for T in (1, 2, 4, 16, 64) for B in (1, 8, 64) for H, HV in GPU_HEADS[:1]] + \
             [(H, HV, T, B) for H, HV in GPU_HEADS[1:] for T, B in ((1, 64), (4, 8), (64, 1))]
GPU_VARLEN = [(16, 32, (1, 4, 0, 17, 64, 2, 1)), (4, 16, (64,)), (16, 64, (3,) * 40)]
GPU_OPTIONS = {
    "no initial state": dict(initial_state=None),
    "no final state": dict(output_final_state=False),
    "no gate, no beta": dict(g=None, beta=None),
    "l2norm": dict(use_qk_l2norm_in_kernel=True),
    "V-first states": dict(state_v_first=True),
    "bf16 initial state": dict(initial_state="bf16"),
    "FLA's layer call": dict(raw="bf16", use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, state_v_first=True),
    "raw gate fp32, no dt_bias, 2 sigmoid": dict(raw="fp32", dt_bias=None, use_gate_in_kernel=True,
                                                 use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
}
POOL_SLOTS = (7, -1, 0, 9, 3, 5)              # of 9: -1 and 9 are padding


def _batch_inputs(H, HV, T, B):
    return _inputs(H, HV, (T,) * B, varlen=False, K=128, V=128, device="cuda", seed=T + B)


def _varlen_inputs(H, HV, lengths, cu_dtype):
    x = _inputs(H, HV, lengths, K=128, V=128, device="cuda", seed=len(lengths))
    return dict(x, cu_seqlens=x["cu_seqlens"].to(cu_dtype))


def _option_inputs(case):
    x = _inputs(16, 32, (1, 4, 0, 17, 2), K=128, V=128, device="cuda", seed=7)
    change = dict(GPU_OPTIONS[case])
    raw = change.pop("raw", None)
    if raw:  # FLA's layer passes its projections' bf16 outputs as g and beta, A_log and dt_bias fp32
        x = _raw_gates(x, seed=3)
        if raw == "bf16":
            x.update(g=x["g"].bfloat16(), beta=x["beta"].bfloat16())
    if change.get("initial_state") == "bf16":
        change["initial_state"] = x["initial_state"].bfloat16()
    if change.get("state_v_first"):
        x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    return {**x, **change}


def _pool_inputs(pool_dtype, state_v_first, in_place):
    x = _inputs(16, 32, (1,) * len(POOL_SLOTS), varlen=False, K=128, V=128, device="cuda", seed=11)
    pool = torch.randn(9, 32, 128, 128, device="cuda").to(pool_dtype)
    idx = torch.tensor(POOL_SLOTS, dtype=torch.int32 if in_place else torch.int64, device="cuda")
    return dict(x, initial_state=pool, ssm_state_indices=idx, inplace_final_state=in_place,
                state_v_first=state_v_first)


POOLS = [(d, vf) for d in (torch.float32, torch.bfloat16) for vf in (False, True)]


@pytest.fixture(scope="module")
def compiled():
    """Every kernel variant the tests below run, compiled here on threads (each 5-15 s)."""
    cases = ([_batch_inputs(H, HV, 1, 1) for H, HV in GPU_HEADS]
             + [_varlen_inputs(H, HV, n, d) for H, HV, n in GPU_VARLEN for d in (torch.int32, torch.int64)]
             + [_option_inputs(c) for c in GPU_OPTIONS]
             + [_pool_inputs(d, vf, p) for d, vf in POOLS for p in (False, True)])
    run_on_threads([functools.partial(decode, **x) for x in cases]
                   + [functools.partial(stage_run, **_varlen_inputs(16, 32, (1, 4, 0, 17), torch.int32))])


def _check_decode(fn, x):
    """check_op of the decode op; fn gets its own copy of the initial state (fn and the references
    may write theirs in place: the bf16 reference writes into a bf16 pool, which it does not copy)."""
    mine = None if x["initial_state"] is None else x["initial_state"].clone()
    refs = dict(x, initial_state=None if mine is None else mine.clone())
    recurrent._warned.clear()  # a fallback warns once a reason: clear, so that this call would warn
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*running the PyTorch reference")  # no fallback
        return check_op("fused_recurrent", lambda **kw: fn(**dict(kw, initial_state=mine)), refs)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("H, HV, T, B", GPU_SHAPES)
def test_kernel_batches_within_the_bound(H, HV, T, B, compiled):
    _check_decode(decode, _batch_inputs(H, HV, T, B))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("H, HV, lengths", GPU_VARLEN)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
def test_kernel_varlen_within_the_bound(H, HV, lengths, cu_dtype, compiled):
    _check_decode(decode, _varlen_inputs(H, HV, lengths, cu_dtype))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("case", GPU_OPTIONS, ids=list(GPU_OPTIONS))
def test_kernel_options_within_the_bound(case, compiled):
    _check_decode(decode, _option_inputs(case))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("pool_dtype, state_v_first", POOLS)
def test_kernel_updates_a_pool_in_place(pool_dtype, state_v_first, compiled):
    """Slots read and written in place, padding (-1, S) neither read nor written, the other slots
    left bit for bit, the pool returned; the same pool read without in place gives new states."""
    x = _pool_inputs(pool_dtype, state_v_first, True)
    checks = _check_decode(decode, x)
    assert {c.output for c in checks} == {"o", "final_state"}
    _check_decode(decode, _pool_inputs(pool_dtype, state_v_first, False))
    pool = x["initial_state"]
    before = pool.clone()
    o, s = decode(**x)
    assert s is pool
    untouched = [1, 2, 4, 6, 8]
    assert torch.equal(pool[untouched], before[untouched]) and not torch.equal(pool[7], before[7])


@pytest.mark.gpu
@pytest.mark.hopper
def test_library_is_the_stage_bit_for_bit(compiled):
    x = _varlen_inputs(16, 32, (1, 4, 0, 17), torch.int32)
    got = decode(**x)
    want = stage_run(**x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.hopper
def test_decode_steps_replay_in_a_cuda_graph(compiled):
    """A decode step (T = 1 a sequence, a pool in place) captured once and replayed gives the eager
    steps' outputs and states, bit for bit."""
    x = _inputs(16, 32, (1,) * 8, varlen=False, K=128, V=128, device="cuda", seed=2)
    idx = torch.arange(8, dtype=torch.int32, device="cuda").flip(0)
    eager_pool, graph_pool = x["initial_state"].clone(), x["initial_state"].clone()
    step = dict(x, ssm_state_indices=idx, inplace_final_state=True)
    eager = [decode(**dict(step, initial_state=eager_pool))[0].clone() for _ in range(3)]
    decode(**dict(step, initial_state=graph_pool.clone()))  # compiled, checked on the host once
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, _ = decode(**dict(step, initial_state=graph_pool))
    for want in eager:
        graph.replay()
        assert torch.equal(o, want)
    assert torch.equal(graph_pool, eager_pool)


@pytest.mark.gpu
@pytest.mark.hopper
def test_kernel_check_catches_a_broken_kernel(monkeypatch, compiled):
    """The GPU check fails for the kernel built with a wrong decay (exp2 of g, not of log2(e) g)."""
    from flashqla.hopper import compile_hopper

    monkeypatch.setattr(recurrent, "LOG2E", 1.0)
    broken = functools.cache(lambda H, HV, variant: compile_hopper(recurrent.fused_recurrent_kernel(H, HV, variant)))
    monkeypatch.setattr(recurrent, "_compiled", broken)
    x = _inputs(16, 32, (4,) * 8, varlen=False, K=128, V=128, device="cuda", seed=1)
    with pytest.raises(AssertionError, match="wrong answer"):
        _check_decode(decode, x)
