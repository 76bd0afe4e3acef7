"""The alert rules, their unit tests and the example scrape configuration, checked by
Prometheus's own tool (Debian's `prometheus` package; .ci/run installs it)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "deploy" / "observability" / "prometheus"


def _promtool(*args: str) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: install Debian's prometheus package (.ci/run does)")
    return subprocess.run([promtool, *args], cwd=RULES, capture_output=True, text=True,
                          timeout=120)


def test_the_rules_are_valid():
    done = _promtool("check", "rules", "atrium-rules.yml")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_alerts_fire_when_and_only_when_their_unit_tests_say():
    done = _promtool("test", "rules", "atrium-rules.test.yml")
    assert done.returncode == 0 and "SUCCESS" in done.stdout, done.stdout + done.stderr


def test_the_example_scrape_configuration_is_valid():
    done = _promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
