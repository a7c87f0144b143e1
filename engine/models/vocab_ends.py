"""The two ends every decoder model shares: the token embedding in, the LM head out.

    class Gemma3Model(VocabEnds): ...       # sets self.embed_tokens and self.lm_head at load
    self.lm_head = make_linear("lm_head.weight", lm_head_weight(config, weights, self.embed_tokens))

`VocabEnds.embed` and `VocabEnds.compute_logits` are what the model runner calls at a step's two
ends; a tensor-parallel rank replaces `embed` and `lm_head` on the instance with their
vocab-parallel forms (engine/parallel/layers.py), so a model reads them through `self` only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.layers.linear import LinearWeight
from engine.models.weights import Weights, take_optional


class VocabEnds:
    """A decoder's embedding lookup and logits. Subclasses set `embed_tokens` [vocab, hidden] and
    `lm_head` ([vocab, hidden] linear) before the first step."""

    embed_tokens: torch.Tensor
    lm_head: LinearWeight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> [T, hidden]. A tensor-parallel rank sets an instance attribute of the
        same name, the vocab-parallel lookup (engine/parallel/layers.py)."""
        return F.embedding(input_ids, self.embed_tokens)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [S, hidden] (the rows to sample from) -> logits [S, vocab] in float32."""
        return self.lm_head(hidden).float()


def lm_head_weight(config: ModelConfig, weights: Weights, embed_tokens: torch.Tensor
                   ) -> torch.Tensor:
    """Pops "lm_head.weight" [vocab, hidden] out of `weights` -> the head's dense weight:
    `embed_tokens` when the config ties them or the checkpoint has none (a present one is still
    shape-checked, then dropped), else the checkpoint's."""
    lm_head = take_optional(weights, "lm_head.weight", (config.vocab_size, config.hidden_size))
    if lm_head is None or config.tie_word_embeddings:
        return embed_tokens
    return lm_head
