"""flashqla.cp: context parallelism across ranks. Spawned gloo ranks (2 and 4) run the reference
path over varlen mixes, both layouts; outputs, final states and every gradient equal a
single-process float64 run to 1e-10, and deliberately broken scans fail the same checks. The
kernel path's orchestration runs on CPU too, the reference put in the kernels' place. The
gpu-marked tests run the kernels over NCCL against the single-GPU library."""

import datetime
import faulthandler
import functools
import itertools
import json
import os
import re
import socket
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashqla
import flashqla.api
from flashqla import cp
from flashqla import reference as ref
from flashqla.testing import ROUNDING_FLOOR, TOLERANCE_FACTOR, Problem, cast_floats, rel_l2

F64 = torch.float64
api = flashqla.chunk_gated_delta_rule
TOL = 1e-10           # float64: the scan reorders sums, so not bitwise, but rounding-level
BROKEN = 1e-6         # a broken variant must miss by far more than rounding
NAMES = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _problem(lengths, seed=0, device="cpu"):
    """float64 inputs (one value head of each gate kind: g = 0, strong, ordinary decay), the
    same on every rank, and fixed upstream gradients do, dht, on ``device``."""
    x = cast_floats(Problem(1, 4, tuple(lengths), K=8, V=8).inputs(seed=seed), F64)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(x["v"].shape, generator=gen, dtype=F64)
    dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=F64)
    x = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    return x, do.to(device), dht.to(device)


