"""A FAKE Hugging Face Hub (not the Hub: the real one cannot be reached from these machines),
served for real over HTTP on 127.0.0.1 from model folders on disk, for `HF_ENDPOINT`. It answers
what `huggingface_hub.snapshot_download` asks: the revision info (`/api/models/<id>/revision/<rev>`)
and the files (`HEAD`/`GET /<id>/resolve/<rev>/<file>`). It can answer the first requests with an
error status (429 with `Retry-After`, 503), require a token (gated repositories) and counts every
request, so tests see retries and how many times each file was fetched."""
from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeHub:
    def __init__(self, repos: dict[str, Path], token: str | None = None, fail_first: int = 0,
                 fail_status: int = 429) -> None:
        self.repos = {rid: Path(p) for rid, p in repos.items()}
        self.token = token  # required on every request when set (a gated repository)
        self.fail_left = fail_first
        self.fail_status = fail_status
        self.requests: Counter = Counter()  # (method, path) -> count
        self.lock = threading.Lock()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def do_GET(self) -> None:
                hub.answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "FakeHub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def commit(self, repo_id: str) -> str:
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def file_count(self, name: str, method: str = "GET") -> int:
        return sum(n for (m, p), n in self.requests.items() if m == method and p.endswith("/" + name))

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = h.path.split("?")[0]
        with self.lock:
            self.requests[(h.command, path)] += 1
            fail = self.fail_left > 0
            self.fail_left -= int(fail)
        if fail:
            return self._send(h, self.fail_status, b"busy", {"Retry-After": "0"}, body)
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            return self._send(h, 401, b"gated", {"X-Error-Code": "GatedRepo",
                                                "X-Error-Message": "Access to this model is restricted"}, body)
        m = re.match(r"^/api/models/(.+)/revision/([^/]+)$", path)
        if m:
            repo = self.repos.get(m.group(1))
            if repo is None:
                return self._missing(h, body)
            info = {"id": m.group(1), "sha": self.commit(m.group(1)),
                    "siblings": [{"rfilename": f.name} for f in sorted(repo.iterdir()) if f.is_file()]}
            return self._send(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        m = re.match(r"^/api/models/(.+)/tree/([^/]+)$", path)
        if m:
            repo = self.repos.get(m.group(1))
            if repo is None:
                return self._missing(h, body)
            tree = [{"type": "file", "path": f.name, "size": f.stat().st_size,
                     "oid": hashlib.sha1(f.read_bytes()).hexdigest()} for f in sorted(repo.iterdir()) if f.is_file()]
            return self._send(h, 200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, body)
        m = re.match(r"^/(.+)/resolve/([^/]+)/(.+)$", path)
        if m and m.group(1) in self.repos and (self.repos[m.group(1)] / m.group(3)).is_file():
            data = (self.repos[m.group(1)] / m.group(3)).read_bytes()
            return self._send(h, 200, data, {"X-Repo-Commit": self.commit(m.group(1)),
                                             "ETag": '"' + hashlib.sha256(data).hexdigest() + '"',
                                             "Content-Type": "application/octet-stream"}, body)
        return self._missing(h, body)

    def _missing(self, h, body: bool) -> None:
        self._send(h, 404, b"not found", {"X-Error-Code": "RepoNotFound",
                                          "X-Error-Message": "Repository not found"}, body)

    @staticmethod
    def _send(h, status: int, data: bytes, headers: dict, body: bool) -> None:
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)
