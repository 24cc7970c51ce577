"""A model hub stand-in on loopback: answers every request with one HTTP status, or never,
or resets the connection, or answers as the hub does for a repository it does not know.
Batch 4: `hang-files` answers the hub API (/api/...) at once with a repository's commit and
never answers a file request (HEAD/GET .../resolve/...): the API up, the file store hanging.

Usage: python3 hub_stand_in.py PORT 429|503|500|hang|hang-files|reset|repo-not-found
"""
import http.server
import socket
import socketserver
import struct
import sys
import os
import time

port, mode = int(sys.argv[1]), sys.argv[2]
BODIES = {
    429: b"Too Many Requests",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
}


class Handler(http.server.BaseHTTPRequestHandler):
    def handle(self) -> None:
        if mode != "reset":
            super().handle()
            return
        self.rfile.readline()  # the request line has arrived: now reset (RST, not FIN)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()

    def _answer(self) -> None:
        if mode == "hang":
            time.sleep(3600)
            return
        if mode == "hang-files":
            if not self.path.startswith("/api/"):
                time.sleep(3600)
                return
            body = b'{"id":"Qwen/Qwen2.5-0.5B-Instruct","sha":"' + b"a" * 40 + b'","siblings":[]}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            return
        if mode == "repo-not-found":  # what huggingface.co answers for an unknown repo id
            body = b'{"error":"Repository not found"}'
            self.send_response(401)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("X-Error-Message", "Repository not found")
            self.send_header("Content-Type", "application/json")
        else:
            status = int(mode)
            body = BODIES.get(status, b"")
            self.send_response(status)
            if status in (429, 503):
                self.send_header("Retry-After", os.environ.get("RETRY_AFTER", "2"))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = _answer


class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


Server(("127.0.0.1", port), Handler).serve_forever()
