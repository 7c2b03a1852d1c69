"""Command line: ``python -m flashqla tour``, ``bench``, ``lab`` and ``lablog``."""

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from flashqla import bench, lablog, tour

CHECKOUT = Path(__file__).resolve().parent.parent  # the repository root, when installed editable
# A Jupyter config dir whose labconfig/default_setting_overrides.json makes "Jupytext Notebook" the
# default viewer of .py files (JupyterLab reads that file from every dir on JUPYTER_CONFIG_PATH).
LAB_CONFIG = CHECKOUT / "notebooks" / ".jupyter"


def checkout_missing(command: str, needs: Path) -> str | None:
    """None inside a checkout, else the message for a ``command`` run from an installed wheel."""
    if needs.exists():
        return None
    return (f"python -m flashqla {command}: this needs a checkout of the repository: it reads {needs}, "
            "which an installed wheel does not have. Clone the repository and install it with "
            "`python3 -m pip install -e .` from its root.")


def lab_command(args=()) -> tuple[list[str], dict, Path]:
    """(argv, environment, working directory) of ``jupyter lab`` over the chapters, opening the
    .py chapters as notebooks; ``args`` are passed on to JupyterLab."""
    env = dict(os.environ)
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        p for p in (str(LAB_CONFIG), env.get("JUPYTER_CONFIG_PATH")) if p)
    return [sys.executable, "-m", "jupyterlab", *args], env, CHECKOUT / "notebooks"


def lab(args) -> int:
    for module in ("jupyterlab", "jupytext"):
        if importlib.util.find_spec(module) is None:
            print(f"python -m flashqla lab: needs `{module}`; install the lab extra: "
                  "python3 -m pip install -e \".[lab]\"", file=sys.stderr)
            return 1
    argv, env, cwd = lab_command(args)
    return subprocess.call(argv, env=env, cwd=cwd)


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
    p_bench.add_argument("--mode", choices=("gdn_fwd", "gdn_train", "cp"), default="gdn_fwd",
                         help="the inference forward, a training step (forward + backward), or "
                              "context parallelism over this host's GPUs (default: %(default)s)")
    p_bench.add_argument("--heads", nargs="+", default=None, metavar="H,HV",
                         help="only these head configurations, e.g. 16,64 2,8 (default: all public)")
    p_bench.add_argument("--problems", nargs="+", default=None, metavar="LABEL",
                         help="only these problems, e.g. '(2, 8) 1x8192' (default: all)")
    p_bench.add_argument("--rows", nargs="+", default=None, metavar="ROW",
                         help="only these rows (the CSV's impl names) beside FLA and FlashQLA; the "
                              "CSV keeps the other rows of these problems (default: all)")
    p_bench.add_argument("--report", action="store_true",
                         help="time nothing: redraw the plots, the book's Results page and the README "
                              "summary from the committed CSVs (any machine)")
    sub.add_parser("lab", help="JupyterLab over the chapters, each opening as a notebook (needs the "
                               "lab extra); further arguments go to jupyter lab")
    sub.add_parser("lablog", help="write the book's Lab log page (book/lab_log.md) from kernels/lab_log.csv")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "lab":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "tour":
        return tour.main(args.plot, args.all)
    if args.command == "lablog":
        return lablog.main()
    if args.command == "lab":
        missing = checkout_missing("lab", CHECKOUT / "notebooks")
        if missing:
            print(missing, file=sys.stderr)
            return 2
        return lab(extra)
    missing = checkout_missing("bench", bench.RESULTS)
    if missing:
        print(missing, file=sys.stderr)
        return 2
    if args.report:
        if any(x is not None for x in (args.csv, args.heads, args.problems, args.rows)):
            parser.error("bench --report redraws from the committed CSVs: it takes no --csv, --heads, "
                         "--problems or --rows")
        bench.report()
        print(f"redrew the plots, {bench.RESULTS_PAGE.relative_to(CHECKOUT)} and the README summary "
              f"from {bench.RESULTS.relative_to(CHECKOUT)}/")
        return 0
    if args.mode == "cp":
        return bench.cp_main(args.commit or _commit(), args.csv, args.problems)
    heads = None if args.heads is None else [tuple(int(n) for n in h.split(",")) for h in args.heads]
    return bench.main(args.commit or _commit(), args.csv, heads, args.mode, args.problems, args.rows)


if __name__ == "__main__":
    sys.exit(main())
