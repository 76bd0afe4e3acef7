"""Slow clients cannot hold the server before anyone is authenticated: request headers and
bodies have deadlines, and connections waiting for their headers are capped
(atrium/server.py, asgi.BodyLimit). Raw sockets against the real server."""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import httpx

from atrium.server import GuardedH11Protocol
from tests.waiting import wait_for


def _connect(api_server: str) -> socket.socket:
    url = urlsplit(api_server)
    return socket.create_connection((url.hostname, url.port), timeout=10)


def _closed_within(sock: socket.socket, limit: float) -> float:
    """Seconds until the server closes the connection (reading whatever it sends)."""
    start = time.monotonic()
    sock.settimeout(limit)
    while sock.recv(4096):
        pass
    return time.monotonic() - start


def test_headers_that_never_finish_are_cut_off_at_the_header_deadline(api_server, settings):
    settings.ATRIUM_HEADER_TIMEOUT_S = 1.0
    with _connect(api_server) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for _ in range(3):  # trickling bytes does not buy time
            time.sleep(0.3)
            sock.sendall(b"a")
        took = _closed_within(sock, 10)
    assert took < 2.5, took


def test_an_idle_keep_alive_connection_gets_the_same_deadline_for_its_next_request(
        api_server, settings):
    settings.ATRIUM_HEADER_TIMEOUT_S = 1.0
    with _connect(api_server) as sock:
        sock.sendall(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert b" 200 " in sock.recv(4096).split(b"\r\n", 1)[0] + b" "
        sock.sendall(b"GET /livez HTTP/1.1\r\nHo")  # then nothing more
        took = _closed_within(sock, 10)
    assert took < 6, took  # uvicorn's keep-alive (5 s) or the header deadline, not never


def test_a_body_shorter_than_its_content_length_gets_a_json_408(api_server, settings):
    settings.ATRIUM_BODY_TIMEOUT_S = 1.0
    with _connect(api_server) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"model": "x"')
        reply = b""
        sock.settimeout(10)
        while chunk := sock.recv(4096):
            reply += chunk
        took = time.monotonic() - start
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert took < 3, took


def test_connections_waiting_for_headers_are_capped(api_server, settings):
    settings.ATRIUM_MAX_PENDING_CONNECTIONS = 4
    settings.ATRIUM_HEADER_TIMEOUT_S = 5.0
    waiting = GuardedH11Protocol.awaiting_headers
    idle = [_connect(api_server) for _ in range(4)]
    try:
        wait_for(lambda: len(waiting) == 4, timeout=10,
                 what="the server to hold the four connections waiting for headers")
        with _connect(api_server) as extra:
            assert _closed_within(extra, 5) < 1  # closed at once, nothing answered
    finally:
        for sock in idle:
            sock.close()
    wait_for(lambda: not waiting, timeout=10, what="the server to let the four go")
    assert httpx.get(f"{api_server}/livez", timeout=10).status_code == 200
