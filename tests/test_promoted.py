"""The library runs what the workbench tested: each kernel in flashqla.fwd and flashqla.bwd builds the
same TileLang program as the stage it was promoted from, and the API takes the kernel path exactly
where it should."""

import pytest
import torch

from flashqla import bwd, fwd
from flashqla.api import kernel_unsupported
from flashqla.stages import load

PROMOTED = [  # (library builder, stage, the stage's builder, a shape)
    (fwd.chunk_local_cumsum_kernel, ("chunk_local_cumsum", 1), "chunk_local_cumsum_kernel", (32,)),
    (fwd.chunk_fwd_intra_kernel, ("chunk_fwd_intra", 1), "chunk_fwd_intra_kernel", (16, 32)),
    (fwd.fused_h_o_kernel, ("gdn_fwd", 3), "fused_h_o_kernel", (16, 32, 128, 128)),
    # the backward (kernels/gdn_bwd/s01_separate_kernels.py and the stages it runs)
    (bwd.chunk_kkt_kernel, ("chunk_kkt", 2), "chunk_kkt_kernel", (16, 32, 128)),
    (bwd.kkt_solve_kernel, ("kkt_solve", 1), "kkt_solve_kernel", (32,)),
    (bwd.chunk_w_u_kernel, ("chunk_w_u", 1), "chunk_w_u_kernel", (16, 32)),
    (bwd.chunk_h_kernel, ("chunk_h", 1), "chunk_h_kernel", (16, 32)),
    (bwd.chunk_bwd_dv_local_kernel, ("chunk_bwd_dv_local", 1), "chunk_bwd_dv_local_kernel", (16, 32)),
    (bwd.chunk_bwd_dhu_kernel, ("chunk_bwd_dhu", 1), "chunk_bwd_dhu_kernel", (16, 32)),
    (bwd.chunk_bwd_dqkwg_kernel, ("chunk_bwd_dqkwg", 1), "chunk_bwd_dqkwg_kernel", (16, 32)),
    (bwd.wy_bwd_kernel, ("wy_bwd", 1), "wy_bwd_kernel", (16, 32)),
]


@pytest.mark.parametrize("builder, stage, stage_builder, shape", PROMOTED,
                         ids=[f"{op}.s{n:02d}" for _, (op, n), _, _ in PROMOTED])
def test_promoted_kernel_is_the_stage_kernel(builder, stage, stage_builder, shape):
    assert builder(*shape).script() == getattr(load(*stage), stage_builder)(*shape).script()


def test_a_changed_kernel_is_caught():
    """The check above can fail: two different kernels print different programs."""
    assert fwd.chunk_fwd_intra_kernel(16, 32).script() != fwd.chunk_fwd_intra_kernel(16, 64).script()


@pytest.mark.parametrize("constant, value, builder, stage, stage_builder", [
    ("BV", 32, bwd.chunk_bwd_dhu_kernel, ("chunk_bwd_dhu", 1), "chunk_bwd_dhu_kernel"),
    ("TWO_WG_THREADS", 128, bwd.wy_bwd_kernel, ("wy_bwd", 1), "wy_bwd_kernel"),
], ids=["BV", "TWO_WG_THREADS"])
def test_a_changed_backward_copy_is_caught(constant, value, builder, stage, stage_builder, monkeypatch):
    """flashqla.bwd renames some of its stages' constants: a copy built with a different value
    would no longer print the stage's program."""
    monkeypatch.setattr(bwd, constant, value)
    assert builder(16, 32).script() != getattr(load(*stage), stage_builder)(16, 32).script()


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
