"""Tool-call formats: each parses a model's output into content and tool calls, whole or
as it streams.

One state machine serves both ways: ``parse(text)`` feeds the whole text to a fresh parser,
so a streamed answer and a whole one agree on every well-formed output, however the text
was chunked. A format is a subclass that frames the calls (``_advance``); the JSON object
inside each call is read by ``ObjectScanner``. To add one, subclass ``ToolCallParser`` with
an ``_in_<state>`` method per framing state (and ``_may_end``), and register it in
``FORMATS`` under the name a model declares as ``"tool_parser"`` in its
tokenizer_config.json (use vLLM's name for it).

Malformed calls (JSON that does not parse, a ``name`` that is not a string, arguments
that are not an object, a call cut short) make the whole output plain content, never an
exception. NOTE: a stream commits to a call once its name and the start of its arguments
are out; if the call then proves malformed (typically: max_tokens cut it), the calls
already sent stand, ``malformed`` is set, and the rest of the output is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import ClassVar

from inference.tools.calls import Delta, ParsedOutput, ToolCall, fragment, new_call_id, opening
from inference.tools.scanner import ObjectScanner


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that could be the start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class ToolCallParser:
    """Feed it a model's output as it streams; it returns OpenAI content and tool-call deltas."""

    name: ClassVar[str]
    args_key: ClassVar[str] = "arguments"
    start_state: ClassVar[str]

    def __init__(self, call_ids: Callable[[], str] = new_call_id) -> None:
        self.tool_calls: list[ToolCall] = []  # the calls completed so far
        self.malformed = False
        self.call_ids = call_ids  # each call's id (calls.call_ids: the same on each reading)
        # NOTE: positions count from the start of the output; _raw keeps only what is still
        # needed (from _base on): unread text, and content a malformed call would send.
        self._raw = ""
        self._base = 0
        self._pos = 0  # how far the state machine has read
        self._content_sent = 0  # the output up to here went out as content (less spaces dropped)
        self._state = self.start_state
        self._after_object = ""  # the state that follows a call's object
        self._scanner: ObjectScanner | None = None
        self._call_id = ""
        self._opened = False  # the current call's opening delta went out
        self._out: list[Delta] = []

    @classmethod
    def parse(cls, text: str) -> ParsedOutput:
        parser = cls()
        deltas = parser.feed(text) + parser.finish()
        if parser.malformed or not parser.tool_calls:
            return ParsedOutput(content=text)
        content = "".join(d.content for d in deltas if d.content is not None)
        return ParsedOutput(content=content or None, tool_calls=list(parser.tool_calls))

    def feed(self, text: str) -> list[Delta]:
        self._raw += text
        if self._state == "text":
            self._send_content(self._end())
        elif self._state != "dropped":
            while self._advance():
                pass
        self._trim()
        return self._flush()

    def finish(self) -> list[Delta]:
        """The end of the output: what was held back goes out, or proves a call cut short."""
        if self._state in ("content", "start", "text"):  # all of the output is content so far
            self._send_content(self._end())
        elif not self._may_end():
            self._give_up()
        return self._flush()

    def _advance(self) -> bool:
        """Reads what the current state can decide of the unread text; False once it must
        wait for more. ``text`` and ``dropped`` never get here: ``feed`` handles them."""
        return getattr(self, f"_in_{self._state}")()

    def _may_end(self) -> bool:
        """Whether the output may end in the current (framing) state."""
        raise NotImplementedError

    def _end(self) -> int:
        return self._base + len(self._raw)

    def _rest(self) -> str:
        return self._raw[self._pos - self._base:]

    def _trim(self) -> None:
        if self._state in ("text", "dropped") or self.tool_calls or self._opened:
            keep = self._pos if self._state not in ("text", "dropped") else self._end()
        else:
            keep = min(self._pos, self._content_sent)
        if keep > self._base:
            self._raw, self._base = self._raw[keep - self._base:], keep

    def _send_content(self, end: int) -> None:
        if end > self._content_sent:
            text = self._raw[self._content_sent - self._base:end - self._base]
            if self._out and self._out[-1].content is not None:
                text = self._out.pop().content + text
            self._out.append(Delta(content=text))
            self._content_sent = end

    def _flush(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _give_up(self) -> None:
        """Malformed: the output is content after all, unless a call has gone out already."""
        self.malformed = True
        if self.tool_calls or self._opened:
            self._state = "dropped"
        else:
            self._state = "text"
            self._send_content(self._end())

    def _skip_space(self) -> str:
        rest = self._rest()
        stripped = rest.lstrip()
        self._pos += len(rest) - len(stripped)
        return stripped

    def _open_object(self, rest: str, then: str) -> bool:
        """At the first non-space character of a call: an object starts here, or it is no call."""
        if not rest:
            return False
        if rest[0] != "{":
            self._give_up()
            return False
        self._scanner, self._call_id, self._opened = ObjectScanner(self.args_key), \
            self.call_ids(), False
        self._state, self._after_object = "object", then
        return True

    def _in_object(self) -> bool:
        scanner = self._scanner
        assert scanner is not None
        self._pos += scanner.feed(self._rest())
        if scanner.failed or (scanner.done and not self._valid(scanner)):
            self._give_up()
            return False
        self._send_call(scanner)
        if not scanner.done:
            return False
        self.tool_calls.append(ToolCall(id=self._call_id, name=scanner.name or "",
                                        arguments=scanner.arguments() or "{}"))
        self._scanner, self._opened, self._state = None, False, self._after_object
        return True

    def _valid(self, scanner: ObjectScanner) -> bool:
        try:
            json.loads(scanner.text)
        except ValueError:
            return False
        return scanner.name is not None

    def _send_call(self, scanner: ObjectScanner) -> None:
        """Opens the call once its name and the start of its arguments are known, then sends
        each new piece of the arguments (all ``{}`` when the model wrote none)."""
        index = len(self.tool_calls)
        if not self._opened:
            if scanner.name is None or not (scanner.has_arguments or scanner.done):
                return
            self._out.append(opening(index, self._call_id, scanner.name))
            self._opened = True
        new = scanner.take_arguments()
        if scanner.done and not scanner.has_arguments:
            new = "{}"
        if new:
            self._out.append(fragment(index, new))


class HermesToolParser(ToolCallParser):
    """``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Hermes,
    Qwen2.5), after optional text. As in vLLM, content is the text before the first block,
    less trailing whitespace; text after or between blocks is dropped. A last block may
    lack its ``</tool_call>`` (the model stopped right after the object)."""

    name = "hermes"
    start_state = "content"
    START, END = "<tool_call>", "</tool_call>"

    def _in_content(self) -> bool:
        rest = self._rest()
        found = rest.find(self.START)
        if found < 0:  # hold back what may open a tag, and spaces that may precede one
            held = _partial_suffix(rest, self.START)
            kept = rest[:len(rest) - held].rstrip()
            self._send_content(self._pos + len(kept))
            self._pos += len(kept)
            return False
        self._send_content(self._pos + len(rest[:found].rstrip()))
        self._pos += found + len(self.START)
        self._state = "open"
        return True

    def _in_open(self) -> bool:
        return self._open_object(self._skip_space(), then="close")

    def _in_close(self) -> bool:
        rest = self._skip_space()
        if rest.startswith(self.END):
            self._pos += len(self.END)
            self._state = "between"
            return True
        if not self.END.startswith(rest):
            self._give_up()
        return False

    def _in_between(self) -> bool:
        """Text after a block is dropped, all but what may start the next tag."""
        rest = self._rest()
        found = rest.find(self.START)
        if found < 0:
            self._pos += len(rest) - _partial_suffix(rest, self.START)
            return False
        self._pos += found + len(self.START)
        self._state = "open"
        return True

    def _may_end(self) -> bool:
        return self._state in ("close", "between", "dropped")


class Llama3JsonToolParser(ToolCallParser):
    """The whole output is ``{"name": ..., "parameters": {...}}`` (Llama 3.1 and later), after
    an optional ``<|python_tag|>``; several calls are separated by ``;``. An output that
    starts otherwise is content."""

    name = "llama3_json"
    args_key = "parameters"
    start_state = "start"
    PYTHON_TAG = "<|python_tag|>"

    def _in_start(self) -> bool:
        rest = self._rest()
        head = rest.lstrip()
        if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
            return False
        if head.startswith(self.PYTHON_TAG):
            self._pos += len(rest) - len(head) + len(self.PYTHON_TAG)
        elif head[0] != "{":
            self._state = "text"
            self._send_content(self._end())
            return False
        self._state = "object_start"
        return True

    def _in_object_start(self) -> bool:
        return self._open_object(self._skip_space(), then="separator")

    def _in_separator(self) -> bool:
        rest = self._skip_space()
        if not rest:
            return False
        if rest[0] != ";":
            self._give_up()
            return False
        self._pos += 1
        self._state = "object_start"
        return True

    def _may_end(self) -> bool:
        return self._state in ("separator", "dropped") or (
            self._state == "object_start" and bool(self.tool_calls))


FORMATS: dict[str, type[ToolCallParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}
