"""deploy/Dockerfile builds the image every manifest runs: it must hold every package the
project installs, and run unprivileged (no container runtime here to build it)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_image_copies_every_package_the_project_installs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    included = project["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.rstrip("*") for p in included} - {"atrium"}  # atrium lives in platform/
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\S+) \1$", dockerfile, re.M))
    assert packages | {"platform"} <= copied, sorted(packages - copied)
    assert all((ROOT / name).is_dir() for name in copied)


def test_the_image_runs_as_the_uid_the_manifests_expect():
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^USER 10001:10001$", dockerfile, re.M)
    manifests = "\n".join(p.read_text() for p in (ROOT / "deploy" / "kubernetes" / "base")
                          .glob("*.yaml"))
    assert set(re.findall(r"runAsUser: (\d+)", manifests)) == {"10001"}
