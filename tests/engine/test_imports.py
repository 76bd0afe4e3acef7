"""What importing the engine's light modules pulls in: never Django, and torch only to build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIGHT = ["engine", "engine.protocol", "engine.worker", "engine.demo_model", "engine.outputs",
         "engine.detokenizer", "engine.sampling_params", "engine.recovery"]


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules)
            + "print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True)
    return set(out.stdout.split())


def test_light_engine_modules_import_neither_torch_nor_django():
    loaded = _loaded_after_import(LIGHT)
    assert "torch" not in loaded and "transformers" not in loaded
    assert "django" not in loaded


def test_no_engine_module_imports_django():
    for path in (ROOT / "engine").rglob("*.py"):
        lines = path.read_text().splitlines()
        assert not [line for line in lines if line.strip().startswith(
            ("import django", "from django"))], path


def test_engine_package_init_is_empty():
    assert (ROOT / "engine" / "__init__.py").read_text() == ""
