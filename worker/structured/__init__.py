"""Grammar-constrained decoding: compiled grammars, and the per-sequence matchers that mask logits."""
