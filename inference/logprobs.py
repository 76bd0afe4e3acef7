"""Engine logprobs as OpenAI writes them: chat's ``logprobs.content`` entries and the legacy
completions object (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``).

The engine sends token ids with their log-probabilities under the model's raw
distribution (docs/api.md); the token texts and bytes come from the model's tokenizer
here. A byte-level BPE token holds raw bytes that may be part of one UTF-8 character:
``bytes`` is exact, ``token`` shows such a fragment with U+FFFD, as OpenAI does.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from tokenizers import Tokenizer, pre_tokenizers

# One engine logprob: [logprob, [[token_id, logprob], ...]] (engine/protocol.py EV_DELTA).
WireLogprob = list[Any]


@cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins back to the bytes they stand for."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # NOTE: the standard table: printable Latin-1 bytes map to themselves, the other 68
    # bytes to the code points from U+0100 on, in byte order.
    printable = [b for b in range(256) if (33 <= b <= 126) or (161 <= b <= 172)
                 or (174 <= b <= 255)]
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    assert set(table) == set(alphabet)
    return table


class TokenTexts:
    """Token id -> (text, bytes) for one tokenizer, cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self.special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._compute(token_id)
        return found

    def _compute(self, token_id: int) -> tuple[str, bytes]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (padded embeddings)
            return "", b""
        if self.byte_level and piece not in self.special:
            table = _byte_decoder()
            raw = bytes(table[c] for c in piece) if all(c in table for c in piece) \
                else piece.encode()
        else:
            raw = self.tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return raw.decode("utf-8", errors="replace"), raw


def chat_entries(texts: TokenTexts, logprobs: list[WireLogprob],
                 token_ids: list[int]) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries for these tokens."""
    out = []
    for token_id, (logprob, top) in zip(token_ids, logprobs, strict=False):
        text, raw = texts.get(token_id)
        out.append({"token": text, "logprob": logprob, "bytes": list(raw),
                    "top_logprobs": [_chat_top(texts, t, lp) for t, lp in top]})
    return out


def _chat_top(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = texts.get(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


class CompletionLogprobs:
    """The legacy completions ``logprobs`` object, built up delta by delta."""

    def __init__(self, texts: TokenTexts, offset: int = 0) -> None:
        self.texts = texts
        self.offset = offset  # characters of text before the next token

    def part(self, logprobs: list[WireLogprob], token_ids: list[int]) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, (logprob, top) in zip(token_ids, logprobs, strict=False):
            text, _ = self.texts.get(token_id)
            tokens.append(text)
            token_logprobs.append(logprob)
            tops.append({self.texts.get(t)[0]: lp for t, lp in top})
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}


def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged


# One engine prompt logprob: [logprob, rank, [[token_id, logprob], ...]], for each prompt
# token after the first (engine/protocol.py EV_DELTA "prompt_logprobs").
def echoed_prompt(texts: TokenTexts, prompt_ids: list[int], wire: list[WireLogprob],
                  top: int) -> dict[str, Any]:
    """The prompt's part of an echoed completion's ``logprobs`` (OpenAI's echo with
    logprobs): its first token has none (nothing precedes it), the others their logprob and
    the ``top`` most likely where they stand."""
    tokens, offsets, offset = [], [], 0
    for token_id in prompt_ids:
        text, _ = texts.get(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None] + [entry[0] for entry in wire],
            "top_logprobs": [None] + [{texts.get(t)[0]: lp for t, lp in entry[2][:top]}
                                      for entry in wire],
            "text_offset": offsets}


def vllm_prompt_logprobs(texts: TokenTexts, prompt_ids: list[int], wire: list[WireLogprob],
                         top: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``choices[].prompt_logprobs``: None for the first token, then for each one
    its own id and the ``top`` most likely there, by id, each with its logprob, its rank
    and its text."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token_id, (logprob, rank, most) in zip(prompt_ids[1:], wire, strict=True):
        entry = {str(t): {"logprob": lp, "rank": r, "decoded_token": texts.get(t)[0]}
                 for r, (t, lp) in enumerate(most[:top], start=1)}
        entry.setdefault(str(token_id), {"logprob": logprob, "rank": rank,
                                         "decoded_token": texts.get(token_id)[0]})
        out.append(entry)
    return out
