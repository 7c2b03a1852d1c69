"""Problems, and the one check that every kernel stage must pass.

The tolerance is derived, not guessed. For each output,

    err       = ||out - ref64|| / ||ref64||     the stage against the float64 reference
    err_bf16  = ||bf16 - ref64|| / ||ref64||    the same reference math run in bf16 PyTorch on the
                                                same inputs (every tensor and intermediate in bf16)
    bound     = TOLERANCE_FACTOR * max(err_bf16, ROUNDING_FLOOR)

and the check asserts err <= bound. A kernel that keeps bf16 operands but accumulates in fp32
should land well inside the bf16 PyTorch error; a factor of 2 leaves room for a different
summation order without admitting structural bugs, which give errors of order 1 (tests show that
dropped chunks, missing decays and transposed states all fail it). ROUNDING_FLOOR is half a bf16
ulp, the error of merely storing a value in bf16, for outputs whose bf16 error happens to vanish.
"""

from __future__ import annotations

import concurrent.futures
import functools
import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashqla import reference
from flashqla.stages import OPS

TOLERANCE_FACTOR = 2.0
ROUNDING_FLOOR = 2.0 ** -9

# (H, HV) of the Qwen3.5 GDN layers at TP1..TP8 that the kernels are tested and timed on
PUBLIC_HEADS = ((2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (8, 24), (16, 48), (16, 16))

# The dtype a kernel receives for each named input (FLA's choices): activations and the WY
# outputs in bf16, gates, A, states in fp32; in the backward, do and the gradients of v_new, u, w
# in bf16, those of gates and states (dht, dh, dg_cum) in fp32.
_BF16_INPUTS = {"q", "k", "v", "w", "u", "v_new", "Ai", "do", "dv_local", "dv2", "du", "dw"}
# The backward's upstream gradients: o and the final state get fixed random weights.
_BWD_SEED = 1234


@dataclass(frozen=True)
class Problem:
    """One test or benchmark problem: heads, sequence lengths, head dims.

    ``varlen`` packs the sequences along T with cu_seqlens (B = 1); otherwise all lengths must be
    equal and they form a batch. Value head j has g = 0 when j % 4 == 0 (a quarter of the heads,
    as in the models), strong decay (g about -2 per token) when j % 4 == 1, and ordinary decay
    (about -0.15) otherwise.
    """

    H: int
    HV: int
    lengths: tuple[int, ...]
    varlen: bool = True
    K: int = 128
    V: int = 128
    initial_state: bool = True

    def __post_init__(self):
        if not self.varlen and len(set(self.lengths)) != 1:
            raise ValueError(f"Problem: `lengths` must be equal without varlen; got {self.lengths}")

    @property
    def label(self) -> str:
        if self.varlen and len(self.lengths) > 1:
            seqs = "+".join(str(n) for n in self.lengths)
        else:
            seqs = f"{len(self.lengths)}x{self.lengths[0]}"
        return f"({self.H}, {self.HV}) {seqs}" + ("" if self.initial_state else " h0=None")

    def inputs(self, device="cpu", seed: int = 0) -> dict:
        """Keyword arguments for ``chunk_gated_delta_rule`` (and the gdn_fwd op), in kernel dtypes."""
        gen = torch.Generator(device).manual_seed(seed)  # drawn where used: large problems fast
        B, T = (1, sum(self.lengths)) if self.varlen else (len(self.lengths), self.lengths[0])
        N = len(self.lengths)

        def randn(*shape):
            return torch.randn(*shape, generator=gen, device=device)

        q = reference.l2norm(randn(B, T, self.H, self.K))
        k = reference.l2norm(randn(B, T, self.H, self.K))
        v = randn(B, T, self.HV, self.V)
        kind = torch.arange(self.HV, device=device) % 4
        g = torch.where(kind == 1, F.logsigmoid(randn(B, T, self.HV) - 2.0),
                        F.logsigmoid(randn(B, T, self.HV) + 2.0))
        g = torch.where(kind == 0, torch.zeros_like(g), g)
        beta = torch.sigmoid(randn(B, T, self.HV))
        h0 = randn(N, self.HV, self.K, self.V) if self.initial_state else None
        cu = None
        if self.varlen:
            cu = torch.tensor([0, *itertools.accumulate(self.lengths)], dtype=torch.int32, device=device)
        bf16 = dict(dtype=torch.bfloat16, device=device)
        fp32 = dict(dtype=torch.float32, device=device)
        return dict(q=q.to(**bf16), k=k.to(**bf16), v=v.to(**bf16), g=g.to(**fp32),
                    beta=beta.to(**fp32), scale=None,
                    initial_state=None if h0 is None else h0.to(**fp32),
                    output_final_state=True, cu_seqlens=cu)


def cast_floats(inputs: dict, dtype: torch.dtype) -> dict:
    """Every floating tensor in ``inputs`` cast to dtype; integers and other values untouched."""
    return {name: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x
            for name, x in inputs.items()}


def op_inputs(op: str, inputs: dict) -> dict:
    """The inputs of sub-step ``op`` for a gdn_fwd problem, as a kernel of that step receives them.

    Upstream intermediates come from the float64 reference, then are cast to the kernel's dtypes
    (bf16 for activations and the WY outputs, fp32 for gates, A and states). The backward ops
    (gdn_bwd and its sub-steps) also get ``do`` [B, T, HV, V] (bf16) and ``dht`` [N, HV, K, V]
    (fp32), drawn from a generator on the inputs' device with a fixed seed, and the backward
    intermediates computed from them by the float64 reference.
    """
    if op in ("gdn_fwd", "fused_recurrent"):  # references that take the problem's inputs as they are
        return dict(inputs)
    x = cast_floats(inputs, torch.float64)
    cu = x["cu_seqlens"]
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    named = dict(q=q, k=k, v=v, g=g, beta=beta, cu_seqlens=cu, scale=x["scale"],
                 initial_state=x["initial_state"], output_final_state=x["output_final_state"])
    named["g_cum"] = reference.chunk_local_cumsum(g, cu)
    named["A"] = reference.chunk_kkt(k, named["g_cum"], beta, cu)
    named["Ai"] = reference.kkt_solve(named["A"], cu)
    named["w"], named["u"] = reference.chunk_w_u(k, v, beta, named["Ai"], named["g_cum"], cu)
    named["h"], named["v_new"], _ = reference.chunk_h(k, named["w"], named["u"], named["g_cum"],
                                                      named["initial_state"], False, cu)
    params = inspect.signature(OPS[op][0]).parameters
    if set(params) - set(named) - {"chunk_size"}:  # a backward op: it needs do, dht or their results
        named.update(_bwd_intermediates(named))
    out = {}
    for name in params:
        if name == "chunk_size":
            continue
        val = named[name]
        if isinstance(val, torch.Tensor) and val.is_floating_point():
            val = val.to(torch.bfloat16 if name in _BF16_INPUTS else torch.float32)
        out[name] = val
    return out


def _bwd_intermediates(named: dict) -> dict:
    """do, dht and the backward's intermediates, in float64, for the forward intermediates ``named``."""
    q, v, cu = named["q"], named["v"], named["cu_seqlens"]
    gen = torch.Generator(q.device).manual_seed(_BWD_SEED)
    N = v.shape[0] if cu is None else cu.numel() - 1
    do = torch.randn(v.shape, generator=gen, device=q.device).to(torch.bfloat16).double()
    dht = torch.randn(N, v.shape[2], q.shape[3], v.shape[3], generator=gen, device=q.device).double()
    x = dict(do=do, dht=dht)
    args = (named["scale"], cu)
    x["dv_local"] = reference.chunk_bwd_dv_local(q, named["k"], do, named["g_cum"], *args)
    x["dh"], _, x["dv2"] = reference.chunk_bwd_dhu(q, named["k"], named["w"], named["g_cum"],
                                                   named["initial_state"], dht, do, x["dv_local"], *args)
    _, _, x["dw"], dg_cum = reference.chunk_bwd_dqkwg(q, named["k"], named["v_new"], named["g_cum"],
                                                      named["h"], x["dv2"], do, x["dh"], *args)
    x["du"] = x["dv2"]
    dg_cum_wy = reference.wy_bwd(named["k"], v, named["beta"], named["Ai"], named["g_cum"], x["dw"],
                                 x["du"], cu)[3]
    x["dg_cum"] = dg_cum + dg_cum_wy
    return x


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; inf when x holds NaN or inf."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    den = ref.norm().item()
    num = (x - ref).norm().item()
    return num / den if den > 0 else num


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


@dataclass(frozen=True)
class OutputCheck:
    output: str
    err: float
    err_bf16: float
    bound: float

    @property
    def ok(self) -> bool:
        return self.err <= self.bound


def check_op(op: str, fn, inputs: dict, factor: float = TOLERANCE_FACTOR) -> list[OutputCheck]:
    """Run ``fn(**inputs)`` and assert every output is within the derived bound of the float64 reference.

    Raises AssertionError listing each output's error and bound; returns the checks on success.
    """
    ref_fn, names = OPS[op]
    want = _as_tuple(ref_fn(**cast_floats(inputs, torch.float64)))
    bf16 = _as_tuple(ref_fn(**cast_floats(inputs, torch.bfloat16)))
    got = _as_tuple(fn(**inputs))
    if len(got) != len(want):
        raise AssertionError(f"{op}: expected {len(want)} outputs {names}, got {len(got)}")
    checks = []
    for name, g_, w_, b_ in zip(names, got, want, bf16):
        if w_ is None:
            if g_ is not None:
                raise AssertionError(f"{op}: output `{name}` should be None")
            continue
        if g_ is None or tuple(g_.shape) != tuple(w_.shape):
            raise AssertionError(f"{op}: output `{name}` has shape "
                                 f"{None if g_ is None else tuple(g_.shape)}, expected {tuple(w_.shape)}")
        base = rel_l2(b_, w_)
        checks.append(OutputCheck(name, rel_l2(g_, w_), base, factor * max(base, ROUNDING_FLOOR)))
    bad = [c for c in checks if not c.ok]
    if bad:
        lines = [f"  {c.output}: rel L2 err {c.err:.3e} > bound {c.bound:.3e} "
                 f"(= {factor} x max(bf16 PyTorch err {c.err_bf16:.3e}, {ROUNDING_FLOOR:.2e}))"
                 for c in bad]
        raise AssertionError(f"{op}: wrong answer\n" + "\n".join(lines))
    return checks


def run_on_threads(calls, workers: int = 16) -> None:
    """Run each call (a function of no arguments, its inputs made on this thread: torch's lazy
    inits are not thread-safe) once, many at a time; one that raised runs once more, alone, and
    raises if it fails again.

    TileLang compiles each new kernel shape on its first call (5-40 s, mostly in nvcc, which runs
    outside the GIL), so compiling them on threads before a GPU test or benchmark run takes the
    time of the slowest few instead of their sum.
    """
    import tilelang  # noqa: F401 -- imported once here: importing it on several threads at once fails

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(call) for call in calls]
    # a call that failed runs again, alone: the first calls of one compiled module on several threads
    # at once can fail to find its function (TVM-FFI: "Cannot find function ..."); a real error
    # raises here
    for call, future in zip(calls, futures):
        if future.exception() is not None:
            call()


