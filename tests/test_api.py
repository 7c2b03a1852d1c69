"""flashqla.chunk_gated_delta_rule: results, autograd, layouts, and a clear error for every bad input."""

import math
import re
import warnings

import numpy as np
import pytest
import torch

import flashqla
from flashqla import reference as ref
from flashqla.testing import Problem, cast_floats, check_op, op_inputs, rel_l2

F64 = torch.float64
api = flashqla.chunk_gated_delta_rule


@pytest.mark.parametrize("problem", [Problem(2, 8, (100, 1, 64, 37), K=32, V=64),
                                     Problem(4, 4, (90, 90), varlen=False, K=16, V=16,
                                             initial_state=False)], ids=lambda p: p.label)
def test_api_within_derived_tolerance(problem):
    checks = check_op("gdn_fwd", api, problem.inputs())
    assert {c.output for c in checks} == {"o", "final_state"}


def test_output_dtypes_and_shapes():
    x = Problem(2, 4, (70,), K=16, V=8).inputs()
    o, s = api(**x)
    assert o.dtype == torch.bfloat16 and o.shape == (1, 70, 4, 8)
    assert s.dtype == torch.float32 and s.shape == (1, 4, 16, 8)
    assert api(**{**x, "output_final_state": False})[1] is None


def test_qk_l2norm_in_kernel():
    x = cast_floats(Problem(1, 2, (80,), K=16, V=16).inputs(), F64)
    q_raw, k_raw = 3.0 * x["q"], 0.5 * x["k"]
    o, s = api(**{**x, "q": q_raw, "k": k_raw}, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = ref.chunk_gated_delta_rule_ref(
        **{**x, "q": ref.l2norm(q_raw), "k": ref.l2norm(k_raw)})
    assert rel_l2(o, o_ref) < 1e-12 and rel_l2(s, s_ref) < 1e-12


def test_scale_and_non_contiguous_inputs():
    x = cast_floats(Problem(2, 2, (50,), K=8, V=8).inputs(), F64)
    o_ref, _ = ref.naive_recurrent_gated_delta_rule(**{**x, "scale": 0.3})
    # the same values behind transposed strides
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x["q"], x["k"], x["v"]))
    g, beta = (t.transpose(0, 2).contiguous().transpose(0, 2) for t in (x["g"], x["beta"]))
    assert not q.is_contiguous() and not g.is_contiguous()
    o, _ = api(**{**x, "q": q, "k": k, "v": v, "g": g, "beta": beta, "scale": 0.3})
    assert rel_l2(o, o_ref) < 1e-12


def test_batch_equals_packed_varlen():
    xb = cast_floats(Problem(2, 4, (77, 77), varlen=False, K=8, V=8).inputs(), F64)
    cu = torch.tensor([0, 77, 154])
    packed = {**xb, "cu_seqlens": cu, **{n: xb[n].reshape(1, 154, *xb[n].shape[2:])
                                          for n in ("q", "k", "v", "g", "beta")}}
    ob, sb = api(**xb)
    ov, sv = api(**packed)
    assert rel_l2(ov.reshape(ob.shape), ob) < 1e-14 and rel_l2(sv, sb) < 1e-14


