"""torch.compile over a model that calls flashqla.chunk_gated_delta_rule: one graph, no breaks, the
same numbers as eager (on the CPU the reference runs inside the custom op, on an SM90 GPU the kernels)."""

import pytest
import torch

import flashqla
from flashqla.testing import rel_l2

F64 = torch.float64


class GatedDeltaNetLayer(torch.nn.Module):
    """A small GDN layer called as FLA's GatedDeltaNet calls the op: raw gate and beta logits, the
    gate's A_log and dt_bias, q/k l2norm, negative eigenvalues and the state [N, HV, V, K]."""

    def __init__(self, hidden=32, H=2, HV=4, K=8, V=8, dtype=F64, device="cpu"):
        super().__init__()
        gen = torch.Generator(device).manual_seed(0)
        def param(*shape):
            return torch.nn.Parameter(torch.randn(*shape, generator=gen, dtype=dtype, device=device) / shape[-1] ** 0.5)
        self.H, self.HV, self.K, self.V = H, HV, K, V
        self.w_qk, self.w_v, self.w_ab = param(hidden, 2 * H * K), param(hidden, HV * V), param(hidden, 2 * HV)
        self.w_o = param(HV * V, hidden)
        self.A_log, self.dt_bias = param(HV), param(HV)

    def forward(self, x, cu_seqlens=None, state=None):
        B, T, _ = x.shape
        q, k = (x @ self.w_qk).view(B, T, 2, self.H, self.K).unbind(2)
        a, b = (x @ self.w_ab).view(B, T, 2, self.HV).unbind(2)
        o, state = flashqla.chunk_gated_delta_rule(
            q, k, (x @ self.w_v).view(B, T, self.HV, self.V), a, b, initial_state=state,
            output_final_state=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=True, state_v_first=True, cu_seqlens=cu_seqlens, use_gate_in_kernel=True,
            A_log=self.A_log, dt_bias=self.dt_bias)
        return o.flatten(2) @ self.w_o, state


def _inputs(varlen, dtype=F64, device="cpu", hidden=32, HV=4, V=8, K=8):
    gen = torch.Generator(device).manual_seed(1)
    if varlen:
        cu = torch.tensor([0, 70, 71, 150], dtype=torch.int32, device=device)
        x = torch.randn(1, 150, hidden, generator=gen, dtype=dtype, device=device)
    else:
        cu, x = None, torch.randn(2, 75, hidden, generator=gen, dtype=dtype, device=device)
    N = 3 if varlen else 2
    state = torch.randn(N, HV, V, K, generator=gen, dtype=torch.float32, device=device)
    return x, cu, state


@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_no_graph_breaks(varlen):
    x, cu, state = _inputs(varlen)
    explained = torch._dynamo.explain(GatedDeltaNetLayer())(x, cu, state.double())
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def _train_step(layer, x, cu, state):
    out, final = layer(x, cu, state)
    (out.square().sum() + final.square().sum()).backward()
    return [out.detach(), final.detach()] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.slow
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_compiled_equals_eager_in_float64(varlen):
    """fullgraph=True with Inductor: outputs, final state and every parameter's gradient within
    1e-12 of eager in float64 (Inductor may fuse the projections' epilogues differently)."""
    torch._dynamo.reset()
    x, cu, state = _inputs(varlen)
    eager_layer, compiled_layer = GatedDeltaNetLayer(), GatedDeltaNetLayer()
    want = _train_step(eager_layer, x, cu, state.double())
    got = _train_step(torch.compile(compiled_layer, fullgraph=True), x, cu, state.double())
    errors = [rel_l2(a, b) for a, b in zip(got, want)]
    assert max(errors) < 1e-12, errors


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("varlen", [False, True], ids=["batch", "varlen"])
def test_compiled_equals_eager_on_the_kernels(varlen, monkeypatch):
    """On the kernels (FLASHQLA_BACKEND=kernels), fullgraph=True: the op's forward and backward
    compiled give eager's bits; the whole layer in bf16 (whose l2norm and gate Inductor fuses, in
    another summation order) agrees to 2^-7, twice the bf16 rounding of its inputs."""
    from flashqla.testing import Problem

    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    torch._dynamo.reset()
    problem = Problem(4, 16, (300, 1, 700)) if varlen else Problem(4, 16, (500, 500), varlen=False)
    x = problem.inputs("cuda")
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def op_step(fn):
        leaves = {n: x[n].clone().requires_grad_() for n in names}
        o, s = fn(*(leaves[n] for n in names), x["cu_seqlens"])
        (o.float().square().sum() + s.square().sum()).backward()
        return [o, s] + [leaves[n].grad for n in names]

    def op(q, k, v, g, beta, h0, cu):
        return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                               cu_seqlens=cu)

    for i, (a, b) in enumerate(zip(op_step(torch.compile(op, fullgraph=True)), op_step(op))):
        assert torch.equal(a, b), (i, rel_l2(a, b))

    torch._dynamo.reset()
    xs, cu, state = _inputs(varlen, torch.bfloat16, "cuda", hidden=256, HV=16, V=128, K=128)
    layers = [GatedDeltaNetLayer(256, 4, 16, 128, 128, torch.bfloat16, "cuda") for _ in range(2)]
    want = _train_step(layers[0], xs, cu, state)
    got = _train_step(torch.compile(layers[1], fullgraph=True), xs, cu, state)
    errors = [rel_l2(a, b) for a, b in zip(got, want)]
    assert max(errors) < 2 ** -7, errors
