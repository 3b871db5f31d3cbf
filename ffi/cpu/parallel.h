// Runs work items 0 .. num_items-1 on XLA's intra-op thread pool (the calling thread works
// too) and returns when every item is done. Shared by the CPU handlers.
//
// Items are claimed from a shared counter, so which thread runs an item depends on timing:
// each item must write outputs no other item writes, in an order of its own, so that results
// never depend on the thread count or on scheduling. The state is shared-owned, so a pool
// task that starts late finds no work and touches nothing else.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_varlen::cpu {

class ParallelState {
 public:
  ParallelState(int64_t num_items, std::function<void(int64_t)> run)
      : num_items_(num_items), run_(std::move(run)) {}

  void work() {
    for (int64_t i; (i = next_.fetch_add(1)) < num_items_;) {
      run_(i);
      if (done_.fetch_add(1) + 1 == num_items_) {
        std::lock_guard<std::mutex> lock(mu_);
        all_done_.notify_all();
      }
    }
  }

  void wait() {
    std::unique_lock<std::mutex> lock(mu_);
    all_done_.wait(lock, [&] { return done_.load() == num_items_; });
  }

 private:
  const int64_t num_items_;
  const std::function<void(int64_t)> run_;  // owns copies of what the items read
  std::atomic<int64_t> next_{0};
  std::atomic<int64_t> done_{0};
  std::mutex mu_;
  std::condition_variable all_done_;
};

// `run(item)` for every item in [0, num_items); `run` is copied into the shared state, so it
// must capture by value (e.g. the params struct).
inline void parallel_for(xla::ffi::ThreadPool& pool, int64_t num_items,
                         std::function<void(int64_t)> run) {
  if (num_items <= 0) return;
  auto state = std::make_shared<ParallelState>(num_items, std::move(run));
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_items - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([state] { state->work(); });
  state->work();
  state->wait();
}

}  // namespace jax_varlen::cpu
