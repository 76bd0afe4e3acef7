"""platform/ holds the Django project but must never shadow the standard library."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_stdlib_platform_is_importable_during_the_test_run():
    import platform

    assert platform.system()
    assert Path(platform.__file__).parent != ROOT / "platform"


def test_stdlib_platform_is_importable_from_the_repo_root():
    out = subprocess.run([sys.executable, "-c", "import platform; print(platform.system())"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip()


def test_platform_folder_is_not_a_package():
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_engine_imports_no_django_and_protocol_imports_no_torch():
    code = ("import sys, engine.protocol; assert 'torch' not in sys.modules, 'torch'; "
            "import engine.worker, engine.reference; "
            "assert not any(m == 'django' or m.startswith('django.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
