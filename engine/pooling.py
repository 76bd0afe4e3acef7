"""How an embedding model turns an input's final hidden states into one vector.

A checkpoint in the sentence-transformers layout says it in its own files: ``modules.json``
lists a Transformer module (the checkpoint itself, at path "" or "."), a Pooling module
whose ``config.json`` names the pooling, and optionally a Normalize module (L2). Such a
checkpoint is an embedding model: it serves embed requests only. A generative checkpoint
serves them too when the operator turns embeddings on (``--embeddings``): last-token
pooling, normalised (``GENERATIVE``).

Plain Python, no torch: the runner does the arithmetic (engine/embedding.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MEAN, CLS, LAST = "mean", "cls", "last"
# A Pooling module's config, in the layout before sentence-transformers 6 (one boolean per
# mode) and in its own ("pooling_mode": a name), to ours.
_LEGACY_MODES = {"pooling_mode_mean_tokens": MEAN, "pooling_mode_cls_token": CLS,
                 "pooling_mode_lasttoken": LAST}
_NAMED_MODES = {"mean": MEAN, "cls": CLS, "lasttoken": LAST}
_UNSUPPORTED_LEGACY = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True, slots=True)
class Pooling:
    mode: str  # MEAN: the average of every position; CLS: the first token's; LAST: the last's
    normalize: bool  # scaled to unit L2 norm

    def __post_init__(self) -> None:
        if self.mode not in (MEAN, CLS, LAST):
            raise ValueError(f"pooling mode must be {MEAN}, {CLS} or {LAST}, got {self.mode!r}")


# What ``--embeddings`` makes a generative model answer with: a causal model's last position
# is the only one that has read the whole input.
GENERATIVE = Pooling(LAST, normalize=True)


def read_pooling(model_dir: Path) -> Pooling | None:
    """The pooling a sentence-transformers checkpoint declares; None for a checkpoint in
    another layout (no ``modules.json``). Raises ValueError for modules or modes the engine
    cannot reproduce (a Dense projection, max pooling, several modes at once)."""
    modules_path = Path(model_dir) / "modules.json"
    if not modules_path.exists():
        return None
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_path} must be a list of modules")
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    if kinds[:1] != ["Transformer"] or modules[0].get("path", "") not in ("", "."):
        raise ValueError(f"{modules_path}: the first module must be the Transformer at the "
                         f"checkpoint's own folder")
    if unknown := sorted(set(kinds) - {"Transformer", "Pooling", "Normalize"}):
        raise ValueError(f"{modules_path}: modules {', '.join(unknown)} are not supported "
                         f"(Transformer, Pooling and Normalize are)")
    if kinds.count("Pooling") != 1:
        raise ValueError(f"{modules_path} must list one Pooling module")
    pooling = modules[kinds.index("Pooling")]
    config = _read_json(Path(model_dir) / str(pooling.get("path", "")) / "config.json")
    # NOTE: a Pooling config's include_prompt is not read: it drops the tokens of an
    # instruction sentence-transformers itself put before the text, and the engine gets
    # token ids, never such a prompt.
    normalize = "Normalize" in kinds
    if normalize and kinds.index("Normalize") < kinds.index("Pooling"):
        raise ValueError(f"{modules_path}: Normalize must come after Pooling")
    return Pooling(_mode(config), normalize=normalize)


def read_max_seq_length(model_dir: Path) -> int | None:
    """The longest input a sentence-transformers checkpoint takes (its
    ``sentence_bert_config.json``), None when it names none. NOTE: sentence-transformers
    cuts a longer input short; the engine refuses it, as it does a prompt past the window."""
    path = Path(model_dir) / "sentence_bert_config.json"
    if not path.exists():
        return None
    value = _read_json(path).get("max_seq_length")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _mode(config: Any) -> str:
    if not isinstance(config, dict):
        raise ValueError("the Pooling module's config.json must be an object")
    if "pooling_mode" in config:
        named = config["pooling_mode"]
        named = named[0] if isinstance(named, list) and len(named) == 1 else named
        if not isinstance(named, str) or named not in _NAMED_MODES:
            raise ValueError(f"pooling mode {named!r} is not supported "
                             f"(supported: {', '.join(_NAMED_MODES)})")
        return _NAMED_MODES[named]
    if unsupported := [key for key in _UNSUPPORTED_LEGACY if config.get(key)]:
        raise ValueError(f"pooling modes {', '.join(unsupported)} are not supported (mean, "
                         f"cls token and last token are)")
    modes = [mode for key, mode in _LEGACY_MODES.items() if config.get(key)]
    if len(modes) > 1:
        raise ValueError("a Pooling module with several modes (a concatenation) is not "
                         "supported")
    # NOTE: sentence-transformers pools by the mean when no mode is set; so does the engine.
    return modes[0] if modes else MEAN


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
