"""The public entry point: ``chunk_gated_delta_rule``, FLA's function (fla-core 0.6.0) of that name,
with its signature, its positional order and its semantics.

Where it runs. On an SM90 GPU (H100, H200) with bfloat16 q, k, v and K = V = 128 the call runs the
TileLang kernels: the forward of ``flashqla.fwd`` (the chunk table, the chunk-local cumsum and the
gate-free solve, then the warp-specialized fused state chain + output kernel, its width from the
sequence lengths, with AutoCP's split where it pays) and the backward of ``flashqla.bwd`` (autograd
saves only the inputs, the backward recomputes the forward's intermediates, and gradients reach
every input, ``initial_state`` included). Every other call (CPU tensors, other GPUs, float16,
float32, float64, other head dims) runs the chunked PyTorch reference (``flashqla.reference``) in
float32 (float64 for float64 inputs) on the inputs' device, forward and backward; so does the
backward alone of a head layout whose backward kernels do not compile (``backward_unsupported``:
TileLang 0.1.15 cannot map the finish kernel for 3, 5, 6 or 12 query/key heads).

The switch: the environment variable FLASHQLA_BACKEND, read at every call.

    auto       (the default) the kernels where they can run, else the reference, after a one-time
               warning that says why
    kernels    the kernels, or a RuntimeError that says why they cannot run this call
    reference  always the reference

The reference ignores ``torch.autocast``: its matmuls run in float32 (float64) inside an autocast
region too, so its error stays that of float32.

FLA's keywords, each done before the kernels by differentiable PyTorch ops, the same for both paths:

    use_qk_l2norm_in_kernel     q, k <- x / sqrt(sum(x^2) + 1e-6) over K, in float32, back in their dtype
    use_beta_sigmoid_in_kernel  beta <- sigmoid(beta) in float32; with allow_neg_eigval 2 sigmoid(beta),
                                in (0, 2) (allow_neg_eigval requires use_beta_sigmoid_in_kernel)
    use_gate_in_kernel          g <- -exp(A_log) softplus(g + dt_bias) in float32; keywords A_log [HV]
                                (required) and dt_bias [HV] (optional)
    state_v_first               initial_state and the final state are [N, HV, V, K] (transposed)
    initial_state               any float dtype; float16 and bfloat16 are upcast to float32 (the
                                state's dtype), its gradient comes back in its own dtype
    scale                       a Python or numpy number or a 0-d tensor (read on the host: a GPU
                                tensor synchronizes); None is K ** -0.5
    cu_seqlens_cpu              the host copy of cu_seqlens (the caller vouches for equal values):
                                the lengths are then read from it, never from cu_seqlens
    chunk_indices               FLA's chunk table [NT, 2]: its shape is checked, its values are
                                never read (the kernels build their table from cu_seqlens)
    chunk_size                  64 only (ValueError otherwise)
    cp_context                  a context from ``flashqla.cp.build_cp_context`` (FLA's keyword): q, k,
                                v, g, beta are this rank's shard, a sequence may span ranks, and the
                                call exchanges states with the other ranks (``flashqla.cp``: its local
                                passes run the kernels or the reference, as above; cu_seqlens, if given,
                                must be the context's, and initial_state and the final state have a
                                row per global sequence)
    transpose_state_layout      FLA's deprecated name for state_v_first (a DeprecationWarning)
    head_first                  raises DeprecationWarning, as FLA does

Any other keyword raises TypeError naming it; bad values raise ValueError naming the argument.

torch.compile. Under ``torch.compile`` the computation is one custom op,
``torch.ops.flashqla.chunk_gated_delta_rule`` (``torch.library``: a fake implementation for
tracing, autograd registered with a backward op of its own), so a model calling this function
compiles with ``fullgraph=True``, with or without cu_seqlens; the checks that read cu_seqlens's
values on the host, the choice of path and the NVTX ranges all run inside the op, never in a
trace. Eager calls run the same forward and backward through an ``autograd.Function``: on a
2-core CPU host it took 0.02-0.04 ms a call, the op's Python dispatch 0.2-0.3 ms.

CUDA graphs. Neither direction synchronizes with the host beyond the one read of cu_seqlens per
tensor (none with cu_seqlens_cpu), kept for later calls, so a training step can be captured in a
CUDA graph after one eager call (cu_seqlens is checked on the host only outside capture).

Threads and streams. The call is safe from several threads and on several CUDA streams at once:
the caches on its path fill under locks, and a device tensor cached by one stream is never read by
another before it is written (``flashqla.caches``).

AutoCP (``flashqla.autocp``): when few (sequence, head) chains would leave most SMs idle (e.g.
(H, HV) = (2, 8) from about 4096 tokens), the forward cuts each sequence into segments whose
chains run in parallel, each from an initial state computed first; the decision takes the
sequence lengths (the host read of ``cu_seqlens``), the head count and the SM count, and the
plan is built on the host and kept for those lengths. A segment's initial state is exact for
heads whose gates decay slowly (or where a token breaks the bound's conditions); for the others
it is wrong by at most exp(-10) times the norm of the state where its warm-up window starts (the
bound FlashQLA uses). The backward splits by its own rule (``flashqla.bwd``: where its state walks
would leave SMs idle, e.g. (2, 8) at 8192 tokens), the segments' initial states as the forward's
and their final-state gradients by the same bound, the windows walked in reverse.

NaN and inf: inputs are not scanned (that would cost a pass over them and a host sync). A NaN or
inf in q, k, v, g or beta at some token poisons, for the value heads that read it, the output of
every token of that chunk (earlier tokens of the chunk included, as the chunk is one matrix
product), of every later token of the sequence, and the final state; other sequences and other
head groups are unaffected. Under AutoCP a warm-up head's later segments start from a state
computed over the last few chunks only, so a NaN or inf in k or v before those chunks does not
reach them (one in g or beta makes the head run exactly, so it does). g = -inf (a hard reset)
yields NaN: pass a large finite negative value instead. A NaN or inf in ``initial_state`` poisons
that sequence and head from its first token.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import numbers
import os
import threading
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flashqla import checks, cp, reference
from flashqla.hopper import hopper_gpu_missing
from flashqla.nvtx import nvtx_range
from flashqla.varlen import host_bounds, remember_bounds

# Activations the reference path accepts; the state is float32 (float64 for float64 inputs).
_ACT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)
CHUNK_SIZE = 64
BACKENDS = ("auto", "kernels", "reference")  # FLASHQLA_BACKEND's values
# FLA's keywords outside its named parameters (fla-core 0.6.0 reads them from **kwargs)
_EXTRA_KWARGS = ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "transpose_state_layout",
                 "head_first")


_NAME = "chunk_gated_delta_rule"


def _fail(name: str, expected: str, got) -> None:
    checks.fail(_NAME, name, expected, got)


def _check_tensor(name, x, ndim, dtypes) -> None:
    checks.check_tensor(_NAME, name, x, ndim, dtypes)


def _extra_kwargs(kwargs: dict, state_v_first: bool) -> tuple[bool, Any, Any, bool]:
    """(use_gate_in_kernel, A_log, dt_bias, state_v_first) from FLA's **kwargs, or the error FLA
    gives (head_first, transpose_state_layout) or a TypeError naming an unknown keyword."""
    unknown = [name for name in kwargs if name not in _EXTRA_KWARGS]
    if unknown:
        raise TypeError(f"chunk_gated_delta_rule() got an unexpected keyword argument {unknown[0]!r}; "
                        "besides its named parameters it takes FLA's use_gate_in_kernel, A_log, "
                        "dt_bias and chunk_size")
    if "head_first" in kwargs:  # FLA raises this (not a warning) for any value
        raise DeprecationWarning("head_first has been removed. Inputs must be in `[B, T, H, ...]` format.")
    if "transpose_state_layout" in kwargs:
        if state_v_first:
            raise ValueError("chunk_gated_delta_rule: pass `state_v_first` or the deprecated "
                             "`transpose_state_layout`, not both")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.",
                      DeprecationWarning, stacklevel=3)
        state_v_first = kwargs["transpose_state_layout"]
    if kwargs.get("chunk_size", CHUNK_SIZE) != CHUNK_SIZE:
        _fail("chunk_size", f"{CHUNK_SIZE} (the kernels' chunk)", repr(kwargs["chunk_size"]))
    return kwargs.get("use_gate_in_kernel", False), kwargs.get("A_log"), kwargs.get("dt_bias"), state_v_first


def _scale_value(scale) -> float | None:
    """``scale`` as a Python float (None stays None)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        if scale.dim() != 0 or not (scale.is_floating_point() or scale.dtype in _INT_DTYPES):
            _fail("scale", "None, a finite number or a 0-d tensor", f"a tensor of shape {tuple(scale.shape)} "
                  f"and dtype {scale.dtype}")
        scale = scale.item()
    elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        scale = float(scale)
    else:
        _fail("scale", "None, a finite number or a 0-d tensor", repr(scale))
    if not math.isfinite(scale):
        _fail("scale", "None, a finite number or a 0-d tensor", repr(scale))
    return scale


