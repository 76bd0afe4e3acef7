"""Email with a wall-clock deadline, and header text that any input leaves safe.

Django's SMTP backend times out each socket operation, not the whole conversation: a
server that answers one byte every few seconds would hold a worker for as long as it
likes. Here a timer cuts the connection at the deadline, wherever it stands.
"""

from __future__ import annotations

import socket
import threading
import unicodedata
from typing import Any

from django.core.mail import EmailMessage, get_connection
from django.core.mail.backends import smtp

HEADER_TEXT_MAX = 120


class MailTimeout(TimeoutError):
    """The server did not take the message within the deadline."""


def header_text(value: str, *, limit: int = HEADER_TEXT_MAX) -> str:
    """``value`` fit for a mail header (a subject) or a one-line label: no control or
    format characters (a newline would end the header; Django refuses one), no lone
    surrogates, at most ``limit`` characters."""
    kept = "".join(" " if unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp") else c
                   for c in value)
    kept = " ".join(kept.split())
    return kept if len(kept) <= limit else kept[:limit - 1] + "…"


class SMTPBackend(smtp.EmailBackend):
    """Django's SMTP backend (settings name it when ATRIUM_EMAIL_HOST is set) whose
    connections a deadline can cut, from the first byte of the server's greeting on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.live: list[Any] = []

    @property
    def connection_class(self) -> type:
        live = self.live

        class Tracked(super().connection_class):
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                live.append(self)  # before it connects: its greeting is read in here
                super().__init__(*args, **kwargs)

        return Tracked

    def cut(self) -> None:
        """Ends every connection's blocked read or write at once."""
        for conversation in self.live:
            sock = getattr(conversation, "sock", None)
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def send_within(*, subject: str, body: str, recipients: list[str],
                deadline_s: float) -> int:
    """Sends one message, done or abandoned within ``deadline_s``; raises MailTimeout or
    OSError (SMTP errors are OSErrors) when it was not sent."""
    connection = get_connection(timeout=deadline_s)
    message = EmailMessage(subject=header_text(subject, limit=200), body=body,
                           to=recipients, connection=connection)
    cut = threading.Event()

    def at_deadline() -> None:
        cut.set()
        if isinstance(connection, SMTPBackend):
            connection.cut()

    timer = threading.Timer(deadline_s, at_deadline)
    timer.daemon = True
    timer.start()
    try:
        return message.send()
    except OSError as exc:
        if cut.is_set():
            raise MailTimeout(f"the mail server did not take the message within "
                              f"{deadline_s:g} s") from exc
        raise
    finally:
        timer.cancel()
        if cut.is_set():
            try:
                connection.close()
            except OSError:
                pass
