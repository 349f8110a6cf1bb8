// Paged pool of cached user prefixes: the C++ core behind relaygr_engine._C.PrefixBlockPool.
//
// Semantics are those of relaygr_engine/_pool_py.py (the reference): same operations, same refusals (a false/empty
// return), same errors (ValueError / KeyError below) raised before any state changes (free() of a pinned entry
// first expires due leases, as the reference does), the same page ids in the same order. This header is plain
// C++17; the Python binding (csrc/bindings.cpp) only converts arguments.
//
// Layout (everything preallocated or grown geometrically; nothing is allocated per page):
//  * page ids 0 .. num_pages-1 and one `next_page` link per page. A page is either on the free list or in exactly
//    one entry's chain, so the same array threads both: the free list is an intrusive LIFO stack (the most recently
//    freed page is reused first) and an entry's pages are a singly linked chain head -> ... -> tail in token order.
//    Freeing an entry splices its whole chain onto the free stack in O(1).
//  * entries live in a slot array with a free-slot stack. Evictable (unpinned) entries sit on an intrusive doubly
//    linked LRU list threaded through the slots (prev/next indices, sentinel head and tail slots, oldest first), so
//    pin/unpin/free unlink from the middle in O(1).
//  * an open-addressing index (user_id, fingerprint) -> slot, and a per-user doubly linked list of slots in insert
//    order (for entries_of).
//  * a min-heap of (expiry, lease_seq, slot) with lazy deletion for lease expiry; a record is live only while its
//    slot's lease is live with the same sequence number. Stale records (renewed or released leases) are dropped
//    once they outnumber the live ones, so the heap stays O(live leases) under constant renewal.
//
// Thread safety: one std::mutex per pool, taken by every public member function that reads mutable state.
// Nothing here touches Python.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "relaygr/flat_map.h"

namespace relaygr {

// Misuse: a bad argument or an operation the entry's state does not allow (Python ValueError).
class ValueError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// The named entry is not cached (Python KeyError).
class KeyError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// check_invariants() found a broken invariant (Python AssertionError): a bug in the pool.
class InvariantError : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

using PageId = std::int32_t;

struct PrefixKey {
  std::uint64_t user_id = 0;
  std::uint64_t fingerprint = 0;
  bool operator==(const PrefixKey& o) const { return user_id == o.user_id && fingerprint == o.fingerprint; }
};

struct PrefixKeyHash {
  std::size_t operator()(const PrefixKey& k) const {
    return static_cast<std::size_t>(mix64(k.user_id ^ mix64(k.fingerprint + 0x9e3779b97f4a7c15ULL)));
  }
};

struct U64Hash {
  std::size_t operator()(std::uint64_t x) const { return static_cast<std::size_t>(mix64(x)); }
};

// Seconds on std::chrono::steady_clock (CLOCK_MONOTONIC on Linux, the clock of Python's time.monotonic()).
double monotonic_seconds();

// Validation shared with the binding, raising ValueError with the reference messages.
void check_count(const char* name, std::int64_t value, std::int64_t minimum);
void check_seconds(const char* name, double value, bool positive);
double resolve_now(std::optional<double> now);  // nullopt -> monotonic_seconds(); rejects non-finite times

class PrefixBlockPool {
 public:
  // Counter and gauge names of stats(), in order (the same keys, in the same order, as the Python pool).
  static constexpr std::size_t kNumStats = 20;
  using Stats = std::array<std::pair<const char*, std::int64_t>, kNumStats>;

  // num_pages and page_size in [1, 2**31); max_pinned_pages in [1, num_pages] (nullopt: num_pages).
  PrefixBlockPool(std::int64_t num_pages, std::int64_t page_size,
                  std::optional<std::int64_t> max_pinned_pages = std::nullopt);
  PrefixBlockPool(const PrefixBlockPool&) = delete;
  PrefixBlockPool& operator=(const PrefixBlockPool&) = delete;

  // The constructor's num_pages/page_size checks, in the reference order (the binding calls this before it
  // converts max_pinned_pages, so errors come out in the same order as from the Python pool).
  static void check_shape(std::int64_t num_pages, std::int64_t page_size);

  // All `now` arguments: seconds on the caller's clock; nullopt reads monotonic_seconds().
  // Operations returning pages write the entry's page ids, in token order, to *pages (cleared first).

  // New entry pinned by one reference (and leased for ttl_s seconds when ttl_s > 0). False: refused, no change.
  bool insert(std::uint64_t user_id, std::uint64_t fingerprint, std::int64_t num_tokens, double ttl_s,
              std::optional<double> now, std::vector<PageId>* pages);
  // Grow a pinned entry to num_tokens and re-key it to new_fingerprint. False: refused, no change.
  bool extend(std::uint64_t user_id, std::uint64_t fingerprint, std::uint64_t new_fingerprint,
              std::int64_t num_tokens, std::optional<double> now, std::vector<PageId>* pages);
  // Take a reference on a cached entry. False: miss.
  bool pin(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now, std::vector<PageId>* pages);
  void unpin(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now);
  // Lease (or renew) for ttl_s seconds. False: over the pinned-page budget.
  bool lease(std::uint64_t user_id, std::uint64_t fingerprint, double ttl_s, std::optional<double> now);
  // True: a live lease ended; false: it had expired already.
  bool release_lease(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now);
  bool has_lease(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now);
  void free(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now);
  std::int64_t expire(std::optional<double> now);