def test_autograd_reaches_every_input_in_float64():
    x = cast_floats(Problem(1, 2, (1, 70, 9), K=4, V=4).inputs(), F64)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [x[n].clone().requires_grad_() for n in names]

    def f(*ts):
        o, s = api(**{**x, **dict(zip(names, ts))})
        return o, s

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The kernel path on the CPU: the references stand in for the kernels, and the calls that reach
    them are counted ({"forward": n, "backward": n})."""
    import flashqla.api

    calls = {"forward": 0, "backward": 0}

    def reference_forward(*args):
        calls["forward"] += 1
        o, s = flashqla.api._reference(*args)
        return o.to(args[2].dtype), s

    def reference_backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens):
        calls["backward"] += 1
        return ref.chunk_gated_delta_rule_bwd_ref(q, k, v, g, beta, do, dht, scale=scale,
                                                  initial_state=initial_state, cu_seqlens=cu_seqlens)

    monkeypatch.setattr(flashqla.api, "kernel_unsupported", lambda *a: None)
    monkeypatch.setattr(flashqla.api, "backward_unsupported", lambda H, HV: None)
    monkeypatch.setattr(flashqla.api, "_kernel_forward", reference_forward)
    monkeypatch.setattr(flashqla.api, "_kernel_backward", reference_backward)
    return calls


@pytest.mark.parametrize("l2norm", [False, True], ids=["plain", "qk_l2norm_in_kernel"])
def test_kernel_path_backward_in_float64(kernels_on_cpu, l2norm):
    """The kernel path's autograd (the custom op saving only its inputs, the backward op
    recomputing the rest), run on the CPU with the references standing in for the kernels:
    gradcheck through it, l2norm included."""
    x = cast_floats(Problem(1, 2, (1, 70, 9), K=4, V=4).inputs(), F64)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = [x[n].clone().requires_grad_() for n in names]

    def f(*ts):
        return api(**{**x, **dict(zip(names, ts))}, use_qk_l2norm_in_kernel=l2norm)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)
    o, s = f(*leaves)
    (o.square().sum() + s.square().sum()).backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in leaves)
    assert kernels_on_cpu["forward"] > 0 and kernels_on_cpu["backward"] > 0


def test_float32_gradients_under_strong_decay_and_partial_chunks():
    """fp32 autograd stays finite and matches float64 gradients.

    The 120- and 60-token sequences end in chunks of 56 and 60 tokens; in the strong-decay heads
    (about -2 per token) their padding once saw exponents near +118, which overflow float32.
    """
    x = cast_floats(Problem(2, 8, (120, 1, 60), K=16, V=16).inputs(), torch.float32)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads(dtype):
        leaves = {n: x[n].detach().to(dtype).requires_grad_() for n in names}
        o, s = api(**{**x, **leaves})
        (o.square().mean() + s.square().mean()).backward()
        return {n: leaves[n].grad for n in names}

    g32, g64 = grads(torch.float32), grads(F64)
    for n in names:
        assert torch.isfinite(g32[n]).all(), n
        assert rel_l2(g32[n], g64[n]) < 1e-4, (n, rel_l2(g32[n], g64[n]))


def test_nan_stays_in_its_sequence_and_chunk_onward():
    """The documented NaN behaviour: its chunk and the rest of its sequence, nothing else."""
    x = Problem(1, 2, (150, 40), K=8, V=8).inputs()
    x["v"] = x["v"].clone()
    x["v"][0, 100, 1] = float("nan")                  # sequence 0, chunk 1 (tokens 64..127), head 1
    o, s = api(**x)
    assert torch.isfinite(o[0, :64]).all()            # earlier chunk untouched
    assert torch.isnan(o[0, 64:150, 1]).all()         # its chunk (earlier tokens too) and later ones
    assert torch.isfinite(o[0, :, 0]).all()           # the other head group is untouched
    assert torch.isfinite(o[0, 150:]).all() and torch.isfinite(s[1]).all()   # the other sequence
    assert torch.isnan(s[0, 1]).all()


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_no_tokens_passes_the_state_through(varlen):
    """T = 0: an empty output, the final state equal to (but not the same tensor as) the initial
    state, and its gradient passed back to the initial state."""
    B, cu = (1, torch.tensor([0, 0, 0])) if varlen else (2, None)
    q, v, g = torch.randn(B, 0, 2, 8), torch.randn(B, 0, 4, 8), torch.zeros(B, 0, 4)
    h0 = torch.randn(2, 4, 8, 8, requires_grad=True)
    o, s = api(q, q, v, g, g, initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert o.shape == (B, 0, 4, 8) and torch.equal(s, h0) and s.data_ptr() != h0.data_ptr()
    (2 * s).sum().backward()
    assert torch.equal(h0.grad, torch.full_like(h0, 2.0))


# ---- every bad input gets a ValueError naming the argument and what was expected ----

def _bad(**change):
    x = Problem(2, 4, (64, 30), K=16, V=16).inputs()
    x.update(change)
    return x


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


BAD_INPUTS = {
    "k shape differs from q": (dict(k=_t(1, 94, 2, 8)), "`k` must be the shape of q"),
    "v batch/time differ": (dict(v=_t(1, 93, 4, 16)), "`v` must be [B, T, HV, V]"),
    "HV not a multiple of H": (dict(v=_t(1, 94, 3, 16), g=_t(1, 94, 3, dtype=torch.float32),
                                    beta=_t(1, 94, 3, dtype=torch.float32)),
                               "multiple of the H = 2 heads"),
    "g shape": (dict(g=_t(1, 94, 2, dtype=torch.float32)), "`g` must be [B, T, HV]"),
    "beta shape": (dict(beta=_t(1, 94, dtype=torch.float32)), "`beta` must be 3-D"),
    "q not 4-D": (dict(q=_t(94, 2, 16)), "`q` must be 4-D"),
    "integer q": (dict(q=torch.ones(1, 94, 2, 16, dtype=torch.int32)), "`q` must be one of"),
    "float8 v": (dict(v=_t(1, 94, 4, 16).to(torch.float8_e4m3fn)), "`v` must be one of"),
    "mixed q/k/v dtypes": (dict(k=_t(1, 94, 2, 16, dtype=torch.float16)), "`k and v` must be the dtype of q"),
    "g not a tensor": (dict(g=0.5), "`g` must be a torch.Tensor"),
    "integer beta": (dict(beta=torch.ones(1, 94, 4, dtype=torch.int64)), "`beta` must be one of"),
    "zero head dim": (dict(q=_t(1, 94, 2, 0), k=_t(1, 94, 2, 0)), "non-empty head dimensions"),
    "scale is a 1-D tensor": (dict(scale=torch.tensor([0.1])), "`scale` must be None, a finite number or a 0-d tensor"),
    "scale is a string": (dict(scale="0.1"), "`scale` must be None, a finite number or a 0-d tensor"),
    "scale is NaN": (dict(scale=math.nan), "`scale` must be None, a finite number or a 0-d tensor"),
    "scale is inf": (dict(scale=torch.tensor(math.inf)), "`scale` must be None, a finite number or a 0-d tensor"),
    "cu_seqlens float": (dict(cu_seqlens=torch.tensor([0.0, 64.0, 94.0])), "`cu_seqlens` must be an int32 or int64"),
    "cu_seqlens list": (dict(cu_seqlens=[0, 64, 94]), "`cu_seqlens` must be an int32 or int64"),
    "cu_seqlens 2-D": (dict(cu_seqlens=torch.tensor([[0, 64, 94]])), "`cu_seqlens` must be 1-D"),
    "cu_seqlens not from 0": (dict(cu_seqlens=torch.tensor([1, 64, 94])), "`cu_seqlens` must be starting at 0"),
    "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 70, 64, 94]),
                                   initial_state=None), "`cu_seqlens` must be non-decreasing"),
    "cu_seqlens not ending at T": (dict(cu_seqlens=torch.tensor([0, 64, 90])), "`cu_seqlens` must be ending at T = 94"),
    "initial_state count": (dict(initial_state=torch.zeros(3, 4, 16, 16)), "`initial_state` must be [N, HV, K, V] = (2, 4, 16, 16)"),
    "initial_state shape": (dict(initial_state=torch.zeros(2, 4, 16, 8)), "`initial_state` must be [N, HV, K, V]"),
    "initial_state integer": (dict(initial_state=torch.zeros(2, 4, 16, 16, dtype=torch.int32)),
                              "`initial_state` must be one of torch.float16, torch.bfloat16"),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_is_named(case):
    change, message = BAD_INPUTS[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        api(**_bad(**change))


def test_cu_seqlens_with_batch_above_one():
    x = Problem(2, 4, (30, 30), varlen=False, K=8, V=8, initial_state=False).inputs()
    with pytest.raises(ValueError, match=re.escape("`q` must be batch size 1 when cu_seqlens is given")):
        api(**{**x, "cu_seqlens": torch.tensor([0, 10, 30])})


def test_mixed_devices():
    x = _bad()
    with pytest.raises(ValueError, match=re.escape("must be on one device")):
        api(**{**x, "v": x["v"].to("meta")})


def test_reference_path_warns_once_and_says_why():
    import flashqla.api

    flashqla.api._warned.clear()
    x = Problem(2, 4, (20,), K=8, V=8).inputs()
    with pytest.warns(UserWarning, match="running the PyTorch reference, because the inputs are on the cpu"):
        api(**x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api(**x)  # the same reason does not warn twice


# ---- FLA 0.6.0's signature and keywords ----

# fla-core 0.6.0's fla.ops.gated_delta_rule.chunk_gated_delta_rule, in its order, then **kwargs
FLA_PARAMETERS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                  "use_qk_l2norm_in_kernel", "use_beta_sigmoid_in_kernel", "allow_neg_eigval",
                  "state_v_first", "cu_seqlens", "cu_seqlens_cpu", "chunk_indices", "cp_context", "kwargs")


def test_signature_is_flas():
    import inspect

    params = inspect.signature(api).parameters
    assert tuple(params) == FLA_PARAMETERS
    assert params["kwargs"].kind is inspect.Parameter.VAR_KEYWORD
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn
    except ImportError:
        return  # fla-core absent: the list above is its 0.6.0 signature
    fla_params = inspect.signature(fla_gdn).parameters
    assert tuple(fla_params) == FLA_PARAMETERS
    assert all(fla_params[n].default == p.default for n, p in params.items() if n != "kwargs")


def _f64(problem=None):
    return cast_floats((problem or Problem(2, 4, (70, 1, 64), K=8, V=8)).inputs(), F64)


def test_every_parameter_by_position():
    """FLA's order: a call passing all of them positionally (the no-op values) gives the
    keyword call's result."""
    x = _f64()
    want = api(**x)
    got = api(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, False, False,
              False, False, x["cu_seqlens"], None, None, None)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_flas_keywords_at_their_no_op_values():
    x = _f64()
    want = api(**x)
    got = api(**x, use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, state_v_first=False,
              cu_seqlens_cpu=None, chunk_indices=None, cp_context=None, use_gate_in_kernel=False,
              chunk_size=64)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_unknown_keyword_is_named():
    with pytest.raises(TypeError, match="unexpected keyword argument 'use_gate'"):
        api(**_f64(), use_gate=True)


