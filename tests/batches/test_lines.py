"""A batch input file checked as a stream (batches/lines.py): every rule the upload has
always had, whatever size the chunks come in, a line split across chunks, a file of many
megabytes, and a line too long refused before it ends."""

from __future__ import annotations

import json

import pytest

from batches import lines as batch_lines

LIMITS = {"max_lines": 100_000, "max_line_bytes": 4 * 1024 * 1024}


def chat(custom_id: str, content: str = "Hi", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": content}],
                     **body}}


def jsonl(*items) -> bytes:
    return b"".join((i if isinstance(i, bytes) else json.dumps(i).encode()) + b"\n"
                    for i in items)


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)] or [b""]


def summarize(data: bytes, size: int, **limits) -> batch_lines.Summary:
    return batch_lines.summarize(chunked(data, size), **{**LIMITS, **limits})


@pytest.mark.parametrize("size", [1, 3, 64, 1 << 20])
@pytest.mark.parametrize("content, says", [
    (b'{"custom_id": "a", "method": "POST"\n', "line 1: not a JSON object"),
    (jsonl(chat("a"), b"[1, 2]"), "line 2: not a JSON object"),
    (jsonl(chat("a"), b"\xff\xfe"), "line 2: not a JSON object"),
    (jsonl(b"[" * 100_000), "line 1: not a JSON object"),
    (jsonl({**chat("a"), "extra": 1}), "line 1: unknown field 'extra'"),
    (jsonl({**chat("a"), "custom_id": ""}), "line 1: custom_id must be a string"),
    (jsonl({**chat("a"), "custom_id": "x" * 513}), "line 1: custom_id must be a string"),
    (jsonl({**chat("a"), "method": "GET"}), "line 1: method must be POST"),
    (jsonl({**chat("a"), "url": "/v1/embeddings"}), "line 1: url must be one of"),
    (jsonl({**chat("a"), "body": {"messages": []}}), "line 1: body must be a JSON object"),
    (jsonl(chat("a", stream=True)), "line 1: a batch request cannot stream"),
    (jsonl(chat("a"), b"", chat("b"), chat("a")), "line 4: custom_id 'a' is used twice"),
    (b"\n\n", "line 1: the file holds no request"),
    (b"", "line 1: the file holds no request"),
])
def test_every_bad_line_is_named_whatever_the_chunks(content, says, size):
    with pytest.raises(batch_lines.BadLine) as refused:
        summarize(content, size)
    assert says in str(refused.value)


def test_too_many_requests_names_the_first_line_past_the_limit():
    with pytest.raises(batch_lines.BadLine) as refused:
        summarize(jsonl(*(chat(f"r{i}") for i in range(4))), 7, max_lines=3)
    assert "line 4: a batch file holds at most 3 requests" in str(refused.value)


def test_a_line_too_long_is_refused_before_it_ends():
    def endless():
        yield jsonl(chat("a"))
        while True:  # one line that never ends: refused once it passes the limit
            yield b"x" * 1000

    with pytest.raises(batch_lines.BadLine) as refused:
        batch_lines.summarize(endless(), max_lines=10, max_line_bytes=10_000)
    assert "line 2: a request is at most 10000 bytes" in str(refused.value)


def test_a_line_split_across_chunks_reads_as_one():
    data = jsonl(chat("first", "x" * 300), chat("second", "y" * 300), chat("third"))
    boundary = data.index(b"second")  # the second line's custom_id cut in two
    pieces = [data[:boundary], data[boundary:boundary + 3], data[boundary + 3:]]
    lines = list(batch_lines.read(pieces, **LIMITS))
    assert [(line.number, line.custom_id) for line in lines] == \
        [(1, "first"), (2, "second"), (3, "third")]
    assert lines[1].body["messages"][0]["content"] == "y" * 300
    assert lines[1].size == len(json.dumps(chat("second", "y" * 300)))


def test_blank_lines_count_in_the_numbering_and_crlf_is_accepted():
    data = b"\r\n" + json.dumps(chat("a")).encode() + b"\r\n\n" + json.dumps(chat("b")).encode()
    lines = list(batch_lines.read(chunked(data, 5), **LIMITS))
    assert [(line.number, line.custom_id) for line in lines] == [(2, "a"), (4, "b")]


def test_a_multi_megabyte_file_is_accepted_and_summarized():
    completions = {"custom_id": "c", "method": "POST", "url": "/v1/completions",
                   "body": {"model": "m", "prompt": "Hi"}}
    rows = [chat(f"r{i}", "z" * 1000) for i in range(6000)]
    data = jsonl(*rows[:4000], completions, *rows[4000:])
    assert len(data) > 6 * 1024 * 1024
    summary = summarize(data, 1 << 20)
    assert summary.lines == 6001
    assert summary.endpoints == {"/v1/chat/completions": 1, "/v1/completions": 4001}


@pytest.mark.parametrize("text", ["\ud800", "a\udc00b", "\x00", "ok\x00"])
@pytest.mark.parametrize("where", ["content", "custom_id_suffix"])
def test_text_no_database_can_hold_is_refused_naming_its_line(text, where):
    bad = chat("a" + (text if where == "custom_id_suffix" else ""),
               content=text if where == "content" else "Hi")
    with pytest.raises(batch_lines.BadLine) as refused:
        summarize(jsonl(chat("first"), bad), 1 << 20)
    assert refused.value.number == 2


def test_a_surrogate_pair_escaped_in_json_is_one_character_and_accepted():
    # json.dumps writes 😀 as \ud83d\ude00: a pair, which a database holds.
    assert summarize(jsonl(chat("a", content="smile 😀")), 7).lines == 1


def test_a_bad_line_found_in_a_checker_process_names_its_line(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_bytes(jsonl(chat("a"), chat("a")))
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1) as pool:
        with pytest.raises(batch_lines.BadLine) as refused:
            pool.submit(batch_lines.summarize_path, str(path), **LIMITS).result()
    assert refused.value.number == 2 and "used twice" in str(refused.value)


PARENT = """
import multiprocessing, os, time
from concurrent.futures import ProcessPoolExecutor
from batches import lines

pool = ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"),
                           initializer=lines.checker_started, initargs=(os.getpid(), 0))
print(*{pool.submit(os.getpid).result() for _ in range(8)}, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_checker_processes_end_when_the_web_process_that_started_them_is_killed():
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                              text=True, cwd=root)
    checkers = [int(pid) for pid in parent.stdout.readline().split()]
    assert checkers and all(Path(f"/proc/{pid}").exists() for pid in checkers)
    parent.send_signal(signal.SIGKILL)  # no shutdown of its pool, no exit handlers
    parent.wait()
    deadline = time.monotonic() + 30
    while left := [pid for pid in checkers if _running(pid)]:
        if time.monotonic() > deadline:
            for pid in left:
                os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"checker processes {left} outlived their web process")
        time.sleep(0.2)
