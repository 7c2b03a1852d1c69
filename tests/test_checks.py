"""A wrong answer must fail: the check used for every stage catches deliberately broken stages."""

import pytest
import torch

from flashqla import reference as ref
from flashqla.testing import Problem, check_op, op_inputs

PROBLEM = Problem(2, 4, (100, 1, 70), K=32, V=32)


def dropped_chunk(q, k, v, g, beta, **kw):
    """Forgets to write chunk 1 (tokens 64..127) of the first sequence into the state."""
    beta = beta.clone()
    beta[:, 64:100] = 0
    return ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, **kw)


def missing_decay(q, k, v, g, beta, **kw):
    return ref.chunk_gated_delta_rule_ref(q, k, v, torch.zeros_like(g), beta, **kw)


def transposed_state(q, k, v, g, beta, initial_state=None, **kw):
    return ref.chunk_gated_delta_rule_ref(q, k, v, g, beta, initial_state=initial_state.transpose(-1, -2),
                                          **kw)


def chunk_o_transposed_state(q, k, v_new, h, g_cum, scale=None, cu_seqlens=None):
    return ref.chunk_o(q, k, v_new, h.transpose(-1, -2), g_cum, scale, cu_seqlens)


def chunk_kkt_with_diagonal(k, g_cum, beta, cu_seqlens=None):
    """A mask off by one: keeps the diagonal beta_i k_i.k_i of A."""
    a = ref.chunk_kkt(k, g_cum, beta, cu_seqlens).clone()
    t = torch.arange(a.shape[1])
    row = t - torch.repeat_interleave(cu_seqlens[:-1].long(), cu_seqlens.diff().long())
    kk = ref.expand_heads(k, beta.shape[2]).float()
    a[0, t, :, row % 64] += beta[0] * (kk[0] ** 2).sum(-1)
    return a

def solve_without_a_level(k, beta, cu_seqlens=None, chunk_size=64):
    """gate_free_solve.s15's walk with one block product lost: X_10 (rows 16-31 of the first chunk,
    columns 0-15) left at zero."""
    ab = ref.gate_free_solve(k, beta, cu_seqlens, chunk_size).clone()
    ab[:, 16:32, :, :16] = 0
    return ab


def test_the_reference_in_fp32_passes():
    check_op("gdn_fwd", lambda **x: ref.chunk_gated_delta_rule_ref(
        **{n: (t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
           for n, t in x.items()}), PROBLEM.inputs())


@pytest.mark.parametrize("broken", [dropped_chunk, missing_decay, transposed_state],
                         ids=lambda f: f.__name__)
def test_broken_forward_fails(broken):
    with pytest.raises(AssertionError, match="gdn_fwd: wrong answer"):
        check_op("gdn_fwd", broken, PROBLEM.inputs())


@pytest.mark.parametrize("op, broken", [("chunk_o", chunk_o_transposed_state),
                                        ("chunk_kkt", chunk_kkt_with_diagonal),
                                        ("gate_free_solve", solve_without_a_level)],
                         ids=["chunk_o transposed state", "chunk_kkt keeps the diagonal",
                              "gate_free_solve loses a block level"])
def test_broken_sub_step_fails(op, broken):
    with pytest.raises(AssertionError, match=f"{op}: wrong answer"):
        check_op(op, broken, op_inputs(op, PROBLEM.inputs()))


def test_wrong_shape_and_missing_output_fail():
    x = PROBLEM.inputs()
    with pytest.raises(AssertionError, match="has shape"):
        check_op("gdn_fwd", lambda **kw: (ref.chunk_gated_delta_rule_ref(**kw)[0][:, 1:],
                                          ref.chunk_gated_delta_rule_ref(**kw)[1]), x)
    with pytest.raises(AssertionError, match="expected 2 outputs"):
        check_op("gdn_fwd", lambda **kw: ref.chunk_gated_delta_rule_ref(**kw)[0], x)


def test_nan_output_fails():
    def nan_stage(**kw):
        o, s = ref.chunk_gated_delta_rule_ref(**kw)
        return o.clone().fill_(float("nan")), s
    with pytest.raises(AssertionError, match="o: rel L2 err inf"):
        check_op("gdn_fwd", nan_stage, PROBLEM.inputs())


def test_run_on_threads_reruns_a_failed_call_alone_and_raises_a_real_error():
    """run_on_threads: a call that fails on a thread (as a TVM-FFI module's first calls on several
    threads at once can) runs again, alone; one that fails again raises."""
    from flashqla.testing import run_on_threads

    done, tries = [], []

    def flaky():
        tries.append(1)
        if len(tries) == 1:
            raise RuntimeError("Cannot find function kernel in the imported modules")
        done.append("flaky")

    run_on_threads([flaky, lambda: done.append("plain")])
    assert sorted(done) == ["flaky", "plain"] and len(tries) == 2

    def broken():
        raise ValueError("a real error")

    with pytest.raises(ValueError, match="a real error"):
        run_on_threads([broken])