@pytest.mark.parametrize("neg", [False, True], ids=["sigmoid", "allow_neg_eigval"])
def test_beta_sigmoid_in_float64(neg):
    """beta <- sigmoid(beta), times 2 with allow_neg_eigval (FLA's fused_beta_sigmoid, scale 2)."""
    x = _f64()
    logits = torch.randn(x["beta"].shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    o, s = api(**{**x, "beta": logits}, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg)
    o_ref, s_ref = ref.chunk_gated_delta_rule_ref(**{**x, "beta": (1 + neg) * torch.sigmoid(logits)})
    assert rel_l2(o, o_ref) < 1e-12 and rel_l2(s, s_ref) < 1e-12


def _gate(g_raw, A_log, dt_bias):
    """FLA's use_gate_in_kernel, in float64: g = -exp(A_log) softplus(g + dt_bias), softplus(x) = log(1 + e^x)."""
    return -A_log.exp() * torch.log1p((g_raw + (0 if dt_bias is None else dt_bias)).exp())


@pytest.mark.parametrize("bias", [True, False], ids=["dt_bias", "no_dt_bias"])
def test_gate_in_kernel_in_float64(bias):
    x = _f64()
    gen = torch.Generator().manual_seed(4)
    g_raw = torch.randn(x["g"].shape, generator=gen, dtype=F64)
    A_log = torch.randn(4, generator=gen, dtype=F64)
    dt_bias = torch.randn(4, generator=gen, dtype=F64) if bias else None
    o, s = api(**{**x, "g": g_raw}, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)
    o_ref, s_ref = ref.chunk_gated_delta_rule_ref(**{**x, "g": _gate(g_raw, A_log, dt_bias)})
    assert rel_l2(o, o_ref) < 1e-12 and rel_l2(s, s_ref) < 1e-12
    try:
        from fla.ops.gated_delta_rule.gate import naive_gdn_gate
    except ImportError:
        return
    # FLA's own PyTorch definition (float32) agrees with the float64 one used above
    fla_g = naive_gdn_gate(g_raw, A_log, dt_bias)
    assert rel_l2(fla_g.double(), _gate(g_raw, A_log, dt_bias)) < 1e-6


def test_state_v_first_transposes_both_states():
    x = _f64()
    o, s = api(**x)
    o_t, s_t = api(**{**x, "initial_state": x["initial_state"].transpose(-1, -2).contiguous()},
                   state_v_first=True)
    assert torch.equal(o_t, o) and torch.equal(s_t, s.transpose(-1, -2)) and s_t.is_contiguous()
    with pytest.warns(DeprecationWarning, match="transpose_state_layout"):
        o_d, s_d = api(**{**x, "initial_state": x["initial_state"].transpose(-1, -2).contiguous()},
                       transpose_state_layout=True)
    assert torch.equal(o_d, o) and torch.equal(s_d, s_t)
    with pytest.raises(ValueError, match=re.escape("`initial_state` must be [N, HV, V, K]")):
        api(**{**x, "initial_state": torch.zeros(3, 4, 8, 4, dtype=F64)}, state_v_first=True)


def test_every_flas_keyword_trains_in_float64():
    """gradcheck through FLA's GatedDeltaNet layer call (l2norm, beta sigmoid with negative
    eigenvalues, the gate with A_log and dt_bias, state_v_first): every gradient, A_log's and
    dt_bias's included, matches finite differences."""
    x = _f64(Problem(1, 2, (1, 70, 9), K=4, V=4))
    gen = torch.Generator().manual_seed(5)
    names = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")
    leaves = [x["q"], x["k"], x["v"], torch.randn(x["g"].shape, generator=gen, dtype=F64),
              torch.randn(x["beta"].shape, generator=gen, dtype=F64), x["initial_state"],
              torch.randn(2, generator=gen, dtype=F64) - 1, torch.randn(2, generator=gen, dtype=F64)]
    leaves = [t.clone().requires_grad_() for t in leaves]

    def f(q, k, v, g, beta, h0, A_log, dt_bias):
        return api(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                   use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True, state_v_first=True,
                   cu_seqlens=x["cu_seqlens"], use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_initial_state(dtype):
    """A bf16 / fp16 initial state is upcast to float32; its gradient comes back in its dtype."""
    x = cast_floats(Problem(2, 4, (70, 1, 64), K=8, V=8).inputs(), torch.float32)
    h0 = x["initial_state"].to(dtype).requires_grad_()
    o, s = api(**{**x, "initial_state": h0})
    o_32, s_32 = api(**{**x, "initial_state": h0.detach().float()})
    assert torch.equal(o, o_32) and torch.equal(s, s_32) and s.dtype == torch.float32
    s.sum().backward()
    assert h0.grad.dtype == dtype and torch.isfinite(h0.grad).all()


@pytest.mark.parametrize("scale", [0.3, np.float32(0.3), np.float64(0.3), torch.tensor(0.3),
                                   torch.tensor(0.3, dtype=F64), 1],
                         ids=["float", "np.float32", "np.float64", "0-d float32", "0-d float64", "int"])
def test_scale_forms(scale):
    x = _f64()
    want = api(**{**x, "scale": float(scale)})
    got = api(**{**x, "scale": scale})
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_cu_seqlens_cpu_replaces_the_host_read(monkeypatch):
    """With cu_seqlens_cpu the lengths come from it: cu_seqlens is never read on the host, and
    cu_seqlens_cpu's values are checked."""
    import flashqla.api

    x = _f64()
    want = api(**x)

    def no_read(cu):
        raise AssertionError("cu_seqlens was read on the host")

    monkeypatch.setattr(flashqla.api, "host_bounds", no_read)
    with pytest.raises(AssertionError, match="read on the host"):  # the check sees a read
        api(**x)
    got = api(**x, cu_seqlens_cpu=x["cu_seqlens"].clone())
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=re.escape("`cu_seqlens_cpu` must be ending at T = 135")):
        api(**x, cu_seqlens_cpu=torch.tensor([0, 70, 71, 134]))
    with pytest.raises(ValueError, match=re.escape("`cu_seqlens_cpu` must be a CPU tensor of cu_seqlens's shape")):
        api(**x, cu_seqlens_cpu=torch.tensor([0, 135]))


def test_chunk_indices_are_checked_and_recomputed():
    x = _f64()
    want = api(**x)
    # FLA's chunk_indices: (sequence, chunk of the sequence) per chunk, 64-token chunks
    fla_indices = torch.tensor([[0, 0], [0, 1], [1, 0], [2, 0]])
    got = api(**x, chunk_indices=fla_indices)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(ValueError, match=re.escape("`chunk_indices` must be [NT, 2]")):
        api(**x, chunk_indices=fla_indices.reshape(-1))
    with pytest.raises(ValueError, match=re.escape("`chunk_indices` must be None without cu_seqlens")):
        api(**_f64(Problem(2, 4, (64, 64), varlen=False, K=8, V=8)), chunk_indices=fla_indices)


FLA_CALL_ERRORS = {
    "chunk_size 32": (dict(chunk_size=32), ValueError, "`chunk_size` must be 64"),
    "cp_context": (dict(cp_context=object()), ValueError, "`cp_context` must be None or a context from"),
    "head_first": (dict(head_first=False), DeprecationWarning, "head_first has been removed"),
    "allow_neg_eigval alone": (dict(allow_neg_eigval=True), ValueError,
                               "`allow_neg_eigval` must be False unless use_beta_sigmoid_in_kernel=True"),
    "A_log without the gate": (dict(A_log=torch.zeros(4)), ValueError,
                               "`A_log and dt_bias` must be None unless use_gate_in_kernel=True"),
    "the gate without A_log": (dict(use_gate_in_kernel=True), ValueError, "`A_log` must be a float tensor of HV = 4"),
    "A_log of H elements": (dict(use_gate_in_kernel=True, A_log=torch.zeros(2)), ValueError,
                            "`A_log` must be a float tensor of HV = 4"),
    "dt_bias of 3 elements": (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(3)),
                              ValueError, "`dt_bias` must be a float tensor of HV = 4"),
    "both state layouts": (dict(state_v_first=True, transpose_state_layout=True), ValueError,
                           "not both"),
}