def check_inputs(q, k, v, g, beta, initial_state, cu_seqlens, state_v_first=False, cu_seqlens_cpu=None,
                 chunk_indices=None, gate=None) -> None:
    """Raise ValueError naming the first bad argument, before any work. Reads no tensor's values
    (``check_bounds`` does that, inside the op): ``gate`` is (A_log, dt_bias) for
    use_gate_in_kernel."""
    B, T, H, K, HV, V = checks.check_qkv(_NAME, q, k, v, _ACT_DTYPES)
    for name, x in (("g", g), ("beta", beta)):
        _check_tensor(name, x, 3, _ACT_DTYPES)
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, T, HV):
            _fail(name, f"[B, T, HV] = {(B, T, HV)}", f"shape {tuple(x.shape)}")
    if gate is not None:
        for name, x in zip(("A_log", "dt_bias"), gate):
            if x is None and name == "dt_bias":  # optional
                continue
            if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.numel() != HV:
                _fail(name, f"a float tensor of HV = {HV} elements (one per value head) with "
                      "use_gate_in_kernel=True", f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))}")
    devices = {x.device for x in (q, k, v, g, beta, initial_state, *(gate or ())) if x is not None}
    if len(devices) > 1:
        _fail("q, k, v, g, beta, initial_state", "on one device", sorted(str(d) for d in devices))

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype not in _INT_DTYPES:
            _fail("cu_seqlens", "an int32 or int64 tensor",
                  getattr(cu_seqlens, "dtype", type(cu_seqlens).__name__))
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            _fail("cu_seqlens", "1-D with at least 2 entries [0, ..., T]", f"shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            _fail("q", "batch size 1 when cu_seqlens is given (sequences are packed along T)", f"B = {B}")
        N = cu_seqlens.numel() - 1
    for name, x, cols in (("cu_seqlens_cpu", cu_seqlens_cpu, None), ("chunk_indices", chunk_indices, 2)):
        if x is None:
            continue
        if cu_seqlens is None:
            _fail(name, "None without cu_seqlens", type(x).__name__)
        if not isinstance(x, torch.Tensor) or x.dtype not in _INT_DTYPES:
            _fail(name, "an int32 or int64 tensor", getattr(x, "dtype", type(x).__name__))
        if cols is None and (x.shape != cu_seqlens.shape or x.device.type != "cpu"):
            _fail(name, f"a CPU tensor of cu_seqlens's shape {tuple(cu_seqlens.shape)}",
                  f"shape {tuple(x.shape)} on {x.device}")
        if cols is not None and (x.dim() != 2 or x.shape[1] != cols):
            _fail(name, "[NT, 2] (sequence, chunk of the sequence)", f"shape {tuple(x.shape)}")
    if initial_state is not None:
        _check_tensor("initial_state", initial_state, 4, _ACT_DTYPES)
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            _fail("initial_state", f"[N, HV, {'V, K' if state_v_first else 'K, V'}] = {want} "
                  "(N = number of sequences)", f"shape {tuple(initial_state.shape)}")


def check_bounds(cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, T: int) -> list[int] | None:
    """The values of cu_seqlens on the host (from cu_seqlens_cpu where given, else one read per
    tensor version, ``flashqla.varlen.host_bounds``), checked; None without cu_seqlens, or inside
    a CUDA-graph capture that no eager call prepared (a graph replays what its eager runs checked)."""
    if cu_seqlens is None:
        return None
    if cu_seqlens_cpu is not None:
        cu = cu_seqlens_cpu.tolist()
        remember_bounds(cu_seqlens, cu)  # the kernels' host reads find them
    else:
        cu = host_bounds(cu_seqlens)
    if cu is not None:
        checks.check_bound_values(_NAME, "cu_seqlens" if cu_seqlens_cpu is None else "cu_seqlens_cpu", cu, T)
    return cu


def kernel_unsupported(device: torch.device, dtype: torch.dtype, K: int, V: int) -> str | None:
    """None when the kernels can run (already checked) inputs like these, otherwise why not."""
    if device.type != "cuda":
        return f"the inputs are on the {device.type}; the kernels need an SM90 CUDA GPU"
    if hopper_gpu_missing():
        return hopper_gpu_missing()
    if dtype != torch.bfloat16:
        return f"q, k, v are {dtype}; the kernels take torch.bfloat16"
    if K != 128 or V != 128:
        return f"K = {K} and V = {V}; the kernels need K = V = 128"
    if importlib.util.find_spec("tilelang") is None:
        return "TileLang is not installed"
    return None


_warned: set[str] = set()
_warned_lock = threading.Lock()


def backend() -> str:
    """FLASHQLA_BACKEND (module docstring), checked."""
    value = os.environ.get("FLASHQLA_BACKEND", "auto")
    if value not in BACKENDS:
        raise ValueError(f"flashqla: the environment variable FLASHQLA_BACKEND must be one of "
                         f"{', '.join(BACKENDS)}; got {value!r}")
    return value


def use_kernels(q: Tensor, v: Tensor) -> bool:
    """Whether this call runs the kernels (FLASHQLA_BACKEND and ``kernel_unsupported``); warns once
    per reason when auto falls back to the reference, raises when kernels cannot run."""
    choice = backend()
    if choice == "reference":
        return False
    reason = kernel_unsupported(q.device, q.dtype, q.shape[3], v.shape[3])
    if reason is None:
        return True
    _fall_back(choice, reason)
    return False


def backward_unsupported(H: int, HV: int) -> str | None:
    """None when the backward's kernels compile for H query/key and HV value heads, else why not
    (``flashqla.bwd.unsupported``: compiled once a head layout)."""
    _, bwd = _kernel_modules()
    return bwd.unsupported(H, HV)


def backward_on_kernels(q: Tensor, v: Tensor) -> bool:
    """``use_kernels``, and the backward's kernels compile for q's and v's head counts; where they
    do not, the reference runs the backward, with use_kernels' warning (its error under
    FLASHQLA_BACKEND=kernels)."""
    if not use_kernels(q, v):
        return False
    reason = backward_unsupported(q.shape[2], v.shape[2])
    if reason is not None:
        _fall_back(backend(), reason)
    return reason is None


def _fall_back(choice: str, reason: str) -> None:
    """The reference runs a call the kernels cannot: a RuntimeError under FLASHQLA_BACKEND=kernels,
    a warning once per reason under auto."""
    if choice == "reference":
        return
    if choice == "kernels":
        raise RuntimeError(f"flashqla.chunk_gated_delta_rule: FLASHQLA_BACKEND=kernels, but the kernels "
                           f"cannot run this call: {reason}")
    with _warned_lock:
        new = reason not in _warned
        _warned.add(reason)
    if new:
        warnings.warn(f"flashqla.chunk_gated_delta_rule: running the PyTorch reference, because {reason}",
                      stacklevel=3)


_import_lock = threading.Lock()


def _kernel_modules():
    """flashqla.fwd and flashqla.bwd, imported at the first kernel call (importing flashqla must not
    pull in TileLang), under a lock: TileLang's import fails when threads run it at once."""
    with _import_lock:
        import tilelang  # noqa: F401 -- the builders import it too, from every thread

        from flashqla import bwd, fwd
    return fwd, bwd


def _kernel_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """The kernels' forward, AutoCP deciding the split (a CPU test puts the reference here)."""
    fwd, _ = _kernel_modules()
    with nvtx_range("fwd"):
        return fwd.forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                           cp=None)


