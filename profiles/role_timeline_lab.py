"""Lab: inside the fused forward kernel, what each warp role spends its cycles on, per chunk.

On the GPU machine, from the project root, after ``. .gpu-bundle/setup.sh``:

    python3 profiles/role_timeline_lab.py measure OUT.csv [--events EVENTS.csv] [--commit SHA]
        [--problems LABEL ...]

For each problem, the library's forward (``flashqla.chunk_gated_delta_rule``) runs once with its
fused kernel (``fused_state_value_kernel`` at BV 64 or 128, ``fused_reform_kernel`` at 16 or 32)
rebuilt with clock stamps: TileLang's CUDA post-processing hook (``tilelang.register_cuda_postproc``)
edits the generated source, and one thread of each warpgroup (its thread 0) writes ``clock64()``
with a site number before and after every mbarrier wait and named barrier (``__sync_thread_partial``),
after every mbarrier arrive, and around every wgmma batch (``warpgroup_arrive`` to
``warpgroup_wait<0>``). The stamps ride behind the final-state buffer: the kernel's ``ht`` is a view
of a larger one. The stamped forward's o and final state must equal the library's bit for bit (an
assert), so the stamps moved no result. Every other kernel is the library's; the cache is off only
for the stamped compile.

Between two stamps a role is, by the first one's site:

    wait bar_X      blocked on mbarrier bar_X (another role's hand-off, or the producer's tiles)
    named barrier   blocked on the warpgroup's own barrier (TileLang's sync around shared copies)
    gemm            a wgmma batch, issue to completion
    work            everything else: elementwise math, register <-> shared copies, address work

``OUT.csv``: one row per (problem, role, activity): cycles per chunk (the sum over the CTA's
stamps divided by its chunks, mean over CTAs), its share of the role's span, and the span per chunk
in cycles and ns (the SM clock from ``%globaltimer`` against ``clock64`` over each CTA), plus
``flashqla.bench.versions``' provenance. ``--events``: one CTA's raw stamps for a window of chunks
(role, site, label, cycle), for the timeline plot in notebooks/05_warp_specialization.py.
``report IN.csv`` prints the table on any machine. ``--stage N`` stamps a gdn_fwd stage's fused kernel
instead of the library's: the wide kernel of s34, s35 and s38-s41, the narrow one of s45 (their
forwards take the compiled fused kernel as ``fused``). ``results/role_timeline.csv`` and ``role_timeline_events.csv`` hold eleven runs: on
one H100 the library (s33's kernels) at 94d60f0, s34 at dac1807, s35 at 45722b0, the library (s37's
kernels; its (16, 64) rows named gdn_fwd.s37) and s38 at 924ffec, s41 at f7b01a9, the library at BV
128 ((16, 16) and (16, 64) 8x4096, s34's kernel) at 2066b86, and on (2, 8) 1x2048 the library (s33's
narrow kernel still; these rows replace 94d60f0's of that problem) and s45 at 4f33b5e; on one H200
s39 at d03048d and s40 at a96646a. The stages' docstrings and the README's gaps quote them.
"""

import argparse
import csv
import re
import sys
from pathlib import Path

from flashqla.testing import Problem

PROBLEMS = [Problem(16, 64, (8192,)), Problem(16, 48, (8192,)), Problem(2, 8, (2048,)), Problem(8, 32, (8192,)),
            Problem(16, 16, (4096,) * 8), Problem(16, 64, (4096,) * 8)]  # the last two at BV 128
ROLES = {"gdn_fused_state_value_kernel": ("state", "value", "scores/output", "producer"),
         "gdn_fused_ws_lean_kernel": ("chain", "scores", "output", "producer"),
         "gdn_fused_state_in_registers_kernel": ("chain", "scores", "output", "producer"),  # gdn_fwd.s39
         "gdn_fused_chain_on_w_kernel": ("chain", "scores", "output", "producer")}  # gdn_fwd.s45
WARPGROUP = 128
STAMPS_PER_CHUNK = 96        # room per (CTA, warpgroup) and chunk: every role stamps fewer
SITE_BITS = 48               # a stamp: site << 48 | (cycle or ns, 48 bits)
CLOCK_SITE, TIMER_SITE = (1 << 16) - 1, (1 << 16) - 2  # the first and last stamps: clock64, %globaltimer
EVENT_WINDOW = (8, 14)       # the chunks of one CTA that --events keeps