@pytest.mark.parametrize("case", FLA_CALL_ERRORS, ids=list(FLA_CALL_ERRORS))
def test_fla_keyword_errors_are_named(case):
    change, error, message = FLA_CALL_ERRORS[case]
    with pytest.raises(error, match=re.escape(message)):
        api(**_bad(), **change)


# ---- FLASHQLA_BACKEND and autocast ----

def test_backend_kernels_raises_with_the_reason(monkeypatch):
    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    with pytest.raises(RuntimeError, match="FLASHQLA_BACKEND=kernels, but the kernels cannot run this "
                                           "call: the inputs are on the cpu"):
        api(**_f64())


def test_backend_reference_never_runs_the_kernels(monkeypatch, kernels_on_cpu):
    x = _f64()
    api(**x)
    assert kernels_on_cpu["forward"] == 1                 # auto: the (stand-in) kernels
    monkeypatch.setenv("FLASHQLA_BACKEND", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # and no warning
        o, s = api(**{n: t.requires_grad_() if n == "v" else t for n, t in x.items()})
    o.sum().backward()
    assert kernels_on_cpu == {"forward": 1, "backward": 0}


def test_backward_falls_back_where_its_kernels_do_not_compile(monkeypatch, kernels_on_cpu):
    """A head layout whose backward kernels do not compile (``api.backward_unsupported``): the
    forward stays on the kernels, the reference runs the backward with a one-time warning naming
    the reason (the same gradients), and FLASHQLA_BACKEND=kernels raises with it."""
    import flashqla.api

    reason = "the backward's kernels do not compile for 1 query/key heads and 2 value heads (stand-in)"
    monkeypatch.setattr(flashqla.api, "backward_unsupported", lambda H, HV: reason)
    flashqla.api._warned.clear()
    x = _f64()
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def grads():
        leaves = {n: x[n].detach().clone().requires_grad_() for n in names}
        o, s = api(**{**x, **leaves})
        (o.square().sum() + s.square().sum()).backward()
        return [leaves[n].grad for n in names]

    with pytest.warns(UserWarning, match=re.escape(f"running the PyTorch reference, because {reason}")):
        got = grads()
    with warnings.catch_warnings():
        warnings.simplefilter("error")                    # once a reason
        grads()
    assert kernels_on_cpu == {"forward": 2, "backward": 0}
    monkeypatch.setattr(flashqla.api, "backward_unsupported", lambda H, HV: None)
    want = grads()                                        # the (stand-in) kernels' backward
    assert kernels_on_cpu == {"forward": 3, "backward": 1}
    assert all(rel_l2(a, b) < 1e-12 for a, b in zip(got, want))
    monkeypatch.setattr(flashqla.api, "backward_unsupported", lambda H, HV: reason)
    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    with pytest.raises(RuntimeError, match=re.escape(f"cannot run this call: {reason}")):
        grads()


def test_backward_kernels_report_what_does_not_compile():
    """TileLang 0.1.15 cannot map the backward's finish kernel for 3 query/key heads: the check
    compiles it first (a few seconds here) and names the kernel and TileLang's error."""
    from flashqla import bwd

    reason = bwd.unsupported(3, 6)
    assert reason is not None and reason.startswith(
        "the backward's kernels do not compile for 3 query/key heads and 6 value heads (finish_kernel: ")
    assert bwd.unsupported(3, 6) is reason                # once a layout


def test_backend_value_is_checked(monkeypatch):
    monkeypatch.setenv("FLASHQLA_BACKEND", "triton")
    with pytest.raises(ValueError, match="FLASHQLA_BACKEND must be one of auto, kernels, reference; got 'triton'"):
        api(**_f64())


def test_reference_ignores_autocast(monkeypatch):
    """Under torch.autocast (bf16) float32 inputs keep float32's error, forward and backward; the
    same reference with autocast left on inside (the deliberately broken variant) does not."""
    import contextlib

    import flashqla.api

    x32 = cast_floats(Problem(2, 4, (100, 30), K=16, V=16).inputs(), torch.float32)
    x64 = cast_floats(x32, F64)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run(x, autocast):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            o, s = api(**{**x, **leaves})
            (o.sum() + s.sum()).backward()
        return [o, s] + [leaves[n].grad for n in names]

    want = run(x64, False)
    plain, under = run(x32, False), run(x32, True)
    errors = [rel_l2(a, w) for a, w in zip(under, want)]
    assert all(torch.equal(a, b) for a, b in zip(under, plain))
    assert max(errors) < 1e-5, errors
    monkeypatch.setattr(flashqla.api, "_no_autocast", lambda device: contextlib.nullcontext())
    broken = max(rel_l2(a, w) for a, w in zip(run(x32, True), want))
    assert broken > 100 * max(errors), (broken, errors)


def test_custom_op_passes_opcheck():
    """torch.library.opcheck: schema, fake implementation, autograd registration, AOT dispatch."""
    x = _f64(Problem(1, 2, (40, 30), K=4, V=4))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"].requires_grad_(), x["initial_state"],
            x["cu_seqlens"], None, 0.5, True)
    torch.library.opcheck(torch.ops.flashqla.chunk_gated_delta_rule, args)


