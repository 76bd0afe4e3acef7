"""The docs' quick starts run as written against a live `atrium up`, so they cannot drift.

A fenced block whose info string says ``e2e`` (```` ```python e2e ````, ```` ```sh e2e ````)
is run: a document's blocks in order, in one folder, in the environment `make install`
made, with the two placeholders a reader fills in replaced — ``http://127.0.0.1:8000`` by
the live server and ``atr_...`` by its key (also exported as ``ATRIUM_API_KEY``).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.conftest import BIN, ROOT, Atrium

FENCE = re.compile(r"^```(\w+)[ \t]+e2e[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks(doc: Path) -> list[tuple[str, str]]:
    return FENCE.findall(doc.read_text())


RUNNABLE = [doc for doc in DOCS if runnable_blocks(doc)]


def test_the_quick_starts_are_marked_to_run():
    assert {"README.md", "adapters.md", "billing.md"} <= {doc.name for doc in RUNNABLE}


@pytest.mark.parametrize("doc", RUNNABLE, ids=lambda doc: doc.name)
def test_a_docs_quick_start_runs_as_written(atrium: Atrium, doc: Path, tmp_path: Path):
    env = {**atrium.env, "ATRIUM_API_KEY": atrium.key}
    for number, (language, body) in enumerate(runnable_blocks(doc), 1):
        body = body.replace("http://127.0.0.1:8000", atrium.base).replace("atr_...", atrium.key)
        if language in ("sh", "bash"):
            command = ["bash", "-e", "-o", "pipefail", "-c", body]
        elif language == "python":
            command = [str(BIN / "python"), "-c", body]
        else:
            pytest.fail(f"{doc.name} block {number}: no way to run a {language!r} block")
        result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                                timeout=180)
        assert result.returncode == 0, (f"{doc.name} block {number} ({language}) failed:\n"
                                        f"{body}\n--- stdout\n{result.stdout}\n"
                                        f"--- stderr\n{result.stderr}")
