"""flashqla as a backend of FLA's own ``chunk_gated_delta_rule`` (fla-core 0.6.0's backend registry).

    import flashqla.integrations.fla
    flashqla.integrations.fla.enable()

From then on ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``, and every FLA layer or model
that calls it, runs ``flashqla.chunk_gated_delta_rule`` for each call that ``verify`` accepts
and FLA's own path (Triton, or another registered backend) for the rest. Accepted: a call the
kernels run (an SM90 GPU, bfloat16 q, k, v, K = V = 128, FLASHQLA_BACKEND not ``reference``)
with any of FLA's keywords that flashqla implements (``flashqla.api``: the l2norm, beta sigmoid,
gate, state_v_first, cu_seqlens_cpu, chunk_indices). Rejected, with the reason FLA logs once at
INFO level (logger ``fla.backends``): a call flashqla would run on its PyTorch reference, and one
with cp_context, a chunk_size other than 64, the deprecated transpose_state_layout or head_first,
or a keyword flashqla does not know.

Why an explicit call: FLA looks for backends only in its own modules (``fla.ops.<op>.backends``),
not through entry points, and a hook installed by ``pip install`` alone would silently replace
FLA in every benchmark that times FLA against flashqla. ``enable()`` registers the backend with
priority 2, ahead of FLA's FlashQLA backend (3); calling it again changes nothing. FLA's switches
apply: ``FLA_FLASHQLA=0`` turns it off, ``FLA_DISABLE_BACKEND_DISPATCH=1`` all of FLA's dispatch
(set before fla is imported). FLA excludes its dispatch from ``torch.compile`` graphs
(``torch.compiler.disable``); a model that calls ``flashqla.chunk_gated_delta_rule`` directly
compiles without graph breaks.
"""

from __future__ import annotations

import functools
import inspect

from flashqla import api

_SIGNATURE = inspect.signature(api.chunk_gated_delta_rule)
_KEYWORDS = ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size")  # FLA's **kwargs that flashqla runs


def verify(*args, **kwargs) -> tuple[bool, str | None]:
    """FLA's verifier protocol: (True, None) when flashqla's kernels run this call of FLA's
    ``chunk_gated_delta_rule``, else (False, why not)."""
    try:
        call = _SIGNATURE.bind(*args, **kwargs).arguments
    except TypeError as exc:
        return False, str(exc)
    extra = call.get("kwargs", {})
    unknown = [name for name in extra if name not in _KEYWORDS]
    if unknown:
        return False, f"flashqla does not take the keyword {unknown[0]!r}"
    if call.get("cp_context") is not None:
        return False, "flashqla does not run FLA's cp_context (flashqla.cp builds its own)"
    if extra.get("chunk_size", api.CHUNK_SIZE) != api.CHUNK_SIZE:
        return False, f"flashqla runs chunk_size {api.CHUNK_SIZE} only"
    if extra.get("use_gate_in_kernel") and extra.get("A_log") is None:
        return False, "use_gate_in_kernel needs A_log"
    if call.get("allow_neg_eigval") and not call.get("use_beta_sigmoid_in_kernel"):
        return False, "allow_neg_eigval needs use_beta_sigmoid_in_kernel"
    if api.backend() == "reference":
        return False, "FLASHQLA_BACKEND=reference"
    q, k, v = call["q"], call["k"], call["v"]
    if not (k.dtype == v.dtype == q.dtype) or q.dim() != 4 or v.dim() != 4:
        return False, "q, k, v must be 4-D tensors of one dtype"
    reason = api.kernel_unsupported(q.device, q.dtype, q.shape[3], v.shape[3])
    return (True, None) if reason is None else (False, reason)


@functools.cache
def _backend_class():
    """The BaseBackend subclass (defined on first use: importing flashqla never imports fla)."""
    from fla.backends import BaseBackend

    class FlashqlaBackend(BaseBackend):
        """flashqla's TileLang kernels for FLA's chunk_gated_delta_rule (``flashqla.integrations.fla``)."""

        backend_type = "flashqla"
        package_name = "flashqla"
        env_var = "FLA_FLASHQLA"
        default_enable = True
        priority = 2

        def chunk_gated_delta_rule_verifier(self, *args, **kwargs):
            return verify(*args, **kwargs)

        def chunk_gated_delta_rule(self, *args, **kwargs):
            return api.chunk_gated_delta_rule(*args, **kwargs)

    return FlashqlaBackend


def enable() -> None:
    """Register flashqla in FLA's registry for ``gated_delta_rule`` (the module docstring)."""
    try:
        from fla.backends import register
    except ImportError as exc:
        raise ImportError("flashqla.integrations.fla.enable() needs FLA: pip install fla-core==0.6.0") from exc
    register("gated_delta_rule")(_backend_class())
