// PrefixBlockPool: see include/relaygr/block_pool.h for the layout and relaygr_engine/_pool_py.py for the
// reference semantics this mirrors operation by operation.
#include "relaygr/block_pool.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>

namespace relaygr {
namespace {

constexpr std::int64_t kMaxPageIds = std::int64_t{1} << 31;  // page ids and page-table entries are int32

std::string key_str(std::uint64_t user_id, std::uint64_t fingerprint) {
  return "(user_id=" + std::to_string(user_id) + ", fingerprint=" + std::to_string(fingerprint) + ")";
}

std::string seconds_str(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

// Min-heap order on (expiry, seq) for the std heap algorithms (which build max-heaps).
struct LaterFirst {
  template <class R>
  bool operator()(const R& a, const R& b) const {
    return a.expiry > b.expiry || (a.expiry == b.expiry && a.seq > b.seq);
  }
};

[[noreturn]] void broken(const std::string& what) {
  throw InvariantError("PrefixBlockPool invariant broken: " + what);
}

void require(bool ok, const char* what) {
  if (!ok) broken(what);
}

}  // namespace

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void check_count(const char* name, std::int64_t value, std::int64_t minimum) {
  if (value < minimum)
    throw ValueError(std::string(name) + " must be an integer >= " + std::to_string(minimum) + ", got " +
                     std::to_string(value));
}

void check_seconds(const char* name, double value, bool positive) {
  if (!std::isfinite(value) || value < 0 || (positive && value == 0))
    throw ValueError(std::string(name) + " must be a finite number of seconds " + (positive ? "> 0" : ">= 0") +
                     ", got " + seconds_str(value));
}

double resolve_now(std::optional<double> now) {
  if (!now) return monotonic_seconds();
  if (!std::isfinite(*now)) throw ValueError("now must be a finite time in seconds, got " + seconds_str(*now));
  return *now;
}

// ------------------------------------------------------------------------------------------------ construction
void PrefixBlockPool::check_shape(std::int64_t num_pages, std::int64_t page_size) {
  check_count("num_pages", num_pages, 1);
  check_count("page_size", page_size, 1);
  if (num_pages >= kMaxPageIds)
    throw ValueError("num_pages must be < 2**31 (page ids are int32), got " + std::to_string(num_pages));
  if (page_size >= kMaxPageIds)
    throw ValueError("page_size must be < 2**31 (kv_last_page_len is int32), got " + std::to_string(page_size));
}

namespace {
std::int64_t checked_max_pinned(std::int64_t num_pages, std::int64_t page_size, std::optional<std::int64_t> m) {
  PrefixBlockPool::check_shape(num_pages, page_size);
  const std::int64_t v = m.value_or(num_pages);
  check_count("max_pinned_pages", v, 1);
  if (v > num_pages)
    throw ValueError("max_pinned_pages must be <= num_pages (" + std::to_string(num_pages) + "), got " +
                     std::to_string(v));
  return v;
}
}  // namespace

PrefixBlockPool::PrefixBlockPool(std::int64_t num_pages, std::int64_t page_size,
                                 std::optional<std::int64_t> max_pinned_pages)
    : num_pages_(num_pages),
      page_size_(page_size),
      max_pinned_(checked_max_pinned(num_pages, page_size, max_pinned_pages)) {
  // Free stack 0, 1, 2, ...: page 0 is handed out first, as from the reference's reversed list.
  next_page_.resize(static_cast<std::size_t>(num_pages_));
  for (std::int64_t p = 0; p < num_pages_; ++p)
    next_page_[static_cast<std::size_t>(p)] = p + 1 < num_pages_ ? static_cast<PageId>(p + 1) : kNil;
  free_head_ = 0;
  num_free_ = num_pages_;
  slots_.reserve(16);
  free_slots_.reserve(16);
  slots_.resize(2);  // LRU sentinels
  slots_[kLruHead].lru_next = kLruTail;
  slots_[kLruTail].lru_prev = kLruHead;
}

// ------------------------------------------------------------------------------------------------ helpers (locked)
std::int32_t PrefixBlockPool::find_slot(std::uint64_t user_id, std::uint64_t fingerprint) const {
  const std::int32_t* s = index_.find(PrefixKey{user_id, fingerprint});
  return s ? *s : kNil;
}

std::int32_t PrefixBlockPool::get_slot(std::uint64_t user_id, std::uint64_t fingerprint) const {
  const std::int32_t s = find_slot(user_id, fingerprint);
  if (s == kNil) throw KeyError("no cached entry for " + key_str(user_id, fingerprint));
  return s;
}

// Everything a new (or re-keyed) entry may allocate, allocated up front: an out-of-memory error then leaves the
// pool unchanged instead of half-updated.
void PrefixBlockPool::reserve_for_new_entry() {
  if (free_slots_.empty() && slots_.size() == slots_.capacity()) {
    slots_.reserve(slots_.size() * 2);
    free_slots_.reserve(slots_.capacity());  // release_slot() never allocates
  }
  index_.reserve(1);
  users_.reserve(1);
  if (heap_.size() == heap_.capacity()) heap_.reserve(std::max<std::size_t>(16, heap_.size() * 2));
}

std::int32_t PrefixBlockPool::alloc_slot() {
  std::int32_t s;
  if (!free_slots_.empty()) {
    s = free_slots_.back();
    free_slots_.pop_back();
    slots_[s] = Slot{};
  } else {
    s = static_cast<std::int32_t>(slots_.size());
    slots_.emplace_back();
  }
  slots_[s].used = true;
  return s;
}

void PrefixBlockPool::release_slot(std::int32_t s) {
  slots_[s] = Slot{};  // used = false, lease = kNone: heap records naming this slot are now stale
  free_slots_.push_back(s);  // cannot allocate: capacity >= number of slots ever handed out
}

void PrefixBlockPool::lru_push_back(std::int32_t s) {
  const std::int32_t last = slots_[kLruTail].lru_prev;
  slots_[s].lru_prev = last;
  slots_[s].lru_next = kLruTail;
  slots_[last].lru_next = s;
  slots_[kLruTail].lru_prev = s;
}

void PrefixBlockPool::lru_unlink(std::int32_t s) {
  Slot& e = slots_[s];
  slots_[e.lru_prev].lru_next = e.lru_next;
  slots_[e.lru_next].lru_prev = e.lru_prev;
  e.lru_prev = e.lru_next = kNil;
}

void PrefixBlockPool::user_link(std::int32_t s) {
  Slot& e = slots_[s];
  UserList* u = users_.find(e.user_id);
  if (u == nullptr) {
    e.user_prev = e.user_next = kNil;
    users_.insert(e.user_id, UserList{s, s});
    return;
  }
  e.user_prev = u->tail;
  e.user_next = kNil;
  slots_[u->tail].user_next = s;
  u->tail = s;
}

void PrefixBlockPool::user_unlink(std::int32_t s) {
  Slot& e = slots_[s];
  UserList* u = users_.find(e.user_id);
  if (e.user_prev != kNil) slots_[e.user_prev].user_next = e.user_next; else u->head = e.user_next;
  if (e.user_next != kNil) slots_[e.user_next].user_prev = e.user_prev; else u->tail = e.user_prev;
  e.user_prev = e.user_next = kNil;
  if (u->head == kNil) users_.erase(e.user_id);
}

void PrefixBlockPool::make_evictable(std::int32_t s) {
  pinned_pages_ -= slots_[s].num_pages;
  evictable_pages_ += slots_[s].num_pages;
  lru_push_back(s);  // most recently used
}

void PrefixBlockPool::make_pinned(std::int32_t s) {
  lru_unlink(s);
  evictable_pages_ -= slots_[s].num_pages;
  pinned_pages_ += slots_[s].num_pages;
}

void PrefixBlockPool::drop_entry(std::int32_t s) {
  Slot& e = slots_[s];
  lru_unlink(s);
  index_.erase(PrefixKey{e.user_id, e.fingerprint});
  user_unlink(s);
  evictable_pages_ -= e.num_pages;
  // Splice the chain onto the free stack: its first page is reused first (the reference pushes reversed pages).
  next_page_[e.tail] = free_head_;
  free_head_ = e.head;
  num_free_ += e.num_pages;
  release_slot(s);
}

bool PrefixBlockPool::reclaim(std::int64_t n, PageId* head, PageId* tail, PageId* ids) {
  if (num_free_ + evictable_pages_ < n) return false;
  while (num_free_ < n) {
    const std::int32_t s = slots_[kLruHead].lru_next;  // least recently used
    ++c_.evictions;
    c_.evicted_pages += slots_[s].num_pages;
    drop_entry(s);
  }
  PageId first = free_head_, last = free_head_;
  if (ids != nullptr) ids[0] = first;
  for (std::int64_t i = 1; i < n; ++i) {
    last = next_page_[last];
    if (ids != nullptr) ids[i] = last;
  }
  free_head_ = next_page_[last];
  next_page_[last] = kNil;
  num_free_ -= n;
  c_.allocations += n;
  c_.peak_used_pages = std::max(c_.peak_used_pages, num_pages_ - num_free_);
  *head = first;
  *tail = last;
  return true;
}

std::int64_t PrefixBlockPool::expire_locked(double now) {
  std::int64_t n = 0;
  while (!heap_.empty() && heap_.front().expiry <= now) {
    const LeaseRecord r = heap_.front();
    std::pop_heap(heap_.begin(), heap_.end(), LaterFirst{});
    heap_.pop_back();
    Slot& e = slots_[r.slot];
    if (!e.used || e.lease != Lease::kLive || e.lease_seq != r.seq) continue;  // stale: gone, released, renewed
    e.lease = Lease::kExpired;
    --live_leases_;
    ++n;
    if (e.ref == 0) make_evictable(r.slot);
  }
  c_.expirations += n;
  return n;
}

void PrefixBlockPool::set_lease(std::int32_t s, double expiry) {
  Slot& e = slots_[s];
  if (e.lease != Lease::kLive) ++live_leases_;
  e.lease = Lease::kLive;
  e.expiry = expiry;
  e.lease_seq = ++seq_;
  heap_.push_back(LeaseRecord{expiry, seq_, s});
  std::push_heap(heap_.begin(), heap_.end(), LaterFirst{});
  ++c_.leases;
  // Renewals and releases leave stale records behind; drop them once they outnumber the live ones.
  if (heap_.size() > 64 && heap_.size() > 2 * static_cast<std::size_t>(live_leases_)) compact_heap();
}

void PrefixBlockPool::compact_heap() {
  auto stale = [this](const LeaseRecord& r) {
    const Slot& e = slots_[r.slot];
    return !e.used || e.lease != Lease::kLive || e.lease_seq != r.seq;
  };
  heap_.erase(std::remove_if(heap_.begin(), heap_.end(), stale), heap_.end());
  std::make_heap(heap_.begin(), heap_.end(), LaterFirst{});
}

void PrefixBlockPool::copy_pages(std::int32_t s, std::vector<PageId>* pages) const {
  const Slot& e = slots_[s];
  pages->resize(static_cast<std::size_t>(e.num_pages));
  PageId p = e.head;
  for (std::int32_t i = 0; i < e.num_pages; ++i, p = next_page_[p]) (*pages)[i] = p;
}

// ------------------------------------------------------------------------------------------------ public API
bool PrefixBlockPool::insert(std::uint64_t user_id, std::uint64_t fingerprint, std::int64_t num_tokens, double ttl_s,
                             std::optional<double> now, std::vector<PageId>* pages) {
  check_count("num_tokens", num_tokens, 1);
  check_seconds("ttl_s", ttl_s, false);
  const double t = resolve_now(now);
  const std::int64_t n = pages_for(num_tokens);
  pages->clear();
  if (n <= num_pages_) pages->resize(static_cast<std::size_t>(n));  // filled by reclaim(); cleared if refused
  std::lock_guard<std::mutex> lock(mu_);
  if (find_slot(user_id, fingerprint) != kNil) {
    pages->clear();
    throw ValueError(key_str(user_id, fingerprint) + " is already cached; free() or extend() it");
  }
  reserve_for_new_entry();
  expire_locked(t);
  if (n > max_pinned_ - pinned_pages_) {  // n may be near INT64_MAX: no overflow
    ++c_.refused_leases;
    pages->clear();
    return false;
  }
  PageId head, tail;
  if (!reclaim(n, &head, &tail, pages->data())) {  // n <= num_pages here, so pages holds n ids
    ++c_.refused_inserts;
    pages->clear();
    return false;
  }
  const std::int32_t s = alloc_slot();
  Slot& e = slots_[s];
  e.user_id = user_id;
  e.fingerprint = fingerprint;
  e.num_tokens = num_tokens;
  e.head = head;
  e.tail = tail;
  e.num_pages = static_cast<std::int32_t>(n);
  e.ref = 1;
  index_.insert(PrefixKey{user_id, fingerprint}, s);
  user_link(s);
  pinned_pages_ += n;
  if (ttl_s > 0) set_lease(s, t + ttl_s);
  ++c_.inserts;
  return true;
}

bool PrefixBlockPool::extend(std::uint64_t user_id, std::uint64_t fingerprint, std::uint64_t new_fingerprint,
                             std::int64_t num_tokens, std::optional<double> now, std::vector<PageId>* pages) {
  check_count("num_tokens", num_tokens, 1);
  const double t = resolve_now(now);
  const std::int64_t total = pages_for(num_tokens);
  pages->clear();
  if (total <= num_pages_) pages->reserve(static_cast<std::size_t>(total));
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = get_slot(user_id, fingerprint);
  if (slots_[s].ref == 0)
    throw ValueError("extend needs the entry pinned by the caller (ref count >= 1), got ref count 0 for " +
                     key_str(user_id, fingerprint));
  if (num_tokens < slots_[s].num_tokens)
    throw ValueError("num_tokens must be >= the entry's " + std::to_string(slots_[s].num_tokens) +
                     " tokens, got " + std::to_string(num_tokens));
  const bool rekey = new_fingerprint != fingerprint;
  if (rekey && find_slot(user_id, new_fingerprint) != kNil)
    throw ValueError(key_str(user_id, new_fingerprint) + " is already cached");
  reserve_for_new_entry();
  expire_locked(t);
  const std::int64_t extra = total - slots_[s].num_pages;
  if (extra > 0) {
    if (extra > max_pinned_ - pinned_pages_) {
      ++c_.refused_leases;
      return false;
    }
    PageId head, tail;
    if (!reclaim(extra, &head, &tail, nullptr)) {  // never evicts this entry: it is pinned
      ++c_.refused_inserts;
      return false;
    }
    Slot& e = slots_[s];
    next_page_[e.tail] = head;
    e.tail = tail;
    e.num_pages += static_cast<std::int32_t>(extra);
    pinned_pages_ += extra;
  }
  if (rekey) {
    index_.erase(PrefixKey{user_id, fingerprint});
    user_unlink(s);  // the re-keyed entry moves to the end of the user's insert order, as in the reference
    slots_[s].fingerprint = new_fingerprint;
    index_.insert(PrefixKey{user_id, new_fingerprint}, s);
    user_link(s);
    if (slots_[s].lease == Lease::kLive) {  // a fresh heap record, as the reference re-keys its record
      set_lease(s, slots_[s].expiry);
      --c_.leases;
    }
  }
  slots_[s].num_tokens = num_tokens;
  ++c_.extends;
  copy_pages(s, pages);
  return true;
}

bool PrefixBlockPool::pin(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now,
                          std::vector<PageId>* pages) {
  const double t = resolve_now(now);
  pages->clear();
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(t);
  const std::int32_t s = find_slot(user_id, fingerprint);
  if (s == kNil) {
    ++c_.misses;
    return false;
  }
  if (!slots_[s].pinned()) make_pinned(s);
  ++slots_[s].ref;
  ++c_.hits;
  copy_pages(s, pages);
  return true;
}

void PrefixBlockPool::unpin(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now) {
  const double t = resolve_now(now);
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = get_slot(user_id, fingerprint);
  if (slots_[s].ref == 0)
    throw ValueError("unpin of " + key_str(user_id, fingerprint) + " which has ref count 0 (expected >= 1)");
  expire_locked(t);
  --slots_[s].ref;
  if (!slots_[s].pinned()) make_evictable(s);
}

bool PrefixBlockPool::lease(std::uint64_t user_id, std::uint64_t fingerprint, double ttl_s,
                            std::optional<double> now) {
  check_seconds("ttl_s", ttl_s, true);
  const double t = resolve_now(now);
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = get_slot(user_id, fingerprint);
  if (heap_.size() == heap_.capacity()) heap_.reserve(std::max<std::size_t>(16, heap_.size() * 2));
  expire_locked(t);
  Slot& e = slots_[s];
  if (e.pinned()) {
    const double renewed = t + ttl_s;
    set_lease(s, e.lease == Lease::kLive ? std::max(renewed, e.expiry) : renewed);
    return true;
  }
  if (pinned_pages_ + e.num_pages > max_pinned_) {
    ++c_.refused_leases;
    return false;
  }
  make_pinned(s);
  set_lease(s, t + ttl_s);
  return true;
}

bool PrefixBlockPool::release_lease(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now) {
  const double t = resolve_now(now);
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = get_slot(user_id, fingerprint);
  if (slots_[s].lease == Lease::kNone)
    throw ValueError("release_lease of " + key_str(user_id, fingerprint) +
                     " which holds no lease (never leased or already released)");
  expire_locked(t);
  Slot& e = slots_[s];
  const bool live = e.lease == Lease::kLive;
  e.lease = Lease::kNone;
  e.lease_seq = ++seq_;  // orphan the heap record
  if (live) {
    --live_leases_;
    if (e.ref == 0) make_evictable(s);
  }
  return live;
}

bool PrefixBlockPool::has_lease(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now) {
  const double t = resolve_now(now);
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = get_slot(user_id, fingerprint);
  expire_locked(t);
  return slots_[s].lease == Lease::kLive;
}

void PrefixBlockPool::free(std::uint64_t user_id, std::uint64_t fingerprint, std::optional<double> now) {
  const double t = resolve_now(now);
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = get_slot(user_id, fingerprint);
  expire_locked(t);
  const Slot& e = slots_[s];
  if (e.pinned())
    throw ValueError("free of pinned " + key_str(user_id, fingerprint) + ": ref count " + std::to_string(e.ref) +
                     ", lease live=" + (e.lease == Lease::kLive ? "True" : "False") + " (expected unpinned)");
  drop_entry(s);
  ++c_.frees;
}

std::int64_t PrefixBlockPool::expire(std::optional<double> now) {
  const double t = resolve_now(now);
  std::lock_guard<std::mutex> lock(mu_);
  return expire_locked(t);
}

std::optional<std::int64_t> PrefixBlockPool::lookup(std::uint64_t user_id, std::uint64_t fingerprint) const {
  std::lock_guard<std::mutex> lock(mu_);
  const std::int32_t s = find_slot(user_id, fingerprint);
  if (s == kNil) return std::nullopt;
  return slots_[s].num_tokens;
}

bool PrefixBlockPool::contains(std::uint64_t user_id, std::uint64_t fingerprint) const {
  std::lock_guard<std::mutex> lock(mu_);
  return find_slot(user_id, fingerprint) != kNil;
}

std::vector<std::pair<std::uint64_t, std::int64_t>> PrefixBlockPool::entries_of(std::uint64_t user_id) const {
  std::vector<std::pair<std::uint64_t, std::int64_t>> out;
  std::lock_guard<std::mutex> lock(mu_);
  const UserList* u = users_.find(user_id);
  if (u == nullptr) return out;
  for (std::int32_t s = u->head; s != kNil; s = slots_[s].user_next)
    out.emplace_back(slots_[s].fingerprint, slots_[s].num_tokens);
  return out;
}

void PrefixBlockPool::pages_of(std::uint64_t user_id, std::uint64_t fingerprint,
                               std::vector<PageId>* pages) const {
  std::lock_guard<std::mutex> lock(mu_);
  copy_pages(get_slot(user_id, fingerprint), pages);
}

void PrefixBlockPool::page_table(const PrefixKey* keys, std::size_t n, std::int32_t* kv_indptr,
                                 std::int32_t* kv_last_page_len, std::vector<PageId>* kv_indices) const {
  std::vector<std::int32_t> resolved(n);
  std::lock_guard<std::mutex> lock(mu_);
  std::int64_t nnz = 0;
  for (std::size_t i = 0; i < n; ++i) {
    resolved[i] = get_slot(keys[i].user_id, keys[i].fingerprint);
    nnz += slots_[resolved[i]].num_pages;
  }
  if (nnz >= kMaxPageIds)
    throw std::overflow_error("page_table of " + std::to_string(nnz) + " pages does not fit int32 kv_indptr");
  kv_indices->resize(static_cast<std::size_t>(nnz));
  PageId* out = kv_indices->data();
  kv_indptr[0] = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const Slot& e = slots_[resolved[i]];
    for (PageId p = e.head; p != kNil; p = next_page_[p]) *out++ = p;
    kv_indptr[i + 1] = static_cast<std::int32_t>(out - kv_indices->data());
    kv_last_page_len[i] = static_cast<std::int32_t>(e.num_tokens - (e.num_pages - 1) * page_size_);
  }
}

PrefixBlockPool::Stats PrefixBlockPool::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return Stats{{
      {"inserts", c_.inserts},
      {"allocations", c_.allocations},
      {"evictions", c_.evictions},
      {"evicted_pages", c_.evicted_pages},
      {"expirations", c_.expirations},
      {"refused_leases", c_.refused_leases},
      {"refused_inserts", c_.refused_inserts},
      {"hits", c_.hits},
      {"misses", c_.misses},
      {"frees", c_.frees},
      {"leases", c_.leases},
      {"extends", c_.extends},
      {"peak_used_pages", c_.peak_used_pages},
      {"entries", static_cast<std::int64_t>(index_.size())},
      {"free_pages", num_free_},
      {"used_pages", num_pages_ - num_free_},
      {"pinned_pages", pinned_pages_},
      {"evictable_pages", evictable_pages_},
      {"num_pages", num_pages_},
      {"max_pinned_pages", max_pinned_},
  }};
}

