"""``raymq storage cut``: the operator's repair of a commit log with a bad frame (no Ray).
Owns the command's arguments, its confirmation and what it prints; the work is done by
``raymq.storage.repair``.

A shard refuses to start when a bad frame in its commit log is followed by valid
data, naming the segment file, the offset and this command.  The command shows
what a cut at that offset removes (bytes, later segment files, the records there
that still parse, by topic), asks (unless ``--yes``), then moves all of it into
``DIR/quarantine/`` and cuts the log.  Exit status: 0 cut, 1 refused or not
confirmed (nothing changed).
"""
from __future__ import annotations

import argparse

CUT_DESCRIPTION = """Cut a shard's commit log at a bad frame that valid data follows (the
shard refuses to start then, naming the offset and this command). Prints what the cut
removes -- bytes, later segment files, and the records there that still parse, by topic --
then asks for confirmation (or --yes). Everything removed is moved into
DIR/quarantine/cut-at-OFFSET/ (the segment's tail as <segment>.from-<file offset>, later
segment files whole); nothing is deleted. OFFSET must be a frame boundary reached through
good frames: a cut inside a frame or behind an earlier bad frame is refused, naming the
offset to use. Stop the shard first; on its next start recovery drops or rebuilds the
consume-queue entries past the new end. Needs no Ray."""


def add_parser(sub) -> None:
    """Register ``storage cut`` on the ``raymq`` command's subparsers."""
    storage = sub.add_parser("storage", help="offline repair of a shard's storage directory",
                             description="Offline repairs of a shard's storage directory "
                                         "(the shard stopped). Needs no Ray.")
    actions = storage.add_subparsers(dest="storage_cmd", required=True, metavar="ACTION")
    cut = actions.add_parser("cut", help="cut the commit log at a bad frame (the rest is "
                                         "moved to DIR/quarantine/)",
                             description=CUT_DESCRIPTION,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    cut.add_argument("directory", metavar="DIR",
                     help="the shard's storage directory (the one holding commitlog/)")
    cut.add_argument("--at", type=int, required=True, metavar="OFFSET", default=argparse.SUPPRESS,
                     help="physical offset to cut at, as the error message gives it")
    cut.add_argument("--yes", action="store_true", help="cut without asking")
    cut.set_defaults(func=cmd_cut)


def cmd_cut(args) -> int:
    from raymq.storage.repair import apply_cut, plan_cut
    plan = plan_cut(args.directory, args.at)
    print(plan.describe(), flush=True)
    if not args.yes and not _confirmed("Cut the commit log here? [y/N] "):
        print("not confirmed: nothing was changed")
        return 1
    quarantine = apply_cut(plan)
    print(f"cut: the commit log now ends at physical offset {plan.offset}; what followed is "
          f"in {quarantine}")
    print("start the shard: recovery brings the consume queues in line with the log")
    return 0


def _confirmed(prompt: str) -> bool:
    try:
        answer = input(prompt)
    except EOFError:
        answer = ""
    return answer.strip().lower() in ("y", "yes")