STAMP_DEFINE = """
#define FQ_STAMP_ANY(site, value) do { if ((threadIdx.x & 127) == 0) { \\
  fq_stamps[fq_n++] = ((unsigned long long)(site) << 48) | ((unsigned long long)(value) & 0xFFFFFFFFFFFFULL); } } while (0)
#define FQ_STAMP(site) do { if (fq_n < fq_cap - 2) { FQ_STAMP_ANY(site, clock64()); } } while (0)
__device__ __forceinline__ unsigned long long fq_globaltimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
"""


def instrument(code: str, state_elems: int, cap: int) -> tuple[str, list[tuple[str, str]]]:
    """``code`` (TileLang's CUDA source of one fused kernel) with clock stamps; the sites as
    (kind, name) in site order. ``state_elems``: HV K V, the floats of one sequence's final state,
    after which (num_seqs of them) the stamps start; ``cap``: stamps per (CTA, warpgroup)."""
    lines = code.split("\n")
    head = next((i for i, s in enumerate(lines) if "__global__ void __launch_bounds__" in s), None)
    if head is None or not lines[head].rstrip().endswith("{"):
        raise ValueError("instrument: `code` must hold a __launch_bounds__ kernel whose signature line opens its body")
    cta = "((int64_t)((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 4 + (threadIdx.x >> 7))"
    out = lines[:head + 1] + [
        f"  const int fq_cap = {cap};",
        f"  unsigned long long* fq_stamps = reinterpret_cast<unsigned long long*>(ht + (int64_t)num_seqs * "
        f"{state_elems}) + {cta} * fq_cap;",
        "  int fq_n = 0;",
        f"  FQ_STAMP_ANY({TIMER_SITE}, fq_globaltimer());",
        f"  FQ_STAMP_ANY({CLOCK_SITE}, clock64());"]
    sites = []

    def stamp(kind, name, indent):
        sites.append((kind, name))
        out.append(f"{indent}FQ_STAMP({len(sites) - 1});")

    depth = 1
    for i in range(head + 1, len(lines)):
        s = lines[i]
        indent = s[:len(s) - len(s.lstrip())]
        wait = re.match(r"\s*(bar_\w+)\[.*\]\.wait\(", s)
        arrive = re.match(r"\s*(bar_\w+)\[.*\]\.arrive\(\);", s)
        sync = "tl::__sync_thread_partial(" in s
        depth += s.count("{") - s.count("}")
        if depth == 0:  # the kernel's closing brace: the last stamps, clock64 then %globaltimer
            out += [f"  FQ_STAMP_ANY({CLOCK_SITE}, clock64());", f"  FQ_STAMP_ANY({TIMER_SITE}, fq_globaltimer());"]
            out += lines[i:]
            break
        # before the line: where a role starts to block, or issues a wgmma batch
        if wait:
            stamp("wait", wait.group(1), indent)
        elif sync:
            stamp("sync", "named barrier", indent)
        elif s.strip() == "tl::warpgroup_arrive();":
            stamp("gemm", "gemm", indent)
        out.append(s)
        # after it: where the block or the batch ends, or a hand-off is signalled
        if wait or sync or s.strip() == "tl::warpgroup_wait<0>();":
            stamp("done", wait.group(1) if wait else "named barrier" if sync else "gemm", indent)
        elif arrive:
            stamp("arrive", arrive.group(1), indent)
    else:
        raise ValueError("instrument: the kernel's closing brace was not found")
    if len(sites) >= TIMER_SITE:
        raise ValueError(f"instrument: {len(sites)} sites do not fit 16 bits")
    return STAMP_DEFINE + "\n".join(out), sites