def _kernel_backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens):
    """The kernels' backward (a CPU test puts the reference backward here)."""
    _, bwd = _kernel_modules()
    with nvtx_range("bwd"):
        return bwd.backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens)


def _work(x: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    return None if x is None else x.to(dtype)


def _reference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """The chunked reference forward in float32 (float64 for float64 inputs)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    return reference.chunk_gated_delta_rule_ref(
        *(_work(x, work) for x in (q, k, v, g, beta)), scale=scale,
        initial_state=_work(initial_state, work), output_final_state=output_final_state,
        cu_seqlens=cu_seqlens)


def _reference_backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens):
    """The chunked reference backward in float32 (float64 for float64 inputs)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    return reference.chunk_gated_delta_rule_bwd_ref(
        *(_work(x, work) for x in (q, k, v, g, beta, do)), dht=_work(dht, work), scale=scale,
        initial_state=_work(initial_state, work), cu_seqlens=cu_seqlens)


def _no_autocast(device: torch.device):
    """An autocast-free region on ``device``: the reference computes in the dtype it states (the
    autocast context is entered only where autocast is on: it costs about 10 us of host time)."""
    if torch.amp.is_autocast_available(device.type) and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _state_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _none_as_empty(x: Tensor | None, like: Tensor) -> Tensor:
    """A custom op returns tensors only: an absent output is an empty one."""
    return like.new_empty(0) if x is None else x


def _own(*outputs: Tensor) -> tuple[Tensor, ...]:
    """A custom op's outputs may not alias its inputs: with no tokens the paths pass states through
    (final state = initial state, dh0 = dht), so then every output is copied."""
    if outputs[0].numel() == 0:
        return tuple(x.clone() for x in outputs)
    return outputs


# ---- forward and backward: a torch.library custom op under torch.compile, an autograd.Function
# in eager mode (the module docstring: the op's Python dispatch costs the host ten times more)

def _forward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
             cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float,
             output_final_state: bool) -> tuple[Tensor, Tensor]:
    """Checked, preprocessed inputs (initial_state in the state's dtype, [N, HV, K, V]) -> (o,
    final state, empty when not asked for)."""
    check_bounds(cu_seqlens, cu_seqlens_cpu, q.shape[1])
    with _no_autocast(q.device):
        if use_kernels(q, v):
            o, ht = _kernel_forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
        else:
            with nvtx_range("fwd.reference"):
                o, ht = _reference(q, k, v, g, beta, scale, initial_state, output_final_state,
                                   cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu)
    return _own(o.to(v.dtype), _none_as_empty(ht if output_final_state else None, q))


