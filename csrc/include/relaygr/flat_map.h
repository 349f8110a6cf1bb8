// Open-addressing hash map (linear probing, backward-shift deletion) for small trivially copyable keys/values.
//
// The block pool keeps one bucket array per index instead of one heap node per entry (std::unordered_map):
// lookups touch one or two cache lines and erase leaves no tombstones. Not thread safe; the pool's mutex guards it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace relaygr {

// splitmix64 finalizer: a cheap bijective mixer, good enough for ids that may be sequential or hashes already.
inline std::uint64_t mix64(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

template <class K, class V, class Hash>
class FlatMap {
 public:
  FlatMap() { rehash(kMinCapacity); }

  std::size_t size() const { return size_; }
  std::size_t capacity() const { return buckets_.size(); }

  V* find(const K& key) {
    for (std::size_t i = home(key);; i = (i + 1) & mask_) {
      Bucket& b = buckets_[i];
      if (!b.used) return nullptr;
      if (b.key == key) return &b.value;
    }
  }
  const V* find(const K& key) const { return const_cast<FlatMap*>(this)->find(key); }

  // Makes room for `extra` more keys so that the next `extra` inserts cannot allocate (or throw).
  void reserve(std::size_t extra) {
    std::size_t cap = buckets_.size();
    while ((size_ + extra) * 2 > cap) cap *= 2;  // load factor <= 1/2 keeps linear probes short
    if (cap != buckets_.size()) rehash(cap);
  }

  // Inserts a key that is not present.
  void insert(const K& key, const V& value) {
    reserve(1);
    std::size_t i = home(key);
    while (buckets_[i].used) i = (i + 1) & mask_;
    buckets_[i] = Bucket{key, value, true};
    ++size_;
  }

  // Removes `key` if present; returns whether it was.
  bool erase(const K& key) {
    std::size_t i = home(key);
    for (;; i = (i + 1) & mask_) {
      if (!buckets_[i].used) return false;
      if (buckets_[i].key == key) break;
    }
    // Backward shift: pull later members of the probe run into the hole so lookups never need tombstones.
    for (std::size_t j = (i + 1) & mask_; buckets_[j].used; j = (j + 1) & mask_) {
      const std::size_t h = home(buckets_[j].key);
      if (((j - h) & mask_) >= ((j - i) & mask_)) {  // bucket j may legally sit at i
        buckets_[i] = buckets_[j];
        i = j;
      }
    }
    buckets_[i].used = false;
    --size_;
    return true;
  }

  template <class F>
  void for_each(F&& fn) const {
    for (const Bucket& b : buckets_)
      if (b.used) fn(b.key, b.value);
  }

 private:
  static constexpr std::size_t kMinCapacity = 16;
  struct Bucket {
    K key{};
    V value{};
    bool used = false;
  };

  std::size_t home(const K& key) const { return static_cast<std::size_t>(Hash{}(key)) & mask_; }

  void rehash(std::size_t cap) {
    std::vector<Bucket> old(cap);
    old.swap(buckets_);
    mask_ = cap - 1;
    for (const Bucket& b : old) {
      if (!b.used) continue;
      std::size_t i = home(b.key);
      while (buckets_[i].used) i = (i + 1) & mask_;
      buckets_[i] = b;
    }
  }

  std::vector<Bucket> buckets_;
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
};

}  // namespace relaygr
