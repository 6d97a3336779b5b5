"""The ``raymq`` command line."""
from __future__ import annotations

import argparse
import logging
import sys

DESCRIPTION = """RayMQ: a transactional message broker on Ray actors, feeding Spark through RayDP.

Commands:
  demo     run the main demonstration and print a consistency report
  bench    run benchmark suites; JSON lines on stdout, progress on stderr
"""


def _cmd_demo(args: argparse.Namespace) -> int:
    from cluster import storage_demo
    return storage_demo.run(args.data_dir)


def _cmd_bench(args: argparse.Namespace) -> int:
    from cluster import bench
    bench.run(args.suites, scale=args.scale, workdir=args.workdir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raymq", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the main demonstration",
                          description="Run the RayMQ demonstration end to end and print a "
                                      "consistency report; exit status 1 when inconsistent.")
    demo.add_argument("--data-dir", help="where to keep the demo's data (default: a new "
                                         "temporary directory)")
    demo.set_defaults(func=_cmd_demo)

    bench = sub.add_parser("bench", help="run benchmarks (JSON lines on stdout)",
                           description="Run benchmark suites. Each result is one JSON object "
                                       "per line on stdout: metric, value, unit, params. "
                                       "Figures with a baseline come with the baseline "
                                       "measured in the same run and their ratio.")
    from cluster.bench import SUITES
    bench.add_argument("suites", nargs="*", metavar="SUITE",
                       help=f"suites to run (default: all): {', '.join(SUITES)}")
    bench.add_argument("--scale", type=float, default=1.0,
                       help="multiply the message counts (e.g. 0.1 for a quick run)")
    bench.add_argument("--workdir", help="directory for benchmark data (default: system temp)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
