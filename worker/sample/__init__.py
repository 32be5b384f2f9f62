"""Sampling: a step's logits to its next tokens (processors, penalties, grammars, draws, logprobs)."""
