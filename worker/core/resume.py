"""A sequence continued on this engine after the replica that ran it was lost (mid-stream failover).

The ingress sends the original prompt and sampling params with a ``ResumeState``; the engine
creates the one sequence with those outputs already appended and carries on from there, so that
what it streams joins what the client was sent as the uninterrupted sequence would have
(docs/reliability.md, "Failover: the engine's part").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagefleet.worker.request_check import InvalidRequest, RequestLimits

if TYPE_CHECKING:
    from pagefleet.worker.sampling_params import SamplingParams


@dataclass(slots=True)
class ResumeState:
    """A sequence continued elsewhere: what it had generated and what its client was sent."""

    output_token_ids: list[int]  # tokens the sequence had generated (all of them, sent or not)
    emitted_text_chars: int  # characters of its output text the client has been sent
    seq_index: int  # the sequence's index in its original request (n > 1)


def check_resume(prompt_token_ids: list[int], params: "SamplingParams", resume: ResumeState,
                 limits: RequestLimits) -> None:
    """Raise ``InvalidRequest`` for a resume that cannot be the state of a sequence of this request
    (what needs the tokenizer or the grammar is checked where the sequence is built)."""
    if params.n != 1:
        raise InvalidRequest(f"a resumed request continues one sequence: n must be 1, got {params.n}", "n")
    if not _is_int(resume.seq_index) or resume.seq_index < 0:
        raise InvalidRequest(f"resume.seq_index must be an integer >= 0, got {resume.seq_index!r}", "resume")
    if not _is_int(resume.emitted_text_chars) or resume.emitted_text_chars < 0:
        raise InvalidRequest(f"resume.emitted_text_chars must be an integer >= 0, got "
                             f"{resume.emitted_text_chars!r}", "resume")
    outputs = resume.output_token_ids
    if params.max_tokens is not None and len(outputs) > params.max_tokens:
        raise InvalidRequest(f"{len(outputs)} resumed output tokens are more than max_tokens "
                             f"({params.max_tokens})", "resume")
    if len(prompt_token_ids) + len(outputs) > limits.max_model_len:
        raise InvalidRequest(f"the prompt ({len(prompt_token_ids)} tokens) and the resumed output "
                             f"({len(outputs)}) are longer than max_model_len ({limits.max_model_len})", "resume")
    for i, t in enumerate(outputs):
        if not _is_int(t) or not 0 <= t < limits.vocab_size:
            raise InvalidRequest(f"resumed output token {i} ({t!r}) is outside the vocabulary "
                                 f"[0, {limits.vocab_size})", "resume")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
