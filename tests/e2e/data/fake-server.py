"""A fake inference server for the end-to-end tests, driven by its arguments.

  fake-server.py [--log FILE] [--spam N] [--fatal-if PATH] [--serve] [--term-status S] [--exit S]
                 [--bind PORT] [--host ADDRESS]

Prints N filler lines (--spam), then a saved log as the server printed it (without the
journal's "Mon DD HH:MM:SS host ident[pid]: " prefix), then either exits with --exit (default 1)
or, with --serve (or when the --fatal-if file is absent), logs that it serves and stays up until
SIGTERM, which it traps and answers with --term-status (143: a server that exits 128+15).
With --bind it first binds 0.0.0.0:PORT as a server does: taken, Python's own traceback
(`OSError: [Errno 98] Address already in use`) and exit 1; free, it serves on it. With --host it
binds that address instead (and says so as vLLM does, in its "non-default args"): one this host
does not have is `OSError: [Errno 99] Cannot assign requested address`.
"""

import argparse
import re
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

JOURNAL_PREFIX = re.compile(r"^[A-Z][a-z]{2} [ 0-9]{2} [0-9:]{8} [^ ]+ [^ ]+\[[0-9]+\]: ")
SERVING = "(APIServer pid={pid}) INFO:     Uvicorn running on http://0.0.0.0:8000"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--log")
    parser.add_argument("--spam", type=int, default=0)
    parser.add_argument("--fatal-if")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--term-status", type=int, default=0)
    parser.add_argument("--exit", type=int, default=1)
    parser.add_argument("--bind", type=int)
    parser.add_argument("--host")
    args = parser.parse_args()
    pid = __import__("os").getpid()
    print(f"(APIServer pid={pid}) INFO vLLM API server version 0.33.0", flush=True)
    if args.host is not None:
        print(
            f"(APIServer pid={pid}) INFO [utils.py:233] non-default args: "
            f"{{'host': '{args.host}', 'port': {args.bind or 0}}}",
            flush=True,
        )
    if args.bind is not None:
        server = socket.socket(socket.AF_INET6 if ":" in (args.host or "") else socket.AF_INET)
        try:
            server.bind((args.host or "0.0.0.0", args.bind))
        except OSError:
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
            return 1
        server.listen()
        args.serve = True
    for n in range(args.spam):
        print(f"(APIServer pid={pid}) INFO loading shard {n}", flush=True)
    crash = args.fatal_if is None or Path(args.fatal_if).exists()
    if args.log and crash:
        for line in Path(args.log).read_text(encoding="utf-8").splitlines():
            print(JOURNAL_PREFIX.sub("", line), flush=True)
    if crash and not args.serve:
        return args.exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(args.term_status))
    print(SERVING.format(pid=pid), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
