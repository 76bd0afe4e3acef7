"""Follows one JSON object as it streams, to find a tool call's name and arguments in it.

A call's arguments stream to the client as the model writes them, so the parser must know
where they start and end before the object is complete. This tracks strings, escapes and
nesting, and reads the object's top-level keys; it does not check values (``tru``,
trailing commas): the caller runs ``json.loads`` on the whole object once it closes.
NOTE: text is kept in lists of pieces, never grown by ``+=``: tools that write files get
arguments of many kilobytes, fed a few characters at a time.
"""

from __future__ import annotations

import json

_WS = " \t\n\r"  # JSON's whitespace


class ObjectScanner:
    """Reads one object whose ``"name"`` is a string and whose ``args_key`` is an object."""

    def __init__(self, args_key: str) -> None:
        self.args_key = args_key
        self.name: str | None = None
        self.has_arguments = False  # the arguments object has begun
        # start, key, key_string, colon, value, value_string, scalar, nested, after, done, error
        self.state = "start"
        self._pieces: list[str] = []  # the object's text
        self._args: list[str] = []  # the arguments' text, a character at a time
        self._args_taken = 0
        self._in_args = False
        self._token: list[str] = []  # the top-level string being read (a key, or a value)
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._key: str | None = None
        self._keys: set[str] = set()

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def failed(self) -> bool:
        return self.state == "error"

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def arguments(self) -> str:
        """All of the arguments' text so far."""
        return "".join(self._args)

    def take_arguments(self) -> str:
        """The arguments' text that came since the last call."""
        new = "".join(self._args[self._args_taken:])
        self._args_taken = len(self._args)
        return new

    def feed(self, chunk: str) -> int:
        """Reads ``chunk`` up to the end of the object (or an error); returns the length used."""
        for used, char in enumerate(chunk):
            if self.state in ("done", "error"):
                self._pieces.append(chunk[:used])
                return used
            self._step(char)
        self._pieces.append(chunk)
        return len(chunk)

    def _step(self, c: str) -> None:
        if self._in_args:
            self._args.append(c)
        if self._in_string:
            self._string_char(c)
        elif c in _WS:
            if self.state == "scalar":
                self._end_value()
        elif self._depth > 1:
            self._nested(c)
        else:
            self._top_level(c)

    def _string_char(self, c: str) -> None:
        if self._depth == 1:
            self._token.append(c)
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            self._in_string = False
            if self._depth == 1:
                self._end_string()

    def _top_level(self, c: str) -> None:
        """A character outside strings, in the object itself (or before it opens)."""
        state = self.state
        if state == "start":
            self._depth, self.state = (1, "key") if c == "{" else (0, "error")
        elif state == "key" and c == '"':
            self._open_string("key_string")
        elif state == "colon":
            self.state = "value" if c == ":" else "error"
        elif state == "value":
            self._start_value(c)
        elif state == "scalar" and c not in ",}":
            return  # the rest of a number, true, false or null
        else:  # the end of a value, or of an empty object
            if state == "scalar":
                self._end_value()
            if c == "," and state != "key":
                self.state = "key"
            elif c == "}":
                self._close()
            else:
                self._fail()

    def _nested(self, c: str) -> None:
        if c == '"':
            self._in_string = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            if self._depth == 1:
                self._end_value()

    def _open_string(self, state: str) -> None:
        self._in_string, self._token, self.state = True, ['"'], state

    def _end_string(self) -> None:
        if self.state == "value_string":
            self._end_value()
            return
        try:
            key = json.loads("".join(self._token))
        except ValueError:
            return self._fail()
        if key in self._keys and key in ("name", self.args_key):
            return self._fail()  # which one would the client get? neither
        self._keys.add(key)
        self._key, self.state = key, "colon"

    def _start_value(self, c: str) -> None:
        if self._key == self.args_key:
            if c != "{":
                return self._fail()  # arguments are an object, or the output is not a call
            self.has_arguments, self._in_args = True, True
            self._args.append(c)
        elif self._key == "name" and c != '"':
            return self._fail()
        if c == '"':
            self._open_string("value_string")
        elif c in "{[":
            self._depth, self.state = 2, "nested"
        else:
            self.state = "scalar"

    def _end_value(self) -> None:
        if self._key == "name":
            try:
                self.name = json.loads("".join(self._token))
            except ValueError:
                return self._fail()
        elif self._key == self.args_key:
            self._in_args = False
        self.state = "after"

    def _close(self) -> None:
        self._depth, self.state = 0, "done"

    def _fail(self) -> None:
        self.state = "error"
