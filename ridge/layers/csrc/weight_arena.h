// Where both CPU extensions put the weights their kernels stream: slabs of 2 MiB pages
// (huge_page_empty for a layout they pack, huge_page_copy for one they read as loaded). One
// definition, compiled into each extension (each keeps its own arena).
#pragma once
#include <torch/extension.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>

namespace ridge_shared {

// Weights live in 2 MiB pages: streaming gigabytes through 4 KiB pages costs a TLB miss
// every 64 cache lines (torch's allocator does not ask for huge pages, and transparent huge
// pages here are "madvise" only). They are carved one after another, 4 KiB aligned, out of
// slabs of address space that ask for huge pages (WeightArena); each was its own allocation
// rounded up to whole 2 MiB pages, which took 658 MB of memory for TinyLlama-1.1B's 520 MB of
// Q4_K matrices (2.4-13 MB each); carved, 522 MB, and the kernels stream them as fast (2-core
// Zen 5, one row over the 88 matrices alternated: q4_k 0.99x, int4 1.01x, bf16 0.99x). A
// slab's pages are faulted in as the packing (or copy) first writes them, so its unused tail
// costs only address space. A freed weight gives its whole pages back to the system at once (a
// slab's space is never carved twice), and the slab is freed with the last weight carved from
// it. Why the AVX2 kernels' weights live here too: Avx2Kernels.place_weight (kernels.py).
class WeightArena {
 public:
  static constexpr size_t kHuge = 2u << 20, kSlab = 64u << 20, kAlign = 4096;
  static constexpr size_t kMinCarve = 64u << 10;  // smaller weights are torch's allocations

  // Room for bytes: ptr into the slab returned (which the tensor keeps alive), or nullptr
  // where no slab could be had. A weight larger than a slab gets a slab of its own.
  std::shared_ptr<void> carve(size_t bytes, void*& ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<void> slab = current_.lock();
    if (!slab || used_ + bytes > size_) {
      const size_t size = std::max(kSlab, (bytes + kHuge - 1) / kHuge * kHuge);
      void* base = map_slab(size);
      if (!base) return nullptr;
      madvise(base, size, MADV_HUGEPAGE);  // before the first touch, so faults take huge pages
      slab = std::shared_ptr<void>(base, [size](void* p) { munmap(p, size); });
      current_ = slab, size_ = size, used_ = 0;
    }
    ptr = static_cast<char*>(slab.get()) + used_;
    used_ = (used_ + bytes + kAlign - 1) / kAlign * kAlign;
    return slab;
  }

  // size bytes (whole 2 MiB pages) at a 2 MiB boundary, mapped from the system, or nullptr. Not
  // malloc's: a slab carved from its heap (as a large aligned request can be, once freed memory
  // lies there) would leave that heap's pages asking for huge pages after the slab is freed, and
  // torch's tensors would go on to take them.
  static void* map_slab(size_t size) {
    const size_t span = size + kHuge;
    void* raw = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) return nullptr;
    const uintptr_t start = reinterpret_cast<uintptr_t>(raw), base = (start + kHuge - 1) / kHuge * kHuge;
    if (base > start) munmap(raw, base - start);  // the unaligned head and tail back
    if (start + span > base + size) munmap(reinterpret_cast<void*>(base + size), start + span - base - size);
    return reinterpret_cast<void*>(base);
  }

  // a freed weight's whole 2 MiB pages back to the system (its partial ones stay with the slab)
  static void release(void* ptr, size_t bytes) {
    const uintptr_t begin = (reinterpret_cast<uintptr_t>(ptr) + kHuge - 1) / kHuge * kHuge;
    const uintptr_t end = (reinterpret_cast<uintptr_t>(ptr) + bytes) / kHuge * kHuge;
    if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_DONTNEED);
  }

 private:
  std::mutex mutex_;
  std::weak_ptr<void> current_;  // the slab being filled, alive while a weight holds it
  size_t size_ = 0, used_ = 0;
};

// An uninitialized tensor for a weight: carved from the arena from kMinCarve bytes (torch's
// allocation below that, or where no slab could be had)
inline torch::Tensor huge_page_empty(at::IntArrayRef shape, const at::TensorOptions& options) {
  static WeightArena arena;
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  const size_t bytes = static_cast<size_t>(numel) * options.dtype().itemsize();
  void* ptr = nullptr;
  std::shared_ptr<void> slab = bytes >= WeightArena::kMinCarve ? arena.carve(bytes, ptr) : nullptr;
  if (!slab) return torch::empty(shape, options);
  // the deleter's copy of slab keeps it alive
  return torch::from_blob(ptr, shape, [slab, bytes](void* p) { WeightArena::release(p, bytes); }, options);
}

// A CPU weight's values in a contiguous tensor of the arena (the same shape and dtype); one
// under kMinCarve bytes, which the arena would not take, stays itself (made contiguous)
inline torch::Tensor huge_page_copy(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "huge_page_copy: a CPU tensor");
  if (static_cast<size_t>(t.numel()) * t.element_size() < WeightArena::kMinCarve) return t.contiguous();
  torch::Tensor out = huge_page_empty(t.sizes(), t.options());
  out.copy_(t);
  return out;
}

}  // namespace ridge_shared