def _run(x, do, dht, idx=None, **kw):
    """(o, final state, dq, dk, dv, dg, dbeta, dh0) of <do, o> + <dht, final state>, on the
    tokens ``idx`` (all without)."""
    inputs = {n: (x[n] if idx is None or n == "initial_state" else x[n][:, idx]).detach().requires_grad_()
              for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, s = api(**inputs, output_final_state=True, **kw)
    loss = (o * (do if idx is None else do[:, idx])).sum() + (s * dht).sum()
    return (o, s, *torch.autograd.grad(loss, list(inputs.values())))


def _shard(ctx):
    """The global token indices of this rank's shard, in local order."""
    return torch.cat([torch.arange(s * ctx.part_len, (s + 1) * ctx.part_len) for s in ctx.slots])


def _errors(lengths, layout, device="cpu"):
    """Per quantity: max |cp - single process| / max(1, max |single process|), the worst rank.
    Final states and dh0 are compared summed over ranks (each rank holds its sequences' rows)."""
    x, do, dht = _problem(lengths, device=device)
    want = _run(x, do, dht, cu_seqlens=x["cu_seqlens"])
    ctx = cp.build_cp_context(x["cu_seqlens"], layout=layout)
    idx = _shard(ctx).to(device)
    got = list(_run(x, do, dht, idx, cp_context=ctx))
    for i in (1, 7):                                              # final state, dh0
        if ctx.world_size > 1:
            dist.all_reduce(got[i])
    errs = []
    for i, (a, b) in enumerate(zip(got, want)):
        b = b if i in (1, 7) else b[:, idx]
        errs.append(((a - b).abs().max() / b.abs().max().clamp(min=1)).item())
    errs = torch.tensor(errs, dtype=F64, device=device)
    if ctx.world_size > 1:
        dist.all_reduce(errs, op=dist.ReduceOp.MAX)
    return dict(zip(NAMES, errs.tolist()))


# ---- broken scans, each of which a check must catch

def _fold_without_m(pairs):      # the forward scan adds the states and forgets the transitions
    return sum(z for z, _ in pairs)


def _fold_grads_with_m(pairs):   # the reverse scan applies M where M^T belongs
    dh = torch.zeros_like(pairs[0][0])
    for dz, m in reversed(pairs):
        dh = m @ dh + dz
    return dh


def _no_exchange(pairs):         # the ranks never combine: every shard starts from zero
    return torch.zeros_like(pairs[0][0])


KERNEL_CALLS = []    # the functions the "kernel path" variant called


def _as_kernel(fn, bounds: bool):
    """``fn`` (a reference pass) in a kernel's place: the local passes must get the kernels' int32
    device bounds (``bounds``), and it records its calls."""
    def run(*args):
        if bounds:
            assert args[-1].dtype == torch.int32 and args[-1].device == args[0].device, args[-1]
        KERNEL_CALLS.append(fn.__name__)
        return fn(*args)
    return run


# variant: ({module: {name: replacement}}, the quantities that stay exact). o and the final state
# are affine in v and h0 with coefficients that no state enters, so dv and dh0 never read the
# forward's states; dq reads the states, never the state gradients. "kernel path": the kernels'
# orchestration (device int32 bounds) with the reference in the kernels' place.
VARIANTS = {"exact": ({}, NAMES),
            "kernel path": ({flashqla.api: {"use_kernels": lambda q, v: True,
                                            "backward_unsupported": lambda H, HV: None,
                                            "_kernel_forward": _as_kernel(flashqla.api._reference, True),
                                            "_kernel_backward": _as_kernel(flashqla.api._reference_backward,
                                                                           True)},
                             cp: {"_kernel_final_state": _as_kernel(cp._reference_final_state, False),
                                  "_kernel_initial_state_grad": _as_kernel(cp._reference_initial_state_grad,
                                                                           False)}},
                            NAMES),
            "no M": ({cp: {"fold_states": _fold_without_m}}, ("dv", "dh0")),
            "M, not M^T": ({cp: {"fold_state_grads": _fold_grads_with_m}}, ("o", "final_state", "dq")),
            "no exchange": ({cp: {"fold_states": _no_exchange, "fold_state_grads": _no_exchange}}, ())}

# (world size, layout, lengths, variant): slots of 150 (2 ranks) or 100 tokens (4), 75 or 50 zigzag,
# so chunks of 64 and pieces cross slot boundaries off the chunk grid
CASES = {
    2: [("contiguous", (300,), "exact"),                  # one sequence spanning every rank
        ("contiguous", (40, 200, 60), "exact"),           # shorter than a shard, one crossing off the boundary
        ("contiguous", (100, 50, 150), "exact"),          # a sequence ending on the boundary
        ("contiguous", (150, 0, 150), "exact"),           # an empty sequence on the boundary
        ("zigzag", (300,), "exact"),
        ("zigzag", (40, 0, 200, 60), "exact"),
        ("contiguous", (40, 200, 60), "no exchange"),
        ("zigzag", (40, 0, 200, 60), "kernel path")],
    4: [("contiguous", (400,), "exact"),
        ("contiguous", (30, 330, 40), "exact"),           # spanning every rank, starting off the boundary
        ("contiguous", (100, 100, 5, 195), "exact"),
        ("zigzag", (400,), "exact"),
        ("zigzag", (30, 330, 40), "exact"),
        ("contiguous", (30, 330, 40), "kernel path"),
        ("contiguous", (400,), "no M"),
        ("contiguous", (400,), "M, not M^T")],
}


def _worker(rank, world, port, out):
    """One rank: every case of CASES[world] over gloo."""
    torch.set_num_threads(1)
    device = "cpu"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                      # auto's one-time reference warning
            for layout, lengths, variant in CASES[world]:
                patches = [(m, name, fn) for m, fns in VARIANTS[variant][0].items() for name, fn in fns.items()]
                saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
                for m, name, fn in patches:
                    setattr(m, name, fn)
                KERNEL_CALLS.clear()
                try:
                    results.append(_errors(lengths, layout, device))
                    if variant == "kernel path":  # every pass ran on them: the local ones here,
                        calls = set(KERNEL_CALLS)       # the boundary ones on some rank
                        assert {"_reference", "_reference_backward"} <= calls, calls
                        some = torch.tensor([fn in calls for fn in ("_reference_final_state",
                                                                    "_reference_initial_state_grad")])
                        dist.all_reduce(some, op=dist.ReduceOp.MAX)
                        assert some.all(), some
                finally:
                    for m, name, fn in saved:
                        setattr(m, name, fn)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_cases(world, tmp_path):
    out = tmp_path / "errors.json"
    mp.start_processes(_worker, args=(world, _free_port(), str(out)), nprocs=world,
                       join=True, start_method="spawn")
    _check_results(world, json.loads(out.read_text()))


def _check_results(world, results):
    """Every case's quantities within TOL; each broken scan misses on every quantity that reads
    it (only a sequence spanning 3 or more slots has an M to forget)."""
    for (layout, lengths, variant), errs in zip(CASES[world], results):
        label = f"{world} ranks, {layout}, {lengths}, {variant}"
        exact = VARIANTS[variant][1]
        assert all(errs[n] < TOL for n in exact), (label, errs)
        assert all(errs[n] > BROKEN for n in NAMES if n not in exact), (label, sorted(errs.items()))


@pytest.mark.parametrize("world", [2, 4])
def test_gloo_ranks_equal_one_process(world, tmp_path):
    _spawn_cases(world, tmp_path)


# ---- the kernels over NCCL, a GPU per rank, against the single-GPU library

GPU_HEADS = (2, 8)   # (H, HV), K = V = 128, bf16: the kernel path
# (layout, lengths): T = 4096, slots of 2048 (2 ranks) or 1024 (4), halves of that zigzag; the middle
# sequence starts and ends off every boundary and spans every rank (its middle slots need M)
GPU_CASES = {2: [("contiguous", (4096,)), ("contiguous", (300, 3000, 796)), ("zigzag", (300, 3000, 796))],
             4: [("contiguous", (300, 3000, 796)), ("zigzag", (4096,))]}


def _gpu_problem(lengths, device):
    """Kernel-dtype inputs (bf16 q, k, v; fp32 gates and initial state), do (bf16 values) and dht,
    the same on every rank."""
    x = Problem(*GPU_HEADS, tuple(lengths)).inputs(seed=3)
    gen = torch.Generator().manual_seed(4)
    do = torch.randn(x["v"].shape, generator=gen).to(torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen)
    x = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in x.items()}
    return x, do.to(device), dht.to(device)