  std::optional<std::int64_t> lookup(std::uint64_t user_id, std::uint64_t fingerprint) const;
  bool contains(std::uint64_t user_id, std::uint64_t fingerprint) const;
  // (fingerprint, num_tokens) of the user's entries, oldest insert (or re-key) first.
  std::vector<std::pair<std::uint64_t, std::int64_t>> entries_of(std::uint64_t user_id) const;
  void pages_of(std::uint64_t user_id, std::uint64_t fingerprint, std::vector<PageId>* pages) const;
  // Page table of keys[0..n): writes kv_indptr[n+1] and kv_last_page_len[n] to caller buffers and sizes, then fills,
  // *kv_indices, all under one lock hold (a consistent snapshot). KeyError names the first key not cached.
  void page_table(const PrefixKey* keys, std::size_t n, std::int32_t* kv_indptr, std::int32_t* kv_last_page_len,
                  std::vector<PageId>* kv_indices) const;

  Stats stats() const;
  void check_invariants() const;  // throws InvariantError

  std::int64_t num_pages() const { return num_pages_; }
  std::int64_t page_size() const { return page_size_; }
  std::int64_t max_pinned_pages() const { return max_pinned_; }
  std::int64_t num_free_pages() const;
  std::int64_t num_evictable_pages() const;
  std::int64_t num_pinned_pages() const;
  std::int64_t num_used_pages() const;
  std::int64_t num_entries() const;

 private:
  enum class Lease : std::uint8_t { kNone, kLive, kExpired };

  struct Slot {
    std::uint64_t user_id = 0;
    std::uint64_t fingerprint = 0;
    std::int64_t num_tokens = 0;
    std::int64_t ref = 0;
    double expiry = 0.0;
    std::uint64_t lease_seq = 0;  // sequence number of the lease's live heap record
    PageId head = -1;             // first page of the chain (token order)
    PageId tail = -1;             // last page of the chain
    std::int32_t num_pages = 0;
    std::int32_t lru_prev = -1, lru_next = -1;    // evictable list (valid only while unpinned)
    std::int32_t user_prev = -1, user_next = -1;  // the user's entries, insert order
    Lease lease = Lease::kNone;
    bool used = false;
    bool pinned() const { return ref > 0 || lease == Lease::kLive; }
  };

  struct UserList {
    std::int32_t head = -1, tail = -1;
  };

  struct LeaseRecord {
    double expiry;
    std::uint64_t seq;
    std::int32_t slot;
  };

  struct Counters {
    std::int64_t inserts = 0, allocations = 0, evictions = 0, evicted_pages = 0, expirations = 0,
                 refused_leases = 0, refused_inserts = 0, hits = 0, misses = 0, frees = 0, leases = 0, extends = 0,
                 peak_used_pages = 0;
  };

  static constexpr std::int32_t kNil = -1;
  static constexpr std::int32_t kLruHead = 0;  // sentinel slots of the LRU list
  static constexpr std::int32_t kLruTail = 1;

  // --- lock held
  std::int64_t pages_for(std::int64_t num_tokens) const {
    return num_tokens / page_size_ + (num_tokens % page_size_ != 0);
  }
  std::int32_t find_slot(std::uint64_t user_id, std::uint64_t fingerprint) const;
  std::int32_t get_slot(std::uint64_t user_id, std::uint64_t fingerprint) const;  // KeyError if absent
  void reserve_for_new_entry();
  std::int32_t alloc_slot();
  void release_slot(std::int32_t s);
  void lru_push_back(std::int32_t s);
  void lru_unlink(std::int32_t s);
  void user_link(std::int32_t s);
  void user_unlink(std::int32_t s);
  void make_evictable(std::int32_t s);
  void make_pinned(std::int32_t s);
  void drop_entry(std::int32_t s);  // unpinned entry: index, user list, LRU, pages back to the free stack
  // Takes n pages off the free stack (evicting LRU entries as needed) as a chain head..tail, writing their ids to
  // ids[0..n) when ids is not null. False (and no change) when n pages cannot be had.
  bool reclaim(std::int64_t n, PageId* head, PageId* tail, PageId* ids);
  std::int64_t expire_locked(double now);
  void set_lease(std::int32_t s, double expiry);
  void compact_heap();
  void copy_pages(std::int32_t s, std::vector<PageId>* pages) const;

  const std::int64_t num_pages_;
  const std::int64_t page_size_;
  const std::int64_t max_pinned_;

  mutable std::mutex mu_;
  std::vector<PageId> next_page_;  // chain / free-list link of each page; kNil ends a list
  PageId free_head_ = kNil;
  std::int64_t num_free_ = 0;
  std::vector<Slot> slots_;              // [0], [1]: LRU sentinels
  std::vector<std::int32_t> free_slots_;  // stack of unused slot indices
  FlatMap<PrefixKey, std::int32_t, PrefixKeyHash> index_;
  FlatMap<std::uint64_t, UserList, U64Hash> users_;
  std::vector<LeaseRecord> heap_;  // min-heap on (expiry, seq)
  std::int64_t live_leases_ = 0;
  std::uint64_t seq_ = 0;
  std::int64_t pinned_pages_ = 0;
  std::int64_t evictable_pages_ = 0;
  Counters c_;
};

}  // namespace relaygr
