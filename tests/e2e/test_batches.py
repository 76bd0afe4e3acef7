"""The Batch API under the real `atrium up`, through the official openai package: a batch
with a line for a model that does not exist, its batch worker killed (SIGKILL) mid-batch,
`atrium up` started again, and the batch finished with no line lost or billed twice."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.e2e.conftest import processes_of

LINES = 20


def _batch_file(model: str) -> bytes:
    rows = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model if i != 7 else "no-such-model", "max_tokens": 24,
                      "ignore_eos": True, "temperature": 0,
                      "messages": [{"role": "user", "content": f"Question {i}"}]}}
            for i in range(LINES)]
    return ("\n".join(json.dumps(r) for r in rows) + "\n").encode()


def _batch_workers(root_pid: int) -> list[int]:
    """The processes of `atrium up`'s batches worker (its main process and its pool)."""
    return processes_of(root_pid, b"worker", b"batches")


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


# On PostgreSQL, as production runs: the runner's lease on SQLite is proven in process
# (tests/inference/test_batches.py), and this test restarts its whole `atrium up`.
@pytest.mark.setups("services")
def test_a_batch_survives_its_worker_killed_and_bills_each_line_once(atrium):
    # The shared `atrium up` runs two lines at a time and resumes a dead runner's batch
    # within 3 s (tests/e2e/conftest.py: SHARED_ENV).
    client = atrium.openai()
    source = client.files.create(file=("questions.jsonl", _batch_file(atrium.model)),
                                 purpose="batch")
    batch = client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"suite": "e2e"})
    _wait(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 4, 180,
          "the batch to start")
    workers = _batch_workers(atrium.proc.pid)
    assert workers, "no batches worker found"
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    killed_at = client.batches.retrieve(batch.id)
    assert killed_at.status == "in_progress"
    assert killed_at.request_counts.completed < LINES - 1
    atrium.proc.wait(timeout=60)  # `atrium up` stops when one of its processes dies
    atrium.start()
    client = atrium.openai()
    _wait(lambda: client.batches.retrieve(batch.id).status == "completed", 240,
          "the resumed batch to complete")

    done = client.batches.retrieve(batch.id)
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (LINES, LINES - 1, 1)
    output = [json.loads(line) for line in
              client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in output) == \
        sorted(f"q{i}" for i in range(LINES) if i != 7)  # every line once, none lost
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 24 for o in output)
    (error,) = [json.loads(line) for line in
                client.files.content(done.error_file_id).text.splitlines()]
    assert (error["custom_id"], error["error"]["code"]) == ("q7", "model_not_found")

    # The ledger: one row per line that ran, at the batch price class, whatever ran twice.
    with atrium.http() as http:
        def billed() -> list[dict]:
            rows = []
            for i in range(LINES):
                answer = http.get(f"/api/v1/tenants/demo/usage/requests/{batch.id}-{i}")
                if answer.status_code == 200:
                    rows.append(answer.json())
                else:
                    assert answer.status_code == 404, answer.text
            return rows

        _wait(lambda: len(billed()) == LINES - 1, 60, "every line in the ledger")
        rows = billed()
    assert {r["price_class"] for r in rows} == {"batch"}
    # A line cut short by the kill is billed for what its first attempt made (the ledger
    # keeps the first report of a line), never twice.
    assert all(0 <= r["output_tokens"] <= 24 for r in rows)
    assert sum(r["output_tokens"] == 24 for r in rows) >= LINES - 1 - 2  # 2 in flight
