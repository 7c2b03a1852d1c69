"""Building TileLang kernels for Hopper. Compiling needs only nvcc; running needs an SM90 GPU.

TileLang reads kernel source with ``inspect.getsource``: define kernels in files (or notebook
cells), never through ``exec`` of a string. Compiled kernels are cached on disk
(``~/.tilelang/cache``), so only the first call of a shape pays the 5-40 s compile.
"""

from __future__ import annotations

import functools
import re

import torch

HOPPER_TARGET = {"kind": "cuda", "arch": "sm_90a"}


def compile_hopper(prim_func, pass_configs: dict | None = None):
    """Lower and build a ``T.prim_func`` for sm_90a; works on a machine without a GPU.
    ``pass_configs``: TileLang's pass options (e.g. ``{"tl.enable_fast_math": True}``), if any."""
    import tilelang  # imported here: importing flashqla must not pull in TileLang

    return tilelang.compile(prim_func, target=HOPPER_TARGET, pass_configs=pass_configs)


def _rewrite_once(prim_func, node_type: str, rewrite, wanted: str):
    """``prim_func`` with the one node of ``node_type`` that ``rewrite`` replaces (it returns None
    for the others); a ValueError that says ``wanted`` unless exactly one was replaced."""
    from tvm import tirx

    found = []

    def visit(stmt):
        new = rewrite(stmt)
        if new is not None:
            found.append(stmt)
        return new

    body = tirx.stmt_functor.ir_transform(prim_func.body, None, visit, [node_type])
    if len(found) != 1:
        raise ValueError(f"{wanted}; got {len(found)}")
    return prim_func.with_body(body)


def dependent_launch(prim_func):
    """``prim_func`` with its kernel waiting on the launch before it (``griddepcontrol.wait``,
    TileLang's ``T.pdl_sync``), then letting the launch after it start (``griddepcontrol.
    launch_dependents``, ``T.pdl_trigger``), both first in the kernel's root block. TileLang then
    launches it with programmatic stream serialization (programmatic dependent launch, PDL): its
    CTAs may be scheduled while the previous kernel finishes, and wait for it, and its memory,
    before anything else. A kernel after it that does the same waits for this one; a kernel
    without PDL waits for its whole predecessor as usual."""
    import tilelang.language as T  # imported here: importing flashqla must not pull in TileLang
    from tvm import tirx

    def prepend(stmt):
        if stmt.name_hint != "tilelang_root":
            return None
        body = tirx.SeqStmt([tirx.Evaluate(T.pdl_sync()), tirx.Evaluate(T.pdl_trigger()), stmt.body])
        return tirx.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, stmt.init,
                           stmt.alloc_buffers, stmt.match_buffers, stmt.annotations)

    return _rewrite_once(prim_func, "tirx.SBlock", prepend,
                         "dependent_launch: `prim_func` must have one kernel (one tilelang_root block)")


def min_ctas_per_sm(prim_func, n: int):
    """``prim_func`` with its kernel's ``T.annotate_min_blocks_per_sm`` set to ``n``: the same
    program, emitted with ``__launch_bounds__(threads, n)``, so ptxas fits n CTAs an SM in the
    register file (spilling if it must)."""
    from tvm import tirx

    if not (isinstance(n, int) and n > 0):
        raise ValueError(f"min_ctas_per_sm: `n` must be a positive int; got {n!r}")

    def reset(stmt):
        if stmt.attr_key != "tl.min_blocks_per_sm":
            return None
        return tirx.AttrStmt(stmt.node, stmt.attr_key, tirx.IntImm(stmt.value.dtype, n), stmt.body)

    return _rewrite_once(prim_func, "tirx.AttrStmt", reset, "min_ctas_per_sm: `prim_func` must annotate "
                         "its CTAs an SM once (T.annotate_min_blocks_per_sm)")


@functools.cache
def hopper_gpu_missing() -> str | None:
    """None when an SM90 GPU is usable here, otherwise why not (for skip messages and the tour)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"needs an SM90 (Hopper) GPU; this one is sm_{major}{minor}"
    return None


def cuda_excerpt(source: str, features, width: int = 110) -> None:
    """Print, per (what, regex) in ``features``, how many lines of generated CUDA ``source`` match
    and the first of them; then the features with no match. For reading what a stage compiled to."""
    lines = source.splitlines()
    print(f"{len(lines)} lines of CUDA C++")
    absent = []
    for what, pattern in features:
        hits = [line.strip() for line in lines if re.search(pattern, line)]
        if not hits:
            absent.append(what.split(":")[0].split(" (")[0])
            continue
        first = hits[0] if len(hits[0]) <= width else hits[0][:width] + " ..."
        print(f"  {len(hits):3d} x {what}\n        {first}")
    print("  absent:", ", ".join(dict.fromkeys(absent)) or "none")