def warm_up(stages, heads=PUBLIC_HEADS, device="cuda", workers: int = 16) -> None:
    """Run every stage once per head configuration on a tiny problem, many at a time
    (``run_on_threads``), the stages that run Triton first, one at a time (its autotuner is not
    thread-safe)."""
    jobs = [(s, op_inputs(s.op, Problem(H, HV, (70,)).inputs(device)))
            for s in stages if not s.missing() for H, HV in heads]
    runs_triton = [("fla" in stage.module.NEEDS) for stage, _ in jobs]
    for (stage, inputs), serial in zip(jobs, runs_triton):
        if serial:
            stage.module.run(**inputs)
    run_on_threads([functools.partial(job[0].module.run, **job[1])
                    for job, serial in zip(jobs, runs_triton) if not serial], workers)


# ---- adversarial inputs for the gate-free solve (gdn_fwd.s04, tests/test_reformulation.py, notebook 04)

def near_duplicate_keys(gen, B, T, H, K, scale=1.0, spread=1e-2):
    """Per chunk of C tokens one random unit direction, each key that direction plus noise of
    relative size ``spread``, normalized, times ``scale`` (so ||k||^2 = scale^2)."""
    C, f64 = reference.CHUNK_SIZE, torch.float64
    base = reference.l2norm(torch.randn(B, -(-T // C), 1, H, K, generator=gen, dtype=f64))
    base = base.expand(-1, -1, C, -1, -1).reshape(B, -1, H, K)[:, :T]
    return scale * reference.l2norm(base + spread * torch.randn(B, T, H, K, generator=gen, dtype=f64))


ADVERSARIAL = ("near_duplicate_keys", "unnormalized_keys", "very_strong_decay")
LENGTHS = (200, 777, 64, 1, 130)


def adversarial_inputs(kind, H=4, HV=16, lengths=LENGTHS, device="cuda", seed=0):
    """Keyword arguments for the forward (varlen, initial state), in kernel dtypes:

    near_duplicate_keys  keys of a chunk within 1e-2 of one direction, L2-normalized; beta in
                         (0.999, 1]; gates as in flashqla.testing.Problem (g = 0, strong, ordinary)
    unnormalized_keys    the same keys times 3 (||k||^2 = 9); odd value heads beta ~ 1 with a decay
                         of -3 to -4 a token (beta ||k||^2 = 9 > 2: the solve must keep the gate),
                         even heads beta = 0.2 (1.8 <= 2: gate-free) with Problem's gates
    very_strong_decay    random unit keys, beta ~ 1, g uniform in (-20, 0) a token
    """
    x = Problem(H, HV, lengths).inputs(seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    B, T = x["v"].shape[:2]
    near1 = 1 - 1e-3 * torch.rand(B, T, HV, generator=gen)
    if kind == "near_duplicate_keys":
        x.update(k=near_duplicate_keys(gen, B, T, H, 128), beta=near1)
    elif kind == "unnormalized_keys":
        odd = torch.arange(HV) % 2 == 1
        x.update(k=near_duplicate_keys(gen, B, T, H, 128, scale=3.0),
                 beta=torch.where(odd, near1, torch.full_like(near1, 0.2)),
                 g=torch.where(odd, -3.0 - torch.rand(B, T, HV, generator=gen), x["g"]))
    elif kind == "very_strong_decay":
        x.update(beta=near1, g=-20.0 * torch.rand(B, T, HV, generator=gen))
    else:
        raise ValueError(f"adversarial_inputs: unknown `kind` {kind!r}")
    x.update(k=x["k"].to(torch.bfloat16), beta=x["beta"].float(), g=x["g"].float())
    return {name: val.to(device) if isinstance(val, torch.Tensor) else val for name, val in x.items()}
