#!/usr/bin/env python3
"""Runs the web page (web/) in headless Chromium and judges what it reports.

Serves a directory on 127.0.0.1, starts Chromium with WebGPU enabled and drives it over the
DevTools protocol on a pipe (--remote-debugging-pipe: no port, no extra packages), waits for the
page to set `window.kvattnDone`, reads `window.kvattnResult` (JSON) and the page's console, and
exits 0 only when:

- the browser offered WebGPU and the page opened an adapter;
- every verification case that ran passed (a case the adapter cannot run is reported as skipped
  with its reason, never as passed, and does not fail the run);
- at least one f32 and one f16 KV attention case ran and passed;
- the toy decoder's step ran and matched its CPU reference.

With --no-webgpu, Chromium starts with WebGPU switched off, and the run passes only when the page
says so (no adapter, no case run, an error naming the missing WebGPU).

Usage: scripts/web-test.py [--dir web] [--query "?kernels=paged"] [--timeout 900]
       [--json out.json] [--chromium /usr/bin/chromium] [--no-webgpu]
Standard library only.
"""

import argparse
import functools
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


class Handler(http.server.SimpleHTTPRequestHandler):
    extensions_map = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".wasm": "application/wasm",
        ".js": "text/javascript",
    }

    def log_message(self, format, *args):  # noqa: A002 (the base class's name)
        pass


def serve(directory):
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Handler, directory=directory)
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Browser:
    """Chromium with the DevTools protocol on fds 3 (its input) and 4 (its output)."""

    def __init__(self, chromium, url, profile, webgpu=True):
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()

        def child_fds():
            os.dup2(to_browser_r, 3)
            os.dup2(from_browser_w, 4)

        gpu_flags = [
            "--enable-unsafe-webgpu",
            "--enable-features=Vulkan",
            "--use-vulkan=native",
        ]
        flags = [
            "--headless=new",
            "--no-sandbox",
            *(gpu_flags if webgpu else ["--disable-features=WebGPU"]),
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--disable-quic",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
        ]
        # Chromium's own log goes to a file (a pipe nobody reads would fill and stall it).
        self.log = open(os.path.join(profile, "chromium.log"), "w+b")
        self.proc = subprocess.Popen(
            [chromium, *flags, url],
            # The child's fds 3 and 4 are made by dup2 after the fork; close_fds would close
            # them again.
            preexec_fn=child_fds,
            close_fds=False,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.buffer = b""
        self.next_id = 0
        self.events = []

    def _read_message(self):
        while b"\0" not in self.buffer:
            chunk = os.read(self.from_browser, 1 << 16)
            if not chunk:
                self.proc.wait(timeout=10)
                self.log.seek(0)
                err = self.log.read().decode(errors="replace")[-4000:]
                raise RuntimeError(f"Chromium closed the DevTools pipe; its stderr:\n{err}")
            self.buffer += chunk
        message, self.buffer = self.buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method, session=None, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read_message()
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def close(self):
        try:
            self.call("Browser.close")
        except Exception:  # noqa: BLE001 (closing anyway)
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def console_lines(events):
    lines = []
    for e in events:
        params = e.get("params", {})
        if e.get("method") == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params["args"])
            lines.append(f"console.{params['type']}: {text}")
        elif e.get("method") == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            text = details.get("exception", {}).get("description", details.get("text"))
            lines.append(f"exception: {text}")
    events.clear()
    return lines


def judge_without_webgpu(result):
    """The reasons a run without WebGPU fails: the page must say that WebGPU is missing."""
    problems = []
    if result.get("webgpu"):
        problems.append("the page reported WebGPU where the browser had none")
    if "no WebGPU" not in (result.get("error") or ""):
        problems.append(f"the page did not say that WebGPU is missing: {result.get('error')!r}")
    if result.get("cases"):
        problems.append("cases ran without WebGPU")
    return problems


