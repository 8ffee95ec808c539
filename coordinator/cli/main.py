"""`coord`: the command line. Talks to coordd over its control socket.

The commands live by group (``cluster_commands``, ``job_commands``, ``setup_commands``), the parser in
``parser``, the calls to the daemon in ``client``.

Start-up time counts (`coord sync` on an unchanged tree is a fraction of a second):
asyncio and the rpc layer are imported only by the commands that need them.
"""

from __future__ import annotations

import sys

from coordinator.cli.client import EXIT_OK, EXIT_USAGE, CliError
from coordinator.cli.parser import build_parser, parse_command_line


def main(argv: list[str] | None = None) -> None:
    args = parse_command_line(argv)
    if not getattr(args, "func", None):
        build_parser().print_help()
        sys.exit(EXIT_USAGE)
    try:
        sys.exit(args.func(args))
    except CliError as exc:
        print(f"coord: {exc}", file=sys.stderr)
        sys.exit(exc.status)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `coord status | head`: the reader left, nothing to report
        sys.stderr.close()
        sys.exit(EXIT_OK)


if __name__ == "__main__":
    main()
