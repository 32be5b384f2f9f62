"""merge_deltas: what a lagging consumer gets instead of one delta per engine step."""

from pagefleet.worker.outputs import CompletionOutput, RequestOutputDelta, TokenLogprob, merge_deltas


def _delta(seqs, finished=False, cached=0):
    return RequestOutputDelta("r", seqs, 7, cached, finished)


def test_one_delta_is_returned_as_it_is():
    d = _delta([CompletionOutput(0, "a", [1], None, None)])
    assert merge_deltas([d]) is d


def test_texts_tokens_and_logprobs_join_in_order_and_the_last_finish_wins():
    lp = [TokenLogprob(1, -0.5), TokenLogprob(2, -1.0), TokenLogprob(3, -2.0)]
    deltas = [_delta([CompletionOutput(0, "He", [1], lp[:1], None)], cached=16),
              _delta([CompletionOutput(0, "llo", [2], lp[1:2], None)], cached=0),
              _delta([CompletionOutput(0, "!", [3], lp[2:], "stop", "!")], finished=True)]
    merged = merge_deltas(deltas)
    assert merged == RequestOutputDelta("r", [CompletionOutput(0, "Hello!", [1, 2, 3], lp, "stop", "!")], 7, 16, True)
    assert deltas[0].sequences[0] == CompletionOutput(0, "He", [1], lp[:1], None)  # inputs untouched


def test_sequences_of_n_merge_by_index_including_ones_that_finished_early():
    deltas = [_delta([CompletionOutput(1, "x", [5], None, None), CompletionOutput(0, "a", [1], None, None)]),
              _delta([CompletionOutput(0, "b", [2], None, "length")]),
              _delta([CompletionOutput(1, "y", [6], None, "length")], finished=True)]
    merged = merge_deltas(deltas)
    assert merged.sequences == [CompletionOutput(0, "ab", [1, 2], None, "length"),
                                CompletionOutput(1, "xy", [5, 6], None, "length")]
    assert merged.finished
