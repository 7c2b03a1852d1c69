"""Command line: ``python -m flashqla tour``, ``python -m flashqla bench`` and ``python -m flashqla lablog``."""

import argparse
import subprocess
import sys
from pathlib import Path

from flashqla import bench, lablog, tour


def _commit() -> str:
    """The checkout's commit, or "unknown" (the GPU machine gets a copy of the tree without .git)."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).parent)
    return out.stdout.strip() or "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashqla")
    sub = parser.add_subparsers(dest="command", required=True)
    p_tour = sub.add_parser("tour", help="run the course path's stages this machine supports, check and time them")
    p_tour.add_argument("--plot", type=Path, default=Path("flashqla-tour.png"),
                        help="where to save the plot (default: %(default)s)")
    p_tour.add_argument("--all", action="store_true",
                        help="every stage under kernels/, not only the milestones")
    p_bench = sub.add_parser("bench", help="time every forward (or training-step) stage, FLA and FlashQLA (GPU)")
    p_bench.add_argument("--csv", type=Path, default=None,
                         help="results file (default: profiles/results/gdn_fwd.csv)")
    p_bench.add_argument("--commit", default=None, help="commit to record (default: git's HEAD)")
    p_bench.add_argument("--mode", choices=("gdn_fwd", "gdn_train"), default="gdn_fwd",
                         help="the inference forward or a training step, forward + backward "
                              "(default: %(default)s)")
    p_bench.add_argument("--heads", nargs="+", default=None, metavar="H,HV",
                         help="only these head configurations, e.g. 16,64 2,8 (default: all public)")
    p_bench.add_argument("--problems", nargs="+", default=None, metavar="LABEL",
                         help="only these problems, e.g. '(2, 8) 1x8192' (default: all)")
    p_bench.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                         help="only these rows (the CSV's impl names) beside FLA and FlashQLA; the "
                              "CSV keeps the other rows of these problems (default: all)")
    p_bench.add_argument("--report", action="store_true",
                         help="only redraw the plot and the README table from the CSV (any machine)")
    sub.add_parser("lablog", help="write the book's Lab log page (book/lab_log.md) from kernels/lab_log.csv")
    args = parser.parse_args(argv)
    if args.command == "tour":
        return tour.main(args.plot, args.all)
    if args.command == "lablog":
        return lablog.main()
    heads = None if args.heads is None else [tuple(int(n) for n in h.split(",")) for h in args.heads]
    return bench.main(args.commit or _commit(), args.csv, args.report, heads, args.mode, args.problems,
                      args.rows)


if __name__ == "__main__":
    sys.exit(main())
