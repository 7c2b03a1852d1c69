"""NVTX ranges in the ``flashqla`` domain, for Nsight Compute's ``--nvtx-include "flashqla@NAME/"``.

Range names look like ``fwd.s03.chunk_o`` and never contain "/". The ``nvtx`` package records
nothing (and costs well under a microsecond) when no profiler is attached, and it works with
CPU-only torch, where ``torch.cuda.nvtx`` would raise.
"""

import nvtx

DOMAIN = "flashqla"


def nvtx_range(name: str):
    """Context manager (and decorator) marking one op or kernel launch."""
    if "/" in name:
        raise ValueError(f"nvtx_range: `name` must not contain '/' (ncu uses it as a separator); got {name!r}")
    return nvtx.annotate(message=name, domain=DOMAIN)