LEAVES = ("q", "k", "v", "g", "beta", "initial_state")
# varlen with lengths 1 and 64, GVA and not, with and without initial state; dht is always given
KERNEL_PATH_PROBLEMS = [Problem(4, 16, (1, 200, 777, 64, 130)), Problem(16, 16, (1000,)),
                        Problem(4, 16, (333, 333), varlen=False, initial_state=False)]


@pytest.fixture(scope="module")
def compiled_kernels():
    """Compile the forward's and the backward's kernels for the heads of the tests below, in parallel."""
    from flashqla import bwd, fwd
    from flashqla.testing import run_on_threads

    def solves(H, HV):  # the forward's choices (gate_free_solve.s11): long problems, then short ones
        for R in {fwd.solve_heads(H, HV, 10**6, 1), fwd.solve_heads(H, HV, 0, 1)}:
            yield fwd.gate_free_solve_with_cumsum_kernel if R <= fwd.SOLVE_TF32_MAX_HEADS else fwd.gate_free_solve_kernel, R

    jobs = [job for H, HV in {(p.H, p.HV) for p in KERNEL_PATH_PROBLEMS} for job in (
        (fwd, fwd.chunk_local_cumsum_kernel, HV), *((fwd, solve, H, HV, R) for solve, R in solves(H, HV)),
        *((fwd, fwd.fused_reform_kernel, H, HV, 128, 128, bv) for bv in (fwd.BLOCK_V, fwd.NARROW_BLOCK_V)),
        (bwd, bwd.walk_kernel, H, HV, bwd.BV),
        *((bwd, b, H, HV) for b in (bwd.prep_kernel, bwd.chunk_bwd_dqkwg_kernel, bwd.wy_bwd_kernel,
                                    bwd.finish_kernel)))]
    run_on_threads([lambda job=job: job[0]._compiled(*job[1:]) for job in jobs])  # each module's cache


