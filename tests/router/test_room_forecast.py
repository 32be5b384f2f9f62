"""Admission control's forecast of room: from the releases and step times the workers publish,
the wait of each request in an ingress's queue (exact figures on constructed views, no Ray)."""

from __future__ import annotations

import math

import pytest

from pagefleet.router.global_scheduler.core import GlobalScheduler
from pagefleet.router.global_scheduler.predictions import Prediction
from pagefleet.router.global_scheduler.views import WorkerView
from pagefleet.router.routing.room_forecast import CutShort, Need, Outlook, forecast_waits, outlook
from pagefleet.worker.core.kv_events import KVEventBatch, Release, pack_releases


def view(room: int, seats: int, releases: list[Release], step_time_s: float, releases_at: float) -> WorkerView:
    v = WorkerView("w", 0, last_seen=releases_at, reported=True)
    v.room_blocks, v.seats = room, seats
    v.releases, v.step_time_s, v.releases_at = pack_releases(releases), step_time_s, releases_at
    return v


def test_an_outlook_times_each_release_from_when_the_view_heard_it_plus_the_lag():
    v = view(2, 5, [Release(4, 1, 3), Release(10, 2, 6)], step_time_s=0.05, releases_at=100.0)
    got = outlook(v, now=100.1, lag_s=0.3)
    # 4 steps x 50 ms + 0.3 s after 100.0 is 0.4 s from now; 10 steps: 0.7 s; running sums
    assert (got.room_blocks, got.seats, got.blocks_by, got.seats_by) == (2, 5, [3, 9], [1, 3])
    assert got.at == pytest.approx([0.4, 0.7])
    # at 100.6 the first was due 0.1 s ago and no batch reported it: it is expected within one
    # more lag, after the second
    late = outlook(v, now=100.6, lag_s=0.3)
    assert (late.blocks_by, late.seats_by, late.at) == ([6, 9], [2, 3], [pytest.approx(0.2), 0.3])
    # a worker that has not timed a step yet: its room now only
    assert outlook(view(2, 5, [Release(4, 1, 3)], 0.0, 100.0), 100.1, 0.3) == Outlook(2, 5)


def test_waits_place_the_queue_first_come_first_served_on_the_worker_with_room_soonest():
    w0 = Outlook(0, 10, at=[0.4, 1.2], blocks_by=[4, 12], seats_by=[1, 3])
    w1 = Outlook(2, 10, at=[0.8], blocks_by=[4], seats_by=[1])
    # 1st: w0 at 0.4 (w1 only at 0.8); 2nd: w1 at 0.8 (w0 needs 8 more: 1.2); 3rd and 4th: w0 at
    # 1.2 (w1's 6 blocks never come); 5th: no worker has 4 more blocks coming
    assert forecast_waits([w0, w1], [Need(4)] * 5) == [0.4, 0.8, 1.2, 1.2, math.inf]
    # nobody starts before the one ahead: 2 blocks fit w1 now, but the 12 ahead wait for 1.2 s
    assert forecast_waits([w0, w1], [Need(12), Need(2)]) == [1.2, 1.2]
    assert forecast_waits([w0, w1], [Need(2)]) == [0.0]  # room now on w1
    # seats count like blocks: plenty of room but no seat until a sequence ends at 0.5 s
    seated = Outlook(100, 0, at=[0.5, 0.9], blocks_by=[1, 2], seats_by=[1, 3])
    assert forecast_waits([seated], [Need(4), Need(4, seqs=2), Need(4)]) == [0.5, 0.9, math.inf]
    assert forecast_waits([], [Need(1)]) == [math.inf]


def test_the_view_keeps_releases_and_step_time_and_a_restored_copy_hears_them_when_restored():
    core = GlobalScheduler(index_kind="python")
    releases = pack_releases([Release(7, 2, 9)])
    core.apply_batch(KVEventBatch("w0", 0, 0, True, num_free_blocks=20, num_total_blocks=64, num_running=2,
                                  releases=releases, step_time_s=0.025), now=5.0)
    v = core.workers["w0"]
    assert (v.releases, v.step_time_s, v.releases_at) == (releases, 0.025, 5.0)
    copy = GlobalScheduler(index_kind="python")
    copy.restore(core.worker_states(), now=6.0)
    c = copy.workers["w0"]
    assert (c.releases, c.step_time_s, c.releases_at) == (releases, 0.025, 6.0)


def test_requests_routed_there_and_not_yet_reported_give_their_room_back_after_their_steps():
    v = view(0, 5, [Release(10, 1, 6)], step_time_s=0.05, releases_at=100.0)
    routed = [Prediction("a", "w", 0, 102.0, [], blocks=4, seqs=1, steps=4, made_at=100.0),
              Prediction("b", "w", 0, 102.0, [], blocks=3, seqs=2, made_at=100.0)]  # its steps are not known
    got = outlook(v, now=100.1, lag_s=0.3, routed=routed)
    # a's 4 steps from when it was routed, plus the lag: 0.4 s from now, before the worker's own 0.7 s
    assert (got.blocks_by, got.seats_by, got.at) == ([4, 10], [1, 2], [pytest.approx(0.4), pytest.approx(0.7)])


def test_requests_cut_short_here_give_their_room_back_one_step_after_they_ended():
    v = view(0, 0, [Release(100, 2, 12)], step_time_s=0.05, releases_at=100.0)
    cut = [CutShort("w", at=100.05, blocks=6, seqs=1), CutShort("w", at=99.5, blocks=2, seqs=3)]
    got = outlook(v, now=100.1, lag_s=0.3, cut_short=cut)
    # the first: 100.05 + one 50 ms step + 0.3 s is 0.3 s from now; the second was due 0.25 s ago
    # (no batch showed it yet): within one more lag, as an overdue release; the worker's own at 5.2 s
    assert (got.blocks_by, got.seats_by) == ([6, 8, 20], [1, 4, 6])
    assert got.at == pytest.approx([0.3, 0.3, 5.2])
