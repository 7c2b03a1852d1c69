"""gdn_fwd, stage 17: s15's pipeline with s16's kernel at 64 and 128 value columns a CTA, and the
widths' step costs measured again.

What changed from s15: only the ``Widths`` record that s15's pipeline runs on. At BV = 64 and 128
the fused kernel is s16's (O stored by TMA), at 32 it stays s12's; a chunk step at each width is
re-measured against s16's step at 64, on the single sequences of 32768 tokens of every public layout
(one wave at each width compared; ``profiles/results/kernel_width.csv``, 4 x H100, commit 51893cc):

    s12 at 32 / s16 at 64     0.81-0.87, geomean 0.85    (s14's table: 0.77, against s12 at 64)
    s16 at 128 / s16 at 64    1.29-1.44, geomean 1.37    (s14's table: 1.6, against s12 at 64)

Why: s16's kernel, timed alone in the same run, is 0.78-0.87x s14's at 128 and 0.84-0.99x s12's at
64 on every problem; at 32 it is 0.96-1.07x s12's (1.01x geomean on the problems where 32 is the
fastest width), so 32 stays s12's. The faster step at 64 moves the break-even points: 128 now wins
with fewer waves of CTAs (a step there is 1.37 of one at 64, not 1.6), and 32 wins less often. On
every one of the 40 problems of ``kernel_width.csv`` ``block_v`` with these steps picks the fastest
of s12 at 32, s16 at 64 and s16 at 128 (``tests/test_stages.py::test_width_rules_pick_the_fastest_measured``).

Measured effect (``python -m flashqla bench``, all 40 problems, 4 x H100, commit 188c42c): 0.98-1.10x
s15, geomean 1.03x (1.08-1.10x on 8 x 4096 of all layouts but (2, 8) and (16, 16), 1.04-1.06x on
the single sequences of (16, 48) and (16, 64)); 0.97-1.30x s13, geomean 1.06x. Against the peers in the
same run: 0.89-3.26x FLA (geomean 1.74x) and 0.45-1.40x FlashQLA, geomean 0.85x, faster on 6 of
38 problems (leaving out (2, 8) and (4, 16) 1 x 2048, where FlashQLA took 1.6-4.3x its time at 8192
tokens: the first problem its process ran). Still behind: few heads on long sequences (0.45-0.73x
on (2, 8), (4, 16) and (16, 16) from 32768 tokens, where FlashQLA's split beats AutoCP) and 8 x 4096
(0.84-0.94x; on (16, 64) the solve alone is 0.51 ms of 1.32, and it took 1.13x FlashQLA's
kkt_solve in ``kernel_split.csv``, one H200). It is the library's forward (``flashqla.fwd``).

Taught in: Lab log (book page lab_log); background in notebooks/05_warp_specialization.py.
"""

import functools

from flashqla import stages

NEEDS = ("hopper",)
# the kernels it may launch: wgmma and TMA (the warm-up's and the fused kernels' products and tiles,
# s16's O); warpgroup_reg_alloc / _dealloc: the fused kernels' role register budgets (setmaxnreg)
SOURCE_MUST_CONTAIN = ("wgmma", "tma_load", "tma_store", "warpgroup_reg_alloc", "warpgroup_reg_dealloc")

PIPELINE = stages.load("gdn_fwd", 15)
CHUNK_SIZE = PIPELINE.CHUNK_SIZE
WIDTHS = PIPELINE.Widths(kernels={32: ("gdn_fwd", 12), 64: ("gdn_fwd", 16), 128: ("gdn_fwd", 16)},
                         step={32: 0.85, 64: 1.0, 128: 1.37},  # the geomeans above
                         nvtx="gdn_fwd.s17")

block_v = functools.partial(PIPELINE.block_v, step=WIDTHS.step)
launch_width = functools.partial(PIPELINE.launch_width, step=WIDTHS.step)
kernel_source = functools.partial(PIPELINE.kernel_source, WIDTHS)
forward = functools.partial(PIPELINE.forward, widths=WIDTHS)
run = functools.partial(PIPELINE.run, widths=WIDTHS)