def _api_grads(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens):
    """The gdn_bwd op through the API: the gradients of <do, o> + <dht, final state> by autograd."""
    x = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
    o, s = api(**{**x, **leaves}, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens)
    grads = dict(zip(leaves, torch.autograd.grad((o, s), list(leaves.values()), (do, dht))))
    for n, t in leaves.items():
        assert grads[n].dtype == t.dtype and grads[n].is_cuda, n
    return tuple(grads.get(n) for n in LEAVES)


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("problem", KERNEL_PATH_PROBLEMS, ids=lambda p: p.label)
def test_api_runs_the_promoted_kernels_and_trains(problem, compiled_kernels, monkeypatch):
    """SM90 + bf16 + K = V = 128: the kernels (FLASHQLA_BACKEND=kernels: no fallback), and the
    forward's outputs and the backward's gradients, every input's, initial_state's included,
    within the derived tolerance."""
    import flashqla.api

    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    x = problem.inputs("cuda")
    assert flashqla.api.kernel_unsupported(x["q"].device, x["q"].dtype, 128, 128) is None
    check_op("gdn_fwd", api, x)
    checks = check_op("gdn_bwd", _api_grads, op_inputs("gdn_bwd", x))
    assert {c.output for c in checks} == {"dq", "dk", "dv", "dg", "dbeta"} | (
        {"dh0"} if problem.initial_state else set())


