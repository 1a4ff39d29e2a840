"""A real browser on the Ray dashboard that `treeserve serve` starts: headless Chromium opens the Serve page of the
running application (the session's `serve_service`, whose Ray instance starts its dashboard as `serve` does) and
finds its three deployments and their running replicas; the screenshot is kept under the test's tmp_path (and
copied to $TREESERVE_DASHBOARD_SCREENSHOT when set). Skipped where Chromium is not installed: `make test`
installs Debian's `chromium` where it may (root with apt-get)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dashboard_browser import chromium, open_serve_page  # tests/services/dashboard_browser.py (on sys.path)

pytestmark = pytest.mark.skipif(chromium() is None, reason="headless browser test: chromium is not installed "
                                "(Debian package `chromium`; `make test` installs it when run as root with apt-get)")

DEPLOYMENTS = ["Router", "Drafter", "Target"]


def test_serve_page_lists_the_three_deployments(serve_service, ray_session, tmp_path):
    url = getattr(ray_session, "dashboard_url", None)
    if url is None:
        pytest.skip("this session's Ray instance was started by another package's fixture, without a dashboard")
    page = open_serve_page(url, serve_service.app_name, DEPLOYMENTS, tmp_path / "serve-page.png")
    missing = [name for name in DEPLOYMENTS if name not in page.text]
    assert not missing, f"the Serve page does not show {missing}; it shows:\n{page.text[:2000]}"
    assert serve_service.app_name in page.text
    assert "RUNNING" in page.text and page.text.count("HEALTHY") >= len(DEPLOYMENTS), page.text[:2000]  # up, not only listed
    png = page.screenshot.read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000  # a rendered page, not an empty frame
    if os.environ.get("TREESERVE_DASHBOARD_SCREENSHOT"):
        shutil.copyfile(page.screenshot, Path(os.environ["TREESERVE_DASHBOARD_SCREENSHOT"]))
