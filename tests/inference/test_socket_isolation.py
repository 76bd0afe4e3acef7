"""A malformed websocket message costs nothing but its own error: the socket's other
streams go on (issue 16)."""

from __future__ import annotations

import json
import random

STREAMS = 16
MALFORMED = 50


def _malformed(rng: random.Random, model: str, n: int) -> tuple[str | bytes, str | None]:
    """(the frame, the id its error must carry: None where the frame has no valid id)."""
    cid = f"bad-{n}"
    good_body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    frames: list[tuple[object, str | None]] = [
        ("not json", None),
        ("[" * 50_000 + "]" * 50_000, None),
        ([1, 2, 3], None),
        ({"type": "request", "id": ["x"], "endpoint": "completions"}, None),
        ({"type": "request", "id": "", "endpoint": "completions"}, None),
        ({"type": "request", "id": "x" * 129, "endpoint": "completions"}, None),
        ({"type": "poke", "id": cid}, cid),
        ({"type": ["request"], "id": cid}, cid),
        ({"type": "request", "id": cid, "endpoint": ["chat"]}, cid),
        ({"type": "request", "id": cid, "endpoint": {"a": 1}, "body": good_body}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions", "extra": 1}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions", "body": "text"}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions",
          "body": {**good_body, "messages": [{"role": ["user"], "content": "x"}]}}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions",
          "body": {**good_body, "messages": [{"role": "user", "content": "\ud800"}]}}, cid),
        ({"type": "request", "id": cid, "endpoint": "completions",
          "body": {"model": model, "prompt": "a\x00b"}}, cid),
        ({"type": "request", "id": cid, "endpoint": "completions",
          "body": {"model": model, "prompt": [10**12]}}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions",
          "body": {**good_body, "temperature": "hot", "stream_options": []}}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions",
          "body": {**good_body, "model": {"$ne": None}}}, cid),
        ({"type": "request", "id": cid, "endpoint": "completions",
          "body": {"model": model, "prompt": "hi", "metadata": {"k": [[[[[[[[[[[[[[[[[[[[[[[[[
              [[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}}, cid),
        ({"type": "request", "id": cid, "endpoint": "chat.completions",
          "body": {**good_body, "model": "someone-elses:adapter"}}, cid),
    ]
    frame, expected = frames[rng.randrange(len(frames))]
    if isinstance(frame, str):
        return frame, expected
    return json.dumps(frame), expected


def test_fifty_malformed_messages_among_sixteen_streams_leave_every_stream_whole(
        api_server, tenant_key, served_model, engine_worker):
    from websockets.sync.client import connect

    rng = random.Random(16)
    url = api_server.replace("http://", "ws://") + "/v1/stream"
    ends: dict[str, dict] = {}
    tokens: dict[str, int] = {f"s{i}": 0 for i in range(STREAMS)}
    errors: list[dict] = []
    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"},
                 max_size=None) as ws:
        sent_bad: list[str | None] = []
        for i in range(STREAMS):
            ws.send(json.dumps({"type": "request", "id": f"s{i}", "endpoint": "completions",
                                "body": {"model": served_model, "prompt": f"stream {i}",
                                         "max_tokens": 12, "temperature": 0}}))
            for _ in range(MALFORMED // STREAMS + (i < MALFORMED % STREAMS)):
                frame, expected = _malformed(rng, served_model, len(sent_bad))
                sent_bad.append(expected)
                ws.send(frame)
        assert len(sent_bad) == MALFORMED
        while len(ends) < STREAMS or len(errors) < MALFORMED:
            message = json.loads(ws.recv(timeout=60))
            if message["id"] in tokens:
                if message["type"] == "chunk":
                    tokens[message["id"]] += 1
                else:
                    ends[message["id"]] = message
            else:
                assert message["type"] == "error", message
                errors.append(message)
    assert {cid: m["type"] for cid, m in ends.items()} == {cid: "done" for cid in tokens}, \
        [m for m in ends.values() if m["type"] != "done"]
    assert all(count >= 1 for count in tokens.values()), tokens
    # Every malformed message had exactly one answer: a 4xx naming its id where it had one.
    assert sorted(map(str, (e["id"] for e in errors))) == sorted(map(str, sent_bad))
    assert all(400 <= e["status"] < 500 and e["error"]["code"] for e in errors), errors


def test_a_request_refused_by_its_checks_never_holds_one_of_the_sockets_places(
        api_server, tenant_key, served_model, engine_worker):
    """Fifteen streams running, then a request for a model the tenant cannot use and a
    sixteenth valid one at once: the refused one gets its own error and the valid one the
    last place; a seventeenth gets the socket's 429. Closing the socket mid-stream is the
    client going away, not a server error."""
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"

    def stream(ws, cid: str) -> None:
        ws.send(json.dumps({"type": "request", "id": cid, "endpoint": "completions",
                            "body": {"model": served_model, "prompt": f"stream {cid}",
                                     "max_tokens": 1500, "temperature": 0}}))

    def until_answered(ws, ids: set[str]) -> dict[str, dict]:
        """Reads until each of ``ids`` has its first message (other streams' chunks go by)."""
        answers: dict[str, dict] = {}
        while set(answers) != ids:
            message = json.loads(ws.recv(timeout=60))
            if message["id"] in ids and message["id"] not in answers:
                answers[message["id"]] = message
            else:
                assert message["type"] == "chunk", message
        return answers

    with connect(url, additional_headers={"Authorization": f"Bearer {tenant_key.key}"},
                 max_size=None) as ws:
        for i in range(STREAMS - 1):
            stream(ws, f"s{i}")
        first = until_answered(ws, {f"s{i}" for i in range(STREAMS - 1)})
        assert all(m["type"] == "chunk" for m in first.values()), first
        ws.send(json.dumps({"type": "request", "id": "foreign", "endpoint": "completions",
                            "body": {"model": "someone-elses:adapter", "prompt": "x"}}))
        stream(ws, "last")
        answers = until_answered(ws, {"foreign", "last"})
        stream(ws, "one-too-many")
        answers |= until_answered(ws, {"one-too-many"})
    assert answers["foreign"]["type"] == "error"
    assert answers["foreign"]["status"] in (400, 404), answers["foreign"]
    assert answers["last"]["type"] == "chunk", answers["last"]
    assert answers["one-too-many"]["type"] == "error"
    assert answers["one-too-many"]["status"] == 429
    assert answers["one-too-many"]["error"]["code"] == "too_many_requests"
