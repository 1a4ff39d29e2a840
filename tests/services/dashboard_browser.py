"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: open a Ray dashboard's Serve page of
one application, wait until it lists given deployments, save a screenshot. Used by
tests/services/test_dashboard_browser.py; also by hand against a running `treeserve serve`:

    python tests/services/dashboard_browser.py http://127.0.0.1:8265 treeserve /tmp/serve.png

The DevTools protocol needs only a WebSocket (aiohttp, which Ray's dashboard depends on already), so no browser
driver package is involved.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

# A closed network otherwise turns Chromium's background fetches (updates, sync, QUIC probes) into refused
# connections and stalls; no sandbox because tests may run as root in a container; a fresh profile every run.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--window-size=1500,1000")
TOKEN_COOKIE = "ray-authentication-token"  # what the dashboard's /api/authenticate sets (ray 2.60)


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class ServePage:
    text: str  # the page's visible text once every wanted name appeared
    screenshot: Path
    seconds: float


def ray_token(dashboard_url: str) -> str | None:
    """The token the dashboard asks for when Ray's token authentication is on (~/.ray/auth_token, or
    $RAY_AUTH_TOKEN), else None."""
    with urllib.request.urlopen(f"{dashboard_url}/api/authentication_mode", timeout=10) as reply:
        if json.load(reply).get("authentication_mode") != "token":
            return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    return path.read_text().strip()


def _devtools_port(profile: Path, process: subprocess.Popen, timeout_s: float) -> int:
    """Chromium writes the port it chose into DevToolsActivePort of its profile."""
    deadline = time.monotonic() + timeout_s
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"chromium exited with status {process.returncode}")
        if marker.is_file() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.2)
    raise TimeoutError(f"chromium did not open its DevTools port within {timeout_s:.0f} s")


async def _drive(ws_url: str, url: str, cookie: dict | None, wanted: list[str], screenshot: Path,
                 timeout_s: float) -> str:
    import aiohttp

    ids = iter(range(1, 1_000_000))

    async with aiohttp.ClientSession() as session, session.ws_connect(ws_url, max_msg_size=0) as ws:
        async def call(method: str, **params):
            call_id = next(ids)
            await ws.send_json({"id": call_id, "method": method, "params": params})
            while True:
                message = await ws.receive_json(timeout=60)
                if message.get("id") == call_id:
                    if "error" in message:
                        raise RuntimeError(f"{method}: {message['error']}")
                    return message.get("result", {})

        if cookie is not None:
            await call("Network.setCookie", **cookie)
        await call("Page.enable")
        await call("Page.navigate", url=url)
        deadline = time.monotonic() + timeout_s
        text = ""
        while time.monotonic() < deadline:
            result = await call("Runtime.evaluate", expression="document.body ? document.body.innerText : ''",
                                returnByValue=True)
            text = result.get("result", {}).get("value") or ""
            if all(name in text for name in wanted):
                break
            await asyncio.sleep(1.0)
        await asyncio.sleep(1.0)  # the tables' last cells (replica states) render just after the names
        shot = await call("Page.captureScreenshot", format="png")
        screenshot.write_bytes(base64.b64decode(shot["data"]))
        result = await call("Runtime.evaluate", expression="document.body.innerText", returnByValue=True)
        return result.get("result", {}).get("value") or text


def open_serve_page(dashboard_url: str, app_name: str, wanted: list[str], screenshot: Path,
                    timeout_s: float = 120.0) -> ServePage:
    """Open `dashboard_url`'s Serve page of application `app_name` in headless Chromium, wait (at most
    `timeout_s`) until its text shows every name of `wanted`, and save a PNG screenshot either way."""
    binary = chromium()
    if binary is None:
        raise FileNotFoundError("chromium is not installed (Debian package `chromium`)")
    started = time.monotonic()
    token = ray_token(dashboard_url)
    cookie = None if token is None else {"name": TOKEN_COOKIE, "value": token, "url": dashboard_url}
    with tempfile.TemporaryDirectory(prefix="treeserve-chromium-") as profile_dir:
        profile = Path(profile_dir)
        process = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            port = _devtools_port(profile, process, 60.0)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as reply:
                page = next(t for t in json.load(reply) if t.get("type") == "page")
            text = asyncio.run(_drive(page["webSocketDebuggerUrl"], f"{dashboard_url}/#/serve/applications/{app_name}",
                                      cookie, wanted, screenshot, timeout_s))
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    return ServePage(text, screenshot, time.monotonic() - started)


if __name__ == "__main__":
    url, app, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    page = open_serve_page(url.rstrip("/"), app, ["Router", "Drafter", "Target"], out)
    print(page.text)
    print(f"screenshot: {page.screenshot} ({page.seconds:.1f} s)", file=sys.stderr)
