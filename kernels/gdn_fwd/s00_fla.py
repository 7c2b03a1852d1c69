"""gdn_fwd, stage 00: the baseline row. FLA's Triton forward, wrapped, not reimplemented.

Every later gdn_fwd stage is measured against this one in the same run. It calls
``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` (fla-core 0.6.0) under ``torch.no_grad``,
as a model's inference step would, after setting ``FLA_FLASH_QLA=0``: when the ``flash_qla``
package is importable, FLA otherwise routes this call to FlashQLA's kernels, and this row would
time the other peer. What it runs is FLA's multi-kernel chunked forward: chunk-local cumsum, gated
K K^T with the triangular solve, w and u, the inter-chunk state recurrence (per-chunk states
written to HBM in bf16), the output. The same sub-steps as ``flashqla.reference``.

Measured effect: none, it is the yardstick (``python -m flashqla bench``).
Taught in: notebooks/03_forward_kernels.py.
"""

import os

import torch

from flashqla.nvtx import nvtx_range

NEEDS = ("cuda", "fla")


def run(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
        cu_seqlens=None, chunk_size=64):
    """FLA's forward on the same arguments; returns (o, final_state or None)."""
    if chunk_size != 64:
        raise ValueError(f"gdn_fwd.s00: `chunk_size` must be 64 (FLA's); got {chunk_size}")
    os.environ["FLA_FLASH_QLA"] = "0"  # time FLA's own Triton kernels, not its FlashQLA backend
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    with torch.no_grad(), nvtx_range("gdn_fwd.s00"):
        return chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, cu_seqlens=cu_seqlens)
