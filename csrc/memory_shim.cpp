// C ABI for counting the bytes of a process's CPU tensors: a CPU allocator that wraps libtorch's
// own (c10::alloc_cpu / c10::free_cpu) and keeps the live bytes and their peak inside a window the
// runner opens around each instruction. libtorch keeps no such count on the CPU (its profiler's
// reporter logs, it does not sum), so the runner installs this one before it makes any tensor.
// Each block carries its size in a 64-byte header, which keeps libtorch's 64-byte alignment.

#include <atomic>
#include <cstdint>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

namespace {

constexpr size_t kHeader = 64;

std::atomic<uint64_t> g_live{0};
std::atomic<uint64_t> g_window_peak{0};

void raise_to(std::atomic<uint64_t>& peak, uint64_t v) {
  uint64_t p = peak.load(std::memory_order_relaxed);
  while (v > p && !peak.compare_exchange_weak(p, v, std::memory_order_relaxed)) {
  }
}

void counted_free(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* block = static_cast<char*>(data) - kHeader;
  uint64_t n = *reinterpret_cast<uint64_t*>(block);
  g_live.fetch_sub(n, std::memory_order_relaxed);
  c10::free_cpu(block);
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto* block = static_cast<char*>(c10::alloc_cpu(n + kHeader));
    *reinterpret_cast<uint64_t*>(block) = n;
    uint64_t live = g_live.fetch_add(n, std::memory_order_relaxed) + n;
    raise_to(g_window_peak, live);
    void* data = block + kHeader;
    return {data, data, &counted_free, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &counted_free; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

}  // namespace

extern "C" {

// Makes the counting allocator libtorch's CPU allocator (idempotent). Tensors made before keep
// their own deleters and are not counted.
void smp_memory_install() {
  static CountingCpuAllocator counting;
  static std::atomic<bool> done{false};
  if (!done.exchange(true)) {
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
}

// Bytes of CPU tensor storage alive now (made since the install).
uint64_t smp_memory_live() { return g_live.load(std::memory_order_relaxed); }

// Opens a window: its peak starts at the live bytes now.
void smp_memory_window_open() { g_window_peak.store(g_live.load(std::memory_order_relaxed), std::memory_order_relaxed); }

// The most live bytes since the window opened.
uint64_t smp_memory_window_peak() {
  uint64_t live = g_live.load(std::memory_order_relaxed);
  raise_to(g_window_peak, live);
  return g_window_peak.load(std::memory_order_relaxed);
}

}  // extern "C"