def activities(words, sites):
    """One warpgroup's stamps (uint64 words, in order) -> ({activity: cycles}, span cycles,
    span ns, [(site, cycle)])."""
    words = [int(w) & ((1 << 64) - 1) for w in words if w]  # torch's int64 reads sites >= 2^15 as negative
    stamps = [(w >> SITE_BITS, w & ((1 << SITE_BITS) - 1)) for w in words]
    timers = [t for s, t in stamps if s == TIMER_SITE]
    clocks = [t for s, t in stamps if s == CLOCK_SITE]
    events = [(s, t) for s, t in stamps if s < CLOCK_SITE - 1]
    assert len(timers) == 2 and len(clocks) == 2, "a warpgroup's first or last stamp is missing: cap too small"
    spent = {}
    for (s, t), (_, t_next) in zip([(CLOCK_SITE, clocks[0])] + events, events + [(CLOCK_SITE, clocks[1])]):
        kind, name = sites[s] if s < len(sites) else ("start", "")
        key = {"wait": f"wait {name}", "sync": "named barrier", "gemm": "gemm"}.get(kind, "work")
        spent[key] = spent.get(key, 0) + t_next - t
    return spent, clocks[1] - clocks[0], timers[1] - timers[0], events


def stamped_kernel(builder, shape, num_chunks, pass_configs):
    """``builder(*shape)`` compiled with stamps (and ``pass_configs``): a callable with the kernel's
    arguments, keeping each call's stamps (uint64, [CTAs * 4, cap]) in ``.stamps``; and its sites."""
    import tilelang
    import torch

    from flashqla.hopper import compile_hopper, dependent_launch

    H, HV, K, V, BV = shape[:5]  # a sixth entry: the wide kernel's wy_stored (gdn_fwd.s37)
    cap = STAMPS_PER_CHUNK * (num_chunks + 2)
    found = {}

    def post(code, target):
        if "gdn_fused" not in code:
            return code
        found["code"], found["sites"] = instrument(code, HV * K * V, cap)
        return found["code"]

    tilelang.disable_cache()
    tilelang.register_cuda_postproc(post)
    try:
        kernel = compile_hopper(dependent_launch(builder(*shape)), pass_configs)
    finally:
        tilelang.register_cuda_postproc(lambda code, target: code)
        tilelang.enable_cache()
    assert "sites" in found, "the post-processing hook never saw the fused kernel"

    class Stamped:
        sites = found["sites"]

        def __call__(self, *args):
            ht = args[-1]
            ctas = (V // BV) * HV * ht.shape[0]
            big = torch.zeros(ht.numel() * 4 + ctas * 4 * cap * 8, dtype=torch.uint8, device=ht.device)
            view = big[:ht.numel() * 4].view(torch.float32).view(ht.shape)
            kernel(*args[:-1], view)
            ht.copy_(view)
            self.stamps = big[ht.numel() * 4:].view(torch.int64).view(ctas * 4, cap).cpu()

    return Stamped()


def measure(out: Path, events_out: Path | None, commit: str, labels=(), stage: int | None = None) -> int:
    import torch

    import flashqla
    from flashqla import bench, fwd, stages

    meta = dict(bench.versions(commit), method="clock64 stamps of warpgroup thread 0, one eager forward")
    rows, event_rows = [], []
    for p in PROBLEMS:
        if labels and bench.short_label(p.label) not in labels:
            continue
        x = p.inputs("cuda", seed=0)
        cap_chunks = -(-max(p.lengths) // 64)
        used = {}
        if stage is None:  # the library: its _compiled hands out the stamped fused kernel
            want = flashqla.chunk_gated_delta_rule(**x)
            library = fwd._compiled

            def patched(builder, *shape):
                if builder in (fwd.fused_state_value_kernel, fwd.fused_reform_kernel):
                    if (builder, shape) not in used:
                        used[builder, shape] = stamped_kernel(builder, shape, cap_chunks, fwd.PASS_CONFIGS[builder])
                    return used[builder, shape]
                return library(builder, *shape)

            fwd._compiled = patched
            try:
                got = flashqla.chunk_gated_delta_rule(**x)
                torch.cuda.synchronize()
            finally:
                fwd._compiled = library
        else:  # a gdn_fwd stage from s34 on: its forward takes the compiled fused kernel as ``fused``
            mod = stages.load("gdn_fwd", stage)
            want = mod.forward(**x)

            def stamped_fused(*shape):
                narrow = shape[4] < 64
                if narrow and not hasattr(mod, "fused_reform_kernel"):
                    raise ValueError(f"{p.label}: gdn_fwd.s{stage} has no narrow kernel of its own; got BV {shape[4]}")
                builder = mod.fused_reform_kernel if narrow else mod.fused_state_value_kernel
                if (builder, shape) not in used:
                    used[builder, shape] = stamped_kernel(builder, shape, cap_chunks, mod.S27.FUSED_CONFIGS)
                return used[builder, shape]

            got = mod.forward(**x, fused=stamped_fused)
            torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), \
            f"{p.label}: the stamped kernel changed the forward's result"
        ((builder, shape), stamped), = used.items()
        name = builder(*shape).attrs["global_symbol"] + "_kernel"  # TileLang's name for the kernel
        impl = "API" if stage is None else f"gdn_fwd.s{stage}"
        roles, BV = ROLES[name], shape[4]
        totals = {}
        for cta in range(stamped.stamps.shape[0] // 4):
            per_role = [activities(stamped.stamps[cta * 4 + wg].tolist(), stamped.sites) for wg in range(4)]
            # the CTA's chunks: the producer waits once a chunk for a free tile stage
            n = sum(stamped.sites[s] == ("wait", "bar_tiles_empty") for s, _ in per_role[3][3])
            if n == 0:  # an empty segment row (AutoCP)
                continue
            t0 = min(ev[0][1] for _, _, _, ev in per_role if ev)  # the CTA's first stamp after its start
            per = per_role[0][1] / n
            for role, (spent, span, ns, ev) in zip(roles, per_role):
                t = totals.setdefault(role, {"span": 0, "ns": 0, "ctas": 0, "spent": {}})
                t["span"] += span / n
                t["ns"] += ns / n
                t["ctas"] += 1
                for key, cycles in spent.items():
                    t["spent"][key] = t["spent"].get(key, 0) + cycles / n
                if events_out is not None and t["ctas"] == 1:  # the first CTA with chunks
                    lo, hi = EVENT_WINDOW
                    for s, c in ev:
                        if lo * per <= c - t0 < hi * per:
                            kind, site = stamped.sites[s]
                            event_rows.append(dict(problem=p.label, impl=impl, kernel=name, block_v=BV, role=role, site=s,
                                                   kind=kind, name=site, cycle=c - t0, **meta))
        for role in roles:
            t = totals[role]
            span = t["span"] / t["ctas"]
            for key, cycles in sorted(t["spent"].items(), key=lambda kv: -kv[1]):
                rows.append(dict(problem=p.label, impl=impl, kernel=name, block_v=BV, role=role, activity=key,
                                 cycles_per_chunk=round(cycles / t["ctas"]),
                                 share=round(cycles / t["ctas"] / span, 3),
                                 span_cycles_per_chunk=round(span), span_ns_per_chunk=round(t["ns"] / t["ctas"]),
                                 **meta))
        print(report_rows([r for r in rows if r["problem"] == p.label]), flush=True)
        for path, got_rows in ((out, rows), (events_out, event_rows)):
            if path is not None and got_rows:  # after every problem: a cut-short run keeps its rows
                with open(path, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(got_rows[0]))
                    writer.writeheader()
                    writer.writerows(got_rows)
    return 0


def report_rows(rows) -> str:
    """Per problem, implementation and role: the span per chunk, then each activity's cycles and share."""
    lines = []
    for label, impl in dict.fromkeys((r["problem"], r["impl"]) for r in rows):
        mine = [r for r in rows if (r["problem"], r["impl"]) == (label, impl)]
        lines.append(f"{label}, {impl}: {mine[0]['kernel']} at BV {mine[0]['block_v']}, cycles per chunk")
        for role in dict.fromkeys(r["role"] for r in mine):
            rr = [r for r in mine if r["role"] == role]
            lines.append(f"  {role:14s} span {rr[0]['span_cycles_per_chunk']:>6} ({rr[0]['span_ns_per_chunk']} ns): "
                         + ", ".join(f"{r['activity']} {r['cycles_per_chunk']} ({float(r['share']):.0%})" for r in rr))
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("measure", "report"))
    ap.add_argument("csv", type=Path)
    ap.add_argument("--events", type=Path, default=None, help="one CTA's stamps for a window of chunks")
    ap.add_argument("--problems", nargs="*", default=[], help='only these, e.g. "(16, 64) 1x8192"')
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--stage", type=int, default=None, help="a gdn_fwd stage (34 on) instead of the library")
    a = ap.parse_args()
    if a.mode == "report":
        with open(a.csv) as f:
            print(report_rows(list(csv.DictReader(f))))
        sys.exit(0)
    sys.exit(measure(a.csv, a.events, a.commit, set(a.problems), a.stage))
