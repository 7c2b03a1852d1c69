"""``python -m flashqla bench``: every forward stage, FLA and FlashQLA, timed the same way in one run.

Rows per problem: each ``gdn_fwd`` stage of the checkout (s00 is FLA's Triton forward, the first
baseline), FlashQLA's ``chunk_gated_delta_rule`` (flash-qla 0.1.3, the second baseline) and the
public ``flashqla.chunk_gated_delta_rule``, all under ``torch.no_grad`` as in inference.
``--mode gdn_train`` times a training step instead (``train_candidates``): the forward, then the
gradients of q, k, v, g, beta and the initial state for random do and dht; FLA, FlashQLA and the
API through autograd, each gdn_bwd stage after the library's forward (``fwd + gdn_bwd/sNN``). Its
problems add one mix a layout with odd lengths (``ODD_MIX``).

Timing, the same for every row: one untimed call per input set (JIT compiles, autotuning), then
CUDA-graph capture of one call per input set and the median over replays, each replay timed with
CUDA events; a row whose capture fails (a host synchronization inside, e.g. reading
``cu_seqlens``) falls back to the same loop timed with events and says so in ``method``. Input
sets rotate so that together they exceed twice the L2 cache: no row is timed out of a warm L2.
Beside it, ``eager_ms``: a call in a loop of back-to-back eager calls, no graph (``eager_ms``), where
the host's time to issue a call shows. A training row also has ``bwd_ms``: the backward alone, timed
as ``ms`` is (the same timer, input sets and median) after the forward ran once per set outside
the timed region (``backward_calls``): for an autograd row, ``torch.autograd.grad`` over the kept
graph; for a stage row, the stage's ``run`` (its forward is ``fwd.forward``). ``method`` names the
backward's own method where it differs ("...; bwd_ms: ..."). Its useful work is the step's less the
forward's (``train_flops`` - ``useful_flops``: two products for each forward product and the solve's
adjoint).

Napkin math, the same useful work for every row so that rows compare (a stage that does more
work, like the recurrence, or less, shows as a lower or higher rate):

    FLOPs = per (chunk, value head) of the chunked form: K K^T, w, u, Q K^T, P v_new
            (2 C^2 K or 2 C^2 V each) and w h, K^T v_new, Q h (2 C K V each); C = 64
    bytes = what must cross HBM once: q, k, v read and o written (bf16), g, beta read (fp32),
            the initial state read and the final state written (fp32)

The CSV's columns (``COLUMNS``, then the provenance): ms, the ratio to each baseline (>1: faster
than it), TFLOP/s and GB/s with their percentage of the roofs measured in the same run (an 8192^3
bf16 matmul, a 1 GiB copy), ``x_floor``: ms over max(FLOPs / GEMM roof, bytes / copy roof), the
card's floor for this work, ``method``, ``eager_ms`` and, in training runs, ``bwd_ms``.

First the peers run once on every problem in parallel processes, one a head layout, so that their
compiles overlap (``start_peer_warmup``). Before timing, every flashqla row (not the peers') is
checked against the float64 reference (``testing.check_op``) on a small varlen problem with the
same heads; a stage that fails is reported as FAILED and not timed. ``python -m flashqla bench
--report`` redraws, on any machine, from the committed CSVs: the plots, the book's Results page
(every problem) and the README's summary (per head layout).
"""

from __future__ import annotations

import csv
import datetime
import functools
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from flashqla.stages import discover
from flashqla.testing import PUBLIC_HEADS, Problem, check_op, op_inputs, run_on_threads

MIXES = ((2048,), (8192,), (32768,), (28672, 4096), (4096,) * 8)
# the training step's mixes: the forward's one-sequence and equal-length shapes, and one odd mix
# (17241 tokens): no length a multiple of the 64-token chunk, so every sequence ends in a partial
# chunk, with a sequence of one token and one of 63 (each less than a chunk) beside a long one of
# 9000 that sets the step's critical path
ODD_MIX = (3000, 1, 777, 4400, 63, 9000)
TRAIN_MIXES = ((8192,), (32768,), (4096,) * 8, ODD_MIX)
PROBLEMS = [Problem(H, HV, mix) for H, HV in PUBLIC_HEADS for mix in MIXES]
CHECK_LENGTHS = (1, 200, 777, 64, 130)
RESULTS = Path(__file__).resolve().parent.parent / "profiles" / "results"
README = RESULTS.parent.parent / "README.md"
CHUNK = 64
FLA_ROW, FLASHQLA_ROW, API_ROW = "FLA (gdn_fwd/s00_fla)", "FlashQLA", "flashqla.chunk_gated_delta_rule"


def useful_flops(p: Problem) -> int:
    chunks = sum(math.ceil(n / CHUNK) for n in p.lengths)
    per_chunk = 2 * CHUNK * CHUNK * (3 * p.K + 2 * p.V) + 3 * 2 * CHUNK * p.K * p.V
    return chunks * p.HV * per_chunk


def useful_bytes(p: Problem) -> int:
    T, N = sum(p.lengths), len(p.lengths)
    acts = 2 * T * (2 * p.H * p.K + 2 * p.HV * p.V)       # q, k, v in, o out (bf16)
    gates = 4 * T * 2 * p.HV                               # g, beta (fp32)
    states = 4 * N * p.HV * p.K * p.V * (2 if p.initial_state else 1)
    return acts + gates + states


@functools.cache
def capture_stream() -> torch.cuda.Stream:
    """The side stream every graph of the benchmark is captured on, and the backward rows' forwards
    run on (``backward_calls``): autograd runs each backward kernel on its forward's stream, so a
    backward whose forward ran on another stream would leave the capture."""
    return torch.cuda.Stream()


