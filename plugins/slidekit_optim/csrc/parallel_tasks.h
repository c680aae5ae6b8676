// slidekit CPU kernels: split a pass into contiguous tasks on torch's intra-op thread pool.
//
// run_in_tasks(count, min_per_task, align, max_tasks, fn) cuts items [0, count) into at most
// as many contiguous ranges as torch has intra-op threads (capped by max_tasks when > 0), each
// at least min_per_task items and, but for the last, a multiple of align items; fn(lo, hi)
// runs each range. Small passes run on fewer tasks, down to one (then on the calling thread).
// Returns how many distinct pool threads ran a task (the tests check the thread cap with it).
// Shared by fused_adam.cpp and adamw8.cpp; included by path, so it builds with either source.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace slidekit {

template <typename Fn>
int64_t run_in_tasks(int64_t count, int64_t min_per_task, int64_t align, int64_t max_tasks, const Fn& fn) {
  const int64_t threads = at::get_num_threads();
  const int64_t limit = max_tasks > 0 ? std::min<int64_t>(max_tasks, threads) : threads;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(limit, count / min_per_task));
  const int64_t per_task = ((count + tasks - 1) / tasks + align - 1) / align * align;
  std::vector<int> ran_on(tasks, -1);  // the pool thread that ran each task
  auto run = [&](int64_t t_begin, int64_t t_end) {
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t lo = std::min(count, t * per_task);
      fn(lo, std::min(count, lo + per_task));
      ran_on[t] = at::get_thread_num();
    }
  };
  if (tasks == 1) {
    run(0, 1);
  } else {
    at::parallel_for(0, tasks, 1, run);
  }
  std::sort(ran_on.begin(), ran_on.end());
  return std::unique(ran_on.begin(), ran_on.end()) - ran_on.begin();
}

}  // namespace slidekit
