"""A constrained sequence's grammar state, and the step's one token bitmask over its logits.

Each sequence (each of a request's ``n``) has its own matcher, which has accepted exactly the
sequence's output tokens: it advances only where the sequence appends a sampled token
(``Sequence.append_token``), so recomputing a preempted sequence's KV leaves it as it is.
"""

from __future__ import annotations

import logging

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


class SequenceGrammar:
    __slots__ = ("matcher", "rejected_token")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.rejected_token: int | None = None

    def accept(self, token_id: int) -> None:
        # The bitmask allows only tokens the grammar accepts; a refusal means a row had no allowed
        # token left. The sequence then ends (``done``) instead of running on unconstrained.
        if not self.matcher.accept_token(token_id):
            self.rejected_token = token_id
            logger.error("the grammar refused token %d, which its bitmask should have masked; the sequence "
                         "ends here", token_id)

    def accept_resumed(self, token_ids: list[int]) -> int | None:
        """Accept a resumed sequence's outputs, generated under this grammar elsewhere; the index of
        the first one it refuses (None: all accepted)."""
        for i, t in enumerate(token_ids):
            if not self.matcher.accept_token(t):
                return i
        return None

    @property
    def done(self) -> bool:
        """The grammar is complete (it accepted a stop token), or refused a token."""
        return self.rejected_token is not None or self.matcher.is_terminated()


class GrammarMasker:
    """Fills one int32 bitmask [S, ceil(V/32)] for a step's constrained rows, then sets every
    logit their grammars refuse to -inf. Rows without a grammar are neither filled nor touched.

    The bitmask is as wide as the logits, and the grammars were compiled for that width: ids past
    the tokenizer's vocabulary (a padded embedding) are refused like any other."""

    def __init__(self) -> None:
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V/32)] int32, grown to the largest step

    def __call__(self, logits: torch.Tensor, grammars: list[SequenceGrammar | None]) -> None:
        # logits: [S, V], modified in place; grammars: [S], None for an unconstrained row
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return
        bitmask = self._buffer(logits.shape[0], logits.shape[1])
        for row in rows:
            try:
                grammars[row].matcher.fill_next_token_bitmask(bitmask, row)
            except Exception:  # one request's grammar fails that request alone
                logger.exception("a grammar's token bitmask could not be filled; its sequence ends")
                bitmask[row] = 0  # allows no token: the sampler ends the row (sampler.in_vocabulary)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)

    def _buffer(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        width = -(-vocab_size // 32)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows or self._bitmask.shape[1] != width:
            self._bitmask = xgr.allocate_token_bitmask(num_rows, vocab_size)
        return self._bitmask[:num_rows]
