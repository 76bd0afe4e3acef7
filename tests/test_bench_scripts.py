"""Every benchmark script still imports: a rename in the code under it fails here, not the
next time someone measures (bench/*.py are run by hand, so nothing else would notice)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_IMPORT_ALL = """
import importlib, json, sys, traceback
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/platform"]
failed = {}
for name in sys.argv[2:]:
    try:
        importlib.import_module(f"bench.{name}")
    except Exception:
        failed[name] = traceback.format_exc(limit=2)
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports():
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if p.stem != "__init__")
    assert len(scripts) > 20
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(ROOT), *scripts],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
