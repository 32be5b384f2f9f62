"""The predictions' key bookkeeping (router/predictions.py): which slots each predicted key is
predicted on, and the counts behind it, exactly, as predictions come and go."""

from __future__ import annotations

from collections import Counter

from pagefleet.router.global_scheduler import WorkerView
from pagefleet.router.predictions import Prediction, Predictions, _uncount


def test_uncount_removes_the_keys_that_reach_zero_with_distinct_and_repeated_keys():
    counter = Counter({1: 2, 2: 1, 3: 1, 4: 5})
    assert _uncount(counter, [1, 2, 3]) == [2, 3]  # distinct keys
    assert counter == Counter({1: 1, 4: 5}) and 2 not in counter and 3 not in counter
    assert _uncount(counter, [4, 1, 4]) == [1]  # a key twice takes two counts
    assert dict(counter) == {4: 3}
    assert _uncount(counter, [4, 4, 4]) == [4] and not counter


def test_the_mask_holds_each_key_while_any_prediction_on_a_slot_says_so():
    preds = Predictions()
    v0, v1 = WorkerView("w0", 0, 0.0), WorkerView("w1", 1, 0.0)
    a = Prediction("a", "w0", 0, 1.0, [10, 11, 12], blocks=3, seqs=1)
    b = Prediction("b", "w0", 0, 1.0, [11, 12, 13], blocks=3, seqs=1)
    c = Prediction("c", "w1", 1, 1.0, [12, 14], blocks=2, seqs=1)
    for pred, view in ((a, v0), (b, v0), (c, v1)):
        preds.add(pred, view)
    assert preds.mask == {10: 0b01, 11: 0b01, 12: 0b11, 13: 0b01, 14: 0b10}
    assert (v0.predicted_blocks, v0.predicted_seqs, v1.predicted_blocks) == (6, 2, 2)
    preds.end(a, v0)  # 11 and 12 stay: b predicts them on slot 0 too
    assert preds.mask == {11: 0b01, 12: 0b11, 13: 0b01, 14: 0b10}
    preds.end(b, v0)  # 12 stays for slot 1 only
    assert preds.mask == {12: 0b10, 14: 0b10}
    assert (v0.predicted_blocks, v0.predicted_seqs) == (0, 0)
    preds.end(c, v1)
    assert preds.mask == {} and preds.by_request == {} and preds._refs == {0: Counter(), 1: Counter()}
