"""The `slurm-multi` command line.

`--help` and `--version` have no side effects: subcommands import what they need only when they run.
"""

from __future__ import annotations

import argparse
import sys

from slurm_multi import __version__


def _lab(args) -> int:
    from slurm_multi import lab

    try:
        if args.lab_command == "up":
            lab.up(args.nodes)
            return 0 if lab.status() else 1
        if args.lab_command == "down":
            lab.down()
            return 0
        return 0 if lab.status() else 1
    except lab.LabError as exc:
        print(f"slurm-multi lab {args.lab_command}: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slurm-multi",
        description="Run one containerized benchmark or training across several GPU nodes of a SLURM cluster.",
    )
    parser.add_argument("--version", action="version", version=f"slurm-multi {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    lab_parser = commands.add_parser("lab", help="the built-in lab cluster: real SLURM + Docker nodes on this machine")
    lab_commands = lab_parser.add_subparsers(dest="lab_command", metavar="ACTION", required=True)
    up = lab_commands.add_parser("up", help="start (or repair) the lab; idempotent")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes, 1-8 (default: 3)")
    lab_commands.add_parser("status", help="show sinfo and each lab daemon's state")
    lab_commands.add_parser("down", help="stop every lab daemon and undo what `up` added to /etc")
    lab_parser.set_defaults(handler=_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
