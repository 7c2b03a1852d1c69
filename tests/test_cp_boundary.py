"""The boundary passes of flashqla.cp on one GPU: ``fwd.final_state`` (a sequence's final state Z
and transition M without its outputs) and ``bwd.initial_state_grad`` (the gradient of the state
entering it without the other gradients). Each is checked against float64 within check_op's bound
(2 x max(the same math in bf16 against float64, 2^-9)) and against the library pass that computes
it with everything else: the whole forward split the same way (within the bound: another width of
the fused kernel) and the whole backward split the same way (bit for bit: the same walk over the
first segment row). Deliberately broken variants (the last segment from the first segment's
state; the first segment's walk from a zero gradient) fail the same checks."""

import functools

import pytest
import torch

from flashqla import reference as ref
from flashqla.testing import ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats, rel_l2, run_on_threads

HEADS = (2, 8)   # (H, HV), K = V = 128; value head j % 4 == 0 has g = 0 (Problem)
# one sequence each: 1 x 8192; the pieces of the varlen mix (300, 5000, 2892) over 4 slots of 2048
# tokens (cp's contiguous layout on 4 ranks), those ending off the 64-token grid (1748, 1204, 844)
# and a whole slot (2048); 4097 (a last segment of one token); 300 (the forward's forced rule
# leaves one segment: the whole pass)
LENGTHS = (8192, 1748, 1204, 844, 2048, 4097, 300)
F64, BF16 = torch.float64, torch.bfloat16


def _inputs(n, seed):
    """Problem's inputs of one sequence of n tokens on the GPU, do (bf16 values) and dht."""
    x = Problem(*HEADS, (n,), varlen=False).inputs("cuda", seed=seed)
    gen = torch.Generator("cuda").manual_seed(seed + 1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(BF16)
    dht = torch.randn(x["initial_state"].shape, generator=gen, device="cuda")
    return x, do, dht


def _args(x):
    return [x[name] for name in ("q", "k", "v", "g", "beta")]


def _bound(in_bf16, in_f64):
    return TOLERANCE_FACTOR * max(rel_l2(in_bf16, in_f64), ROUNDING_FLOOR)


def _final_refs(x):
    """(Z, M) of the reference in float64 and in bf16: the final state, the sequence's transition."""
    out = []
    for dtype in (F64, BF16):
        y = cast_floats(x, dtype)
        z = ref.chunk_gated_delta_rule_ref(*_args(y), None, y["initial_state"], True)[1]
        out.append((z, ref.sequence_transition(y["k"], y["g"], y["beta"])))
    return out


def _dh0_refs(x, do, dht):
    """dh0 of the reference backward in float64 and in bf16."""
    return [ref.chunk_gated_delta_rule_bwd_ref(*_args(y), do.to(dtype), dht.to(dtype), None,
                                               y["initial_state"])[5]
            for dtype in (F64, BF16) for y in [cast_floats(x, dtype)]]


def _library_final(x):
    """(Z, M) from the library's whole forward, split by the rule forced (cp=True) as final_state is."""
    from flashqla import fwd
    q, k, v, g, beta = _args(x)
    eye = torch.eye(q.shape[3], device="cuda").expand(1, v.shape[2], q.shape[3], q.shape[3])
    return (fwd.forward(q, k, v, g, beta, None, x["initial_state"], True, None, cp=True)[1],
            fwd.forward(q, k, torch.zeros_like(v), g, beta, None, eye, True, None, cp=True)[1])


@pytest.fixture(scope="module")
def compiled():
    """The kernels of every call below, compiled on threads (TileLang's disk cache keeps them)."""
    from flashqla import bwd, fwd

    def calls(n):
        x, do, dht = _inputs(n, 0)
        fwd.final_state(*_args(x), None, x["initial_state"], True)
        _library_final(x)
        bwd.initial_state_grad(*_args(x), do, dht, None)
        bwd.backward(*_args(x), do, dht, None, x["initial_state"], None, cp=True)
    run_on_threads([functools.partial(calls, n) for n in LENGTHS])
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("n", LENGTHS)
def test_final_state_and_transition_within_the_bound(n, compiled):
    """Z and M from final_state: within the bound of float64 (M: ``reference.sequence_transition``)
    and of the library's whole forward, split the same way, that computes them with the outputs."""
    from flashqla import fwd
    x, _, _ = _inputs(n, seed=n)
    z, m = fwd.final_state(*_args(x), None, x["initial_state"], True)
    (z64, m64), (zb, mb) = _final_refs(x)
    lib_z, lib_m = _library_final(x)
    z_bound, m_bound = _bound(zb, z64), _bound(mb, m64)
    errors = {"Z vs float64": (rel_l2(z, z64), z_bound), "Z vs library": (rel_l2(z, lib_z), z_bound),
              "M vs float64": (rel_l2(m, m64), m_bound), "M vs library": (rel_l2(m, lib_m), m_bound)}
    assert all(e <= b for e, b in errors.values()), (n, errors)
    assert fwd.final_state(*_args(x), None, x["initial_state"])[1] is None


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("n", LENGTHS)
def test_initial_state_grad_is_the_backward_dh0(n, compiled):
    """dh0 from initial_state_grad: the bits of the library's whole backward split the same way
    (cp=True), and within the bound of float64."""
    from flashqla import bwd
    x, do, dht = _inputs(n, seed=n)
    dh0 = bwd.initial_state_grad(*_args(x), do, dht, None)
    lib = bwd.backward(*_args(x), do, dht, None, x["initial_state"], None, cp=True)[5]
    want, in_bf16 = _dh0_refs(x, do, dht)
    assert torch.equal(dh0, lib), (n, rel_l2(dh0, lib))
    assert rel_l2(dh0, want) <= _bound(in_bf16, want), (n, rel_l2(dh0, want), _bound(in_bf16, want))


@pytest.mark.gpu
@pytest.mark.hopper
def test_broken_boundary_passes_fail_the_checks(compiled, monkeypatch):
    """final_state with every segment row holding the first one's state (the last segment from
    the sequence's initial state) misses Z and M beyond the bound (4097 tokens: a last segment of
    one token); initial_state_grad with the reverse chain's rows zero (the first segment's walk from
    dS' = 0) misses dh0 (300 tokens: segments of two chunks)."""
    from flashqla import bwd, fwd
    chain, chain_grads = fwd.chain_states, bwd.segment_state_grads

    def first_row_everywhere(*args):
        h_seg = chain(*args)
        return h_seg[:1].expand_as(h_seg).contiguous()
    monkeypatch.setattr(fwd, "chain_states", first_row_everywhere)
    monkeypatch.setattr(bwd, "segment_state_grads", lambda *args: torch.zeros_like(chain_grads(*args)))
    x, _, _ = _inputs(4097, seed=5)
    z, m = fwd.final_state(*_args(x), None, x["initial_state"], True)
    (z64, m64), (zb, mb) = _final_refs(x)
    assert rel_l2(z, z64) > _bound(zb, z64) and rel_l2(m, m64) > _bound(mb, m64), (rel_l2(z, z64), rel_l2(m, m64))
    x, do, dht = _inputs(300, seed=6)
    want, in_bf16 = _dh0_refs(x, do, dht)
    got = bwd.initial_state_grad(*_args(x), do, dht, None)
    assert rel_l2(got, want) > _bound(in_bf16, want), rel_l2(got, want)