def judge(result):
    """The reasons the run fails (empty: it passed)."""
    problems = []
    if not result.get("webgpu"):
        return [f"no WebGPU: {result.get('error', 'the page found no navigator.gpu')}"]
    if result.get("error"):
        problems.append(f"the page reported an error: {result['error']}")
    cases = result.get("cases", [])
    ran = [c for c in cases if c["status"] != "skipped"]
    for c in ran:
        if c["status"] != "pass":
            problems.append(f"{c['kernel']} {c['name']}: {c['status']} ({c.get('note')})")
    for fmt in ("f32", "f16"):
        if not any(
            c["status"] == "pass" and c["kernel"] in ("decode", "paged") and c["format"] == fmt
            for c in ran
        ):
            problems.append(f"no {fmt} KV attention case ran and passed")
    decode = result.get("decode")
    if not decode or not decode.get("passed"):
        problems.append(f"the toy decoder's step did not pass: {decode}")
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=os.path.join(os.path.dirname(__file__), "..", "web"))
    parser.add_argument("--query", default="")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", help="write the page's result here")
    parser.add_argument("--chromium", default="chromium")
    parser.add_argument("--no-webgpu", action="store_true", help="check the no-WebGPU message")
    args = parser.parse_args()

    server = serve(os.path.abspath(args.dir))
    url = f"http://127.0.0.1:{server.server_port}/index.html{args.query}"
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvattn-chromium-") as profile:
        browser = Browser(args.chromium, "about:blank", profile, webgpu=not args.no_webgpu)
        try:
            targets = browser.call("Target.getTargets")["targetInfos"]
            page = next(t for t in targets if t["type"] == "page")
            session = browser.call(
                "Target.attachToTarget", targetId=page["targetId"], flatten=True
            )["sessionId"]
            browser.call("Runtime.enable", session=session)
            browser.call("Page.enable", session=session)
            browser.call("Page.navigate", session=session, url=url)
            loaded = time.monotonic()
            result = None
            shown = 0
            while time.monotonic() - start < args.timeout:
                time.sleep(1)
                for line in console_lines(browser.events):
                    print(line, flush=True)
                state = browser.call(
                    "Runtime.evaluate",
                    session=session,
                    expression="JSON.stringify({done: window.kvattnDone === true, "
                    "rows: (window.kvattnProgress || 0), result: window.kvattnResult || null})",
                    returnByValue=True,
                )["result"].get("value")
                state = json.loads(state) if state else {}
                if state.get("rows", 0) > shown:
                    shown = state["rows"]
                    print(f"[{time.monotonic() - loaded:6.1f}s] {shown} cases done", flush=True)
                if state.get("done"):
                    result = json.loads(state["result"])
                    break
            for line in console_lines(browser.events):
                print(line)
        finally:
            browser.close()
    server.shutdown()
    if result is None:
        print(f"error: the page did not finish within {args.timeout:.0f} s", file=sys.stderr)
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print_summary(result)
    problems = judge_without_webgpu(result) if args.no_webgpu else judge(result)
    for p in problems:
        print(f"error: {p}", file=sys.stderr)
    print("web test:", "FAILED" if problems else "passed", f"({time.monotonic() - start:.0f} s)")
    return 1 if problems else 0


def print_summary(result):
    adapter = result.get("adapter") or {}
    browser = result.get("browser_adapter") or {}
    said = ", ".join(f"{k} {v}" for k, v in browser.items() if v)
    print(
        f"adapter: {adapter.get('name')!r} ({adapter.get('backend')}, "
        f"{adapter.get('device_type')}); the browser says: {said or 'nothing'}; "
        f"attention kernel: {result.get('attention_kernel')}"
    )
    print(f"kvattn uses: {', '.join(result.get('features', [])) or 'no optional feature'}")
    print(f"adapter features: {', '.join(result.get('adapter_features', []))}")
    for key, value in result.get("limits") or []:
        print(f"  {key}: {value}")
    print(f"{'kernel':<10} {'case':<58} {'result':<8} {'ms':>9}  note")
    for c in result.get("cases", []):
        ms = c.get("seconds", 0) * 1e3
        note = c.get("note") or ""
        print(f"{c['kernel']:<10} {c['name'][:58]:<58} {c['status']:<8} {ms:9.1f}  {note[:80]}")
    decode = result.get("decode")
    if decode:
        print(f"toy decoder step: {json.dumps(decode)}")
    for key in ("first_result_ms", "verify_seconds", "total_seconds"):
        if key in result:
            print(f"{key}: {result[key]}")


if __name__ == "__main__":
    sys.exit(main())
