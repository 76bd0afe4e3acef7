"""Incremental detokenization with stop strings, independent of any model.

Token ids arrive one at a time; each call returns the text that may be shown
now. Two things are held back: a trailing broken UTF-8 sequence (the decoded
window ends in U+FFFD until the character's last byte arrives), and text that
could still turn out to be the start of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """One request's output text; the engine feeds it every sampled token."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stop_string: str | None = None  # the stop string that ended the text
        self.finished = False
        # NOTE: ids[_prefix_offset:_read_offset] decode to _prefix_text, which was already
        # emitted; decoding from _prefix_offset (not from 0) keeps each step O(1) in the
        # output length while giving the tokenizer's decoder a little left context.
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""
        self._pending = ""  # decoded, not emitted: it may begin a stop string
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def stopped(self) -> bool:
        return self.stop_string is not None

    def add_token(self, token_id: int) -> str:
        """Returns the new text this token makes safe to emit (often "")."""
        if self.finished:
            raise RuntimeError("the detokenizer has finished")
        self.token_ids.append(token_id)
        window = self._decode(self.token_ids[self._prefix_offset:])
        if len(window) <= len(self._prefix_text) or window.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a multi-byte character is still incomplete
        new_text = window[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset:self._read_offset])
        return self._release(new_text)

    def flush(self) -> str:
        """Ends the text: returns whatever was held back (nothing after a stop string)."""
        if self.finished:
            return ""
        self.finished = True
        if self.stopped:
            return ""
        tail = ""
        if self._read_offset < len(self.token_ids):
            window = self._decode(self.token_ids[self._prefix_offset:])
            tail = window[len(self._prefix_text):]
        text, self._pending = self._pending + tail, ""
        hit = self._find_stop(text)
        if hit is not None:
            text = text[:hit]
        self.text += text
        return text

    def _release(self, new_text: str) -> str:
        if not self.stop:
            self.text += new_text
            return new_text
        pending = self._pending + new_text
        hit = self._find_stop(pending)
        if hit is not None:
            out, self._pending = pending[:hit], ""
            self.finished = True
        else:
            hold = self._stop_prefix_len(pending)
            out, self._pending = pending[:len(pending) - hold], pending[len(pending) - hold:]
        self.text += out
        return out

    def _find_stop(self, text: str) -> int | None:
        """Index of the earliest stop string in ``text``; records which one matched."""
        best: int | None = None
        for stop in self.stop:
            index = text.find(stop)
            if index != -1 and (best is None or index < best):
                best, self.stop_string = index, stop
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that some stop string starts with."""
        for size in range(min(len(text), self._max_hold), 0, -1):
            suffix = text[-size:]
            if any(stop.startswith(suffix) for stop in self.stop):
                return size
        return 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)
