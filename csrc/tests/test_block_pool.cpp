// Standalone test of the C++ block pool (no Python). Build and run:
//   cmake -S . -B build/cpptest -DRELAYGR_BUILD_PYTHON=OFF -DRELAYGR_BUILD_TESTS=ON -DCMAKE_BUILD_TYPE=Debug
//         -DCMAKE_CXX_FLAGS="-fsanitize=address,undefined"   (or -fsanitize=thread)
//   cmake --build build/cpptest && ctest --test-dir build/cpptest --output-on-failure
// The Python test suite (python_tests/test_pool.py) checks the full semantics against the reference; this test
// covers the core's own data structures under sanitizers, including threads.
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "relaygr/block_pool.h"

using relaygr::KeyError;
using relaygr::PageId;
using relaygr::PrefixBlockPool;
using relaygr::ValueError;

namespace {

int failures = 0;

void check(bool ok, const char* what, int line) {
  if (!ok) {
    std::fprintf(stderr, "FAILED line %d: %s\n", line, what);
    ++failures;
  }
}
#define CHECK(cond) check((cond), #cond, __LINE__)

std::int64_t stat(const PrefixBlockPool& pool, const std::string& name) {
  for (const auto& kv : pool.stats())
    if (name == kv.first) return kv.second;
  std::fprintf(stderr, "no stat %s\n", name.c_str());
  std::abort();
}

template <class E, class F>
bool throws(F&& fn) {
  try {
    fn();
  } catch (const E&) {
    return true;
  }
  return false;
}

void test_basics() {
  PrefixBlockPool pool(8, 4);
  std::vector<PageId> pages;
  CHECK(pool.insert(1, 10, 9, 0.0, 0.0, &pages));
  CHECK((pages == std::vector<PageId>{0, 1, 2}));  // free stack hands out 0, 1, 2, ...
  CHECK(pool.num_pinned_pages() == 3 && pool.num_free_pages() == 5);
  CHECK(*pool.lookup(1, 10) == 9 && pool.contains(1, 10) && !pool.lookup(1, 11));
  pool.unpin(1, 10, 0.0);
  CHECK(pool.num_evictable_pages() == 3);
  pool.free(1, 10, 0.0);
  CHECK(pool.insert(2, 20, 4, 0.0, 0.0, &pages));
  CHECK((pages == std::vector<PageId>{0}));  // freed pages are reused first, in the freed entry's order
  pool.check_invariants();
}

void test_lru_and_budget() {
  PrefixBlockPool pool(6, 2);
  std::vector<PageId> pages;
  for (std::uint64_t u = 0; u < 3; ++u) CHECK(pool.insert(u, 0, 4, 0.0, 0.0, &pages));
  for (std::uint64_t u : {1, 0, 2}) pool.unpin(u, 0, 0.0);
  CHECK(pool.pin(0, 0, 0.0, &pages));
  pool.unpin(0, 0, 0.0);  // LRU order now 1, 2, 0
  CHECK(pool.insert(9, 0, 3, 0.0, 0.0, &pages));
  CHECK(!pool.contains(1, 0) && pool.contains(2, 0) && pool.contains(0, 0));
  pool.check_invariants();

  PrefixBlockPool small(10, 1, 4);
  CHECK(small.insert(1, 1, 3, 5.0, 0.0, &pages));
  small.unpin(1, 1, 0.0);  // still leased
  CHECK(!small.insert(2, 2, 2, 5.0, 0.0, &pages));  // 3 + 2 > 4 pinned pages
  CHECK(stat(small, "refused_leases") == 1);
  CHECK(small.expire(5.0) == 1 && small.num_pinned_pages() == 0);
  CHECK(!small.release_lease(1, 1, 5.0));            // expired before release
  CHECK(throws<ValueError>([&] { small.release_lease(1, 1, 5.0); }));
  small.check_invariants();
}

void test_errors_leave_pool_unchanged() {
  PrefixBlockPool pool(8, 4);
  std::vector<PageId> pages;
  pool.insert(1, 1, 4, 1.0, 0.0, &pages);
  const auto before = pool.stats();
  CHECK(throws<ValueError>([&] { pool.insert(1, 1, 4, 0.0, 0.0, &pages); }));
  CHECK(throws<ValueError>([&] { pool.insert(2, 2, 0, 0.0, 0.0, &pages); }));
  CHECK(throws<ValueError>([&] { pool.insert(2, 2, 4, -1.0, 0.0, &pages); }));
  CHECK(throws<ValueError>([&] { pool.insert(2, 2, 4, 0.0, 1.0 / 0.0, &pages); }));
  CHECK(throws<KeyError>([&] { pool.unpin(9, 9, 0.0); }));
  CHECK(throws<ValueError>([&] { pool.extend(1, 1, 2, 3, 0.0, &pages); }));
  CHECK(throws<ValueError>([&] { PrefixBlockPool bad(4, 4, 5); }));
  CHECK(throws<ValueError>([&] { PrefixBlockPool bad(std::int64_t{1} << 31, 4); }));
  CHECK(pool.stats() == before);
  pool.check_invariants();
}

void test_page_table_and_extend() {
  PrefixBlockPool pool(16, 4);
  std::vector<PageId> a, b, grown;
  pool.insert(1, 1, 4, 0.0, 0.0, &a);
  pool.insert(2, 2, 9, 2.0, 0.0, &b);
  CHECK(pool.extend(2, 2, 3, 13, 0.0, &grown));
  CHECK(grown.size() == 4 && std::equal(b.begin(), b.end(), grown.begin()));
  CHECK(pool.has_lease(2, 3, 1.0) && !pool.contains(2, 2));
  const relaygr::PrefixKey keys[] = {{2, 3}, {1, 1}};
  std::int32_t indptr[3], last[2];
  std::vector<PageId> indices;
  pool.page_table(keys, 2, indptr, last, &indices);
  CHECK(indptr[0] == 0 && indptr[1] == 4 && indptr[2] == 5 && last[0] == 1 && last[1] == 4);
  CHECK(indices.size() == 5 && indices[4] == a[0]);
  pool.check_invariants();
}

// Random single-threaded operations with the invariants checked after each one.
void test_random_sequences() {
  for (unsigned seed = 0; seed < 200; ++seed) {
    std::mt19937_64 rng(seed);
    const std::int64_t num_pages = 1 + static_cast<std::int64_t>(rng() % 40);
    const std::int64_t page_size = 1 + static_cast<std::int64_t>(rng() % 4);
    PrefixBlockPool pool(num_pages, page_size, 1 + static_cast<std::int64_t>(rng() % num_pages));
    std::vector<PageId> pages;
    double now = 0.0;
    for (int step = 0; step < 300; ++step) {
      const std::uint64_t u = rng() % 6, f = rng() % 4;
      try {
        switch (rng() % 10) {
          case 0:
          case 1: pool.insert(u, f, 1 + static_cast<std::int64_t>(rng() % 20), (rng() % 3) * 0.5, now, &pages); break;
          case 2: pool.pin(u, f, now, &pages); break;
          case 3:
          case 4: pool.unpin(u, f, now); break;
          case 5: pool.lease(u, f, 0.5 + static_cast<double>(rng() % 4), now); break;
          case 6: pool.release_lease(u, f, now); break;
          case 7: pool.free(u, f, now); break;
          case 8: pool.extend(u, f, rng() % 4, 1 + static_cast<std::int64_t>(rng() % 30), now, &pages); break;
          default: now += 0.25 * static_cast<double>(rng() % 8); pool.expire(now);
        }
      } catch (const ValueError&) {
      } catch (const KeyError&) {
      }
      pool.check_invariants();
    }
  }
}

void test_threads() {
  PrefixBlockPool pool(64, 4, 48);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&pool, t] {
      std::mt19937_64 rng(t);
      std::vector<PageId> pages;
      for (int i = 0; i < 20000; ++i) {
        const std::uint64_t u = rng() % 40, f = rng() % 3;
        try {
          if (rng() % 2) {
            const std::int64_t tokens = 1 + static_cast<std::int64_t>(rng() % 24);
            if (pool.insert(u, f, tokens, (rng() % 3) * 0.001, std::nullopt, &pages))
              pool.unpin(u, f, std::nullopt);
          } else if (pool.pin(u, f, std::nullopt, &pages)) {
            pool.unpin(u, f, std::nullopt);
            if (rng() % 4 == 0) pool.free(u, f, std::nullopt);
          }
        } catch (const ValueError&) {  // already cached, or pinned by another thread
        } catch (const KeyError&) {    // freed by another thread
        }
        if (i % 1000 == 0) pool.check_invariants();
      }
    });
  }
  for (auto& th : threads) th.join();
  pool.expire(relaygr::monotonic_seconds() + 3600.0);
  pool.check_invariants();
  CHECK(pool.num_pinned_pages() == 0);
  CHECK(pool.num_used_pages() + pool.num_free_pages() == 64);
}

}  // namespace

int main() {
  try {
    test_basics();
    test_lru_and_budget();
    test_errors_leave_pool_unchanged();
    test_page_table_and_extend();
    test_random_sequences();
    test_threads();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAILED: uncaught %s\n", e.what());
    return 1;
  }
  if (failures) return 1;
  std::printf("test_block_pool: all checks passed\n");
  return 0;
}
