#!/usr/bin/env python3
"""The app of integration.TestSidecar: entities that check the sidecar's
contract and report what broke it on GET /violations.

An entity keeps {"last": n} in shardd's state API: loaded at activation,
written (If-Match) at every message {"seq": n}. It records a violation when
one of its calls runs while another of its calls runs in this app (turn
taking), when a message or a stop reaches it while it is not active, when it
is activated twice, and when a message's seq is neither the next one nor
the last one again (a request sent again after a crash: answered without
applying it). Other messages (the test's single-owner probes) are answered
without state.

Usage: sidecar_app.py PORT
"""
import json, sys, threading, urllib.error, urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

lock = threading.Lock()
busy, active = set(), {}  # entity -> True while a call runs; entity -> (last, etag)
report = {"violations": [], "calls": 0, "activations": 0, "stops": 0, "applied": 0, "repeated": 0, "peak": 0}
running = 0


def violation(msg):
    with lock:
        if len(report["violations"]) < 50:
            report["violations"].append(msg)


def state(method, url, body=None, etag=None):
    req = urllib.request.Request(url, body, {"If-Match": etag} if etag else {}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read(), r.headers["ETag"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["ETag"]


def load(url):
    code, data, etag = state("GET", url)
    if code == 404:
        return 0, etag
    if code != 200:
        raise RuntimeError(f"state GET answered {code}: {data!r}")
    return json.loads(data)["last"], etag


class App(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def answer(self, code, data):
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/violations":
            with lock:
                return self.answer(200, json.dumps(report).encode())
        self.answer(200, b"ok")  # /healthz

    def do_POST(self):
        global running
        body = self.rfile.read(int(self.headers["Content-Length"] or 0))
        _, kind, typ, id = self.path.split("/")
        key = f"{typ}/{id}"
        with lock:
            if key in busy:
                report["violations"].append(f"{key}: {kind} while another call of it runs")
            busy.add(key)
            running += 1
            report["calls"] += 1
            report["peak"] = max(report["peak"], running)
        try:
            code, data = self.call(kind, key, body)
        except Exception as e:  # the state API of a killed shardd, say
            code, data = 500, repr(e).encode()
        finally:
            with lock:
                busy.discard(key)
                running -= 1
        self.answer(code, data)

    def call(self, kind, key, body):
        url = f"{self.headers['Natshard-State-Url']}/state/{key}"
        if kind == "activate":
            if key in active:
                violation(f"{key}: activated twice")
            active[key] = load(url)
            with lock:
                report["activations"] += 1
            return 200, b""
        if kind == "stop":
            if active.pop(key, None) is None:
                violation(f"{key}: stopped while not active")
            with lock:
                report["stops"] += 1
            return 200, b""
        if key not in active:
            violation(f"{key}: a message while not active")
            return 409, b"not active"
        try:
            seq = json.loads(body)["seq"]
        except (ValueError, KeyError, TypeError):
            return 200, b'{"probe":true}'
        last, etag = active[key]
        if seq == last:
            with lock:
                report["repeated"] += 1
            return 200, json.dumps({"last": last}).encode()
        if seq != last + 1:
            violation(f"{key}: message {seq} after {last}")
        code, data, etag = state("PUT", url, json.dumps({"last": seq}).encode(), etag)
        if code == 412:  # written elsewhere (a previous owner): read it again, once
            last, etag = load(url)
            active[key] = (last, etag)
            if seq == last:
                return 200, json.dumps({"last": last}).encode()
            if seq != last + 1:
                violation(f"{key}: message {seq} after {last} (read again after a conflict)")
            code, data, etag = state("PUT", url, json.dumps({"last": seq}).encode(), etag)
        if code != 204:
            return 500, f"state PUT answered {code}: {data!r}".encode()
        active[key] = (seq, etag)
        with lock:
            report["applied"] += 1
        return 200, json.dumps({"last": seq}).encode()


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), App).serve_forever()
