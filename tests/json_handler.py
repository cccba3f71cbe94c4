"""A base for the tests' stand-in HTTP servers (a reward server's, an OpenAI-compatible judge's): JSON answers, no log lines."""

from http.server import BaseHTTPRequestHandler


class JSONHandler(BaseHTTPRequestHandler):
    def send_json(self, status: int, body: bytes) -> None:
        """`body` (JSON bytes) with `status`."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass
