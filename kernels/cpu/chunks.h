// Work sharing for the CPU ops: threads take fixed-size chunks from a shared counter instead
// of one static share each (at::parallel_for's split), so a thread the OS preempts (the
// server's own I/O threads on a small box, a neighbour's process) delays the chunk it holds,
// not half of the op: the other threads take the rest. llama.cpp's matmuls share work the same
// way. With one thread, or a range below `grain`, the calling thread runs it all.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace tessera {

// fn(begin, end) over [0, n) in chunks of `chunk` (the last may be shorter), each run once.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, int64_t grain, const F& fn) {
  if (n <= 0) return;
  chunk = std::max<int64_t>(1, chunk);
  const int64_t chunks = (n + chunk - 1) / chunk;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), chunks);
  if (threads <= 1 || n <= grain || at::in_parallel_region()) {
    fn(0, n);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace tessera
