"""A websocket's messages: a request (whose body is checked like an HTTP body), a cancel, or
a resume of a resumable request (inference/resumable.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError

from inference.errors import InvalidRequest
from inference.params import Strict, Text, invalid

MAX_CLIENT_ID = 128  # a websocket request's own id

ClientId = Annotated[Text, Field(min_length=1, max_length=MAX_CLIENT_ID)]
_CLIENT_ID = TypeAdapter(ClientId, config=ConfigDict(strict=True))


class SocketRequest(Strict):
    """A websocket's request message; ``body`` is the HTTP body, checked like one.
    ``resumable``: true, or seconds of grace (the HTTP header's values)."""

    type: Literal["request"]
    id: ClientId
    endpoint: Literal["chat.completions", "completions", "responses", "messages"]
    body: Any = None
    resumable: bool | Annotated[int, Field(gt=0)] = False


class SocketCancel(Strict):
    type: Literal["cancel"]
    id: ClientId


class SocketResume(Strict):
    """Follow a resumable request again, after its event ``after`` (-1: from the first)."""

    type: Literal["resume"]
    id: ClientId
    request_id: Annotated[Text, Field(min_length=1, max_length=MAX_CLIENT_ID)]
    after: Annotated[int, Field(ge=-1, le=10**9)] = -1


SocketMessage = SocketRequest | SocketCancel | SocketResume
_SOCKET_MESSAGE = TypeAdapter(Annotated[SocketMessage, Field(discriminator="type")])


def parse_socket_message(message: Any) -> SocketMessage:
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
