"""The labelled corpus (redaction_corpus.py) meets the targets docs/request-logs.md reports."""

from __future__ import annotations

from tests.redaction.redaction_corpus import NEGATIVES, POSITIVES, score


def test_the_corpus_is_large_enough_to_mean_something():
    s = score()
    assert s.labelled["secrets"] >= 40 and s.labelled["cards"] >= 10
    assert len(NEGATIVES) >= 60 and len(POSITIVES) >= 60


def test_every_secret_and_card_in_the_corpus_is_redacted():
    s = score()
    assert s.recall("secrets") == 1.0
    assert s.recall("cards") == 1.0


def test_personal_data_recall_is_complete_on_the_corpus():
    assert score().recall("personal") == 1.0


def test_precision_is_at_least_095():
    s = score()
    assert s.precision >= 0.95, s.false_positives


def test_look_alikes_are_mostly_left_whole():
    s = score(NEGATIVES)
    assert s.detections <= 3, s.false_positives
