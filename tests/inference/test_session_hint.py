"""The conversation hint (x-session-id, else `user`) reaches placement over HTTP and over
the websocket, and a malformed one is refused the same way on both (inference/routing.py)."""

from __future__ import annotations

import json

import httpx
from prometheus_client import REGISTRY

CHAT = "/v1/chat/completions"


def _placed_by_session() -> float:
    return REGISTRY.get_sample_value("atrium_routing_placements_total",
                                     {"policy": "scored", "reason": "session"}) or 0.0


def _chat(model: str) -> dict:
    return {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _post(api_server: str, key: str, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(f"{api_server}{CHAT}", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}", **headers})


def test_the_session_header_or_the_user_field_places_a_request(
        api_server, tenant_key, served_model, engine_worker):
    before = _placed_by_session()
    assert _post(api_server, tenant_key.key, _chat(served_model),
                 **{"x-session-id": "conversation-1"}).status_code == 200
    assert _post(api_server, tenant_key.key,
                 {**_chat(served_model), "user": "end-user-7"}).status_code == 200
    assert _post(api_server, tenant_key.key, _chat(served_model)).status_code == 200
    assert _placed_by_session() == before + 2  # the third named no conversation


def _ask_over_the_websocket(api_server: str, key: str, model: str, **headers: str) -> dict:
    from websockets.sync.client import connect

    url = api_server.replace("http://", "ws://") + "/v1/stream"
    with connect(url, additional_headers={"Authorization": f"Bearer {key}", **headers}) as ws:
        ws.send(json.dumps({"type": "request", "id": "w1", "endpoint": "chat.completions",
                            "body": {**_chat(model), "stream": True}}))
        while True:
            message = json.loads(ws.recv(timeout=30))
            if message["type"] in ("done", "error"):
                return message


def test_a_websockets_handshake_names_the_conversation_of_its_requests(
        api_server, tenant_key, served_model, engine_worker):
    before = _placed_by_session()
    done = _ask_over_the_websocket(api_server, tenant_key.key, served_model,
                                   **{"x-session-id": "conversation-2"})
    assert done["type"] == "done" and _placed_by_session() == before + 1
    refused = _ask_over_the_websocket(api_server, tenant_key.key, served_model,
                                      **{"x-session-id": "s" * 257})
    assert refused["type"] == "error"
    assert (refused["error"]["code"], refused["error"]["param"]) == ("invalid_value",
                                                                    "x-session-id")
