// The global scheduler's KV index in C++: routing key -> the slots holding it, and per slot its keys
// and those of them in use.
//
// kv_index_native.py loads it with ctypes (which releases the GIL for every call) and says what each
// entry point means; kv_index.py's KVBlockIndex is the reference it must equal. Not thread-safe: one
// caller at a time, like the Python index.
//
// Layout, for memory (hundreds of workers x 100k blocks) and for few cache misses per event:
//   * one open-addressing table of packed 12-byte entries (key, holders) for every key held by anyone;
//     holders is a slot when one worker holds the key (nearly every key), else a record of up to
//     three slots, else a bitset over all slots (keys of popular prompts);
//   * per slot, a log of its keys in the order they came (KeyLog), so that a drop or a snapshot
//     touches only what that worker holds, and a (small) set of those a running sequence holds.
//     Whether a slot holds a key is read from the key's holders, so an event misses the caches
//     once (the key's bucket): appends and evictions, which come oldest first, touch the log's
//     ends only.
// The tables probe linearly and delete by backward shift (no tombstones: churn never degrades
// them). Batch calls prefetch the buckets of the keys a few steps ahead, so the misses of one
// event overlap those of the next (and of one KV event batch those of the next, in a run of
// them); tables of megabytes ask for huge pages (fewer TLB misses).

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <sys/mman.h>
#include <unordered_map>
#include <vector>