def _backward(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None,
              cu_seqlens: Tensor | None, cu_seqlens_cpu: Tensor | None, scale: float, do: Tensor,
              dht: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The gradients of <do, o> + <dht, final state>: dq, dk, dv, dg, dbeta in their inputs' dtypes,
    dh0 in initial_state's (empty without it)."""
    with _no_autocast(q.device):
        if backward_on_kernels(q, v):
            grads = _kernel_backward(q, k, v, g, beta, do, dht, scale, initial_state, cu_seqlens)
        else:
            with nvtx_range("bwd.reference"):
                grads = _reference_backward(q, k, v, g, beta, do, dht, scale, initial_state,
                                            cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu)
    *grads, dh0 = (None if d is None else d.to(x.dtype) for d, x in zip(grads, (q, k, v, g, beta, initial_state)))
    return _own(*grads, _none_as_empty(dh0, q))


def _save_inputs(ctx, inputs, output) -> None:
    """Autograd keeps only the inputs: the backward recomputes the forward's intermediates."""
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu)
    ctx.scale, ctx.output_final_state = scale, output_final_state


def _input_grads(ctx, do, dht, backward) -> tuple:
    """The gradients of the forward's ten inputs, from ``backward`` (``_backward`` or its op)."""
    q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu = ctx.saved_tensors
    grads = backward(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, ctx.scale, do,
                     dht if ctx.output_final_state else None)
    return (*grads[:5], grads[5] if initial_state is not None else None, None, None, None, None)


