"""The shape of a demo checkpoint and the recipe of its brief training pass.

Its own module because both the builder (``demo_model.py``) and the trainer
(``demo_train.py``) read it, and neither should import the other to get it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ModelSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int = 2048
    init_std: float = 0.02
    train_steps: int = 0  # a brief pass on the corpus so the demo babbles English-like text
    train_batch: int = 8
    train_seq_len: int = 64
    # 2e-2 left the demo answering chat-control tokens (<|user|>, BOS) on some CPUs.
    train_lr: float = 5e-3

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError("hidden_size must be a multiple of num_attention_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads
