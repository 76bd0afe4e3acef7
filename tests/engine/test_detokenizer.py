from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.demo_model import SPECIAL_TOKENS
from engine.detokenizer import IncrementalDetokenizer

# Text as a model writes it: special tokens are ids, never spelled out in the text.
UNICODE = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\ufffd"),
                  max_size=40).filter(lambda t: not any(s in t for s in SPECIAL_TOKENS))


def _stream(tokenizer: Tokenizer, text: str, stop: list[str] | None = None
            ) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, stop or [])
    deltas = []
    for token_id in tokenizer.encode(text, add_special_tokens=False).ids:
        deltas.append(detok.add_token(token_id))
        if detok.stopped:
            break
    deltas.append(detok.flush())
    return deltas, detok


@settings(max_examples=300, deadline=None)
@given(UNICODE)
def test_no_delta_holds_a_broken_character(tokenizer: Tokenizer, text: str):
    deltas, _ = _stream(tokenizer, text)
    assert not any("\ufffd" in d for d in deltas)


@settings(max_examples=300, deadline=None)
@given(UNICODE)
def test_concatenated_deltas_equal_the_full_decode(tokenizer: Tokenizer, text: str):
    deltas, detok = _stream(tokenizer, text)
    assert "".join(deltas) == tokenizer.decode(detok.token_ids) == text


def test_deltas_of_ordinary_text_rebuild_it_exactly(tokenizer: Tokenizer):
    text = "Straße, naïve café — 東京 🦊 and tabs\t and\nnewlines"
    assert "".join(_stream(tokenizer, text)[0]) == text


def test_multibyte_characters_split_across_tokens_wait_for_their_last_byte(
        tokenizer: Tokenizer):
    text = "🦊"  # four bytes; byte-level BPE learned no merge for it
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.add_token(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1) and deltas[-1] == text


def test_special_tokens_are_left_out_of_the_text(tokenizer: Tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_token(tokenizer.token_to_id("<|end|>")) == ""
    assert detok.flush() == ""


def test_stop_string_across_a_token_boundary_is_not_emitted(tokenizer: Tokenizer):
    text = "The old sailor finds a golden boat."
    deltas, detok = _stream(tokenizer, text, stop=["sailor fi"])
    assert "".join(deltas) == "The old "
    assert detok.stopped and detok.stop_string == "sailor fi"


def test_a_possible_stop_prefix_is_held_until_it_is_disambiguated(tokenizer: Tokenizer):
    detok = IncrementalDetokenizer(tokenizer, ["boat!"])
    out = []
    for token_id in tokenizer.encode("a golden boat.", add_special_tokens=False).ids:
        out.append(detok.add_token(token_id))
    assert out[-2:] == [" ", "boat."]  # "boat" waited for the "." that ruled out "boat!"
    assert not detok.stopped


def test_held_text_is_released_by_flush_when_generation_ends(tokenizer: Tokenizer):
    deltas, detok = _stream(tokenizer, "a golden boat", stop=["boat!"])
    assert deltas[-1] == "boat" and "".join(deltas) == "a golden boat"
    assert not detok.stopped


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer):
    deltas, detok = _stream(tokenizer, "one two three four", stop=["four", "two"])
    assert "".join(deltas) == "one "
    assert detok.stop_string == "two"


@settings(max_examples=200, deadline=None)
@given(UNICODE, st.data())
def test_text_stops_right_before_the_first_stop_string(tokenizer: Tokenizer, text: str, data):
    assume(text)
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:data.draw(st.integers(start + 1, len(text)))]
    deltas, detok = _stream(tokenizer, text, stop=[stop])
    assert "".join(deltas) == text[:text.index(stop)]
    assert detok.stopped


def test_adding_after_finish_is_an_error(tokenizer: Tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add_token(5)
