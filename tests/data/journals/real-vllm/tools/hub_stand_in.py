"""A model hub stand-in on loopback: answers every request with one HTTP status, or never.

Usage: python3 hub_stand_in.py PORT 429|503|hang
"""
import http.server
import socketserver
import sys
import os
import time

port, mode = int(sys.argv[1]), sys.argv[2]


class Handler(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        if mode == "hang":
            time.sleep(3600)
            return
        status = int(mode)
        body = {429: b"Too Many Requests", 503: b"Service Unavailable"}.get(status, b"")
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