std::int64_t PrefixBlockPool::num_free_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_free_;
}
std::int64_t PrefixBlockPool::num_evictable_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return evictable_pages_;
}
std::int64_t PrefixBlockPool::num_pinned_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pinned_pages_;
}
std::int64_t PrefixBlockPool::num_used_pages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return num_pages_ - num_free_;
}
std::int64_t PrefixBlockPool::num_entries() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<std::int64_t>(index_.size());
}

// ------------------------------------------------------------------------------------------------ invariants
void PrefixBlockPool::check_invariants() const {
  std::lock_guard<std::mutex> lock(mu_);
  constexpr std::int32_t kFree = -2;
  std::vector<std::int32_t> owner(static_cast<std::size_t>(num_pages_), kNil);  // slot owning each page

  // Free stack: num_free_ distinct pages, then the end of the list.
  PageId p = free_head_;
  for (std::int64_t i = 0; i < num_free_; ++i) {
    require(p >= 0 && p < num_pages_, "free list runs short or out of range");
    if (owner[p] != kNil) broken("page " + std::to_string(p) + " on the free list twice");
    owner[p] = kFree;
    p = next_page_[p];
  }
  require(p == kNil, "free list longer than num_free");

  // Entries: key index, page chains, pin accounting.
  std::vector<std::pair<std::int32_t, std::uint64_t>> records;  // (slot, seq) of every heap record
  records.reserve(heap_.size());
  for (const LeaseRecord& r : heap_) records.emplace_back(r.slot, r.seq);
  std::sort(records.begin(), records.end());
  std::int64_t used = 0, pinned = 0, evictable = 0, unpinned_entries = 0, live = 0;
  for (std::size_t s = 2; s < slots_.size(); ++s) {
    const Slot& e = slots_[s];
    if (!e.used) continue;
    ++used;
    auto entry_broken = [&e](const char* what) { broken(key_str(e.user_id, e.fingerprint) + " " + what); };
    const std::int32_t* indexed = index_.find(PrefixKey{e.user_id, e.fingerprint});
    if (indexed == nullptr || *indexed != static_cast<std::int32_t>(s)) entry_broken("not indexed to its slot");
    if (e.num_tokens < 1 || e.num_pages != pages_for(e.num_tokens)) entry_broken("pages do not match tokens");
    if (e.ref < 0) entry_broken("has a negative ref count");
    PageId q = e.head, last = kNil;
    for (std::int32_t i = 0; i < e.num_pages; ++i) {
      if (q < 0 || q >= num_pages_) entry_broken("page chain runs short or out of range");
      if (owner[q] != kNil) entry_broken(("owns page " + std::to_string(q) + " that is free or owned twice").c_str());
      owner[q] = static_cast<std::int32_t>(s);
      last = q;
      q = next_page_[q];
    }
    if (q != kNil || last != e.tail) entry_broken("page chain longer than num_pages or tail wrong");
    if (e.pinned()) {
      pinned += e.num_pages;
      if (e.lru_prev != kNil || e.lru_next != kNil) entry_broken("pinned but on the LRU list");
    } else {
      evictable += e.num_pages;
      ++unpinned_entries;
    }
    if (e.lease == Lease::kLive) {
      ++live;
      const bool recorded = std::binary_search(records.begin(), records.end(),
                                               std::make_pair(static_cast<std::int32_t>(s), e.lease_seq));
      if (!recorded) entry_broken("holds a live lease without its heap record");
    }
  }
  require(static_cast<std::int64_t>(index_.size()) == used, "index size != entries");
  require(used + static_cast<std::int64_t>(free_slots_.size()) + 2 == static_cast<std::int64_t>(slots_.size()),
          "slot leaked");
  for (std::int32_t s : free_slots_) require(!slots_[s].used, "free slot in use");
  std::int64_t owned = 0;
  for (std::int32_t o : owner) {
    require(o != kNil, "page lost (neither free nor owned)");
    owned += o != kFree;
  }
  require(owned + num_free_ == num_pages_, "page count mismatch");
  require(pinned == pinned_pages_ && evictable == evictable_pages_, "pinned/evictable page counts drifted");
  require(live == live_leases_, "live lease count drifted");

  // LRU list: exactly the unpinned entries, consistently doubly linked.
  std::int64_t on_lru = 0;
  for (std::int32_t s = slots_[kLruHead].lru_next, prev = kLruHead; s != kLruTail; prev = s, s = slots_[s].lru_next) {
    require(s >= 2 && static_cast<std::size_t>(s) < slots_.size() && slots_[s].used, "LRU list names a bad slot");
    require(slots_[s].lru_prev == prev, "LRU back link broken");
    require(!slots_[s].pinned(), "pinned entry on the LRU list");
    require(++on_lru <= used, "LRU list cycles");
  }
  require(slots_[kLruTail].lru_prev != kNil, "LRU tail sentinel unlinked");
  require(on_lru == unpinned_entries, "unpinned entry missing from the LRU list");

  // Per-user lists: every entry exactly once, under its own user, in a consistent doubly linked list.
  std::int64_t listed = 0;
  users_.for_each([&](std::uint64_t user, const UserList& u) {
    std::int32_t prev = kNil;
    for (std::int32_t s = u.head; s != kNil; prev = s, s = slots_[s].user_next) {
      require(s >= 2 && static_cast<std::size_t>(s) < slots_.size() && slots_[s].used, "user list names a bad slot");
      require(slots_[s].user_id == user, "entry listed under another user");
      require(slots_[s].user_prev == prev, "user list back link broken");
      require(++listed <= used, "user list cycles");
    }
    require(prev == u.tail && prev != kNil, "user list tail wrong or empty list kept");
  });
  require(listed == used, "entry missing from its user's list");

  // Lease heap: heap-ordered (stale records allowed).
  require(std::is_heap(heap_.begin(), heap_.end(), LaterFirst{}), "lease heap out of order");
}

}  // namespace relaygr
