"""A websocket's messages: a request (whose body is checked like an HTTP body) or a cancel."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from inference.errors import InvalidRequest
from inference.params import Strict, Text, invalid

MAX_CLIENT_ID = 128  # a websocket request's own id

ClientId = Annotated[Text, Field(min_length=1, max_length=MAX_CLIENT_ID)]
_CLIENT_ID = TypeAdapter(ClientId, config=ConfigDict(strict=True))


class SocketRequest(Strict):
    """A websocket's request message; ``body`` is the HTTP body, checked like one."""

    type: Literal["request"]
    id: ClientId
    endpoint: Literal["chat.completions", "completions", "responses"]
    body: Any = None


class SocketCancel(Strict):
    type: Literal["cancel"]
    id: ClientId


_SOCKET_MESSAGE = TypeAdapter(Annotated[SocketRequest | SocketCancel,
                                        Field(discriminator="type")])


def parse_socket_message(message: Any) -> SocketRequest | SocketCancel:
    if not isinstance(message, dict):
        raise InvalidRequest("messages must be JSON objects", code="invalid_json")
    try:
        return _SOCKET_MESSAGE.validate_python(message)
    except ValidationError as exc:
        raise invalid(exc) from None


def socket_message_id(message: Any) -> str | None:
    """The id of a message, refused or not, when it has a valid one: its error names it."""
    try:
        return _CLIENT_ID.validate_python(message.get("id"))
    except (AttributeError, ValidationError):
        return None
