"""Chapter 5's exercises: a barrier's wait parity, the shared-memory budget of gdn_fwd.s05, and
register budgets that a warp-specialized kernel may legally set.

- ``check_wait_parity`` runs a producer and a consumer over a ring of tile slots, each slot with a
  "full" and an "empty" mbarrier modeled as the hardware counts phases, with the learner's parity
  on every wait, in two schedules (the producer eager, then the consumer eager). It fails on a wait
  that passes before its chunk's arrivals are in (the consumer reads a stale or overwritten slot)
  and on a deadlock.
- ``check_smem_bytes`` compares the learner's count with the shared buffers that s05's kernel
  allocates, its shapes evaluated at several tile widths, stage and slot counts.
- ``check_register_budgets`` compiles the learner's kernel for sm_90a and reads every
  ``tl::warpgroup_reg_alloc<n>`` / ``_dealloc<n>`` (PTX ``setmaxnreg.inc`` / ``.dec``) of the
  generated CUDA against the rules of ``tests/test_stages.py``.
"""

from __future__ import annotations

import re

from flashqla.exercises import report, run_answer
from flashqla.exercises.ch04 import allocations
from flashqla.stages import load

WARPGROUP = 128
REGISTER_FILE = 65536          # 32-bit registers per SM, shared by the CTA's threads


# ---- 1. the wait parity
class _Barrier:
    """An mbarrier as the hardware counts it: a phase completes when its arrivals are in; a wait
    with parity P passes when the phase of parity P is the one that completed last, i.e. when the
    current (incomplete) phase's parity differs from P. The first wait with parity 1 passes at once."""

    def __init__(self):
        self.completed = 0

    def passes(self, parity) -> bool:
        return self.completed % 2 != parity


def _ring(wait_parity, slots: int, chunks: int, producer_first: bool) -> str | None:
    """Producer and consumer over ``slots`` slots for ``chunks`` chunks; None, or what went wrong."""
    full, empty = [_Barrier() for _ in range(slots)], [_Barrier() for _ in range(slots)]
    data = [None] * slots                  # the chunk whose tiles a slot holds
    pc = cc = 0                            # the next chunk of the producer and of the consumer
    while cc < chunks:
        moved = False
        for role in (("producer", "consumer") if producer_first else ("consumer", "producer")):
            if role == "producer":
                while pc < chunks:
                    s, parity = pc % slots, wait_parity(pc, slots, True)
                    if parity not in (0, 1):
                        return f"wait_parity({pc}, {slots}, True) returned {parity!r}, not 0 or 1"
                    if not empty[s].passes(parity):
                        break
                    if data[s] is not None and data[s] >= cc:   # its previous chunk is not consumed yet
                        return (f"with {slots} slot(s), the producer's wait for chunk {pc} on empty[{s}] "
                                f"(parity {parity}) passed while chunk {data[s]} was still unread in slot "
                                f"{s}: it overwrote it")
                    data[s] = pc
                    full[s].completed += 1
                    pc, moved = pc + 1, True
            else:
                while cc < chunks:
                    s, parity = cc % slots, wait_parity(cc, slots, False)
                    if parity not in (0, 1):
                        return f"wait_parity({cc}, {slots}, False) returned {parity!r}, not 0 or 1"
                    if not full[s].passes(parity):
                        break
                    if data[s] != cc:
                        held = "nothing yet" if data[s] is None else f"chunk {data[s]}'s tiles"
                        return (f"with {slots} slot(s), the consumer's wait for chunk {cc} on full[{s}] "
                                f"(parity {parity}) passed while slot {s} held {held}")
                    empty[s].completed += 1
                    cc, moved = cc + 1, True
        if not moved:
            s = cc % slots
            return (f"with {slots} slot(s), deadlock: the consumer waits for chunk {cc} on full[{s}] with "
                    f"parity {wait_parity(cc, slots, False)} and the producer for chunk {pc} on "
                    f"empty[{pc % slots}] with parity {wait_parity(pc, slots, True) if pc < chunks else '-'}")
    return None


def check_wait_parity(wait_parity):
    """``wait_parity(c, slots, previous_user) -> 0 or 1``: the parity that chunk c passes to
    ``T.barrier_wait`` on its slot's barrier (slot c % slots): for the arrivals of chunk c itself
    (``previous_user=False``: the tiles have landed) or of chunk c - slots (``True``: the slot's
    previous user released it)."""
    name = "the wait parity"
    for slots in (1, 2, 3):
        for producer_first in (True, False):
            wrong, err = run_answer(name, _ring, wait_parity, slots, 4 * slots + 3, producer_first)
            if err or wrong:
                return report(name, [err or wrong])
    return report(name, [])


