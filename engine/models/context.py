"""How many tokens a checkpoint's context holds, read from its config.json (no torch).

One rule for the engine (``ModelConfig``) and the platform (``served_models``), so the
platform never admits a request the engine then refuses for its length.
"""

from __future__ import annotations

from typing import Any


def context_window(raw: dict[str, Any]) -> int:
    """``max_position_embeddings``, capped by a sliding window where the model uses one.

    NOTE: attention here is always full; a context no longer than the window makes that
    exact, so the window caps the context instead.
    """
    context = int(raw.get("max_position_embeddings") or 2048)
    is_qwen2 = raw.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in (
        raw.get("architectures") or [])
    window = raw.get("sliding_window")
    if window and (raw.get("use_sliding_window", True) if is_qwen2 else True):
        context = min(context, int(window))
    return context
