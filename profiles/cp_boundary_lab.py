"""Lab: the boundary passes of flashqla.cp (``fwd.final_state``, ``bwd.initial_state_grad``) against
the whole library forward and backward of the same piece, on one GPU, unsplit, at the forced rule's
segment length and at fixed ones: which split makes the boundary pass cheapest (cp.py passes the
rule's forced L).

On the GPU machine, from the project root:

    python3 profiles/cp_boundary_lab.py

Prints, per head layout ((2, 8), which AutoCP splits, and (16, 64), whose heads fill the SMs unsplit)
and piece (one sequence, the pieces of 1 x 524288 on 2 and 4 ranks), the milliseconds (CUDA events around eager calls, median of 20 after 3 warm-up calls,
flashqla.timing.median_ms) of the library forward and backward, then per L: final_state (Z),
final_state with M, initial_state_grad. It writes no CSV."""

import torch

from flashqla import bwd, fwd
from flashqla.testing import Problem
from flashqla.timing import median_ms

PIECES = (262144, 131072)   # 1 x 524288 over 2 and 4 ranks
HEADS = ((2, 8), (16, 64))
LENGTHS = (False, True, 16, 32, 64, 128, 256)   # cp: False unsplit, True the forced rule's L


def main():
    device = torch.device("cuda")
    for (H, HV), n in ((heads, n) for heads in HEADS for n in PIECES):
        x = Problem(H, HV, (n,), varlen=False).inputs("cuda")
        a, h0 = [x[k] for k in ("q", "k", "v", "g", "beta")], x["initial_state"]
        do = torch.randn_like(x["v"])

        def ms(f):
            return round(median_ms(f, device, warmup=3, repeat=20), 3)
        print((H, HV), n, "forward", ms(lambda: fwd.forward(*a, None, h0, True, None)),
              "backward", ms(lambda: bwd.backward(*a, do, h0, None, h0, None)), flush=True)
        for cp in LENGTHS:
            print((H, HV), n, "L", cp, "final_state", ms(lambda: fwd.final_state(*a, None, h0, False, cp)),
                  "with M", ms(lambda: fwd.final_state(*a, None, h0, True, cp)),
                  "initial_state_grad", ms(lambda: bwd.initial_state_grad(*a, do, h0, None, cp)), flush=True)


if __name__ == "__main__":
    main()
