"""Command line: ``python -m flashqla tour``."""

import argparse
import sys
from pathlib import Path

from flashqla import tour


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashqla")
    sub = parser.add_subparsers(dest="command", required=True)
    p_tour = sub.add_parser("tour", help="run every stage this machine supports, check and time it")
    p_tour.add_argument("--plot", type=Path, default=Path("flashqla-tour.png"),
                        help="where to save the plot (default: %(default)s)")
    args = parser.parse_args(argv)
    return tour.main(args.plot)


if __name__ == "__main__":
    sys.exit(main())