def _bf16_reference(x, do, dht):
    """check_op's err_bf16 operand: the reference math run in bf16 on the global problem."""
    b = cast_floats(x, torch.bfloat16)
    o, s = ref.chunk_gated_delta_rule_ref(b["q"], b["k"], b["v"], b["g"], b["beta"], None, b["initial_state"],
                                          True, x["cu_seqlens"])
    grads = ref.chunk_gated_delta_rule_bwd_ref(b["q"], b["k"], b["v"], b["g"], b["beta"], do,
                                               dht.to(torch.bfloat16), None, b["initial_state"],
                                               x["cu_seqlens"])
    return (o, s, *grads)


def _gpu_errors(lengths, layout, device):
    """Per quantity: rel L2 (global, over every rank's shard) of cp against the float64 reference
    and against the single-GPU library, the library's against float64, check_op's bound
    2 max(err_bf16, 2^-9), whether two cp runs gave the same bits, and the host synchronizations
    that CUDA's sync debug mode saw in a third (warnings, not errors: a rank that raised alone would
    leave the others in a collective)."""
    x, do, dht = _gpu_problem(lengths, device)
    cu = x["cu_seqlens"]
    ref64 = _run(cast_floats(x, F64), do.double(), dht.double(), cu_seqlens=cu)
    lib = _run(x, do, dht, cu_seqlens=cu)
    ctx = cp.build_cp_context(cu, layout=layout)
    idx = _shard(ctx).to(device)
    runs = [list(_run(x, do, dht, idx, cp_context=ctx)) for _ in range(2)]
    same = torch.tensor([all(torch.equal(a, b) for a, b in zip(*runs))], device=device, dtype=torch.int32)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            _run(x, do, dht, idx, cp_context=ctx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message)[:200] for w in seen      # not the mode's own "prototype feature" notice
             if "called a synchronizing CUDA operation" in str(w.message)]
    got = runs[0]
    for i in (1, 7):                                              # final state, dh0: rows summed
        dist.all_reduce(got[i])
    sums = []                                                     # ||cp - ref||^2, ||ref||^2 per ref
    for i, a in enumerate(got):
        for r in (ref64, lib):
            b = r[i] if i in (1, 7) else r[i][:, idx]
            d, n = (a.double() - b.double()).square().sum(), b.double().square().sum()
            sums += [d, n] if i not in (1, 7) or ctx.rank == 0 else [0 * d, 0 * n]  # state rows once
    sums = torch.stack(sums)
    dist.all_reduce(sums)
    sums = sums.view(len(NAMES), 2, 2).tolist()
    bf16 = _bf16_reference(x, do, dht)
    out = {}
    for i, name in enumerate(NAMES):
        base = rel_l2(bf16[i], ref64[i])
        out[name] = dict(vs_f64=(sums[i][0][0] / sums[i][0][1]) ** 0.5,
                         vs_library=(sums[i][1][0] / sums[i][1][1]) ** 0.5,
                         library_vs_f64=rel_l2(lib[i], ref64[i]),
                         bound=TOLERANCE_FACTOR * max(base, ROUNDING_FLOOR))
    out["bitwise"], out["host_syncs"] = bool(same.item()), syncs
    return out