namespace {

using u8 = uint8_t;
using u32 = uint32_t;
using u64 = uint64_t;
using i64 = int64_t;

constexpr i64 PREFETCH_AHEAD = 12;  // keys: enough misses in flight to cover memory latency
constexpr u64 MIN_CAPACITY = 16;
constexpr u64 NEAR_HEAD = 256;  // log positions past its head searched for a leaving key (a request's blocks)
constexpr size_t HUGE_PAGE = 2u << 20;

// Routing keys are the first 8 bytes of a block hash, little-endian, whatever the machine.
inline u64 read_key(const u8* p) {
    u64 k;
    std::memcpy(&k, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    k = __builtin_bswap64(k);
#endif
    return k;
}

inline void write_key(u8* p, u64 k) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    k = __builtin_bswap64(k);
#endif
    std::memcpy(p, &k, 8);
}

// Fibonacci hashing (the top bits of key * 2^64 / phi): block hashes are random already, but keys
// given by hand (0, 1, 2, ...) must spread too.
inline u64 spread(u64 key) { return key * 0x9E3779B97F4A7C15ull; }

// Load factors past which a table doubles: 0.8 for the table of every key (memory: 12 bytes a
// bucket, one table), 0.5 for a slot's set (8 bytes a bucket; at 0.8 a probe for a new key or a
// deletion's shift runs past the first cache line often enough to cost a quarter of ingest).
inline bool over_load(u64 used, u64 capacity) { return used * 5 > capacity * 4; }
inline bool set_over_load(u64 used, u64 capacity) { return used * 2 > capacity; }

inline u64 set_capacity_for(u64 n) {
    u64 cap = MIN_CAPACITY;
    while (set_over_load(n, cap)) cap *= 2;
    return cap;
}

inline int log2_of(u64 pow2) { return 63 - __builtin_clzll(pow2); }

// Memory for a table of `bytes`, zeroed; null when there is none. Large tables are aligned to huge
// pages and ask for them (a hint: without transparent huge pages it changes nothing).
inline void* table_alloc(size_t bytes) {
    if (bytes < HUGE_PAGE) return std::calloc(1, bytes);  // (tables are powers of two: nothing wasted)
    bytes = (bytes + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE;
    void* p = std::aligned_alloc(HUGE_PAGE, bytes);
    if (p) {
        madvise(p, bytes, MADV_HUGEPAGE);
        std::memset(p, 0, bytes);
    }
    return p;
}

// One slot's keys. 0 marks an empty bucket; the key 0 itself is a flag beside the table.
struct KeySet {
    u64* buckets = nullptr;
    u64 mask = 0;  // capacity - 1 (capacity 0 while buckets is null)
    int shift = 64;
    u64 used = 0;  // nonzero keys stored
    bool has_zero = false;

    u64 size() const { return used + has_zero; }
    u64 capacity() const { return buckets ? mask + 1 : 0; }
    u64 home(u64 key) const { return spread(key) >> shift; }

    void prefetch(u64 key) const {
        if (buckets) __builtin_prefetch(&buckets[home(key)]);
    }

    void release() {
        std::free(buckets);
        *this = KeySet();
    }

    void rehash(u64 cap) {
        u64* old = buckets;
        u64 old_cap = capacity();
        buckets = static_cast<u64*>(table_alloc(cap * sizeof(u64)));
        if (!buckets) throw std::bad_alloc();
        mask = cap - 1;
        shift = 64 - log2_of(cap);
        for (u64 i = 0; i < old_cap; ++i) {
            u64 k = old[i];
            if (!k) continue;
            u64 j = home(k);
            while (buckets[j]) j = (j + 1) & mask;
            buckets[j] = k;
        }
        std::free(old);
    }

    void reserve(u64 n) {
        if (set_over_load(n, capacity())) rehash(set_capacity_for(n));
    }

    bool contains(u64 key) const {
        if (!key) return has_zero;
        if (!buckets) return false;
        for (u64 i = home(key);; i = (i + 1) & mask) {
            u64 b = buckets[i];
            if (b == key) return true;
            if (!b) return false;
        }
    }

    // True when the key was not in the set.
    bool insert(u64 key) {
        if (!key) {
            bool added = !has_zero;
            has_zero = true;
            return added;
        }
        if (set_over_load(used + 1, capacity())) rehash(capacity() ? capacity() * 2 : MIN_CAPACITY);
        u64 i = home(key);
        for (;; i = (i + 1) & mask) {
            u64 b = buckets[i];
            if (b == key) return false;
            if (!b) break;
        }
        buckets[i] = key;
        ++used;
        return true;
    }

    // True when the key was in the set.
    bool erase(u64 key) {
        if (!key) {
            bool had = has_zero;
            has_zero = false;
            return had;
        }
        if (!buckets) return false;
        u64 i = home(key);
        for (;; i = (i + 1) & mask) {
            u64 b = buckets[i];
            if (b == key) break;
            if (!b) return false;
        }
        // Backward shift: pull later keys of the probe run into the hole unless that would put
        // one before its home bucket.
        for (u64 j = (i + 1) & mask; buckets[j]; j = (j + 1) & mask) {
            if (((j - home(buckets[j])) & mask) >= ((j - i) & mask)) {
                buckets[i] = buckets[j];
                i = j;
            }
        }
        buckets[i] = 0;
        --used;
        if (capacity() > MIN_CAPACITY && used * 8 < capacity()) rehash(capacity() / 2);  // a shrunk worker
        return true;
    }

    template <class F>
    void for_each(F&& f) const {
        if (has_zero) f(u64(0));
        for (u64 i = 0, cap = capacity(); i < cap; ++i)
            if (buckets[i]) f(buckets[i]);
    }
};

// One slot's cached keys in the order they came: a log read from `head`. Whether the slot holds a
// key is the key table's to say (its holders); the log only lists them, for a drop or a snapshot,
// and costs no cache miss per event: keys are appended, and evictions, which come oldest first,
// pop the head; a key leaving near the head (a request's blocks are evicted last first) is
// overwritten by the head's key, which is popped. A key that leaves farther out of that order
// stays in the log as a dead occurrence, counted in `dead` until it reaches the head or a
// compaction drops it. A key has at most one live occurrence, the newest of its occurrences (it
// is appended only when not held).
struct KeyLog {
    std::vector<u64> keys;
    u64 head = 0;
    u64 live = 0;
    std::unordered_map<u64, u32> dead;  // key -> its dead occurrences; empty while evictions come in order

    void push(u64 key) {
        // Compact rather than grow when a quarter of the log is popped or dead.
        if (keys.size() == keys.capacity() && (keys.size() - live) * 4 >= keys.size() && keys.size() > 64)
            compact();
        keys.push_back(key);
        ++live;
    }

    // `key` is held (live in the log).
    void remove(u64 key) {
        --live;
        if (dead.empty() || !dead.count(key)) {  // its one occurrence is the live one
            // The oldest keys leave, mostly: the head, or one near it (a finished request's
            // blocks are evicted last first), whose place the head's key takes.
            u64 end = keys.size() < head + NEAR_HEAD ? keys.size() : head + NEAR_HEAD;
            for (u64 i = head; i < end; ++i) {
                if (keys[i] != key) continue;
                keys[i] = keys[head++];
                drop_dead_head();
                return;
            }
        }
        ++dead[key];
        drop_dead_head();
        if (keys.size() > 4 * live + 64) compact();
    }

    // The head is kept live: dead occurrences that reach it go.
    void drop_dead_head() {
        while (!dead.empty() && head < keys.size()) {
            auto it = dead.find(keys[head]);
            if (it == dead.end()) break;
            if (--it->second == 0) dead.erase(it);
            ++head;
        }
    }

    void compact() {
        u64 out = 0;
        for (u64 i = head; i < keys.size(); ++i) {
            u64 key = keys[i];
            if (!dead.empty()) {
                auto it = dead.find(key);
                if (it != dead.end()) {  // dead occurrences come before the live one
                    if (--it->second == 0) dead.erase(it);
                    continue;
                }
            }
            keys[out++] = key;
        }
        keys.resize(out);
        head = 0;
    }

    // The live keys, in the order they came.
    template <class F>
    void for_each(F&& f) const {
        if (dead.empty()) {
            for (u64 i = head; i < keys.size(); ++i) f(keys[i]);
            return;
        }
        std::unordered_map<u64, u32> skip = dead;
        for (u64 i = head; i < keys.size(); ++i) {
            auto it = skip.find(keys[i]);
            if (it != skip.end() && it->second) {
                --it->second;
                continue;
            }
            f(keys[i]);
        }
    }

    std::vector<u64> live_keys() const {
        std::vector<u64> out;
        out.reserve(live);
        for_each([&](u64 key) { out.push_back(key); });
        return out;
    }

    void release() {
        std::vector<u64>().swap(keys);
        head = live = 0;
        std::unordered_map<u64, u32>().swap(dead);
    }
};

struct Slot {
    KeyLog cached;
    KeySet in_use;  // keys a running sequence holds (not necessarily cached: the batches say so)
};

#pragma pack(push, 4)
struct Entry {
    u64 key;
    u32 holders;  // see the tags below; EMPTY marks a free bucket
};
#pragma pack(pop)
static_assert(sizeof(Entry) == 12, "entries are packed: 12 bytes, five to a cache line");

constexpr u32 TAG = 0xC0000000u;
constexpr u32 FEW = 0x80000000u;   // holders = FEW | index of a Few record
constexpr u32 WIDE = 0xC0000000u;  // holders = WIDE | index of a bitset record
constexpr u32 INDEX = 0x3FFFFFFFu;
constexpr u32 EMPTY = 0xFFFFFFFFu;  // (WIDE | INDEX: that bitset record is never handed out)
constexpr u32 FEW_SLOTS = 3;
constexpr u32 MAX_SLOTS = 1u << 16;  // bitsets span every slot: keep them bounded

struct Few {
    u32 n;
    u32 slot[FEW_SLOTS];  // slot[0] links the free list while unused
};

inline bool is_single(u32 h) { return h < FEW; }

struct Index {
    Entry* table = nullptr;
    u64 mask = 0;
    int shift = 64;
    u64 distinct = 0;
    u64 entries = 0;
    std::vector<Slot> slots;
    std::vector<Few> few;
    u32 few_free = EMPTY;
    u32 words = 1;  // u64 words per bitset record: covers every slot in `slots`
    std::vector<u64> wide;
    std::vector<u32> wide_count;
    std::vector<u32> wide_free;
    std::vector<u64> scratch_current, scratch_holders;  // the prefix walk's bitsets

    Index() { rehash(MIN_CAPACITY); }
    ~Index() {
        std::free(table);
        for (Slot& s : slots) {
            s.cached.release();
            s.in_use.release();
        }
    }

    u64 capacity() const { return mask + 1; }
    u64 home(u64 key) const { return spread(key) >> shift; }
    void prefetch(u64 key) const { __builtin_prefetch(&table[home(key)]); }

    void rehash(u64 cap) {
        Entry* old = table;
        u64 old_cap = table ? capacity() : 0;
        table = static_cast<Entry*>(table_alloc(cap * sizeof(Entry)));
        if (!table) {
            table = old;
            throw std::bad_alloc();
        }
        for (u64 i = 0; i < cap; ++i) table[i].holders = EMPTY;
        mask = cap - 1;
        shift = 64 - log2_of(cap);
        for (u64 i = 0; i < old_cap; ++i) {
            if (old[i].holders == EMPTY) continue;
            u64 j = home(old[i].key);
            while (table[j].holders != EMPTY) j = (j + 1) & mask;
            table[j] = old[i];
        }
        std::free(old);
    }

    Entry* find(u64 key) const {
        for (u64 i = home(key);; i = (i + 1) & mask) {
            Entry* e = &table[i];
            if (e->holders == EMPTY) return nullptr;
            if (e->key == key) return e;
        }
    }

    void erase(Entry* e) {
        u64 i = static_cast<u64>(e - table);
        for (u64 j = (i + 1) & mask; table[j].holders != EMPTY; j = (j + 1) & mask) {
            if (((j - home(table[j].key)) & mask) >= ((j - i) & mask)) {
                table[i] = table[j];
                i = j;
            }
        }
        table[i].holders = EMPTY;
        --distinct;
    }

    void ensure_slot(u32 slot) {
        if (slot < slots.size()) return;
        slots.resize(slot + 1);
        u32 need = (slot + 64) / 64;
        if (need <= words) return;
        u32 grown = need > 2 * words ? need : 2 * words;
        std::vector<u64> bits(wide_count.size() * grown, 0);
        for (size_t r = 0; r < wide_count.size(); ++r)
            std::memcpy(&bits[r * grown], &wide[r * words], words * sizeof(u64));
        wide.swap(bits);
        words = grown;
    }

    // ---- holder records ----

    u32 new_few() {
        if (few_free != EMPTY) {
            u32 r = few_free;
            few_free = few[r].slot[0];
            return r;
        }
        few.push_back(Few());
        return static_cast<u32>(few.size() - 1);
    }

    void free_few(u32 r) {
        few[r].slot[0] = few_free;
        few_free = r;
    }

    u32 new_wide() {
        u32 r;
        if (!wide_free.empty()) {
            r = wide_free.back();
            wide_free.pop_back();
        } else {
            r = static_cast<u32>(wide_count.size());
            wide_count.push_back(0);
            wide.resize(wide.size() + words);
        }
        std::memset(&wide[size_t(r) * words], 0, words * sizeof(u64));
        wide_count[r] = 0;
        return r;
    }

    u64* bits_of(u32 r) { return &wide[size_t(r) * words]; }

    // h with `slot` added (h does not hold it).
    u32 with_holder(u32 h, u32 slot) {
        if (is_single(h)) {
            u32 r = new_few();
            few[r] = Few{2, {h, slot, 0}};
            return FEW | r;
        }
        u32 r = h & INDEX;
        if ((h & TAG) == FEW) {
            if (few[r].n < FEW_SLOTS) {
                few[r].slot[few[r].n++] = slot;
                return h;
            }
            Few f = few[r];
            free_few(r);
            u32 w = new_wide();
            for (u32 i = 0; i < f.n; ++i) bits_of(w)[f.slot[i] / 64] |= u64(1) << (f.slot[i] % 64);
            wide_count[w] = f.n;
            h = WIDE | w;
            r = w;
        }
        bits_of(r)[slot / 64] |= u64(1) << (slot % 64);
        ++wide_count[r];
        return h;
    }

    // h without `slot` (h holds it); EMPTY when nobody is left.
    u32 without_holder(u32 h, u32 slot) {
        if (is_single(h)) return EMPTY;
        u32 r = h & INDEX;
        if ((h & TAG) == FEW) {
            Few& f = few[r];
            for (u32 i = 0; i < f.n; ++i) {
                if (f.slot[i] == slot) {
                    f.slot[i] = f.slot[--f.n];
                    break;
                }
            }
            if (f.n > 1) return h;
            u32 last = f.slot[0];
            free_few(r);
            return last;
        }
        u64* bits = bits_of(r);
        bits[slot / 64] &= ~(u64(1) << (slot % 64));
        if (--wide_count[r] > FEW_SLOTS) return h;
        u32 f = new_few();
        few[f].n = 0;
        for (u32 w = 0; w < words; ++w)
            for (u64 b = bits[w]; b; b &= b - 1) few[f].slot[few[f].n++] = w * 64 + __builtin_ctzll(b);
        wide_free.push_back(r);
        return FEW | f;
    }

    // The slots of h, ORed into a bitset of `n` words.
    void or_into(u32 h, u64* bitset, u32 n) {
        if (is_single(h)) {
            if (h / 64 < n) bitset[h / 64] |= u64(1) << (h % 64);
            return;
        }
        u32 r = h & INDEX;
        if ((h & TAG) == FEW) {
            const Few& f = few[r];
            for (u32 i = 0; i < f.n; ++i)
                if (f.slot[i] / 64 < n) bitset[f.slot[i] / 64] |= u64(1) << (f.slot[i] % 64);
            return;
        }
        const u64* bits = bits_of(r);
        for (u32 w = 0; w < n && w < words; ++w) bitset[w] |= bits[w];
    }

    // ---- (slot, key) updates; the slot's own set says whether anything changes ----

    void add_holder(u64 key, u32 slot) {
        if (over_load(distinct + 1, capacity())) rehash(capacity() * 2);
        u64 i = home(key);
        for (;; i = (i + 1) & mask) {
            Entry& e = table[i];
            if (e.holders == EMPTY) {
                e.key = key;
                e.holders = slot;
                ++distinct;
                return;
            }
            if (e.key == key) {
                e.holders = with_holder(e.holders, slot);
                return;
            }
        }
    }

    void remove_holder(u64 key, u32 slot) {
        Entry* e = find(key);
        u32 h = without_holder(e->holders, slot);
        if (h == EMPTY)
            erase(e);
        else
            e->holders = h;
    }

    bool has_holder(u32 h, u32 slot) const {
        if (is_single(h)) return h == slot;
        u32 r = h & INDEX;
        if ((h & TAG) == FEW) {
            const Few& f = few[r];
            for (u32 i = 0; i < f.n; ++i)
                if (f.slot[i] == slot) return true;
            return false;
        }
        return slot / 64 < words && (wide[size_t(r) * words + slot / 64] >> (slot % 64) & 1);
    }

    bool holds(u32 slot, u64 key) const {
        const Entry* e = find(key);
        return e && has_holder(e->holders, slot);
    }

    // `slot` added to the key's holders unless it is one already; true when it was added.
    bool add_holder_if_new(u64 key, u32 slot) {
        if (over_load(distinct + 1, capacity())) rehash(capacity() * 2);
        for (u64 i = home(key);; i = (i + 1) & mask) {
            Entry& e = table[i];
            if (e.holders == EMPTY) {
                e.key = key;
                e.holders = slot;
                ++distinct;
                return true;
            }
            if (e.key == key) {
                if (has_holder(e.holders, slot)) return false;
                e.holders = with_holder(e.holders, slot);
                return true;
            }
        }
    }

    // `slot` taken off the key's holders if it is one; true when it was.
    bool remove_holder_if_held(u64 key, u32 slot) {
        Entry* e = find(key);
        if (!e || !has_holder(e->holders, slot)) return false;
        u32 h = without_holder(e->holders, slot);
        if (h == EMPTY)
            erase(e);
        else
            e->holders = h;
        return true;
    }

    // Each of n packed keys through f, with their home buckets requested PREFETCH_AHEAD keys before
    // they are needed.
    template <class F>
    void each_key(const u8* data, i64 n, i64 width, F&& f) {
        for (i64 i = 0; i < n && i < PREFETCH_AHEAD; ++i) prefetch(read_key(data + i * width));
        for (i64 i = 0; i < n; ++i) {
            if (i + PREFETCH_AHEAD < n) prefetch(read_key(data + (i + PREFETCH_AHEAD) * width));
            f(read_key(data + i * width));
        }
    }

    // (slot, key) updates: the key's holders say whether anything changes, the slot's log follows.
    bool add_key(KeyLog& mine, u32 slot, u64 key) {
        if (!add_holder_if_new(key, slot)) return false;
        try {
            mine.push(key);
        } catch (...) {
            remove_holder(key, slot);
            throw;
        }
        ++entries;
        return true;
    }

    void remove_key(KeyLog& mine, u32 slot, u64 key) {
        if (!remove_holder_if_held(key, slot)) return;
        mine.remove(key);
        --entries;
    }

    // Returns how many keys were new to the slot; those go to `added` (if not null), in order.
    i64 add(u32 slot, const u8* data, i64 n, i64 width, u64* added = nullptr) {
        ensure_slot(slot);
        KeyLog& mine = slots[slot].cached;
        i64 count = 0;
        each_key(data, n, width, [&](u64 key) {
            if (add_key(mine, slot, key)) {
                if (added) added[count] = key;
                ++count;
            }
        });
        return count;
    }

    void remove(u32 slot, const u8* data, i64 n, i64 width) {
        if (slot >= slots.size()) return;
        KeyLog& mine = slots[slot].cached;
        each_key(data, n, width, [&](u64 key) { remove_key(mine, slot, key); });
    }

    // Each of `keys` through f, with the global buckets prefetched ahead.
    template <class F>
    void each_prefetched(const std::vector<u64>& keys, F&& f) {
        u64 n = keys.size(), ahead = 0;
        for (u64 i = 0; i < n; ++i) {
            for (; ahead < n && ahead < i + 4 * PREFETCH_AHEAD; ++ahead) prefetch(keys[ahead]);
            f(keys[i]);
        }
    }

    void clear(u32 slot) {
        if (slot >= slots.size()) return;
        KeyLog& mine = slots[slot].cached;
        each_prefetched(mine.live_keys(), [&](u64 key) { remove_holder(key, slot); });
        entries -= mine.live;
        mine.release();
        slots[slot].in_use.release();
    }

    static KeySet set_of(const u8* data, i64 n, i64 width) {
        KeySet set;
        try {
            set.reserve(static_cast<u64>(n));
            for (i64 i = 0; i < n; ++i) set.insert(read_key(data + i * width));
        } catch (...) {
            set.release();
            throw;
        }
        return set;
    }

    void replace(u32 slot, const u8* data, i64 n, i64 width) {
        ensure_slot(slot);
        KeySet fresh = set_of(data, n, width);
        KeyLog& old = slots[slot].cached;
        std::vector<u64> keys;
        try {
            // Room for half as many again: the log then compacts in place as the worker churns
            // (KeyLog::push), instead of copying itself at its first event.
            keys.reserve(fresh.size() + fresh.size() / 2 + 64);
        } catch (...) {
            fresh.release();
            throw;
        }
        each_prefetched(old.live_keys(), [&](u64 key) {
            if (!fresh.contains(key)) remove_holder(key, slot);
        });
        entries -= old.live;
        for (i64 i = 0; i < n; ++i) {  // each key once, in the snapshot's order (erased once seen)
            if (i + PREFETCH_AHEAD < n) prefetch(read_key(data + (i + PREFETCH_AHEAD) * width));
            u64 key = read_key(data + i * width);
            if (!fresh.erase(key)) continue;
            add_holder_if_new(key, slot);
            keys.push_back(key);
        }
        fresh.release();
        old.release();
        old.live = keys.size();
        old.keys.swap(keys);
        entries += old.live;
    }

    void replace_in_use(u32 slot, const u8* data, i64 n, i64 width) {
        ensure_slot(slot);
        KeySet fresh = set_of(data, n, width);
        slots[slot].in_use.release();
        slots[slot].in_use = fresh;
    }

    // KV event batches in order, each in the order the Python core applies one: cleared, removed,
    // stored, acquired, released. Batch b is slot_of[b]'s; counts[4b..4b+3] are its numbers of
    // removed, stored, acquired and released keys and parts[4b..4b+3] where they are packed. The
    // cached keys (removed, then stored) are prefetched PREFETCH_AHEAD keys ahead across batch
    // boundaries, so a batch's first events do not wait for memory as a call of their own would.
    void apply_many(i64 num_batches, const u32* slot_of, const u8* cleared, const i64* counts,
                    const u8* const* parts, i64 width) {
        i64 ahead_batch = 0, ahead_key = 0;  // the next cached key to prefetch
        auto prefetch_next = [&]() {
            if (ahead_batch == num_batches) return;
            const i64* n = counts + 4 * ahead_batch;
            while (ahead_batch < num_batches && ahead_key >= n[0] + n[1]) {
                ++ahead_batch;
                n += 4;
                ahead_key = 0;
            }
            if (ahead_batch == num_batches) return;
            const u8* const* at = parts + 4 * ahead_batch;
            u64 key = read_key(ahead_key < n[0] ? at[0] + ahead_key * width : at[1] + (ahead_key - n[0]) * width);
            ++ahead_key;
            prefetch(key);
        };
        for (i64 i = 0; i < PREFETCH_AHEAD; ++i) prefetch_next();
        for (i64 b = 0; b < num_batches; ++b) {
            u32 slot = slot_of[b];
            ensure_slot(slot);  // (before the references below: it may move every slot)
            if (cleared[b]) clear(slot);
            KeyLog& mine = slots[slot].cached;
            KeySet& in_use = slots[slot].in_use;
            const i64* n = counts + 4 * b;
            const u8 *removed = parts[4 * b], *stored = parts[4 * b + 1], *acquired = parts[4 * b + 2],
                     *released = parts[4 * b + 3];
            for (i64 i = 0; i < n[0]; ++i) {
                prefetch_next();
                remove_key(mine, slot, read_key(removed + i * width));
            }
            for (i64 i = 0; i < n[0]; ++i) in_use.erase(read_key(removed + i * width));
            for (i64 i = 0; i < n[1]; ++i) {
                prefetch_next();
                add_key(mine, slot, read_key(stored + i * width));
            }
            for (i64 i = 0; i < n[1]; ++i) in_use.insert(read_key(stored + i * width));
            for (i64 i = 0; i < n[2]; ++i) in_use.insert(read_key(acquired + i * width));
            for (i64 i = 0; i < n[3]; ++i) in_use.erase(read_key(released + i * width));
        }
    }

    // ---- queries ----

    // For every slot holding keys[0] (or given it by `extra`): how many leading keys it holds
    // without a gap, as (slot, run) pairs; the return value is how many.
    i64 prefix_runs(const u8* data, i64 n, i64 width, Index* extra, const i64* extra_slot, const i64* mask_at,
                    const u64* masks, i64 num_masks, i64 mask_words, u32* out_slot, u32* out_run) {
        u64 top = slots.size();
        if (extra && extra->slots.size() > top) top = extra->slots.size();
        for (i64 i = 0; extra_slot && i < n; ++i)
            if (extra_slot[i] >= 0 && u64(extra_slot[i]) >= top) top = extra_slot[i] + 1;
        if (num_masks && u64(mask_words) * 64 > top) top = mask_words * 64;
        u32 nw = static_cast<u32>((top + 63) / 64);
        if (!nw) return 0;
        scratch_current.assign(nw, 0);
        scratch_holders.assign(nw, 0);
        u64* cur = scratch_current.data();
        u64* m = scratch_holders.data();
        for (i64 i = 0; i < n && i < 2 * PREFETCH_AHEAD; ++i) {
            prefetch(read_key(data + i * width));
            if (extra) extra->prefetch(read_key(data + i * width));
        }
        i64 mask = 0, found = 0;
        for (i64 i = 0; i < n; ++i) {
            if (i + 2 * PREFETCH_AHEAD < n) {
                prefetch(read_key(data + (i + 2 * PREFETCH_AHEAD) * width));
                if (extra) extra->prefetch(read_key(data + (i + 2 * PREFETCH_AHEAD) * width));
            }
            u64* into = i ? m : cur;
            if (i) std::memset(m, 0, nw * sizeof(u64));
            u64 key = read_key(data + i * width);
            if (const Entry* e = find(key)) or_into(e->holders, into, nw);
            if (extra)
                if (const Entry* e = extra->find(key)) extra->or_into(e->holders, into, nw);
            if (extra_slot && extra_slot[i] >= 0) into[extra_slot[i] / 64] |= u64(1) << (extra_slot[i] % 64);
            for (; mask < num_masks && mask_at[mask] == i; ++mask)
                for (i64 w = 0; w < mask_words; ++w) into[w] |= masks[mask * mask_words + w];
            bool any = false;
            for (u32 w = 0; w < nw; ++w) {
                if (i) {
                    for (u64 ended = cur[w] & ~m[w]; ended; ended &= ended - 1) {
                        out_slot[found] = w * 64 + __builtin_ctzll(ended);
                        out_run[found++] = static_cast<u32>(i);
                    }
                    cur[w] &= m[w];
                }
                any |= cur[w] != 0;
            }
            if (!any) return found;
        }
        for (u32 w = 0; w < nw; ++w)
            for (u64 b = cur[w]; b; b &= b - 1) {
                out_slot[found] = w * 64 + __builtin_ctzll(b);
                out_run[found++] = static_cast<u32>(n);
            }
        return found;
    }
};

}  // namespace

// Entry points. Keys come packed: n keys `width` bytes apart (8: packed routing keys, 16: packed
// block hashes), each read from its first 8 bytes. Updates return 0, or -1 when memory ran out
// (the index is then unchanged for that key, consistent otherwise).
extern "C" {

void* kvi_new() {
    try {
        return new Index();
    } catch (...) {
        return nullptr;
    }
}

void kvi_free(void* index) { delete static_cast<Index*>(index); }

u32 kvi_max_slots() { return MAX_SLOTS; }

i64 kvi_distinct(const void* index) { return static_cast<const Index*>(index)->distinct; }

i64 kvi_entries(const void* index) { return static_cast<const Index*>(index)->entries; }

const Slot* slot_of(const void* index, u32 slot) {
    const Index* ix = static_cast<const Index*>(index);
    return slot < ix->slots.size() ? &ix->slots[slot] : nullptr;
}

i64 kvi_size(const void* index, u32 slot, int in_use) {
    const Slot* s = slot_of(index, slot);
    return !s ? 0 : in_use ? s->in_use.size() : s->cached.live;
}

// The slot's keys as packed little-endian u64s into out (room for kvi_size keys); returns how many.
i64 kvi_keys(const void* index, u32 slot, int in_use, u8* out) {
    const Slot* s = slot_of(index, slot);
    i64 n = 0;
    auto put = [&](u64 key) { write_key(out + 8 * n++, key); };
    if (s && in_use)
        s->in_use.for_each(put);
    else if (s)
        s->cached.for_each(put);
    return n;
}

// Those of the n keys the slot holds (or has in use), in order, into out; returns how many.
i64 kvi_among(const void* index, u32 slot, int in_use, const u8* data, i64 n, i64 width, u64* out) {
    const Index* ix = static_cast<const Index*>(index);
    const Slot* s = slot_of(index, slot);
    i64 found = 0;
    for (i64 i = 0; s && i < n; ++i) {
        u64 key = read_key(data + i * width);
        if (in_use ? s->in_use.contains(key) : ix->holds(slot, key)) out[found++] = key;
    }
    return found;
}

// The slots holding `key`, into out (room for every slot); returns how many.
i64 kvi_holders(void* index, u64 key, u32* out) {
    Index* ix = static_cast<Index*>(index);
    const Entry* e = ix->find(key);
    if (!e) return 0;
    u32 nw = ix->words;
    std::vector<u64> bits(nw, 0);
    ix->or_into(e->holders, bits.data(), nw);
    i64 n = 0;
    for (u32 w = 0; w < nw; ++w)
        for (u64 b = bits[w]; b; b &= b - 1) out[n++] = w * 64 + __builtin_ctzll(b);
    return n;
}

// Adds the keys to the slot; those new to it go to `added` (room for n; may be null). Returns how
// many were new, or -1 when memory ran out.
i64 kvi_add(void* index, u32 slot, const u8* data, i64 n, i64 width, u64* added) {
    try {
        return static_cast<Index*>(index)->add(slot, data, n, width, added);
    } catch (...) {
        return -1;
    }
}

int kvi_remove(void* index, u32 slot, const u8* data, i64 n, i64 width) {
    try {
        static_cast<Index*>(index)->remove(slot, data, n, width);
        return 0;
    } catch (...) {
        return -1;
    }
}

int kvi_clear(void* index, u32 slot) {
    try {
        static_cast<Index*>(index)->clear(slot);
        return 0;
    } catch (...) {
        return -1;
    }
}

// The slot's cached keys, or (in_use) its keys in use, made exactly these.
int kvi_replace(void* index, u32 slot, int in_use, const u8* data, i64 n, i64 width) {
    try {
        Index* ix = static_cast<Index*>(index);
        if (in_use)
            ix->replace_in_use(slot, data, n, width);
        else
            ix->replace(slot, data, n, width);
        return 0;
    } catch (...) {
        return -1;
    }
}

// One KV event batch of a worker: Index::apply_many of one.
int kvi_apply(void* index, u32 slot, int cleared, const u8* removed, i64 num_removed, const u8* stored,
              i64 num_stored, const u8* acquired, i64 num_acquired, const u8* released, i64 num_released,
              i64 width) {
    try {
        const i64 counts[4] = {num_removed, num_stored, num_acquired, num_released};
        const u8* const parts[4] = {removed, stored, acquired, released};
        const u8 flag = cleared != 0;
        static_cast<Index*>(index)->apply_many(1, &slot, &flag, counts, parts, width);
        return 0;
    } catch (...) {
        return -1;
    }
}

// Index::apply_many, with each batch's four parts packed one after another in `data` (batch after
// batch) and their sizes in bytes in `lengths`. Returns 0; -1 when memory ran out; -2, changing
// nothing, when a part is not a whole number of keys or a slot is not below MAX_SLOTS.
int kvi_apply_many(void* index, i64 num_batches, const u32* slots, const u8* cleared, const i64* lengths,
                   const u8* data, i64 width) {
    try {
        std::vector<i64> counts(4 * num_batches);
        std::vector<const u8*> parts(4 * num_batches);
        const u8* at = data;
        for (i64 i = 0; i < 4 * num_batches; ++i) {
            if (slots[i / 4] >= MAX_SLOTS || lengths[i] < 0 || lengths[i] % width) return -2;
            counts[i] = lengths[i] / width;
            parts[i] = at;
            at += lengths[i];
        }
        static_cast<Index*>(index)->apply_many(num_batches, slots, cleared, counts.data(), parts.data(), width);
        return 0;
    } catch (...) {
        return -1;
    }
}

// Index::prefix_runs, with further holders of the keys (predicted ones): those of the index `extra`
// (may be null), and extra_slot: per key, a slot or -1 (may be null); the keys at positions mask_at
// (ascending) have more: masks, mask_words u64 bitset words each. out_slot and out_run need room
// for every slot that can appear.
i64 kvi_prefix_runs(void* index, const u8* data, i64 n, i64 width, void* extra, const i64* extra_slot,
                    const i64* mask_at, const u64* masks, i64 num_masks, i64 mask_words, u32* out_slot, u32* out_run) {
    try {
        return static_cast<Index*>(index)->prefix_runs(data, n, width, static_cast<Index*>(extra), extra_slot, mask_at,
                                                       masks, num_masks, mask_words, out_slot, out_run);
    } catch (...) {
        return -1;
    }
}

}  // extern "C"
