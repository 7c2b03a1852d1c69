"""fused_recurrent.s02 (decode, every load of a CTA in flight before its first wait; BV = 8 or 16
value columns a CTA): its sm_90a compile at each width (the launch bound, the cp.async staging),
and (GPU) each width within the derived tolerance over the library tests' batches, varlen
problems, options and state pools (tests/test_recurrent.py checks the library's width, BV)."""

import functools

import pytest
import torch

from flashqla.stages import load
from flashqla.testing import run_on_threads
from test_recurrent import (GPU_HEADS, GPU_OPTIONS, GPU_SHAPES, GPU_VARLEN, POOLS, _batch_inputs,
                            _check_decode, _option_inputs, _pool_inputs, _varlen_inputs)

S02 = load("fused_recurrent", 2)
LAYER = S02.Variant(state_v_first=True, l2norm=True, gate="raw", dt_bias=True, beta="sigmoid",
                    g_dtype="bfloat16", beta_dtype="bfloat16")


@pytest.mark.parametrize("BV", S02.WIDTHS)
def test_each_width_compiles_with_its_launch_bound(BV):
    """FLA's layer variant at each width, for sm_90a: the CTAs an SM asked of ptxas, and q, k, v
    staged by cp.async with one wait (about 10 s a width)."""
    source = S02._compiled(16, 32, LAYER, BV).get_kernel_source()
    assert f"__launch_bounds__(32, {S02.MIN_CTAS_PER_SM[BV]})" in source
    assert "cp_async_gs_conditional" in source and source.count("cp_async_wait<0>") == 1


def test_other_widths_are_refused():
    with pytest.raises(ValueError, match=r"`BV` must be one of \(8, 16\); got 32"):
        S02.fused_recurrent_kernel(16, 32, S02.Variant(), 32)


# ---- the kernel on the GPU ---------------------------------------------------------------------

def _s02(BV):
    return functools.partial(S02.run, BV=BV)


@pytest.fixture(scope="module")
def compiled_s02():
    """Every s02 variant the tests below run, at both widths, compiled here on threads."""
    cases = ([_batch_inputs(H, HV, 1, 1) for H, HV in GPU_HEADS]
             + [_varlen_inputs(H, HV, n, d) for H, HV, n in GPU_VARLEN for d in (torch.int32, torch.int64)]
             + [_option_inputs(c) for c in GPU_OPTIONS]
             + [_pool_inputs(d, vf, p) for d, vf in POOLS for p in (False, True)])
    run_on_threads([functools.partial(_s02(BV), **x) for BV in S02.WIDTHS for x in cases])


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("H, HV, T, B", GPU_SHAPES)
@pytest.mark.parametrize("BV", S02.WIDTHS)
def test_s02_batches_within_the_bound(BV, H, HV, T, B, compiled_s02):
    _check_decode(_s02(BV), _batch_inputs(H, HV, T, B))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("H, HV, lengths", GPU_VARLEN)
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("BV", S02.WIDTHS)
def test_s02_varlen_within_the_bound(BV, H, HV, lengths, cu_dtype, compiled_s02):
    _check_decode(_s02(BV), _varlen_inputs(H, HV, lengths, cu_dtype))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("case", GPU_OPTIONS, ids=list(GPU_OPTIONS))
@pytest.mark.parametrize("BV", S02.WIDTHS)
def test_s02_options_within_the_bound(BV, case, compiled_s02):
    _check_decode(_s02(BV), _option_inputs(case))


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("pool_dtype, state_v_first", POOLS)
@pytest.mark.parametrize("BV", S02.WIDTHS)
def test_s02_updates_a_pool_in_place(BV, pool_dtype, state_v_first, compiled_s02):
    """Slots read and written in place, padding (-1, S) neither read nor written, the other slots
    left bit for bit, the pool returned; the same pool read without in place gives new states."""
    x = _pool_inputs(pool_dtype, state_v_first, True)
    checks = _check_decode(_s02(BV), x)
    assert {c.output for c in checks} == {"o", "final_state"}
    _check_decode(_s02(BV), _pool_inputs(pool_dtype, state_v_first, False))
    pool = x["initial_state"]
    before = pool.clone()
    o, s = _s02(BV)(**x)
    assert s is pool
    untouched = [1, 2, 4, 6, 8]
    assert torch.equal(pool[untouched], before[untouched]) and not torch.equal(pool[7], before[7])


@pytest.mark.gpu
@pytest.mark.hopper
def test_s02_check_catches_a_broken_kernel(monkeypatch, compiled_s02):
    """The GPU check above fails for s02 built with a wrong decay (exp2 of g, not of log2(e) g)."""
    from flashqla.hopper import compile_hopper

    monkeypatch.setattr(S02, "LOG2E", 1.0)
    broken = functools.cache(lambda H, HV, variant, BV: compile_hopper(S02.fused_recurrent_kernel(H, HV, variant, BV)))
    monkeypatch.setattr(S02, "_compiled", broken)
    with pytest.raises(AssertionError, match="wrong answer"):
        _check_decode(_s02(8), _batch_inputs(16, 32, 4, 8))
