"""A resumed sequence's start (``core.resume``): its detokenizer and grammar as the original's were
after the tokens it had generated. Built off the step thread (``AsyncLLMEngine.generate``): the
replay costs a couple of decodes and one grammar step per resumed token."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from pagefleet.worker.core.resume import ResumeState
from pagefleet.worker.engine.detokenizer import IncrementalDetokenizer
from pagefleet.worker.request_check import InvalidRequest
from pagefleet.worker.sampling_params import SamplingParams
from pagefleet.worker.structured.matcher import SequenceGrammar

if TYPE_CHECKING:
    import xgrammar as xgr


class ResumedStart(NamedTuple):
    output_token_ids: list[int]
    seq_index: int
    detokenizer: IncrementalDetokenizer  # text = the outputs' text, emitted = what the client was sent
    grammar: SequenceGrammar | None  # has accepted every output token
    stop_str: str | None  # a stop string the outputs' text already holds: the sequence is done


def new_detokenizer(tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, prompt_token_ids, params.stop, params.include_stop_str_in_output,
                                  params.skip_special_tokens)


def resumed_start(tokenizer, prompt_token_ids: list[int], params: SamplingParams, resume: ResumeState,
                  grammar: "xgr.CompiledGrammar | None") -> ResumedStart:
    """Raise ``InvalidRequest`` where the outputs cannot be this request's: a token the grammar
    refuses, or more characters sent than their text holds. ``resume`` passed ``check_resume``."""
    outputs = list(resume.output_token_ids)
    detok = new_detokenizer(tokenizer, prompt_token_ids, params)
    stop_str = detok.replay([*prompt_token_ids, *outputs], len(prompt_token_ids), params.min_tokens)
    if resume.emitted_text_chars > len(detok.text):
        raise InvalidRequest(f"resume.emitted_text_chars ({resume.emitted_text_chars}) is more than the "
                             f"{len(detok.text)} characters of the resumed output's text", "resume")
    detok.emitted = resume.emitted_text_chars
    matcher = None
    if grammar is not None:
        matcher = SequenceGrammar(grammar)
        refused = matcher.accept_resumed(outputs)
        if refused is not None:
            raise InvalidRequest(f"resumed output token {refused} ({outputs[refused]}) is refused by the "
                                 "request's structured_outputs grammar", "resume")
    return ResumedStart(outputs, resume.seq_index, detok, matcher, stop_str)
