"""flashqla.integrations.fla: FLA's own chunk_gated_delta_rule runs flashqla where the verifier
accepts the call, FLA's path otherwise. Needs fla-core 0.6.0 (the dev extra); on the CPU the
references stand in for the kernels, on an SM90 GPU the kernels run."""

import pytest
import torch

import flashqla
import flashqla.api
from flashqla import reference as ref
from flashqla.integrations import fla as integration
from flashqla.testing import Problem, cast_floats, rel_l2

fla_backends = pytest.importorskip("fla.backends")
F64 = torch.float64


@pytest.fixture
def enabled(monkeypatch):
    """flashqla registered in FLA's registry for this test only; the calls it runs are counted."""
    calls = []
    api = flashqla.api.chunk_gated_delta_rule

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return api(*args, **kwargs)

    monkeypatch.setattr(flashqla.api, "chunk_gated_delta_rule", counted)
    monkeypatch.delenv("FLA_FLASHQLA", raising=False)
    integration.enable()
    integration.enable()  # a second call changes nothing
    registry = fla_backends._get_operation_registry("gated_delta_rule")
    yield calls, registry._backends["flashqla"]
    del registry._backends["flashqla"]  # FLA's own path again for later tests (its benchmarks)


def test_registered_ahead_of_flashqla(enabled):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401 -- loads FLA's backends

    _, backend = enabled
    registry = fla_backends._get_operation_registry("gated_delta_rule")
    order = [b.backend_type for b in registry._get_sorted_backends()]
    assert order.count("flashqla") == 1
    assert "flash_qla" not in order or order.index("flashqla") < order.index("flash_qla")
    assert backend.is_available() and backend.is_enabled()


def _layer_call(x, **change):
    """FLA's GatedDeltaNet layer call (raw gate and beta, A_log, dt_bias, l2norm, state [N, HV, V, K])."""
    gen = torch.Generator(x["q"].device).manual_seed(2)
    HV = x["v"].shape[2]
    call = dict(q=x["q"], k=x["k"], v=x["v"], g=torch.randn(x["g"].shape, generator=gen, device=x["g"].device),
                beta=torch.randn(x["beta"].shape, generator=gen, device=x["g"].device),
                A_log=torch.randn(HV, generator=gen, device=x["g"].device),
                dt_bias=torch.randn(HV, generator=gen, device=x["g"].device),
                initial_state=x["initial_state"].transpose(-1, -2).contiguous(), output_final_state=True,
                use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                allow_neg_eigval=True, state_v_first=True, cu_seqlens=x["cu_seqlens"])
    return {**call, **change}


def test_fla_runs_flashqla_where_verified(enabled, monkeypatch):
    """With the kernel path open (the references standing in for the kernels), FLA's function
    gives flashqla's result for the layer's call, and the float64 reference's for a plain one."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    calls, _ = enabled
    monkeypatch.setattr(flashqla.api, "kernel_unsupported", lambda *a: None)
    monkeypatch.setattr(flashqla.api, "_kernel_forward", flashqla.api._reference)
    x = cast_floats(Problem(2, 4, (70, 1, 64), K=8, V=8).inputs(), F64)
    call = cast_floats(_layer_call(x), F64)
    got = fla_gdn(**call)
    assert len(calls) == 1
    want = flashqla.chunk_gated_delta_rule(**call)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    o, s = fla_gdn(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                   cu_seqlens=x["cu_seqlens"])                        # positional, FLA's order
    o_ref, s_ref = ref.chunk_gated_delta_rule_ref(**x)
    assert len(calls) == 2 and rel_l2(o, o_ref) < 1e-12 and rel_l2(s, s_ref) < 1e-12


REJECTED = {
    "cp_context": (dict(cp_context=object()), "cp_context"),
    "chunk_size 32": (dict(chunk_size=32), "chunk_size 64 only"),
    "head_first": (dict(head_first=False), "'head_first'"),
    "transpose_state_layout": (dict(transpose_state_layout=True), "'transpose_state_layout'"),
    "an unknown keyword": (dict(something=1), "'something'"),
    "the gate without A_log": (dict(A_log=None), "needs A_log"),
}


@pytest.mark.parametrize("case", REJECTED, ids=list(REJECTED))
def test_verifier_leaves_the_rest_to_fla(enabled, monkeypatch, case):
    _, backend = enabled
    monkeypatch.setattr(flashqla.api, "kernel_unsupported", lambda *a: None)
    change, reason = REJECTED[case]
    x = Problem(2, 4, (70, 1, 64), K=8, V=8).inputs()
    assert backend.verify("chunk_gated_delta_rule", **_layer_call(x)) == (True, None)
    accepted, why = backend.verify("chunk_gated_delta_rule", **_layer_call(x, **change))
    assert not accepted and reason in why


def test_verifier_rejects_what_flashqla_runs_on_its_reference(enabled, monkeypatch):
    _, backend = enabled
    x = Problem(2, 4, (70, 1, 64), K=8, V=8).inputs()
    assert backend.verify("chunk_gated_delta_rule", **x) == (
        False, "the inputs are on the cpu; the kernels need an SM90 CUDA GPU")
    monkeypatch.setattr(flashqla.api, "kernel_unsupported", lambda *a: None)
    monkeypatch.setenv("FLASHQLA_BACKEND", "reference")
    assert backend.verify("chunk_gated_delta_rule", **x) == (False, "FLASHQLA_BACKEND=reference")


def test_fla_switch_turns_it_off(enabled, monkeypatch):
    _, backend = enabled
    monkeypatch.setenv("FLA_FLASHQLA", "0")
    assert not backend.is_enabled()


@pytest.mark.gpu
@pytest.mark.hopper
def test_fla_layer_call_runs_the_kernels(enabled, monkeypatch):
    """On an SM90 GPU: FLA's function runs flashqla's kernels for the layer's bf16 call (its
    result, forward and backward, is flashqla's bit for bit) and FLA's own path for float16."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    calls, _ = enabled
    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    x = Problem(4, 16, (1, 300, 700)).inputs("cuda")
    call = _layer_call(x)
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "initial_state")

    def train(fn):
        leaves = {n: call[n].clone().requires_grad_() for n in names}
        o, s = fn(**{**call, **leaves})
        (o.float().square().sum() + s.square().sum()).backward()
        return [o, s] + [leaves[n].grad for n in names]

    got = train(fla_gdn)
    assert len(calls) == 1
    for a, b in zip(got, train(flashqla.chunk_gated_delta_rule)):  # direct: not counted
        assert torch.equal(a, b), rel_l2(a, b)
    half = {n: t.half() if n in ("q", "k", "v") else t for n, t in call.items()}
    o, _ = fla_gdn(**half)
    assert len(calls) == 1 and o.dtype == torch.float16
