"""Email under a wall-clock deadline, against real SMTP conversations on loopback: one
that completes, and one whose server answers a byte at a time (core/mail.py)."""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from core.mail import MailTimeout, header_text, send_within


class _Smtp(socketserver.StreamRequestHandler):
    """Enough of SMTP for one message: what it received is kept on the server."""

    def handle(self) -> None:
        server = self.server
        if server.trickle:
            for byte in b"220 slow.test ESMTP\r\n":
                self.wfile.write(bytes([byte]))
                time.sleep(0.5)  # a byte inside each read's timeout; the greeting takes 10 s
            return
        self.wfile.write(b"220 mail.test ESMTP\r\n")
        while line := self.rfile.readline():
            verb = line[:4].upper()
            if verb == b"DATA":
                self.wfile.write(b"354 go on\r\n")
                data = b""
                while (chunk := self.rfile.readline()) not in (b".\r\n", b""):
                    data += chunk
                server.messages.append(data)
                self.wfile.write(b"250 kept\r\n")
            elif verb == b"QUIT":
                self.wfile.write(b"221 bye\r\n")
                return
            elif verb == b"EHLO":
                self.wfile.write(b"250 mail.test\r\n")
            else:
                self.wfile.write(b"250 ok\r\n")


@pytest.fixture
def smtp_server(settings) -> Iterator[socketserver.ThreadingTCPServer]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Smtp)
    server.daemon_threads = True
    server.trickle, server.messages = False, []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.EMAIL_BACKEND = "core.mail.SMTPBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT = "127.0.0.1", server.server_address[1]
    settings.EMAIL_USE_TLS = False
    yield server
    server.shutdown()
    server.server_close()


def test_a_message_goes_out_through_a_server_that_answers(smtp_server):
    assert send_within(subject="budget\r\nBcc: x@example.test", body="spent",
                       recipients=["owner@acme.test"], deadline_s=5) == 1
    [message] = smtp_server.messages
    assert b"Subject: budget Bcc: x@example.test\r\n" in message
    assert b"\r\nBcc:" not in message


def test_a_server_that_answers_a_byte_at_a_time_is_cut_at_the_deadline(smtp_server):
    smtp_server.trickle = True
    began = time.monotonic()
    with pytest.raises(MailTimeout):
        send_within(subject="s", body="b", recipients=["owner@acme.test"], deadline_s=1.5)
    # Each byte came within the per-read timeout; only the wall clock stopped it.
    assert time.monotonic() - began < 4
    assert smtp_server.messages == []


def test_a_refused_connection_is_an_oserror_not_a_timeout(settings):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings.EMAIL_BACKEND = "core.mail.SMTPBackend"
    settings.EMAIL_HOST, settings.EMAIL_PORT, settings.EMAIL_USE_TLS = "127.0.0.1", port, False
    with pytest.raises(OSError) as refused:
        send_within(subject="s", body="b", recipients=["a@b.test"], deadline_s=2)
    assert not isinstance(refused.value, MailTimeout)


@pytest.mark.parametrize("raw, safe", [
    ("eve\r\nBcc: all@example.test", "eve Bcc: all@example.test"),
    ("tab\there\x00and\u2028line", "tab here and line"),
    ("\ud800lone", "lone"),
    ("x" * 300, "x" * 119 + "…"),
])
def test_header_text_leaves_one_safe_line(raw, safe):
    assert header_text(raw) == safe
