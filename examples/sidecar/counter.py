#!/usr/bin/env python3
"""A sharded counter for natshard's HTTP sidecar (docs/SIDECAR.md); standard library only."""
import json, os, urllib.error, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
def state(method, url, body=None, etag=None):  # shardd's state API
    req = urllib.request.Request(url, body, {"If-Match": etag} if etag else {}, method=method)
    try:
        with urllib.request.urlopen(req) as r: return r.status, r.read(), r.headers["ETag"]
    except urllib.error.HTTPError as e: return e.code, e.read(), e.headers["ETag"]

class Counter(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: shardd reuses its connections
    def do_GET(self): self.answer(200, b"ok")  # GET /healthz
    def do_POST(self):  # POST /entities/{type}/{id}: a message to entity id, its body the increment
        _, kind, typ, id = self.path.split("/")
        by = self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"1"
        if kind != "entities": return self.answer(404, b"")  # /activate, /stop: not needed here
        if not by.isdigit(): return self.answer(400, b"not a number")
        url = f"{self.headers['Natshard-State-Url']}/state/{typ}/{id}"
        for _ in range(2):  # compare-and-set: on a conflict (412), read again and retry once
            code, data, etag = state("GET", url)
            count = (json.loads(data)["count"] if code == 200 else 0) + int(by)
            code, _, _ = state("PUT", url, json.dumps({"count": count}).encode(), etag)
            if code != 412: break
        self.answer(200 if code == 204 else 500, json.dumps({"count": count}).encode())
    def answer(self, code, data):
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers(); self.wfile.write(data)

ThreadingHTTPServer(("127.0.0.1", int(os.environ.get("PORT", "8080"))), Counter).serve_forever()
