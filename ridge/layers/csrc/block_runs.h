// Blocks of a weight shared out over the threads, with work stealing.
//
// A static split gives each thread one contiguous run of blocks (one stream of W, what DRAM
// and the prefetchers serve best), but the threads do not stream at the same rate: a core
// that shares memory with the other, or was busy a moment, finishes later, and the other one
// waits at the join. Here each thread starts on the run a static split gives it and takes its
// blocks front first; a thread out of blocks takes the back half of the run with the most
// left and walks that in order too. Which thread computes a block never changes what it computes.
// Reversed, slot t starts on the run a static split gives slot slots - 1 - t (quant_alternate,
// linear_call.h: the runs' order flipped every other call).
#pragma once
#include <atomic>
#include <cstdint>
#include <vector>

class BlockRuns {
 public:
  // blocks [0, n) over `slots` runs (the threads of the parallel_for that calls next)
  BlockRuns(int64_t n, int64_t slots, bool reversed = false) : runs_(static_cast<size_t>(slots)) {
    for (int64_t t = 0; t < slots; ++t) {
      const int64_t r = reversed ? slots - 1 - t : t;
      runs_[t].v.store(pack(n * r / slots, n * (r + 1) / slots), std::memory_order_relaxed);
    }
  }

  // slot t's next block j and the end of the run it lies in, as it stands now (a thief may
  // still shorten it); false when no run has a block left to take
  bool next(int64_t t, int64_t& j, int64_t& end) {
    std::atomic<uint64_t>& own = runs_[t].v;
    for (;;) {
      uint64_t cur = own.load(std::memory_order_acquire);
      if (lo(cur) < hi(cur)) {
        if (own.compare_exchange_weak(cur, pack(lo(cur) + 1, hi(cur)), std::memory_order_acq_rel)) {
          j = lo(cur), end = hi(cur);
          return true;
        }
        continue;
      }
      // out of blocks: the back half of the run with the most left (2 or more)
      int64_t victim = -1;
      uint64_t seen = 0;
      for (size_t v = 0; v < runs_.size(); ++v) {
        const uint64_t c = runs_[v].v.load(std::memory_order_acquire);
        if (static_cast<int64_t>(v) != t && hi(c) - lo(c) >= 2 && (victim < 0 || hi(c) - lo(c) > hi(seen) - lo(seen)))
          victim = static_cast<int64_t>(v), seen = c;
      }
      if (victim < 0) return false;
      const uint64_t mid = lo(seen) + (hi(seen) - lo(seen) + 1) / 2;
      if (runs_[victim].v.compare_exchange_strong(seen, pack(lo(seen), mid), std::memory_order_acq_rel))
        own.store(pack(mid, hi(seen)), std::memory_order_release);
    }
  }

 private:
  struct alignas(64) Run {
    std::atomic<uint64_t> v;  // the run's next block (low 32 bits) and its end (high 32)
  };
  static uint64_t pack(uint64_t begin, uint64_t end) { return begin | (end << 32); }
  static uint64_t lo(uint64_t v) { return v & 0xFFFFFFFFu; }
  static uint64_t hi(uint64_t v) { return v >> 32; }
  std::vector<Run> runs_;
};