_op = torch.library.custom_op("flashqla::chunk_gated_delta_rule", _forward, mutates_args=())
_op_backward = torch.library.custom_op("flashqla::chunk_gated_delta_rule_backward", _backward,
                                       mutates_args=())


@_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, output_final_state):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    o = v.new_empty(B, T, HV, V)
    if not output_final_state:
        return o, q.new_empty(0)
    return o, q.new_empty(N, HV, K, V, dtype=_state_dtype(q))


@_op_backward.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale, do, dht):
    dh0 = q.new_empty(0) if initial_state is None else torch.empty_like(initial_state)
    return (*(torch.empty_like(x) for x in (q, k, v, g, beta)), dh0)


torch.library.register_autograd("flashqla::chunk_gated_delta_rule",
                                lambda ctx, do, dht: _input_grads(ctx, do, dht, _op_backward),
                                setup_context=_save_inputs)


class _Function(torch.autograd.Function):
    """The op's eager twin: the same forward, saved inputs and backward."""

    @staticmethod
    def forward(ctx, *inputs):
        outputs = _forward(*inputs)
        _save_inputs(ctx, inputs, outputs)
        return outputs

    @staticmethod
    def backward(ctx, do, dht):
        return _input_grads(ctx, do, dht, _backward)


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | Tensor | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    cp_context: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet, FLA's ``chunk_gated_delta_rule`` (its parameters in its order; the keywords'
    meanings: the module docstring).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V], HV a multiple of H; all of one dtype.
        g: [B, T, HV] per-token log decay (<= 0), or the gate's input with use_gate_in_kernel.
        beta: [B, T, HV] step size in (0, 1], or its logit with use_beta_sigmoid_in_kernel.
        scale: multiplies q; defaults to K ** -0.5.
        initial_state: [N, HV, K, V] ([N, HV, V, K] with state_v_first), N = B, or the number of
            sequences with cu_seqlens.
        output_final_state: also return the state after the last token of every sequence.
        cu_seqlens: int32/int64 [N + 1] sequence boundaries over T, with B = 1.
        cp_context: a ``flashqla.cp.build_cp_context`` context: the inputs are then this rank's
            shard of the packed tokens, N counts the sequences of the global cu_seqlens.
        **kwargs: FLA's use_gate_in_kernel, A_log, dt_bias, chunk_size.

    Returns:
        o: [B, T, HV, V] in v's dtype; final_state: [N, HV, K, V] ([N, HV, V, K] with
        state_v_first) float32 (float64 for float64 inputs), or None.
    """
    use_gate, A_log, dt_bias, state_v_first = _extra_kwargs(kwargs, state_v_first)
    if cp_context is not None:  # the local bounds are the context's; initial_state has global rows
        cp.check_context(cp_context, cu_seqlens, cu_seqlens_cpu)
        cu_seqlens, cu_seqlens_cpu = cp_context.cu_seqlens, cp_context.cu_seqlens_cpu
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        _fail("allow_neg_eigval", "False unless use_beta_sigmoid_in_kernel=True", True)
    if not use_gate and (A_log is not None or dt_bias is not None):
        _fail("A_log and dt_bias", "None unless use_gate_in_kernel=True", "a tensor")
    scale = _scale_value(scale)
    check_inputs(q, k, v, g, beta, initial_state if cp_context is None else None, cu_seqlens, state_v_first,
                 cu_seqlens_cpu, chunk_indices, (A_log, dt_bias) if use_gate else None)
    if cp_context is not None:
        cp.check_shard(cp_context, q, v, initial_state, state_v_first, _ACT_DTYPES)
    if use_qk_l2norm_in_kernel:
        q, k = (reference.l2norm(x.to(torch.promote_types(x.dtype, torch.float32))).to(x.dtype)
                for x in (q, k))
    if use_beta_sigmoid_in_kernel:
        beta = torch.sigmoid(beta.to(torch.promote_types(beta.dtype, torch.float32)))
        beta = 2 * beta if allow_neg_eigval else beta
    if use_gate:
        work = torch.promote_types(g.dtype, torch.float32)
        g = g.to(work) + (0 if dt_bias is None else dt_bias.to(work).reshape(-1))
        g = -A_log.to(work).reshape(-1).exp() * F.softplus(g)
    if initial_state is not None:
        initial_state = initial_state.to(_state_dtype(q))
        if state_v_first:  # both layouts give the same bits: the kernels read a contiguous [K, V]
            initial_state = initial_state.transpose(-1, -2).contiguous()
    scale = q.shape[3] ** -0.5 if scale is None else scale
    if cp_context is not None:
        with _no_autocast(q.device):
            o, final_state = cp.chunk_gated_delta_rule_cp(q, k, v, g, beta, scale, initial_state, cp_context)
    else:
        if torch.compiler.is_compiling():
            run = _op
        elif torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                             for x in (q, k, v, g, beta, initial_state)):
            run = _Function.apply
        else:  # nothing to differentiate (inference): the forward alone, without autograd's bookkeeping
            run = _forward
        o, final_state = run(q, k, v, g, beta, initial_state, cu_seqlens, cu_seqlens_cpu, scale,
                             bool(output_final_state))
    if not output_final_state:
        return o, None
    return o, (final_state.transpose(-1, -2).contiguous() if state_v_first else final_state)
