"""A fake inference server whose engine dies while its API server stays up (a hung engine).

Prints a saved crash log as the server printed it (without the journal's "Mon DD HH:MM:SS host
ident[pid]: " prefix), then vLLM's EngineDeadError, then keeps answering 500 on
http://127.0.0.1:PORT/health forever, as vLLM's API server does once its EngineCore is gone, so
systemd sees an active unit and never restarts it.

Usage: fake-hung-engine.py LOG PORT
"""

import re
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

JOURNAL_PREFIX = re.compile(r"^[A-Z][a-z]{2} [ 0-9]{2} [0-9:]{8} [^ ]+ [^ ]+\[[0-9]+\]: ")
# As vLLM prints it: the error line, then the traceback's last line (its frames left out).
ENGINE_DEAD = (
    "(APIServer pid=41207) ERROR 03-03 09:14:31 [async_llm.py:480] AsyncLLM output_handler"
    " failed.\n(APIServer pid=41207) ERROR 03-03 09:14:31 [async_llm.py:480]"
    " vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."
    " See stack trace (above) for the root cause."
)


class EngineDead(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(500)
        self.send_header("Content-Type", "text/plain")
        self.end_headers()
        self.wfile.write(b"EngineDeadError\n")

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep the journal to the engine's own lines


def main() -> None:
    log, port = sys.argv[1], int(sys.argv[2])
    with Path(log).open(encoding="utf-8") as lines:
        for line in lines:
            print(JOURNAL_PREFIX.sub("", line.rstrip("\n")), flush=True)
    print(ENGINE_DEAD, flush=True)
    HTTPServer(("127.0.0.1", port), EngineDead).serve_forever()


if __name__ == "__main__":
    main()