def _gpu_worker(rank, world, port, out):
    """One rank: every case of GPU_CASES[world] over NCCL, the kernels on a GPU per rank."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")               # NVLink multicast off
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                      # the float64 run's reference warning
            results = [_gpu_errors(lengths, layout, f"cuda:{rank}") for layout, lengths in GPU_CASES[world]]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


GRAPH_CASE = ("contiguous", (300, 3000, 796))   # a sequence spanning the two ranks, one on each


def _graph_worker(rank, world, port, out):
    """One rank: GRAPH_CASE's cp call, forward and backward, captured in one CUDA graph after two
    eager calls on a side stream (torch.cuda.graph's warm-up); rank 0 writes each rank's verdict:
    None when the replay gave the eager call's bits, else what went wrong. Each rank appends every
    step it reaches to ``<out>.rank<r>`` (``_graph_step``), and a rank still running after
    GRAPH_RANK_S writes every thread's stack there and exits: the test then says where it stopped."""
    log = open(f"{out}.rank{rank}", "a")
    faulthandler.dump_traceback_later(GRAPH_RANK_S, exit=True, file=log)
    step = functools.partial(_graph_step, log)
    step("started")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")               # NVLink multicast off
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"), timeout=datetime.timedelta(seconds=120))
    step("process group")
    try:
        layout, lengths = GRAPH_CASE
        x, do, dht = _gpu_problem(lengths, f"cuda:{rank}")
        ctx = cp.build_cp_context(x["cu_seqlens"], layout=layout)
        idx = _shard(ctx).to(x["q"].device)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for i in range(2):
                    eager = _run(x, do, dht, idx, cp_context=ctx)
                    step(f"eager call {i + 1}")
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            step("eager calls finished on the device")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _run(x, do, dht, idx, cp_context=ctx)
            step("captured")
            graph.replay()
            torch.cuda.synchronize()
            step("replayed")
            verdict = None if all(torch.equal(a, b) for a, b in zip(captured, eager)) else \
                "the replay differs from the eager call"
        except Exception as exc:  # noqa: BLE001 -- reported by the test, not raised on one rank alone
            verdict = f"{type(exc).__name__}: {exc}"[:300]
        step(f"verdict {verdict}")
        verdicts = [None] * world
        dist.all_gather_object(verdicts, verdict)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(verdicts, f)
    finally:
        faulthandler.cancel_dump_traceback_later()
        dist.destroy_process_group()
        log.close()


GRAPH_RANK_S = 150   # loading the kernels from TileLang's cache and both calls take well under this


def _graph_step(log, what: str) -> None:
    log.write(f"{time.strftime('%X')} {what}\n")
    log.flush()


def _rank_problems(lengths, layout, world):
    """The kernel problems the ranks of a case run: every shard (varlen, its pieces, the local
    passes) and every piece alone (varlen False, the boundary passes), as Problems, to compile
    before the ranks start."""
    bounds = [0, *itertools.accumulate(lengths)]
    slots = world * (2 if layout == "zigzag" else 1)
    L = bounds[-1] // slots
    shards = {r: [] for r in range(world)}
    for s in range(slots):
        r = s if s < world else 2 * world - 1 - s
        shards[r] += [min(b, (s + 1) * L) - max(a, s * L) for a, b in zip(bounds, bounds[1:])
                      if min(b, (s + 1) * L) > max(a, s * L)]
    return ([Problem(*GPU_HEADS, tuple(p)) for p in shards.values()]
            + [Problem(*GPU_HEADS, (n,), varlen=False) for p in shards.values() for n in p])


@pytest.fixture(scope="module")
def warm_kernels():
    """Every kernel the GPU cases launch, compiled on threads in this process (TileLang's disk
    cache then serves the ranks): a training step of each global problem and shard, the boundary
    passes of each piece."""
    from flashqla import bwd, fwd
    from flashqla.testing import run_on_threads

    def step(p):
        x = p.inputs("cuda")
        inputs = [x[n] for n in ("q", "k", "v", "g", "beta")]
        if not p.varlen:  # a piece: Z and M, dZ
            fwd.final_state(*inputs, None, x["initial_state"], True)
            bwd.initial_state_grad(*inputs, torch.zeros_like(x["v"]), x["initial_state"], None)
            return
        leaves = [x[n].requires_grad_() for n in ("q", "k", "v", "g", "beta", "initial_state")]
        o, s = api(**x)
        torch.autograd.grad(o.float().sum() + s.sum(), leaves)

    problems = {Problem(*GPU_HEADS, lengths) for cases in GPU_CASES.values() for _, lengths in cases}
    problems |= {p for w, cases in GPU_CASES.items() for layout, lengths in cases
                 for p in _rank_problems(lengths, layout, w)}
    run_on_threads([functools.partial(step, p) for p in sorted(problems, key=lambda p: p.label)])
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.parametrize("world", [pytest.param(w, marks=pytest.mark.skipif(
    torch.cuda.device_count() < w, reason=f"needs {w} GPUs")) for w in (2, 4)])
def test_nccl_kernel_ranks_match_one_gpu(world, tmp_path, warm_kernels):
    """The kernels over NCCL: outputs, final states and every gradient within check_op's bound of
    the float64 reference and of the single-GPU library, bitwise the same run to run, and no host
    synchronization in a call (rank 0's)."""
    out = tmp_path / "errors.json"
    mp.start_processes(_gpu_worker, args=(world, _free_port(), str(out)), nprocs=world, join=True,
                       start_method="spawn")
    failures = []                  # every case printed and checked before the test fails
    for (layout, lengths), errs in zip(GPU_CASES[world], json.loads(out.read_text())):
        label = f"{world} ranks, {layout}, {lengths}"
        print(label, json.dumps(errs))
        bitwise, syncs = errs.pop("bitwise"), errs.pop("host_syncs")
        bad = {n: e for n, e in errs.items() if max(e["vs_f64"], e["vs_library"]) > e["bound"]}
        failures += [(label, "beyond the bound", bad)] if bad else []
        failures += [] if bitwise else [(label, "two runs differ")]
        failures += [(label, "host syncs", syncs)] if syncs else []
    assert not failures, failures


@pytest.mark.gpu
@pytest.mark.hopper
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_kernel_ranks_replay_in_a_cuda_graph(tmp_path, warm_kernels):
    """The cp call over NCCL, forward and backward, captured in one CUDA graph on each of two ranks:
    the replay gives the eager call's outputs and gradients bit for bit. The ranks get
    GRAPH_RANK_S and a margin; a rank that has not finished by then is killed, and the test fails
    with each rank's steps (and stacks, where its own watchdog wrote them)."""
    out = tmp_path / "graph.json"
    ranks = mp.start_processes(_graph_worker, args=(2, _free_port(), str(out)), nprocs=2, join=False,
                               start_method="spawn")
    deadline, failure = time.monotonic() + GRAPH_RANK_S + 30, "killed at the deadline"
    try:
        while not ranks.join(timeout=5):
            if time.monotonic() > deadline:
                for proc in ranks.processes:
                    proc.kill()
                break
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:  # its watchdog's exit, say
        failure = f"{type(exc).__name__}: {exc}"[:2000]
    steps = {r: (tmp_path / f"graph.json.rank{r}").read_text() if (tmp_path / f"graph.json.rank{r}").exists()
             else "(no step: the rank never started its worker)" for r in range(2)}
    assert out.exists(), f"the ranks did not finish ({failure}); their steps:\n{steps[0]}\n---\n{steps[1]}"
    assert json.loads(out.read_text()) == [None, None], steps


# ---- one rank, in process

@pytest.mark.parametrize("layout", cp.LAYOUTS)
def test_one_rank_is_the_plain_call(layout):
    """World size 1 (no torch.distributed): the plain varlen call, zigzag's two slots included."""
    errs = _errors((40, 0, 200, 60), layout)
    assert max(errs.values()) < TOL, errs


def test_one_rank_bitwise_contiguous():
    x, do, dht = _problem((70, 1, 64, 65))
    want = _run(x, do, dht, cu_seqlens=x["cu_seqlens"])
    got = _run(x, do, dht, cp_context=cp.build_cp_context(x["cu_seqlens"]))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_one_rank_keywords_dtypes_and_inference():
    """FLA's keywords, bf16 inputs and a call without autograd take the cp path as they take the
    plain one (world size 1: the same reference computation), gradients reaching A_log and dt_bias."""
    x = Problem(2, 4, (70, 1, 64, 65), K=8, V=8).inputs()          # bf16 q, k, v; fp32 gates
    x["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous()
    cu = x.pop("cu_seqlens")
    gate = {"A_log": torch.linspace(-1, 0.5, 4), "dt_bias": torch.linspace(0, 1, 4)}
    kw = dict(use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, use_gate_in_kernel=True,
              state_v_first=True)
    outs = []
    for extra in (dict(cu_seqlens=cu), dict(cp_context=cp.build_cp_context(cu))):
        leaves = {n: t.detach().requires_grad_() for n, t in {**x, **gate}.items()
                  if isinstance(t, torch.Tensor) and t.is_floating_point()}
        call = {**x, **leaves, **kw, **extra}
        o, s = api(**call)
        grads = torch.autograd.grad(o.float().sum() + s.sum(), list(leaves.values()))
        with torch.no_grad():
            o_inference, _ = api(**call)
        assert torch.equal(o_inference, o)
        outs.append((o, s, *grads))
    assert outs[1][0].dtype == torch.bfloat16 and outs[1][1].shape == (4, 4, 8, 8)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_sequence_transition_carries_the_initial_state():
    """final(h0) - final(0) = M h0 on the naive recurrence, and a wrong M (one chunk missing) fails."""
    x = cast_floats(Problem(1, 4, (150, 1, 64), K=8, V=8).inputs(), F64)
    plain = {**x, "initial_state": None}
    _, with_h0 = ref.naive_recurrent_gated_delta_rule(**x)
    _, from_zero = ref.naive_recurrent_gated_delta_rule(**plain)
    M = ref.sequence_transition(x["k"], x["g"], x["beta"], x["cu_seqlens"])
    assert (with_h0 - from_zero - M @ x["initial_state"]).abs().max() < 1e-12
    short = torch.tensor([0, 86, 87, 151])                      # each sequence one chunk shorter
    M_short = ref.sequence_transition(x["k"][:, :151], x["g"][:, :151], x["beta"][:, :151], short)
    assert (with_h0 - from_zero - M_short @ x["initial_state"]).abs().max() > 1e-3


# ---- bad contexts and calls

def test_build_errors_are_named():
    cu = torch.tensor([0, 100, 300])
    for kwargs, message in [
        (dict(layout="ring"), "`layout` must be 'contiguous' or 'zigzag'; got 'ring'"),
        (dict(cu_seqlens_cpu=torch.tensor([0, 300])), "`cu_seqlens_cpu` must be an int32 or int64 CPU tensor"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            cp.build_cp_context(cu, **kwargs)
    for bad, message in [(cu.float(), "`cu_seqlens` must be an int32 or int64 tensor"),
                         (torch.tensor([0, 200, 100]), "`cu_seqlens` must be non-decreasing"),
                         (torch.tensor([0]), "`cu_seqlens` must be 1-D with at least 2 entries"),
                         (torch.tensor([0, 0]), "`cu_seqlens` must be ending at a positive multiple of 1")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            cp.build_cp_context(bad)
    with pytest.raises(ValueError, match=re.escape("`cu_seqlens` must be ending at a positive multiple of 2 "
                                                   "tokens (the zigzag layout")):
        cp.build_cp_context(torch.tensor([0, 301]), layout="zigzag")
    with pytest.raises(ValueError, match=re.escape("`group` must be None unless torch.distributed is "
                                                   "initialized")):
        cp.build_cp_context(cu, object())


def test_call_errors_are_named():
    x, _, _ = _problem((40, 200, 60))
    ctx = cp.build_cp_context(x["cu_seqlens"])
    plain = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    for change, message in [
        (dict(cp_context=object()), "`cp_context` must be None or a context from flashqla.cp.build_cp_context"),
        (dict(cu_seqlens=x["cu_seqlens"].clone()), "`cu_seqlens` must be None or cp_context.cu_seqlens"),
        (dict(initial_state=x["initial_state"][:2]), "`initial_state` must be (3, 4, 8, 8) with cp_context"),
        ({n: t[:, :150] for n, t in plain.items()}, "`q` must be this rank's shard [1, 300, H, K]"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            api(**{**plain, "cp_context": ctx, **change})
    api(**plain, cp_context=ctx, cu_seqlens=ctx.cu_seqlens, cu_seqlens_cpu=ctx.cu_seqlens_cpu)


def test_backend_kernels_raises_where_they_cannot_run(monkeypatch):
    """FLASHQLA_BACKEND=kernels: a cp_context call the kernels cannot run (float64 on the CPU)
    raises; reference runs it without a warning."""
    x, _, _ = _problem((60,))
    plain = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    ctx = cp.build_cp_context(x["cu_seqlens"])
    monkeypatch.setenv("FLASHQLA_BACKEND", "kernels")
    with pytest.raises(RuntimeError, match=re.escape("FLASHQLA_BACKEND=kernels, but the kernels cannot run "
                                                     "this call")):
        api(**plain, cp_context=ctx)
    monkeypatch.setenv("FLASHQLA_BACKEND", "reference")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api(**plain, cp_context=ctx)
