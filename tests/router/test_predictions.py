"""The predictions' key bookkeeping (router/global_scheduler/predictions.py): which slots each predicted key is
predicted on, and the counts behind it, exactly, as predictions come and go; and the compiled index that mirrors
them for the compiled prefix match."""

from __future__ import annotations

from collections import Counter

import pytest

from pagefleet.router.global_scheduler.kv_index_native import NativeKVBlockIndex
from pagefleet.router.global_scheduler.predictions import Prediction, Predictions, _uncount
from pagefleet.router.global_scheduler.views import WorkerView


def test_uncount_removes_the_keys_that_reach_zero_with_distinct_and_repeated_keys():
    counter = Counter({1: 2, 2: 1, 3: 1, 4: 5})
    assert _uncount(counter, [1, 2, 3]) == [2, 3]  # distinct keys
    assert counter == Counter({1: 1, 4: 5}) and 2 not in counter and 3 not in counter
    assert _uncount(counter, [4, 1, 4]) == [1]  # a key twice takes two counts
    assert dict(counter) == {4: 3}
    assert _uncount(counter, [4, 4, 4]) == [4] and not counter


@pytest.fixture(params=[False, True], ids=["dict", "compiled"])
def preds(request):
    return Predictions(NativeKVBlockIndex(request.getfixturevalue("compiled_lib")) if request.param else None)


def predicted(preds: Predictions) -> dict[int, int]:
    """Each predicted key's slots as a bit mask: what the index's prefix match sees."""
    masks = {key: preds.holders(key) for key in range(20)}
    masks = {key: mask for key, mask in masks.items() if mask}
    assert len(preds.held_index if preds.held_index is not None else preds.held) == len(masks)
    return masks


def counts(preds: Predictions) -> dict[int, dict[int, int]]:
    """key -> slot -> predictions, for the keys several predictions hold (``_counts``, or with the
    compiled index, one per (slot, key) there and ``_repeats`` beyond it)."""
    if preds.held_index is None:
        return preds._counts
    out = {}
    for key in range(20):
        mask = preds.holders(key)
        by_slot = {slot: 1 + preds._repeats.get(slot, {}).get(key, 0) for slot in range(301) if mask >> slot & 1}
        if sum(by_slot.values()) > 1:
            out[key] = by_slot
    return out


def test_the_mask_holds_each_key_while_any_prediction_on_a_slot_says_so(preds):
    v0, v1 = WorkerView("w0", 0, 0.0), WorkerView("w1", 1, 0.0)
    a = Prediction("a", "w0", 0, 1.0, [10, 11, 12], blocks=3, seqs=1)
    b = Prediction("b", "w0", 0, 1.0, [11, 12, 13], blocks=3, seqs=1)
    c = Prediction("c", "w1", 1, 1.0, [12, 14], blocks=2, seqs=1)
    for pred, view in ((a, v0), (b, v0), (c, v1)):
        preds.add(pred, view)
    assert predicted(preds) == {10: 0b01, 11: 0b01, 12: 0b11, 13: 0b01, 14: 0b10}
    assert counts(preds) == {11: {0: 2}, 12: {0: 2, 1: 1}}
    assert (v0.predicted_blocks, v0.predicted_seqs, v1.predicted_blocks) == (6, 2, 2)
    preds.end(a, v0)  # 11 and 12 stay: b predicts them on slot 0 too
    assert predicted(preds) == {11: 0b01, 12: 0b11, 13: 0b01, 14: 0b10}
    assert counts(preds) == {12: {0: 1, 1: 1}}  # one prediction left on 11
    preds.end(b, v0)  # 12 stays for slot 1 only
    assert predicted(preds) == {12: 0b10, 14: 0b10} and counts(preds) == {}
    assert (v0.predicted_blocks, v0.predicted_seqs) == (0, 0)
    preds.end(c, v1)
    assert preds.by_request == {} and counts(preds) == {} and predicted(preds) == {}


def test_a_key_twice_in_a_prediction_and_identical_predictions_on_a_slot_are_counted(preds):
    v0, v300 = WorkerView("w0", 0, 0.0), WorkerView("w300", 300, 0.0)  # slot 300: a mask past 64 bits
    a = Prediction("a", "w0", 0, 1.0, [7, 8, 7], blocks=3, seqs=1)  # 7 twice (two blocks with one key)
    b = Prediction("b", "w0", 0, 1.0, [7, 8, 7], blocks=3, seqs=1)
    c = Prediction("c", "w300", 300, 1.0, [8, 9], blocks=2, seqs=1)
    for pred, view in ((a, v0), (b, v0), (c, v300)):
        preds.add(pred, view)
    assert predicted(preds) == {7: 1, 8: 1 | 1 << 300, 9: 1 << 300}
    assert counts(preds) == {7: {0: 4}, 8: {0: 2, 300: 1}}
    preds.end(a, v0)
    assert predicted(preds) == {7: 1, 8: 1 | 1 << 300, 9: 1 << 300}
    assert counts(preds) == {7: {0: 2}, 8: {0: 1, 300: 1}}
    preds.end(c, v300)
    assert predicted(preds) == {7: 1, 8: 1} and counts(preds) == {7: {0: 2}}
    preds.end(b, v0)
    assert counts(preds) == {} and predicted(preds) == {}