def _graph_or_events(fn, sets, repeat: int) -> tuple[float, str]:
    """Median ms of one call: CUDA-graph replay of one call per set, or events if capture fails."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=capture_stream()):
            for x in sets:
                fn(x)
        launch, method = graph.replay, "CUDA graph replay"
    except Exception:  # noqa: BLE001 -- any capture failure means: time it without a graph
        torch.cuda.synchronize()
        launch, method = (lambda: [fn(x) for x in sets]), "CUDA events, no graph (capture failed)"
    launch()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(sets))
    return statistics.median(times), method


def problem_inputs(problem: Problem, seed: int, training: bool = False) -> dict:
    """One input set of ``problem`` on the GPU; for a training step with its upstream gradients."""
    x = problem.inputs("cuda", seed=seed)
    return _with_upstream_grads(x, seed) if training else x


def num_input_sets(problem: Problem, l2_bytes: int) -> int:
    """How many independent input sets of ``problem`` exceed twice the L2 cache together."""
    return max(1, math.ceil(2 * l2_bytes / useful_bytes(problem)))


def input_sets(problem: Problem, l2_bytes: int, training: bool = False) -> list[dict]:
    """``num_input_sets`` independent input sets of ``problem``, all holding one ``cu_seqlens``
    tensor (its values are the same in every set).

    The peers memoize what they derive from ``cu_seqlens`` (chunk indices) by the tensor's identity,
    in a queue of 4 entries (FLA's FLA_TENSOR_CACHE_SIZE, FlashQLA's ``tensor_cache``, fla-core 0.6.0
    and flash-qla 0.1.3). With more sets than that and a tensor per set, the graph capture (one call
    per set) misses, and recomputing reads a count on the host, which fails the capture: FLA then
    faulted on (2, 8) and (4, 16) 1x2048 (11 and 6 sets; commit 3198fc1) until its queue was
    sized, and FlashQLA fell back to timing without a graph there (1.2 and 0.32 ms, 98a6f05). One
    tensor is one entry for every implementation, ours included."""
    sets = [problem_inputs(problem, i, training) for i in range(num_input_sets(problem, l2_bytes))]
    for x in sets[1:]:
        x["cu_seqlens"] = sets[0]["cu_seqlens"]
    return sets


def time_row(fn, sets: list[dict], grad: bool = False) -> tuple[float, str]:
    """Median ms of fn over the input sets; under torch.no_grad (inference) unless ``grad``."""
    with torch.set_grad_enabled(grad):
        for x in sets:  # compile / autotune outside the timed region and the capture
            fn(x)
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(sets[0])
        end.record()
        end.synchronize()
        repeat = max(3, min(50, int(300 / max(start.elapsed_time(end), 1e-3))))
        return _graph_or_events(fn, sets, repeat)


def eager_ms(fn, sets: list[dict], grad: bool = False, graph_ms: float = 0.1) -> float:
    """Milliseconds of one call in a loop of back-to-back eager calls (no graph): the loop's wall
    time over its calls, synchronized once at its end, median of three loops of about 100 ms (at
    most 200 calls). What a user's eager loop runs at: the larger of the host's time to issue a call
    (Python, the launches) and the GPU's, plus what does not overlap; ``ms`` beside it is the GPU's."""
    calls = max(10, min(200, int(100 / max(graph_ms, 1e-3))))
    walls = []
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(calls):
                fn(sets[i % len(sets)])
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e3 / calls)
    return statistics.median(walls)


def backward_calls(backward, sets: list[dict]) -> list:
    """``backward(x)`` of every input set (a training row's: the forward run once, with grad),
    on ``capture_stream()``, outside any timed region: the calls that run the backward alone."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls = [backward(x) for x in sets]
    torch.cuda.current_stream().wait_stream(stream)
    return calls


def time_candidate(name: str, fn, backward, sets: list[dict], mode: Mode) -> dict:
    """One row's times on one problem's input sets: ``ms`` and ``method`` of fn (``time_row``, or
    ``time_peer_twice`` for a peer), ``eager_ms``, and, for a training row, ``bwd_ms``: the same
    timer on the backward alone (``backward_calls``), over the same sets. Where the backward's
    method differs from the step's, ``method`` says both ("...; bwd_ms: <the backward's>")."""
    training = mode is TRAINING
    timer = time_peer_twice if name in mode.peers else time_row
    ms, method = timer(fn, sets, training)
    times = dict(ms=ms, method=method, eager_ms=eager_ms(fn, sets, training, ms))
    if backward is not None:
        times["bwd_ms"], bwd_method = timer(lambda call: call(), backward_calls(backward, sets), True)
        if bwd_method != method:
            times["method"] = f"{method}; bwd_ms: {bwd_method}"
    return times


def time_peer_twice(fn, sets: list[dict], grad: bool = False) -> tuple[float, str]:
    """``time_row`` for a peer, tried once more after an error that leaves the device usable: FLA's
    first call on a fresh machine compiles and autotunes its Triton kernels, and that failed on two
    of three fresh machines ("PassManager::run failed" in ``chunk_delta_h``; one H100, commit
    cf060dc), for a problem whose later calls compiled and ran. A second failure is raised."""
    try:
        return time_row(fn, sets, grad)
    except Exception as exc:  # noqa: BLE001 -- said, then tried once more
        torch.cuda.synchronize()  # a lost context raises here: no second try
        print(f"  {type(exc).__name__}: {str(exc)[:120]}; timing it once more", flush=True)
        return time_row(fn, sets, grad)


def _stop_if_device_lost(name: str, label: str) -> None:
    """After a row's error: a device fault (an illegal memory access, say) is sticky, so every later
    row and problem would fail too. Stop the run with that said; the CSV holds the problems before."""
    try:
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 -- any error here means the CUDA context is lost
        raise RuntimeError(
            f"bench: the CUDA context is lost after `{name}` on {label} ({type(exc).__name__}: "
            f"{str(exc)[:120]}); the CSV keeps the problems timed before. Rerun the rest with "
            "--heads (a new process), and CUDA_LAUNCH_BLOCKING=1 to name the faulting kernel") from exc


def roofs() -> tuple[float, float]:
    """(bf16 matmul TFLOP/s, copy GB/s) measured on this card now, median of 20."""
    def med(fn):
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(20):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        return statistics.median(ts)

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    tflops = 2 * 8192**3 / med(lambda: a @ a) / 1e9
    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    gbs = 2 * x.numel() * 2 / med(lambda: y.copy_(x)) / 1e6
    return tflops, gbs


def versions(commit: str) -> dict:
    import tilelang

    def version(pkg):
        try:
            return __import__(pkg).__version__
        except ImportError:
            return "absent"

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.splitlines()[0]  # one line per GPU
    return dict(gpu=torch.cuda.get_device_name(), driver=driver, cuda=torch.version.cuda,
                torch=torch.__version__, tilelang=tilelang.__version__, fla=version("fla"),
                flash_qla=version("flash_qla"), commit=commit,
                date=datetime.date.today().isoformat())


def candidates() -> list[tuple[str, object, bool, None]]:
    """(row name, fn(inputs dict) -> outputs, checked against the reference?, None: no backward)
    for everything this machine can run."""
    from flashqla.api import chunk_gated_delta_rule

    rows = []
    for stage in discover():
        if stage.op == "gdn_fwd" and not stage.missing():
            # s00 is FLA's own forward, a peer: unchecked here like FlashQLA (its stage test checks it)
            name = FLA_ROW if stage.number == 0 else stage.name
            rows.append((name, lambda x, s=stage: s.module.run(**x), stage.number != 0, None))
    try:
        import flash_qla

        rows.append((FLASHQLA_ROW, lambda x: flash_qla.chunk_gated_delta_rule(**x), False, None))
    except ImportError:
        pass
    rows.append((API_ROW, lambda x: chunk_gated_delta_rule(**x), True, None))
    return rows


def train_flops(p: Problem) -> int:
    """A training step's useful FLOPs: the forward's, plus two products in the backward for each
    forward product (dA = dY B^T, dB = A^T dY) and the solve's adjoint (2 x 2 C^3 per chunk and
    value head: dA = -Ai^T dAi Ai^T). Recomputation is not useful work."""
    chunks = sum(math.ceil(n / CHUNK) for n in p.lengths)
    return 3 * useful_flops(p) + chunks * p.HV * 2 * 2 * CHUNK**3


def train_bytes(p: Problem) -> int:
    """What a training step must move at least: the forward's traffic, and the backward's, which
    reads do and the final state's gradient and writes a gradient for every input: the same again."""
    return 2 * useful_bytes(p)


def _autograd_row(name: str, fn, checked: bool) -> tuple:
    """A training row through autograd, fn(**inputs) -> (o, final state): (name, step, checked,
    backward). ``step(x)`` runs the forward, then the gradients of every input for the upstream
    gradients do and dht, returned as gdn_bwd's outputs; ``backward(x)`` runs the same forward once
    and returns the call that computes those gradients from its graph, kept (``retain_graph``) for
    as many calls as the timing makes."""
    def forward(x):
        names = ("q", "k", "v", "g", "beta", "initial_state")
        leaves = {n: x[n].detach().requires_grad_() for n in names}
        with torch.enable_grad():
            o, ht = fn(**{**x, **leaves, "output_final_state": True})
        return functools.partial(torch.autograd.grad, (o, ht), list(leaves.values()), (x["do"], x["dht"]))
    return name, lambda x: forward(x)(), checked, lambda x: functools.partial(forward(x), retain_graph=True)


def train_candidates() -> list[tuple[str, object, bool, object]]:
    """(row name, step(inputs with do, dht) -> (dq, dk, dv, dg, dbeta, dh0), checked?, backward)
    for a training step: FLA, FlashQLA and the API through autograd (``_autograd_row``); each
    gdn_bwd stage after the promoted forward (``flashqla.fwd``). ``backward(x)`` runs once what the
    backward needs before it and returns the backward alone as a call without arguments: for the
    autograd rows the forward, with grad; for a stage row nothing (the stage's ``run`` takes the
    inputs and recomputes what it needs; ``fwd.forward`` is the forward's part of the step)."""
    from flashqla import fwd
    from flashqla.api import chunk_gated_delta_rule

    fwd_args = ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens")
    bwd_args = ("q", "k", "v", "g", "beta", "do", "dht", "scale", "initial_state", "cu_seqlens")
    rows = []
    if os.environ.get("FLA_FLASH_QLA") == "0":  # else fla routes to FlashQLA: not FLA's own row
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

            rows.append(_autograd_row(FLA_ROW.split(" ")[0], lambda **x: fla_gdn(
                **{n: x[n] for n in fwd_args}, output_final_state=True), False))
        except ImportError:
            pass
    try:
        import flash_qla

        rows.append(_autograd_row(FLASHQLA_ROW, lambda **x: flash_qla.chunk_gated_delta_rule(
            **{n: x[n] for n in fwd_args}, output_final_state=True), False))
    except ImportError:
        pass
    for stage in discover():
        if stage.op == "gdn_bwd" and not stage.missing():
            def step(x, s=stage):
                fwd.forward(*(x[n] for n in fwd_args[:7]), True, x["cu_seqlens"])
                return s.module.run(**{n: x[n] for n in bwd_args})
            rows.append((f"fwd + {stage.name}", step, True, lambda x, s=stage: functools.partial(
                s.module.run, **{n: x[n] for n in bwd_args})))
    rows.append(_autograd_row(API_ROW, lambda **x: chunk_gated_delta_rule(
        **{n: x[n] for n in fwd_args}, output_final_state=True), True))
    return rows


@dataclass(frozen=True)
class Mode:
    """What one benchmark times: its rows, the reference that checks them, its napkin math."""

    name: str               # the CSV's stem and the Results page's markers
    title: str
    problems: tuple
    candidates: object      # () -> [(row name, fn(inputs), checked?, backward or None)]
    check_op: str           # flashqla.stages.OPS entry whose reference checks the rows
    flops: object           # Problem -> useful FLOPs
    bytes: object           # Problem -> compulsory HBM bytes
    peers: tuple            # the (FLA, FlashQLA) row names, for the vs_ columns


def _with_upstream_grads(x: dict, seed: int) -> dict:
    """A problem's inputs plus random do (bf16) and dht (fp32): a training step's upstream gradients."""
    gen = torch.Generator(x["v"].device).manual_seed(seed)
    N, HV, V = x["initial_state"].shape[0], x["v"].shape[2], x["v"].shape[3]
    do = torch.randn(x["v"].shape, generator=gen, device=x["v"].device).to(torch.bfloat16)
    dht = torch.randn(N, HV, x["q"].shape[3], V, generator=gen, device=x["v"].device)
    return {**x, "do": do, "dht": dht}


FORWARD = Mode("gdn_fwd", "forward", tuple(PROBLEMS), candidates, "gdn_fwd", useful_flops,
               useful_bytes, (FLA_ROW, FLASHQLA_ROW))
TRAINING = Mode("gdn_train", "training step (forward + backward)",
                tuple(Problem(H, HV, mix) for H, HV in PUBLIC_HEADS for mix in TRAIN_MIXES),
                train_candidates, "gdn_bwd", train_flops, train_bytes, ("FLA", FLASHQLA_ROW))
MODES = {m.name: m for m in (FORWARD, TRAINING)}


def start_peer_warmup(mode: Mode, problems) -> dict:
    """Start one process per head layout of ``problems`` that runs each peer once on each of that
    layout's problems (``_run_peers_once``), all at once: FlashQLA compiles its TileLang kernels on
    a layout's first calls, one after another (3-4 minutes a layout on a fresh H100 machine), and
    FLA its Triton ones; run in parallel, the compiles cost about one layout's time, and TileLang's
    and Triton's disk caches then serve the timed run's untimed first calls. -> {(H, HV): process}."""
    labels = {}
    for p in problems:
        labels.setdefault((p.H, p.HV), []).append(short_label(p.label))
    code = "import sys; from flashqla import bench; bench._run_peers_once(sys.argv[1], sys.argv[2:])"
    return {heads: subprocess.Popen([sys.executable, "-c", code, mode.name, *names],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for heads, names in labels.items()}


def wait_peer_warmup(procs: dict) -> None:
    """Wait for ``start_peer_warmup``'s processes; one that failed (out of memory, say) leaves its
    layout's compiles to the timed run's first calls, and says so."""
    for (H, HV), proc in procs.items():
        if proc.wait() != 0:
            print(f"bench: warming the peers on ({H}, {HV}) failed (exit {proc.returncode}); "
                  "they compile in their first timed-run call instead", flush=True)


def _run_peers_once(mode_name: str, labels: list[str]) -> None:
    """``start_peer_warmup``'s child: each peer of mode ``mode_name`` called once on each problem
    that ``labels`` name (short labels), its inputs freed after each."""
    mode = MODES[mode_name]
    peers = [c for c in mode.candidates() if c[0] in mode.peers]
    for p in mode.problems:
        if short_label(p.label) not in labels:
            continue
        x = problem_inputs(p, 0, mode is TRAINING)
        for _, fn, *_ in peers:
            with torch.no_grad():  # a training row turns grad on itself
                fn(x)
        torch.cuda.synchronize()
        del x
        torch.cuda.empty_cache()


def run_bench(commit: str, csv_path: Path, problems=PROBLEMS, keep=(), mode: Mode = FORWARD,
              rows_to_time=None) -> list[dict]:
    """Check, then time every row (or only ``rows_to_time`` and both peers) on every problem; the
    CSV (``keep``'s rows that this run does not replace, then this run's, ``merge_rows``) is
    rewritten after each problem."""
    training = mode is TRAINING
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cands = mode.candidates()
    if rows_to_time is not None:
        unknown = set(rows_to_time) - {c[0] for c in cands}
        if unknown:
            raise ValueError(f"bench: `rows` {sorted(unknown)} are not rows of this machine's "
                             f"{mode.name} benchmark: {[c[0] for c in cands]}")
        rows_to_time = {*rows_to_time, *mode.peers}  # the vs_ columns need the peers of this run
        cands = [c for c in cands if c[0] in rows_to_time]
    failed = set()
    heads = sorted({(p.H, p.HV) for p in problems})
    # the peers' compiles, one process a head layout (``start_peer_warmup``), beside ours:
    # JIT-compile our TileLang rows (the stages and the API) for every head configuration, all on
    # threads (one run hung compiling in the main thread after a threaded warm-up), on one sequence
    # and on nine (the fused kernel's two widths, gdn_fwd.s12's ``block_v``)
    warming = start_peer_warmup(mode, problems)
    jobs = [(fn, problem_inputs(Problem(H, HV, lengths), 0, training)) for H, HV in heads
            for lengths in ((70,), (70,) * 9) for name, fn, _, _ in cands if name not in mode.peers]
    def compile_row(job):
        try:
            job[0](job[1])
        except Exception as exc:  # noqa: BLE001 -- its check below fails it and says why
            print(f"compile of a row failed: {type(exc).__name__}: {exc}", flush=True)

    run_on_threads([functools.partial(compile_row, job) for job in jobs])
    wait_peer_warmup(warming)
    print(f"{time.strftime('%X')} compiled; checking", flush=True)
    for H, HV in heads:
        x = op_inputs(mode.check_op, Problem(H, HV, CHECK_LENGTHS).inputs("cuda", seed=1))
        for name, fn, checked, _ in cands:
            if not checked:
                continue
            try:
                check_op(mode.check_op, lambda **kw: fn(kw), x)
            except Exception as exc:  # noqa: BLE001 -- a wrong answer or a crash: not timed, said why
                failed.add(name)
                print(f"FAILED {name} on ({H}, {HV}): {type(exc).__name__}: {exc}")
    tflops_roof, gbs_roof = roofs()
    meta = dict(versions(commit), gemm_roof_tflops=round(tflops_roof),
                copy_roof_gbs=round(gbs_roof))
    rows = []
    for p in problems:
        flops, nbytes = mode.flops(p), mode.bytes(p)
        floor_ms = max(flops / tflops_roof / 1e9, nbytes / gbs_roof / 1e6)
        base = {}
        sets = input_sets(p, l2, training)
        for name, fn, _, backward in cands:
            if name in failed:
                rows.append(dict(problem=p.label, impl=name, ms="", method="FAILED its check"))
                continue
            try:
                times = time_candidate(name, fn, backward, sets, mode)
            except Exception as exc:  # noqa: BLE001 -- e.g. a peer without this feature: said why
                rows.append(dict(problem=p.label, impl=name, ms="",
                                 method=f"ERROR {type(exc).__name__}: {str(exc)[:120]}"))
                print(f"ERROR {name} on {p.label}: {exc}", flush=True)
                _stop_if_device_lost(name, p.label)
                continue
            ms = times.pop("ms")
            base.setdefault(name, ms)
            rows.append(dict(problem=p.label, impl=name, ms=round(ms, 4), method=times.pop("method"),
                             **{k: round(v, 4) for k, v in times.items()},  # eager_ms, bwd_ms
                             tflops=round(flops / ms / 1e9, 1),
                             pct_gemm_roof=round(100 * flops / ms / 1e9 / tflops_roof, 1),
                             gbs=round(nbytes / ms / 1e6), pct_copy_roof=round(
                                 100 * nbytes / ms / 1e6 / gbs_roof, 1),
                             x_floor=round(ms / floor_ms, 2)))
        for r in rows:
            if r["problem"] == p.label and r["ms"] != "":
                for peer, col in zip(mode.peers, ("vs_fla", "vs_flashqla")):
                    r[col] = round(base[peer] / r["ms"], 2) if peer in base else ""
        print(time.strftime("%X"), format_rows([r for r in rows if r["problem"] == p.label]),
              sep="\n", flush=True)
        write_csv(merge_rows(list(keep), [{**r, **meta} for r in rows], mode.problems, rows_to_time),
                  csv_path)
    return [{**r, **meta} for r in rows]


COLUMNS = ("problem", "impl", "ms", "vs_fla", "vs_flashqla", "tflops", "pct_gemm_roof", "gbs",
           "pct_copy_roof", "x_floor", "method", "eager_ms", "bwd_ms")


def format_rows(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        cells = [str(r.get(c, "")) for c in COLUMNS]
        lines.append(f"{cells[0]:28} {cells[1]:34} " + " ".join(f"{c:>8}" for c in cells[2:10])
                     + f"  {cells[10]}" + (f"; eager {cells[11]}" if cells[11] else ""))
    return "\n".join(lines)


def write_csv(rows: list[dict], path: Path) -> None:
    """The rows as a CSV: the COLUMNS some row has (a forward run has no ``bwd_ms``), in their
    order, then the provenance."""
    fields = [c for c in COLUMNS if any(c in r for r in rows)] + [k for k in rows[0] if k not in COLUMNS]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def provenance(rows: list[dict]) -> dict:
    """Each provenance field of the rows, every distinct value listed (shards run as separate
    processes: one per GPU, or later commits for some head configurations), the roofs each process
    measured as a range."""
    meta = {k: ", ".join(dict.fromkeys(r[k] for r in rows)) for k in rows[0]}
    for k in ("gemm_roof_tflops", "copy_roof_gbs"):
        vals = sorted({int(r[k]) for r in rows})
        meta[k] = f"{vals[0]}" if len(vals) == 1 else f"{vals[0]}-{vals[-1]}"
    return meta


# --- the report: README summary, the book's Results page and the plots, from the committed CSVs ---

BOOK = RESULTS.parent.parent / "book"
RESULTS_PAGE = BOOK / "results.md"
PLOTS = BOOK / "images"  # copies of the plots, inside the book's source tree where Sphinx finds them
CP_PAGE = BOOK / "cp.md"  # the CP page: its scaling table between the bench:cp markers
GRAPH = "CUDA graph replay"


def stage_id(impl: str) -> str:
    """'gdn_fwd/s44_warmup_two_products' -> 'gdn_fwd.s44'; 'fwd + gdn_bwd/s02_fused_walks' ->
    'fwd + gdn_bwd.s02'; peers and the API unchanged."""
    return re.sub(r"(\w+)/s(\d\d)_\w+", r"\1.s\2", impl)


def _by_problem(rows: list[dict]) -> dict[str, dict[str, dict]]:
    """problem label -> impl -> row, problems in the CSV's order, rows without a time left out."""
    out = {}
    for r in rows:
        if r["ms"]:
            out.setdefault(r["problem"], {})[r["impl"]] = r
    return out


def api_ratios(rows: list[dict], mode: Mode = FORWARD) -> dict[str, tuple[float, float]]:
    """Per problem, (FLA's time, FlashQLA's time) over the API's: above 1, the API is faster.
    A ratio compares rows of one run only (same commit and GPU); anything else raises."""
    out = {}
    for label, got in _by_problem(rows).items():
        missing = [name for name in (API_ROW, *mode.peers) if name not in got]
        if missing:
            raise ValueError(f"bench report: {mode.name}.csv has no time for {missing} on {label}")
        api = got[API_ROW]
        for peer in mode.peers:
            if (got[peer]["commit"], got[peer]["gpu"]) != (api["commit"], api["gpu"]):
                raise ValueError(f"bench report: on {label} the API row ({api['commit']}, {api['gpu']}) "
                                 f"and {peer}'s ({got[peer]['commit']}, {got[peer]['gpu']}) are not "
                                 "from one run: time them together (`bench --problems ... --rows ...`)")
        out[label] = tuple(float(got[peer]["ms"]) / float(api["ms"]) for peer in mode.peers)
    return out


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(map(math.log, values)) / len(values))


def _mixes(labels) -> str:
    """The token mixes of these problem labels, e.g. '1x8192, 1x32768, 8x4096'."""
    return ", ".join(dict.fromkeys(short_label(x).split(") ", 1)[1] for x in labels))


def summary_table(runs: dict[str, list[dict]]) -> str:
    """Markdown for the README: per head layout (H, HV), the API's speed against FLA and FlashQLA
    in each mode (``runs``: mode name -> its CSV rows), geomean over the layout's problems (min-max),
    with the cards and commits named."""
    modes = [MODES[name] for name in runs]
    ratios = {m.name: api_ratios(runs[m.name], m) for m in modes}
    layouts = sorted({heads_and_lengths(x)[:2] for r in ratios.values() for x in r})

    def cell(mode, layout, i):
        vals = [v[i] for x, v in ratios[mode.name].items() if layout in (None, heads_and_lengths(x)[:2])]
        return f"{geomean(vals):.2f}x ({min(vals):.2f}-{max(vals):.2f})" if vals else "-"

    lines = ["Speed of `flashqla.chunk_gated_delta_rule` against FLA and FlashQLA: their time over ours "
             "(above 1: faster), the geometric mean over a head layout's problems, the range in "
             "brackets. Each ratio compares rows timed in one run.", ""]
    for m in modes:
        api = [r for r in runs[m.name] if r["impl"] == API_ROW and r["ms"]]
        counts = {}  # problems timed per layout: a run of some layouts leaves others with fewer
        for x in ratios[m.name]:
            counts[heads_and_lengths(x)[:2]] = counts.get(heads_and_lengths(x)[:2], 0) + 1
        low, high = min(counts.values()), max(counts.values())
        per_layout = f"{low}" if low == high else f"{low}-{high}"
        commits = list(dict.fromkeys(r["commit"][:7] for r in api))
        lines.append(f"- {m.title.capitalize()}: {per_layout} problems a layout ({_mixes(ratios[m.name])} "
                     f"tokens) on {provenance(api)['gpu']}, commit{'s' * (len(commits) > 1)} "
                     f"{', '.join(commits)}.")
    lines += ["", "| (H, HV) | " + " | ".join(f"{m.title.split(' (')[0]} vs {peer}" for m in modes
                                           for peer in ("FLA", "FlashQLA")) + " |",
              "|---" * (1 + 2 * len(modes)) + "|"]
    for layout in [*layouts, None]:
        name = f"({layout[0]}, {layout[1]})" if layout else f"all {len(layouts)}"
        lines.append(f"| {name} | " + " | ".join(cell(m, layout, i) for m in modes for i in (0, 1)) + " |")
    return "\n".join(lines)


def results_table(rows: list[dict], mode: Mode = FORWARD) -> str:
    """Markdown for the Results page: every problem with its useful work, FLA, FlashQLA and the API
    (ms, ratios, napkin math; the backward alone where the CSV has it) and the fastest flashqla
    stage, then the provenance of every row shown."""
    ratios = api_ratios(rows, mode)
    shown, best_rows = [], []
    eager = any(r.get("eager_ms") for r in rows)  # runs from before the eager column have none
    bwd = any(r.get("bwd_ms") for r in rows)      # nor the backward's
    lines = ["| problem | GFLOP | MB | FLA ms | FlashQLA ms | API ms | vs FLA | vs FlashQLA | "
             + ("eager ms: FLA, FlashQLA, API | " if eager else "")
             + ("backward ms: FLA, FlashQLA, API | " if bwd else "")
             + "API TFLOP/s (% GEMM roof) | API GB/s (% copy roof) | API x floor | fastest stage: ms (commit) |",
             "|---" * (12 + eager + bwd) + "|"]

    def ms(r, column="ms"):
        if not r.get(column):
            return "-"
        return r[column] + ("" if row_methods(r)[column == "bwd_ms"] == GRAPH else " †")

    for label, got in _by_problem(rows).items():
        H, HV, lengths = heads_and_lengths(label)
        p = Problem(H, HV, tuple(lengths))
        fla, flashqla, api = (got[name] for name in (*mode.peers, API_ROW))
        stages = [r for name, r in got.items() if name not in (*mode.peers, API_ROW)]
        best = min(stages, key=lambda r: float(r["ms"])) if stages else None
        shown += [fla, flashqla, api]
        best_rows += [best] if best else []
        lines.append(
            f"| {short_label(label)} | {mode.flops(p) / 1e9:.1f} | {mode.bytes(p) / 1e6:.0f} | {ms(fla)} | "
            f"{ms(flashqla)} | {ms(api)} | {ratios[label][0]:.2f} | {ratios[label][1]:.2f} | "
            + (" / ".join(r.get("eager_ms") or "-" for r in (fla, flashqla, api)) + " | " if eager else "")
            + (" / ".join(ms(r, "bwd_ms") for r in (fla, flashqla, api)) + " | " if bwd else "")
            + f"{api['tflops']} ({api['pct_gemm_roof']} %) | {api['gbs']} ({api['pct_copy_roof']} %) | "
            f"{api['x_floor']} | "
            + (f"{stage_id(best['impl'])}: {ms(best)} ({best['commit'][:7]}) |" if best else "- |"))
    marked = [row_methods(r)[0] for r in shown + best_rows]
    marked += [row_methods(r)[1] for r in shown if r.get("bwd_ms")]
    methods = dict.fromkeys(m for m in marked if m != GRAPH)
    if methods:
        lines += ["", "† " + "; ".join(methods) + "."]
    meta = provenance(shown + best_rows)
    lines += ["", f"Software: driver {meta['driver']}, CUDA {meta['cuda']}, torch {meta['torch']}, "
              f"TileLang {meta['tilelang']}, fla {meta['fla']}, flash-qla {meta['flash_qla']}. "
              f"Every time is a median; {GRAPH} unless marked †. Runs:", ""]
    for commit in dict.fromkeys(r["commit"] for r in shown + best_rows):
        of = [r for r in shown + best_rows if r["commit"] == commit]
        run = provenance(of)
        roles = [f"{role} on {n} problems" for role, n in (
            ("FLA, FlashQLA and the API", sum(r["impl"] == API_ROW for r in of)),
            ("the fastest stage", sum(r in best_rows for r in of))) if n]
        lines.append(f"- `{commit[:7]}` ({run['date']}, {run['gpu']}; roofs measured in the same "
                     f"process: bf16 GEMM {run['gemm_roof_tflops']} TFLOP/s, copy {run['copy_roof_gbs']} "
                     f"GB/s): " + "; ".join(roles) + ".")
    return "\n".join(lines)


def row_methods(r: dict) -> tuple[str, str]:
    """(how ``ms`` was timed, how ``bwd_ms`` was) of a CSV row: ``method`` names the backward's
    after "; bwd_ms: " where the two differ."""
    step, _, backward = r["method"].partition("; bwd_ms: ")
    return step, backward or step


def replace_between(text: str, name: str, block: str) -> str:
    """``text`` with what lies between ``<!-- bench:NAME:begin -->`` and its end marker replaced by
    ``block``."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    if begin not in text or end not in text:
        raise ValueError(f"bench report: the markers {begin} and {end} are missing")
    return text[:text.index(begin) + len(begin)] + "\n" + block + "\n" + text[text.index(end):]


def between(text: str, name: str) -> str:
    """What lies between the ``bench:NAME`` markers, stripped."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    return text[text.index(begin) + len(begin):text.index(end)].strip()


# the plots' series: the peers and the API, then the milestones of the course path in their colours
STYLE = {"FLA": ("0.3", "s"), FLASHQLA_ROW: ("tab:red", "D"), API_ROW: ("tab:blue", "o")}
MILESTONE_STYLES = (("tab:green", "v"), ("tab:orange", "^"), ("tab:purple", "<"), ("tab:brown", ">"),
                    ("tab:pink", "P"), ("tab:olive", "X"), ("tab:cyan", "*"))


def plot_series(rows: list[dict], mode: Mode = FORWARD) -> dict[str, tuple[str, str, str]]:
    """impl -> (legend label, colour, marker): FLA, FlashQLA, the API and the milestone stages."""
    from flashqla.stages import MILESTONES

    impls = dict.fromkeys(r["impl"] for r in rows)
    series = {mode.peers[0]: ("FLA", *STYLE["FLA"]), FLASHQLA_ROW: ("FlashQLA", *STYLE[FLASHQLA_ROW]),
              API_ROW: ("flashqla (the API)", *STYLE[API_ROW])}
    milestones = [i for i in impls if stage_id(i).removeprefix("fwd + ") in MILESTONES]
    assert len(milestones) <= len(MILESTONE_STYLES), f"more milestones than styles: {milestones}"
    for impl, style in zip(milestones, MILESTONE_STYLES):
        series[impl] = (stage_id(impl), *style)
    return series


def plot(rows: list[dict], path: Path, mode: Mode = FORWARD) -> None:
    """Latency against problem (log scale): the peers, the API and the milestone stages."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["problem"] for r in rows))
    title = mode.title.split(" (")[0]
    fig, ax = plt.subplots(figsize=(max(10, 0.3 * len(labels)), 5))
    for impl, (name, colour, marker) in plot_series(rows, mode).items():
        pts = [(labels.index(r["problem"]), float(r["ms"])) for r in rows if r["impl"] == impl and r["ms"]]
        api = impl == API_ROW  # drawn wide and pale underneath: the stage it runs shows on top of it
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker=marker, color=colour, label=name,
                ms=7 if api else 5, lw=4 if api else 1, alpha=0.5 if api else 1, zorder=1 if api else 2)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), [short_label(x) for x in labels], rotation=90, fontsize=7)
    ax.set_ylabel(f"{title}, ms (log)")
    api = provenance([r for r in rows if r["impl"] == API_ROW])
    ax.set_title(f"gdn {title}, {api['gpu']}; the API and the peers at {api['commit']}", fontsize=9)
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def cp_table(rows: list[dict]) -> str:
    """Markdown for the book's CP page: every row of ``results/cp.csv`` that was timed or failed,
    by problem, step and world size, with its provenance."""
    lines = ["| problem | step | GPUs | impl | ms | vs FLA | efficiency | exchange share | TFLOP/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["problem"], r["step"], int(r["world_size"]), r["impl"] != API_ROW)):
        ms = r["ms"] or ("out of memory" if "OutOfMemory" in r["method"] else r["method"][:40])
        lines.append(f"| {short_label(r['problem'])} | {r['step']} | {r['world_size']} | "
                     f"{'FLA' if r['impl'] == 'FLA' else 'flashqla'} | {ms} | {r['vs_fla']} | "
                     f"{r['efficiency']} | {r['exchange_share']} | {r['tflops']} |")
    meta = {k: ", ".join(dict.fromkeys(r[k] for r in rows)) for k in rows[0]}
    lines.append(f"\n{meta['gpu']}, driver {meta['driver']}, CUDA {meta['cuda']}, torch {meta['torch']}, "
                 f"TileLang {meta['tilelang']}, fla {meta['fla']}, flash-qla {meta['flash_qla']}; "
                 f"commits {meta['commit']}, {meta['date']}. Eager CUDA-event medians over 5 calls, the "
                 "slowest rank's; efficiency = t_1 / (n t_n), the same impl and step on one GPU.")
    return "\n".join(lines)


def plot_cp(rows: list[dict], path: Path) -> None:
    """Strong scaling: ms against the number of GPUs (log), one line per problem, step and impl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    series = dict.fromkeys((r["problem"], r["step"], r["impl"]) for r in rows)
    for i, (problem, step, impl) in enumerate(series):
        pts = sorted((int(r["world_size"]), float(r["ms"])) for r in rows if r["ms"] and
                     (r["problem"], r["step"], r["impl"]) == (problem, step, impl))
        if pts:
            ax.plot(*zip(*pts), marker="o" if impl == API_ROW else "x", ls="-" if step == "forward" else "--",
                    color=plt.cm.tab20.colors[i % 20],
                    label=f"{'flashqla' if impl == API_ROW else 'FLA'} {step} {short_label(problem)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks([1, 2, 4], ["1", "2", "4"])
    ax.set_xlabel("GPUs (one sequence, contiguous shards)")
    ax.set_ylabel("ms (log)")
    ax.set_title(f"context parallelism, {', '.join(dict.fromkeys(r['gpu'] for r in rows))}", fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def report(results: Path = RESULTS, readme: Path = README, page: Path = RESULTS_PAGE,
           images: Path = PLOTS, cp_page: Path = CP_PAGE) -> None:
    """Redraw everything the committed CSVs feed: each mode's plot (``results/<mode>.png``, copied
    into the book), its table on the Results page, the README's summary, and the CP page's
    scaling table and plot (``results/cp.csv``)."""
    runs = {name: read_csv(results / f"{name}.csv") for name in MODES}
    text = page.read_text()
    images.mkdir(exist_ok=True)
    for name, rows in runs.items():
        plot(rows, results / f"{name}.png", MODES[name])
        shutil.copyfile(results / f"{name}.png", images / f"{name}.png")
        text = replace_between(text, name, results_table(rows, MODES[name]))
    page.write_text(text)
    readme.write_text(replace_between(readme.read_text(), "summary", summary_table(runs)))
    cp_rows = read_csv(results / "cp.csv")
    plot_cp(cp_rows, results / "cp.png")
    shutil.copyfile(results / "cp.png", images / "cp.png")
    cp_page.write_text(replace_between(cp_page.read_text(), "cp", cp_table(cp_rows)))


def short_label(label: str) -> str:
    """'(16, 32) 4096+4096+...+4096' -> '(16, 32) 8x4096' (display only; the CSV keeps the label)."""
    return re.sub(r"\b(\d+)(\+\1)+\b", lambda m: f"{m.group(0).count('+') + 1}x{m.group(1)}", label)


def heads_and_lengths(label: str) -> tuple[int, int, list[int]]:
    """'(16, 32) 28672+4096' -> (16, 32, [28672, 4096]); '(2, 8) 1x2048' -> (2, 8, [2048])."""
    m = re.match(r"\((\d+), (\d+)\) (\d+)x(\d+)\b|\((\d+), (\d+)\) ([\d+]+)", label)
    if m is None:
        raise ValueError(f"bench: `label` must look like '(H, HV) NxT' or '(H, HV) T1+T2+...'; got {label!r}")
    if m.group(1):
        return int(m.group(1)), int(m.group(2)), [int(m.group(4))] * int(m.group(3))
    return int(m.group(5)), int(m.group(6)), [int(n) for n in m.group(7).split("+")]


def autocp_splits_timed(rows: list[dict]) -> list[tuple[str, str, float, float]]:
    """(problem label, AutoCP stage, ms of its chain alone, ms with CP) wherever a forward run split:
    the AutoCP stage (s06 over s05's kernel, s08 over s07's) and its chain differ by more than 8 %
    (where nothing is split, the two rows of the 4 x H100 run at 188c42c differ by up to 7 %).
    Not s11 over s10: s11 also runs another solve (gate_free_solve.s02), so the two differ where
    nothing is split."""
    ms = {(r["problem"], r["impl"].split("/")[-1][:3]): float(r["ms"]) for r in rows if r["ms"]}
    return [(label, cp, ms[label, chain], ms[label, cp])
            for label in dict.fromkeys(r["problem"] for r in rows)
            for cp, chain in (("s06", "s05"), ("s08", "s07"))
            if (label, cp) in ms and abs(ms[label, chain] / ms[label, cp] - 1) > 0.08]


def split_sweep(stage: str, path: Path | None = None) -> dict:
    """The run of ``profiles/split_lab.py`` that swept ``stage`` (e.g. "gdn_fwd.s20") in
    ``path`` (default ``results/autocp_split.csv``): problem label -> {(impl, L): ms} over every row
    of that run (the stage at each forced L, L "0" unsplit; the rule and the peers with L "")."""
    rows = read_csv(path or RESULTS / "autocp_split.csv")
    runs = {r["commit"] for r in rows if r["impl"] == stage and r["L"] != ""}
    sweep = {}
    for r in rows:
        if r["commit"] in runs and r["ms"]:
            sweep.setdefault(r["problem"], {})[r["impl"], r["L"]] = float(r["ms"])
    return sweep


def merge_rows(old: list[dict], new: list[dict], problems=PROBLEMS, rows_timed=None) -> list[dict]:
    """The CSV after a run over some problems: their old rows replaced, other problems' rows kept;
    with ``rows_timed`` (a run of some rows only), only those rows of those problems replaced."""
    done = {r["problem"] for r in new}
    order = {p.label: i for i, p in enumerate(problems)}
    replaced = (lambda r: r["problem"] in done) if rows_timed is None else (
        lambda r: r["problem"] in done and r["impl"] in rows_timed)
    rows = [r for r in old if not replaced(r)] + new
    return sorted(rows, key=lambda r: order.get(r["problem"], len(order)))  # stable: rows keep order


def main(commit: str, csv_path: Path | None, heads=None, mode: str = "gdn_fwd", labels=None,
         row_names=None) -> int:
    """Time ``mode`` ("gdn_fwd": the inference forward, "gdn_train": a training step) on this GPU.
    ``heads``: only the problems of these (H, HV); ``labels``: only these problems (short labels,
    ``short_label``); ``row_names``: only these rows, beside both peers (a run must fit the GPU
    machine's 10 minutes). The CSV keeps the rows this run does not time from earlier runs, each
    row with its own provenance."""
    m = MODES[mode]
    csv_path = csv_path or RESULTS / f"{m.name}.csv"
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (use --report to redraw from the committed CSVs)")
        return 1
    problems = [p for p in m.problems if (heads is None or (p.H, p.HV) in heads)
                and (labels is None or short_label(p.label) in labels)]
    if not problems:
        raise ValueError(f"bench: `heads` {heads} and `problems` {labels} select none of "
                         f"{[short_label(p.label) for p in m.problems]}")
    partial = heads is not None or labels is not None or row_names is not None
    keep = read_csv(csv_path) if partial and csv_path.exists() else []
    rows = run_bench(commit, csv_path, problems, keep, m, row_names)
    print(f"wrote {csv_path}")
    return 1 if any(r["method"] == "FAILED its check" for r in rows) else 0


# --- cp: context parallelism across the GPUs of this host, FLA's cp_context beside it ---
#
# ``python -m flashqla bench --mode cp`` spawns its own ranks (torch.multiprocessing, NCCL, a GPU
# each) for world sizes 1, 2 and 4 (those the host has), one process group per world size, and
# times on every problem a forward (no grad) and a training step (forward, then the gradients of
# q, k, v, g, beta for a random do) of one long sequence in the contiguous layout: flashqla's
# ``chunk_gated_delta_rule`` with ``flashqla.cp``'s context, and FLA's with ``fla.ops.cp``'s
# (FLA_FLASH_QLA=0: FLA's own kernels). On one GPU both run their plain single-GPU call. FLA's
# cp_context takes no initial state and returns no final state, so no row has either. Timing: two
# untimed calls, then CP_REPEAT calls, each after a barrier, timed with CUDA events on every
# rank; ``ms`` is the slowest rank's median. ``exchange_ms``: the time a call spends in
# ``flashqla.cp``'s all_gathers (waiting for the other ranks included), the slowest rank's median;
# FLA's rows have none. ``efficiency`` = t_1 / (n t_n), the same impl and step on one GPU.
# ``tflops``: the useful FLOPs (``useful_flops``, ``train_flops``) over ms, all GPUs together;
# ``pct_gemm_roof`` of n GEMM roofs. The correctness of the path is tests/test_cp.py's (its gpu
# tests). ``--problems`` runs fewer, e.g. '(2, 8) 1x131072'.

# the largest last: a rank that runs out of memory alone ends its world size's run (the rows before stay)
CP_PROBLEMS = tuple(Problem(H, HV, (n,)) for H, HV in ((2, 8), (16, 64)) for n in (131072, 524288))
CP_STEPS = ("forward", "training")
CP_REPEAT = 5
CP_COLUMNS = ("problem", "impl", "step", "world_size", "ms", "vs_fla", "efficiency", "exchange_ms",
              "exchange_share", "tflops", "pct_gemm_roof", "method")
_exchanges: list = []  # (start, end) CUDA events of each all_gather of flashqla.cp in a timed call


def _timed_all_gather(all_gather):
    """``flashqla.cp._all_gather`` between two CUDA events on the caller's stream."""
    def run(x, ctx):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = all_gather(x, ctx)
        end.record()
        _exchanges.append((start, end))
        return out
    return run


def _time_ranks(fn) -> tuple[float, float]:
    """(ms, exchange ms) of ``fn()`` on every rank at once: the slowest rank's medians."""
    import torch.distributed as dist

    fn()
    fn()
    times, exchanges = [], []
    for _ in range(CP_REPEAT):
        dist.barrier()
        torch.cuda.synchronize()
        _exchanges.clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        exchanges.append(sum(a.elapsed_time(b) for a, b in _exchanges))
    out = torch.tensor([statistics.median(times), statistics.median(exchanges)], device="cuda")
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return tuple(out.tolist())


def _cp_calls(p: Problem, rank: int, world: int) -> tuple[dict, dict, torch.Tensor]:
    """({impl: fn(**inputs) -> o}, this rank's inputs, do): ``p``'s one sequence drawn alike on every
    rank, this rank's slice of it, and the calls (the context built once)."""
    import torch.distributed as dist
    from fla.ops import cp as fla_cp
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_gdn

    from flashqla import cp
    from flashqla.api import chunk_gated_delta_rule

    x = p.inputs("cuda")
    cu, T = x["cu_seqlens"], x["q"].shape[1]
    shard = slice(rank * T // world, (rank + 1) * T // world)
    inputs = {n: x[n][:, shard].contiguous() for n in ("q", "k", "v", "g", "beta")}
    del x
    torch.cuda.empty_cache()  # the global problem's memory back: the training step needs it
    gen = torch.Generator("cuda").manual_seed(rank)
    do = torch.randn(inputs["v"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    if world == 1:
        calls = {API_ROW: lambda **kw: chunk_gated_delta_rule(**kw, cu_seqlens=cu)[0],
                 "FLA": lambda **kw: fla_gdn(**kw, cu_seqlens=cu)[0]}
    else:
        ours = cp.build_cp_context(cu, dist.group.WORLD, cu_seqlens_cpu=cu.cpu())
        theirs = fla_cp.build_cp_context(cu, dist.group.WORLD, cu_seqlens_cpu=cu.cpu())
        calls = {API_ROW: lambda **kw: chunk_gated_delta_rule(**kw, cp_context=ours)[0],
                 "FLA": lambda **kw: fla_gdn(**kw, cp_context=theirs)[0]}
    return calls, inputs, do


def _cp_step(call, inputs: dict, do, step: str):
    """fn() running one forward (no grad) or one training step of ``call``."""
    if step == "forward":
        def run():
            with torch.no_grad():
                call(**inputs)
        return run
    leaves = {n: t.detach().requires_grad_() for n, t in inputs.items()}
    return lambda: torch.autograd.grad(call(**leaves), list(leaves.values()), do)


def _cp_worker(rank: int, world: int, port: int, labels: list[str], out: str, csv_path: str,
               meta: dict) -> None:
    """One rank of world size ``world``: every (problem, impl, step) timed; rank 0 appends each row
    to ``out`` as a JSON line and rewrites the CSV from all of them (``_write_cp_csv``), so a run
    killed or stopped at any point keeps every row it timed (a rank that fails alone leaves the
    others in a collective until the group's timeout ends the run)."""
    import datetime
    import json

    import torch.distributed as dist

    from flashqla import cp

    os.environ["FLA_FLASH_QLA"] = "0"                  # FLA's own kernels
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")      # NVLink multicast off
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank), timeout=datetime.timedelta(seconds=180))
    cp._all_gather = _timed_all_gather(cp._all_gather)
    try:
        for p in CP_PROBLEMS:
            if short_label(p.label) not in labels:
                continue
            calls, inputs, do = _cp_calls(p, rank, world)
            for step in CP_STEPS:
                for impl, call in calls.items():
                    row = dict(problem=p.label, impl=impl, step=step, world_size=world)
                    try:
                        ms, exchange = _time_ranks(_cp_step(call, inputs, do, step))
                        row.update(ms=round(ms, 3), method="CUDA events, eager", exchange_ms=(
                            round(exchange, 3) if impl == API_ROW and world > 1 else ""))
                    except Exception as exc:  # noqa: BLE001 -- e.g. out of memory on one GPU: said why
                        row.update(ms="", method=f"ERROR {type(exc).__name__}: {str(exc)[:120]}")
                    torch.cuda.empty_cache()   # the next impl gets this one's cached blocks back
                    if rank == 0:
                        print(time.strftime("%X"), row, flush=True)
                        with open(out, "a") as f:
                            f.write(json.dumps(row) + "\n")
                        _write_cp_csv(out, Path(csv_path), meta)
            del calls, inputs, do
            torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()


def _compile_cp_kernels(problems) -> None:
    """The forward's and backward's kernels the cp rows may launch (every solve, width and
    AutoCP kernel of their heads), compiled on threads; TileLang's disk cache serves the ranks."""
    from flashqla import bwd, fwd

    jobs = []
    for H, HV in {(p.H, p.HV) for p in problems}:
        for R in {fwd.solve_heads(H, HV, 10**6, 1), fwd.solve_heads(H, HV, 0, 1)}:
            jobs += [(fwd, fwd.gate_free_solve_with_cumsum_kernel, H, HV, R),
                     *((fwd, fwd.gate_free_solve_kernel, H, HV, R, wy) for wy in (False, True))]
        jobs += [(fwd, fwd.chunk_local_cumsum_kernel, HV), (fwd, fwd.windows_kernel, HV),
                 (fwd, fwd.warmup_kernel, H, HV), (fwd, fwd.chain_kernel, HV),
                 *((fwd, b, H, HV, 128, 128, bv)
                   for b in (fwd.fused_reform_kernel, fwd.fused_state_value_kernel, fwd.fused_state_in_registers_kernel)
                   for bv in (fwd.BLOCK_V, fwd.NARROW_BLOCK_V, fwd.NARROWEST_BLOCK_V)),
                 (bwd, bwd.walk_kernel, H, HV, bwd.BV), (bwd, bwd.bwd_windows_kernel, HV),
                 *((bwd, b, H, HV) for b in (bwd.prep_kernel, bwd.chunk_bwd_dqkwg_kernel, bwd.wy_bwd_kernel,
                                             bwd.finish_kernel, bwd.dh_warmup_kernel))]

    def compile_one(job):
        try:
            job[0]._compiled(*job[1:])
        except Exception:  # noqa: BLE001 -- a width a builder does not take: no launch asks for it
            pass
    run_on_threads([functools.partial(compile_one, job) for job in jobs])


def _cp_world(world: int, labels: list[str], out: Path, csv_path: Path, meta: dict) -> None:
    """Spawn ``world`` ranks (``_cp_worker``); their rows go to ``out`` and the CSV as they come."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.start_processes(_cp_worker, args=(world, port, labels, str(out), str(csv_path), meta),
                           nprocs=world, join=True, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 -- a rank died: the rows before it are kept
        print(f"bench cp: world size {world} stopped: {type(exc).__name__}: {str(exc)[:300]}",
              flush=True)


def _write_cp_csv(out: str, csv_path: Path, meta: dict) -> list[dict]:
    """The CSV of every row in the JSON lines ``out`` (this run's, all world sizes so far), with
    ``_cp_napkin``'s columns and ``meta``'s provenance; returns its rows."""
    import json

    with open(out) as f:
        raw = [json.loads(line) for line in f]
    rows = [{**{c: r.get(c, "") for c in CP_COLUMNS}, **meta}
            for r in _cp_napkin(raw, meta["gemm_roof_tflops"])]
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows


def _cp_napkin(rows: list[dict], tflops_roof: float) -> list[dict]:
    """The rows with vs_fla (FLA's ms over this row's, same world size), efficiency (t_1 / (n t_n),
    same impl), exchange_share, TFLOP/s over all GPUs and its % of n GEMM roofs."""
    ms = {(r["problem"], r["impl"], r["step"], r["world_size"]): r["ms"] for r in rows}
    out = []
    for r in rows:
        r = {**r}
        if r["ms"] != "":
            p = next(p for p in CP_PROBLEMS if p.label == r["problem"])
            flops = (useful_flops if r["step"] == "forward" else train_flops)(p)
            one = ms.get((r["problem"], r["impl"], r["step"], 1))
            fla = ms.get((r["problem"], "FLA", r["step"], r["world_size"]))
            exchange = r.get("exchange_ms", "")
            r.update(vs_fla=round(fla / r["ms"], 2) if fla else "",
                     efficiency=round(one / (r["world_size"] * r["ms"]), 3) if one else "",
                     exchange_share=round(exchange / r["ms"], 3) if exchange != "" else "",
                     tflops=round(flops / r["ms"] / 1e9, 1),
                     pct_gemm_roof=round(100 * flops / r["ms"] / 1e9 / (r["world_size"] * tflops_roof), 1))
        out.append(r)
    return out


def cp_main(commit: str, csv_path: Path | None = None, labels=None) -> int:
    """``bench --mode cp``: world sizes 1, 2, 4 (those this host has), each as spawned ranks; the CSV
    (``results/cp.csv`` or ``csv_path``) rewritten after every row, so a run cut short keeps what it
    timed."""
    if torch.cuda.device_count() < 1:
        print("bench: needs a CUDA GPU")
        return 1
    csv_path = csv_path or RESULTS / "cp.csv"
    labels = labels or [short_label(p.label) for p in CP_PROBLEMS]
    problems = [p for p in CP_PROBLEMS if short_label(p.label) in labels]
    if not problems:
        raise ValueError(f"bench: `problems` {labels} select none of "
                         f"{[short_label(p.label) for p in CP_PROBLEMS]}")
    _compile_cp_kernels(problems)
    tflops_roof, _ = roofs()
    torch.cuda.empty_cache()  # this process's memory on GPU 0 back to rank 0
    meta = dict(versions(commit), gemm_roof_tflops=round(tflops_roof))
    out = csv_path.with_suffix(".rows.jsonl")  # this run's rows as they come, until it ends
    out.unlink(missing_ok=True)
    for world in [w for w in (1, 2, 4) if w <= torch.cuda.device_count()]:
        _cp_world(world, labels, out, csv_path, meta)
    rows = _write_cp_csv(str(out), csv_path, meta) if out.exists() else []
    out.unlink(missing_ok=True)
    for r in rows:
        print(", ".join(f"{k}={r[k]}" for k in CP_COLUMNS))
    print(f"wrote {csv_path}")
    return 1 if not rows or any(r["ms"] == "" and r["impl"] == API_ROW for r in rows) else 0
