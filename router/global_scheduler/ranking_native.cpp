// The routing decision's ranking walk in C++, over the compiled KV index's prefix runs.
//
// Built into the same library as kv_index_native.cpp; ranking_native.py calls it and says what it
// means; ranking.py's candidate_rows (with core.GlobalScheduler.route) is the reference it must
// equal. A worker's row is (no room, cost, load, queue, id); the best k rows are those with room,
// best first, or when no worker has room, the first k. Rows compare by cost, load, queue and id
// order, so the candidates are put in a heap and popped in that order until k rows with room are
// out (or none can come): the walk visits a handful of workers of a thousand. Whether a worker has
// room is known from its numbers except when reusing its idle cached blocks decides it; then the
// caller's idle_count is asked, and only for workers popped.

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using u8 = uint8_t;
using u32 = uint32_t;
using i64 = int64_t;

// A worker's numbers in the caller's table: one row of FIELDS int64s per slot.
enum Field { LOAD, QUEUED, ROOM, SEATS, ID_ORDER, FIELDS };

enum Room : u8 { HAS_ROOM, NO_ROOM, DEPENDS };  // DEPENDS: on how many of its cached blocks are idle

struct Candidate {
    double cost;
    i64 load, queued, id_order;
    u32 slot, cached;
    Room room;
};

// The heap's order: a is worse than b (std heaps keep the largest on top).
inline bool worse(const Candidate& a, const Candidate& b) {
    if (a.cost != b.cost) return a.cost > b.cost;
    if (a.load != b.load) return a.load > b.load;
    if (a.queued != b.queued) return a.queued > b.queued;
    return a.id_order > b.id_order;
}

}  // namespace

extern "C" {

typedef i64 (*IdleCount)(u32 slot, i64 cached);  // idle blocks among the slot's first `cached`; < 0: failed

// The best k rows for a request of `need` blocks and `seqs` sequences whose prompt has num_keys
// blocks, among the candidate slots; (run_slots, run_lengths): the prefix runs, as
// kvi_prefix_runs gives them. Writes the rows' slots, cached blocks and no-room flags, best first;
// returns how many, or -1 when idle_count failed.
i64 rank_best(const i64* table, const u32* candidates, i64 num_candidates, const u32* run_slots,
              const u32* run_lengths, i64 num_runs, i64 num_keys, i64 need, i64 seqs, double weight, i64 k,
              IdleCount idle_count, u32* out_slot, u32* out_cached, u8* out_no_room) {
    u32 top = 0;
    for (i64 i = 0; i < num_candidates; ++i) top = std::max(top, candidates[i] + 1);
    std::vector<u32> cached(top, 0);
    for (i64 i = 0; i < num_runs; ++i)
        if (run_slots[i] < top) cached[run_slots[i]] = run_lengths[i];
    std::vector<Candidate> heap;
    heap.reserve(num_candidates);
    i64 may_have_room = 0;
    for (i64 i = 0; i < num_candidates; ++i) {
        u32 slot = candidates[i];
        const i64* w = table + i64(slot) * FIELDS;
        i64 c = cached[slot];
        Room room;
        if (w[SEATS] < seqs || w[ROOM] < need - c)
            room = NO_ROOM;  // not even with every cached block in use
        else if (w[ROOM] >= need)
            room = HAS_ROOM;  // even with every cached block idle
        else
            room = DEPENDS;
        may_have_room += room != NO_ROOM;
        heap.push_back({weight * double(num_keys - c) + double(w[LOAD]), w[LOAD], w[QUEUED], w[ID_ORDER], slot,
                        u32(c), room});
    }
    std::make_heap(heap.begin(), heap.end(), worse);
    std::vector<Candidate> with_room, without_room;
    while (!heap.empty() && i64(with_room.size()) < k) {
        if (!may_have_room && (!with_room.empty() || i64(without_room.size()) == k)) break;
        std::pop_heap(heap.begin(), heap.end(), worse);
        Candidate best = heap.back();
        heap.pop_back();
        bool counted = best.room != NO_ROOM;  // in may_have_room
        if (best.room == DEPENDS) {
            i64 idle = idle_count(best.slot, best.cached);
            if (idle < 0) return -1;
            best.room = table[i64(best.slot) * FIELDS + ROOM] < need - i64(best.cached) + idle ? NO_ROOM : HAS_ROOM;
        }
        may_have_room -= counted;
        if (best.room == HAS_ROOM)
            with_room.push_back(best);
        else if (with_room.empty() && i64(without_room.size()) < k)
            without_room.push_back(best);
    }
    const std::vector<Candidate>& rows = with_room.empty() ? without_room : with_room;
    for (size_t i = 0; i < rows.size(); ++i) {
        out_slot[i] = rows[i].slot;
        out_cached[i] = rows[i].cached;
        out_no_room[i] = rows[i].room == NO_ROOM;
    }
    return i64(rows.size());
}

}  // extern "C"