@pytest.mark.gpu
@pytest.mark.hopper
def test_three_query_heads_train_on_the_reference_backward(monkeypatch):
    """(3, 6): the forward on the kernels, the backward on the reference (its kernels do not
    compile for 3 query/key heads) with its one-time warning; outputs and every gradient within
    the derived tolerance, never a crash."""
    import flashqla.api

    monkeypatch.delenv("FLASHQLA_BACKEND", raising=False)
    flashqla.api._warned.clear()
    x = Problem(3, 6, (300, 77)).inputs("cuda")
    check_op("gdn_fwd", api, x)
    with pytest.warns(UserWarning, match="do not compile for 3 query/key heads"):
        check_op("gdn_bwd", _api_grads, op_inputs("gdn_bwd", x))


@pytest.mark.gpu
@pytest.mark.hopper
def test_training_step_replays_in_a_cuda_graph(compiled_kernels, monkeypatch):
    """Forward and backward through the API, varlen, captured in one CUDA graph: its replay gives
    eager's outputs and gradients bit for bit, and again after the inputs change in place."""
    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    x = KERNEL_PATH_PROBLEMS[0].inputs("cuda")
    leaves = {n: x[n].clone().requires_grad_() for n in LEAVES}
    gen = torch.Generator("cuda").manual_seed(1)
    w_o = torch.randn(x["v"].shape, generator=gen, device="cuda")
    w_s = torch.randn(x["initial_state"].shape, generator=gen, device="cuda")

    def step():
        for t in leaves.values():
            t.grad = None
        o, s = api(**{**x, **leaves})
        ((o.float() * w_o).sum() + (s * w_s).sum()).backward()
        return [o.detach(), s.detach()] + [leaves[n].grad for n in LEAVES]

    side = torch.cuda.Stream()  # warm up off the default stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            eager = step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for changed in (False, True):
        if changed:
            with torch.no_grad():
                leaves["v"].mul_(-1)                          # new inputs, same tensors
                leaves["initial_state"].mul_(0.5)
            eager = step()
        graph.replay()
        torch.cuda.synchronize()
        for name, got, want in zip(("o", "final_state", *LEAVES), captured, eager):
            assert torch.equal(got, want), (name, changed, rel_l2(got, want))


@pytest.mark.gpu
def test_api_trains_on_cuda():
    """CUDA inputs: within the derived tolerance, and gradients reach every input on the GPU."""
    x = Problem(4, 16, (1, 300, 1000)).inputs("cuda")
    check_op("gdn_fwd", api, x)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    o, s = api(**{**x, **leaves})
    (o.float().square().mean() + s.square().mean()).backward()
    for n in names:
        grad = leaves[n].grad
        assert grad is not None and grad.is_cuda and torch.isfinite(grad).all() and grad.abs().sum() > 0, n
