"""A healthy fake vLLM server with request logging on: it logs each prompt it is sent.

Prints a banner and "Application startup complete." as vLLM's API server does, answers 200 on
/health, and for each POST to /v1/completions logs vLLM's INFO request line with the client's
prompt quoted as vLLM quotes it (Python's repr: a newline in the prompt stays `\\n`), then
answers 200. What a client sends reaches the journal; nothing else about the server changes.

Usage: fake-prompted-server.py --port PORT
"""

import json
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PREFIX = "(APIServer pid=41207) INFO 03-03 09:14:31"


class Server(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._answer(200 if self.path == "/health" else 404, b"")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        prompt = json.loads(body or b"{}").get("prompt", "")
        print(
            f"{PREFIX} [logger.py:41] Received request cmpl-{uuid.uuid4().hex}-0: "
            f"prompt: {prompt!r}, params: SamplingParams(n=1, max_tokens=16), "
            "prompt_token_ids: None, lora_request: None.",
            flush=True,
        )
        self._answer(200, b'{"choices": [{"text": "ok"}]}')

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # the request lines above are the log


def main() -> None:
    port = int(sys.argv[sys.argv.index("--port") + 1])
    print(f"{PREFIX} [api_server.py:1839] vLLM API server version 0.11.0", flush=True)
    server = ThreadingHTTPServer(("127.0.0.1", port), Server)
    print(f"{PREFIX} [launcher.py:37] Route: /v1/completions, Methods: POST", flush=True)
    print("(APIServer pid=41207) INFO:     Application startup complete.", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