# ---- 2. the shared-memory budget of gdn_fwd.s05
SMEM_CONFIGS = (dict(BV=64, NUM_STAGES=2, NUM_HANDOFF=2),      # s05 as built
                dict(BV=32, NUM_STAGES=2, NUM_HANDOFF=2),
                dict(BV=64, NUM_STAGES=3, NUM_HANDOFF=2),
                dict(BV=64, NUM_STAGES=2, NUM_HANDOFF=1),
                dict(BV=128, NUM_STAGES=1, NUM_HANDOFF=1))


def s05_smem_bytes(**config) -> int:
    """The bytes of the shared buffers that gdn_fwd.s05's kernel allocates, its shapes evaluated
    with ``config`` (BV, NUM_STAGES, NUM_HANDOFF, ...) instead of the stage's constants."""
    s05 = load("gdn_fwd", 5)
    return sum(b for _, kind, _, _, b in allocations(s05, s05.fused_h_o_kernel, **config) if kind == "shared")


def check_smem_bytes(smem_bytes):
    """``smem_bytes(C, K, BV, stages, handoff) -> int``: the shared memory of s05's buffers."""
    name = "s05's shared-memory budget"
    s05 = load("gdn_fwd", 5)
    C, K = s05.CHUNK_SIZE, s05.DEFAULT_SHAPE["K"]
    for config in SMEM_CONFIGS:
        want = s05_smem_bytes(**config)
        got, err = run_answer(name, smem_bytes, C, K, config["BV"], config["NUM_STAGES"], config["NUM_HANDOFF"])
        if err:
            return report(name, [err])
        if got != want:
            diff = got - want if isinstance(got, int) else None
            return report(name, [
                f"with BV = {config['BV']}, {config['NUM_STAGES']} tile stage(s) and {config['NUM_HANDOFF']} "
                f"hand-off slot(s) your count is {got!r} bytes, the kernel allocates {want}"
                + (f" ({diff:+d} bytes = {diff / 1024:+.1f} KiB)" if diff is not None else "")])
    return report(name, [])


# ---- 3. register budgets that setmaxnreg may set
def budget_failures(source: str) -> list[str]:
    """What is illegal in the register budgets of a kernel's generated CUDA (empty: all legal)."""
    launch = re.search(r"__launch_bounds__\((\d+)", source)
    if launch is None:
        return ["no __launch_bounds__ in the generated CUDA"]
    threads = int(launch.group(1))
    start = min(255, REGISTER_FILE // threads) // 8 * 8      # what ptxas gives each thread at launch
    budgets = [(way, int(n)) for way, n in re.findall(r"warpgroup_reg_(alloc|dealloc)<(\d+)>", source)]
    failures = []
    if len(budgets) != threads // WARPGROUP:
        failures.append(f"{len(budgets)} setmaxnreg for {threads // WARPGROUP} warpgroups: every role sets one")
    for way, n in budgets:
        if n % 8 or not 24 <= n <= 256:
            failures.append(f"warpgroup_reg_{way}<{n}>: a budget is a multiple of 8 in [24, 256]")
        if way == "alloc" and n < start:
            failures.append(f"warpgroup_reg_alloc<{n}> (setmaxnreg.inc) below the {start} registers each of "
                            f"the {threads} threads starts with: .inc may only raise the count (an illegal "
                            f"instruction on the GPU); lower it with .dec (T.set_max_nreg(n, 0))")
        if way == "dealloc" and n > start:
            failures.append(f"warpgroup_reg_dealloc<{n}> (setmaxnreg.dec) above the {start} registers a thread "
                            f"starts with: .dec may only lower the count; raise it with .inc (T.set_max_nreg(n, 1))")
    pool = threads // WARPGROUP * start
    if sum(n for _, n in budgets) > pool:
        failures.append(f"the budgets add up to {sum(n for _, n in budgets)} registers a thread over the "
                        f"warpgroups, more than the pool of {pool} ({threads // WARPGROUP} x {start}): an .inc "
                        f"would wait forever for registers nobody frees")
    return failures


def check_register_budgets(roles_kernel):
    """``roles_kernel() -> T.prim_func``: compiled for sm_90a; its setmaxnreg budgets must be legal."""
    name = "register budgets"

    def compile_it():
        from flashqla.hopper import compile_hopper

        return compile_hopper(roles_kernel()).get_kernel_source()

    source, err = run_answer(name, compile_it)
    if err:
        return report(name, [f"the kernel did not compile: {err}"])
    return report(name, budget_failures(source))
