"""The workbench contract: how tests, the tour and the benchmark find and run kernel stages.

A stage is one frozen file ``kernels/<op>/sNN_<what_changed>.py`` in a checkout. It defines

    NEEDS                  tuple of what it needs to run: "cuda", "hopper" (an SM90 GPU), or the
                           name of an importable package (e.g. "fla")
    run(...)               same arguments and outputs as the op's reference, ``OPS[op][0]``
    kernel_source()        (TileLang stages) the CUDA C++ it generates for sm_90a, built on any machine
    SOURCE_MUST_CONTAIN    (TileLang stages) strings that source must contain: the instructions
                           the stage is about, e.g. ("wgmma",)

``MILESTONES`` is the course path: the stages the chapters teach, in order. Every other stage is
the lab log, an experiment on the way from one milestone to the next, listed with its measured
effect and verdict in ``kernels/lab_log.csv`` (``flashqla.lablog``, the book's Lab log page).

The installed library never imports ``kernels``: ``discover`` loads the stage files by path from
the checkout this package lives in, so the dependency points one way (kernels -> flashqla).
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from flashqla import reference
from flashqla.hopper import hopper_gpu_missing

# op name (a folder under kernels/) -> (the reference that defines what its stages compute,
#                                        the names of its outputs)
OPS = {
    "gdn_fwd": (reference.chunk_gated_delta_rule_ref, ("o", "final_state")),
    "chunk_local_cumsum": (reference.chunk_local_cumsum, ("g_cum",)),
    "chunk_kkt": (reference.chunk_kkt, ("A",)),
    "kkt_solve": (reference.kkt_solve, ("Ai",)),
    "chunk_w_u": (reference.chunk_w_u, ("w", "u")),
    "chunk_fwd_intra": (reference.chunk_fwd_intra, ("w", "u")),
    "gate_free_solve": (reference.gate_free_solve, ("Ab",)),
    "chunk_h": (reference.chunk_h, ("h", "v_new", "final_state")),
    "chunk_o": (reference.chunk_o, ("o",)),
    # the backward and its sub-steps
    "gdn_bwd": (reference.chunk_gated_delta_rule_bwd_ref, ("dq", "dk", "dv", "dg", "dbeta", "dh0")),
    "chunk_bwd_dv_local": (reference.chunk_bwd_dv_local, ("dv_local",)),
    "chunk_bwd_dhu": (reference.chunk_bwd_dhu, ("dh", "dh0", "dv2")),
    "chunk_bwd_dqkwg": (reference.chunk_bwd_dqkwg, ("dq", "dk", "dw", "dg")),
    "wy_bwd": (reference.wy_bwd, ("dk", "dv", "dbeta", "dg")),
    "chunk_local_reverse_cumsum": (reference.chunk_local_reverse_cumsum, ("dg",)),
    # decode: a few tokens a sequence, the state kept on chip
    "fused_recurrent": (reference.fused_recurrent_gated_delta_rule_ref, ("o", "final_state")),
}

# The course path: the stages the chapters teach, in the order a learner meets them. Every other
# stage is the lab log (the experiments that led from one milestone to the next), kept and tested
# but off the path; the book's Lab log page lists them.
MILESTONES = (
    "gdn_fwd.s01",  # the recurrence on the GPU: the state on chip, one token at a time
    "gdn_fwd.s02",  # the chunked form: a kernel per sub-step, matrix products on wgmma
    "gdn_fwd.s03",  # the state recurrence and the output fused: h and v_new stay on chip
    "gdn_fwd.s04",  # the gate-free reformulation: w and u never formed
    "gdn_fwd.s05",  # warp specialization: chain, scores, output and producer warpgroups
    "gdn_fwd.s06",  # AutoCP: long sequences cut into segments that run in parallel
    "gdn_fwd.s44",  # the final forward, the library's
    "gdn_bwd.s01",  # the chunked backward, a kernel per sub-step
    "gdn_bwd.s02",  # the fused backward, the library's
    "gdn_bwd.s03",  # backward AutoCP: the walks cut into segments, the library's where its rule splits
)

KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
_STAGE_FILE = re.compile(r"s(\d\d)_(\w+)\.py")
_loading = threading.RLock()  # a module is registered before it runs: others must not see it half-made


@dataclass(frozen=True)
class Stage:
    op: str
    number: int
    path: Path

    @property
    def id(self) -> str:
        """e.g. "chunk_kkt.s01" (also the NVTX range prefix)."""
        return f"{self.op}.s{self.number:02d}"

    @property
    def name(self) -> str:
        """e.g. "chunk_kkt/s01_wgmma"."""
        return f"{self.op}/{self.path.stem}"

    @property
    def milestone(self) -> bool:
        """Whether this stage is on the course path (``MILESTONES``) rather than in the lab log."""
        return self.id in MILESTONES

    @property
    def module(self):
        mod_name = f"kernels.{self.op}.{self.path.stem}"
        with _loading:
            if mod_name not in sys.modules:
                spec = importlib.util.spec_from_file_location(mod_name, self.path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module  # before exec: inspect.getsource (TileLang) looks it up
                spec.loader.exec_module(module)
            return sys.modules[mod_name]

    def missing(self) -> str | None:
        """None when this machine can run the stage, otherwise why not."""
        for need in self.module.NEEDS:
            if need == "cuda" and not torch.cuda.is_available():
                return "no CUDA GPU on this machine"
            if need == "hopper" and hopper_gpu_missing():
                return hopper_gpu_missing()
            if need not in ("cuda", "hopper") and importlib.util.find_spec(need) is None:
                return f"needs the `{need}` package"
        return None


def discover(kernels_dir: Path = KERNELS_DIR) -> list[Stage]:
    """Every stage file under kernels_dir, ordered by op then number. Empty outside a checkout."""
    stages = []
    for path in sorted(kernels_dir.glob("*/s[0-9][0-9]_*.py")):
        op = path.parent.name
        if op not in OPS:
            raise ValueError(f"stage {path}: its folder `{op}` is not an op in flashqla.stages.OPS")
        stages.append(Stage(op, int(_STAGE_FILE.fullmatch(path.name).group(1)), path))
    return sorted(stages, key=lambda s: (s.op, s.number))


@functools.cache  # stages built from others call this on every run: search the tree once
def load(op: str, number: int, kernels_dir: Path = KERNELS_DIR):
    """The module of stage ``op.sNN``, for stages built from earlier ones (e.g. gdn_fwd.s02 runs the
    chunk_kkt stage). Raises LookupError when the checkout has no such stage."""
    for stage in discover(kernels_dir):
        if (stage.op, stage.number) == (op, number):
            return stage.module
    raise LookupError(f"no stage {op}.s{number:02d} under {kernels_dir}")
