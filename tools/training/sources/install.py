"""Install the corpus sources' Debian packages (`treeserve make-corpus --install-sources`, `make corpus-sources`).

Best effort, as the project's other optional installs (the browser test's chromium): packages already
installed are left alone, the rest go through one `apt-get install` when this runs as root on a machine
with apt-get; anywhere else, or when apt fails, a warning names what is missing and the corpus is built
from whatever is there. `make test` never runs this: the tests read committed fixtures.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import warnings
from dataclasses import dataclass
from typing import Callable

from .registry import SOURCES, SourceSpec

Runner = Callable[[list[str]], tuple[int, str]]  # argv -> (exit status, standard output)


def _run(argv: list[str]) -> tuple[int, str]:
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, check=False,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    return done.returncode, done.stdout


@dataclass(frozen=True)
class InstallReport:
    already: tuple[str, ...]  # installed before
    installed: tuple[str, ...]  # installed now
    missing: tuple[str, ...]  # still missing (no root or apt, or apt failed)


def wanted_packages(specs: tuple[SourceSpec, ...] = SOURCES) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p for spec in specs for p in spec.packages))


def install_sources(specs: tuple[SourceSpec, ...] = SOURCES, run: Runner = _run, is_root: bool | None = None,
                    has_apt: bool | None = None) -> InstallReport:
    """apt-get install the packages of `specs` that dpkg does not list as installed (`run`, `is_root` and
    `has_apt` are the machine's unless a test gives its own)."""
    packages = wanted_packages(specs)
    already = tuple(p for p in packages if _installed(p, run))
    todo = [p for p in packages if p not in already]
    if not todo:
        return InstallReport(already, (), ())
    is_root = os.geteuid() == 0 if is_root is None else is_root
    has_apt = shutil.which("apt-get") is not None if has_apt is None else has_apt
    if not (is_root and has_apt):
        warnings.warn(f"corpus sources not installed (needs root and apt-get): {' '.join(todo)}; "
                      "the corpus is built from what is there")
        return InstallReport(already, (), tuple(todo))
    run(["apt-get", "update", "-q"])
    if run(["apt-get", "install", "-y", "-q", "--no-install-recommends", *todo])[0] == 0:
        return InstallReport(already, tuple(todo), ())
    # One unknown package fails the whole command: try them one by one so the others still come.
    done = tuple(p for p in todo if run(["apt-get", "install", "-y", "-q", "--no-install-recommends", p])[0] == 0)
    missing = tuple(p for p in todo if p not in done)
    if missing:
        warnings.warn(f"apt-get could not install {' '.join(missing)}; those corpus sources are skipped")
    return InstallReport(already, done, missing)


def _installed(package: str, run: Runner) -> bool:
    """dpkg-query also exits 0 for a package it merely knows of (removed, config files left): read its status."""
    status, out = run(["dpkg-query", "-W", "-f=${Status}", package])
    return status == 0 and out.strip().endswith("ok installed")
