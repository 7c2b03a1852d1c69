"""gate_free_solve, stage 09: the solve chosen by how many value heads a CTA holds: s08 (the
inverse's lower-left half on the tensor cores) with one or two, s06 (all on the CUDA cores, one
barrier a CTA) with three or four.

What changed from s06 and s08: nothing in either kernel; ``solve`` picks one per launch from
``cta_heads(H, HV)`` (the value heads of one key head that share its K K^T in a CTA).

Why (``profiles/results/solve.csv``, 4 x H100, commit d8516c1): s08 took 0.83-0.85x s06's time
with two heads a CTA ((16, 32)) and 0.93-0.94x with one ((16, 16)), but 1.02-1.16x with three or
four. With more heads a CTA, s06's Latin square keeps all four warps busy on the CUDA cores and
its 35 KiB let four CTAs share an SM; s08's tensor-core half needs 71 KiB (three CTAs an SM) and
waits on shared memory (Nsight Compute: ``short_scoreboard`` first). With one or two heads a CTA
s06 has less work to interleave, and s08's two 32 x 32 x 32 products replace 12 of the 16 block
products of each head.

Precision: s08's, where it runs (tf32 adds 1.5-2.9e-4 relative L2 to Ab against 1.6-1.9e-3 for
its bf16 store); s06's (s02's bits) elsewhere.

Measured effect: as chosen, s08's times on (16, 32) and (16, 16) and s06's elsewhere (the solve
lab above). In the forward (gdn_fwd.s22 against s21, which runs s05's solve; one H100, commit
e7a917b): 0.91-0.98x s21's time on the unsplit (16, 32) and (16, 16) problems but 1x2048. GPU
tests: the public shapes (commit 3e168be).

Taught in: Lab log (book page lab_log); background in notebooks/04_reformulation.py.
"""

from flashqla import stages

NEEDS = ("hopper",)
SOURCE_MUST_CONTAIN = ("wgmma", "float t_col[16]", "__shfl_xor_sync", "kTensorFloat32")

BALANCED = stages.load("gate_free_solve", 6)    # all on the CUDA cores
TENSOR_CORE = stages.load("gate_free_solve", 8)  # the lower-left half on the tensor cores
TENSOR_CORE_MAX_HEADS = 2                        # s08 wherever a CTA holds at most this many
CHUNK_SIZE = BALANCED.CHUNK_SIZE
cta_heads = BALANCED.cta_heads                   # the same grouping in both stages


def stage_for(H: int, HV: int):
    """The solve stage for H key heads and HV value heads: s08 at one or two heads a CTA, else s06."""
    return TENSOR_CORE if cta_heads(H, HV) <= TENSOR_CORE_MAX_HEADS else BALANCED


def kernel_source() -> str:
    """The CUDA C++ generated for sm_90a: s06's kernel, then s08's."""
    return BALANCED.kernel_source() + TENSOR_CORE.kernel_source()


def solve(k, beta, g_cum, cu_seqlens=None):
    """``solve`` of s06 or s08 (``stage_for``): k [B, T, H, K] bf16, beta, g_cum [B, T, HV] fp32 ->
    (ab [B, T, HV, 64] bf16, gated [NT, HV] int32)."""
    return stage_for(k.shape[2], beta.shape[2]).solve(k, beta, g_cum, cu_seqlens)


def run(k, beta, cu_seqlens=None, chunk_size=CHUNK_SIZE):
    """k [B, T, H, K] bf16, beta [B, T, HV] fp32 -> Ab [B, T, HV, 64] bf16 (s06's or s08's)."""
    return stage_for(k.shape[2], beta.shape[2]).run(k, beta, cu_seqlens, chunk_size)
