"""Building TileLang kernels for Hopper. Compiling needs only nvcc; running needs an SM90 GPU.

TileLang reads kernel source with ``inspect.getsource``: define kernels in files (or notebook
cells), never through ``exec`` of a string. Compiled kernels are cached on disk
(``~/.tilelang/cache``), so only the first call of a shape pays the 5-40 s compile.
"""

from __future__ import annotations

import functools

import torch

HOPPER_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def compile_hopper(prim_func, pass_configs: dict | None = None):
    """Lower and build a ``T.prim_func`` for sm_90a; works on a machine without a GPU.
    ``pass_configs``: TileLang's pass options (e.g. ``{"tl.enable_fast_math": True}``), if any."""
    import tilelang  # imported here: importing flashqla must not pull in TileLang

    return tilelang.compile(prim_func, target=HOPPER_TARGET, pass_configs=pass_configs)


@functools.cache
def hopper_gpu_missing() -> str | None:
    """None when an SM90 GPU is usable here, otherwise why not (for skip messages and the tour)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs an SM90 (Hopper) GPU; this one is sm_{major}{minor}"
    return None
