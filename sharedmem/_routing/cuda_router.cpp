// The routing allocator on CUDA: PyTorch's CUDA allocator for the whole process (installed
// through torch.cuda.memory.CUDAPluggableAllocator, before the first CUDA allocation), which
// serves the n-th allocation of a step from the pool's arena at its planned offset, exactly as
// router.cpp does on the CPU (the plan's rules are route_core.h's). Everything else goes to
// the upstream pair set by set_upstream: on a GPU the stream-ordered allocator of the CUDA
// runtime (cudaMallocAsync / cudaFreeAsync, what PyTorch's own cudaMallocAsync backend uses;
// the runtime makes a context current on autograd's device thread, the driver API would not),
// the stand-in's memory in tests.
//
// A scope belongs to a stream, not to a thread: on CUDA the autograd engine runs backward on a
// device thread of its own, with the forward's streams, so routing by the step's stream
// catches backward's allocations where a thread-local scope would miss them. An allocation on
// a stream without a scope, from any thread, goes upstream. Reusing an arena offset on the
// step's stream is ordered after the kernels that used it before, as the caching allocator's
// own reuse is; an allocation on another stream never gets arena bytes.
//
// No CUDA header is needed: a stream is an opaque pointer here, and the upstream pair is
// called through pointers, so this file builds (and is tested) on machines without CUDA.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

#include "route_core.h"

namespace {

using sharedmem_route::Decision;
using sharedmem_route::Plan;
using sharedmem_route::Scope;
using sharedmem_route::Serve;

// cudaMallocAsync(void**, size_t, cudaStream_t) and cudaFreeAsync(void*, cudaStream_t): 0 is
// cudaSuccess.
using UpstreamAlloc = int (*)(uint64_t*, size_t, void*);
using UpstreamFree = int (*)(uint64_t, void*);
std::atomic<UpstreamAlloc> g_alloc{nullptr};
std::atomic<UpstreamFree> g_free{nullptr};

// Never destroyed: see State.
sharedmem_route::State& g_state = *new sharedmem_route::State;
using StreamKey = std::pair<int, uintptr_t>;  // (device, stream): stream 0 is every device's
std::mutex& g_scopes_mutex = *new std::mutex;
auto& g_scopes = *new std::map<StreamKey, Scope*>;  // under g_scopes_mutex
std::atomic<int> g_open{0};  // how many scopes are open: allocations look them up only then

void* upstream_alloc(size_t size, void* stream) {
  if (size == 0) return nullptr;  // as the caching allocator: no bytes, no pointer
  UpstreamAlloc alloc = g_alloc.load(std::memory_order_acquire);
  TORCH_CHECK(alloc != nullptr, "sharedmem: the CUDA routing allocator has no upstream");
  uint64_t ptr = 0;
  int code = alloc(&ptr, size, stream);
  TORCH_CHECK_WITH(OutOfMemoryError, code == 0 && ptr != 0,
                   "sharedmem: CUDA could not allocate ", size, " bytes (driver error ", code,
                   ") through the routing allocator. Free tensors you no longer need, lower the "
                   "batch size, or give the step a budget (pooled_train_step(..., budget=)).");
  return reinterpret_cast<void*>(ptr);
}

// What PyTorch calls for every CUDA allocation once the router is installed.
void* route_alloc(size_t size, int device, uintptr_t stream) {
  if (g_open.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(g_scopes_mutex);
    auto it = g_scopes.find(StreamKey{device, stream});
    if (it != g_scopes.end()) {
      Scope& scope = *it->second;
      Decision decision = g_state.decide(scope, size);
      if (decision.serve == Serve::kArena) return decision.address;
      void* ptr = upstream_alloc(size, reinterpret_cast<void*>(stream));
      if (decision.serve == Serve::kWatched) g_state.record(scope, ptr, size, true);
      return ptr;
    }
  }
  return upstream_alloc(size, reinterpret_cast<void*>(stream));
}

// ``stream`` is the one the allocation was made on (the pluggable allocator keeps it).
void route_free(uintptr_t ptr, uintptr_t stream) {
  if (ptr == 0) return;
  if (g_state.release(reinterpret_cast<void*>(ptr))) return;  // arena bytes: the pool's
  UpstreamFree free = g_free.load(std::memory_order_acquire);
  if (free != nullptr) free(ptr, reinterpret_cast<void*>(stream));
}

void set_upstream(uintptr_t alloc, uintptr_t free) {
  TORCH_CHECK(alloc != 0 && free != 0, "sharedmem: the CUDA router needs both upstream calls");
  g_alloc.store(reinterpret_cast<UpstreamAlloc>(alloc), std::memory_order_release);
  g_free.store(reinterpret_cast<UpstreamFree>(free), std::memory_order_release);
}

void open_scope(StreamKey key, std::unique_ptr<Scope> scope) {
  std::lock_guard<std::mutex> lock(g_scopes_mutex);
  TORCH_CHECK(g_scopes.count(key) == 0,
              "sharedmem: a step's scope is already open on this stream");
  g_scopes[key] = scope.release();
  g_open.fetch_add(1, std::memory_order_release);
}

std::unique_ptr<Scope> close_scope(StreamKey key, bool recording) {
  std::lock_guard<std::mutex> lock(g_scopes_mutex);
  auto it = g_scopes.find(key);
  TORCH_CHECK(it != g_scopes.end() && it->second->recording == recording,
              recording ? "sharedmem: no recording is open on this stream"
                        : "sharedmem: no replay is open on this stream");
  std::unique_ptr<Scope> owned(it->second);
  g_scopes.erase(it);
  g_open.fetch_sub(1, std::memory_order_release);
  return owned;
}

// The storage of a view of the arena (held while allocations live in it), or none.
c10::Storage storage_of(const std::optional<at::Tensor>& owner) {
  return owner.has_value() && owner->defined() ? owner->storage() : c10::Storage();
}

void begin_record(uintptr_t base, size_t size, int device, uintptr_t stream,
                  const std::optional<at::Tensor>& owner) {
  TORCH_CHECK(g_alloc.load() != nullptr, "sharedmem: the CUDA routing allocator is not installed");
  TORCH_CHECK(base % 64 == 0, "sharedmem: the arena's address is not 64-byte aligned");
  open_scope({device, stream}, g_state.recording_scope(base, size, storage_of(owner)));
}

std::vector<std::vector<int64_t>> end_record(int device, uintptr_t stream) {
  return g_state.recorded(*close_scope({device, stream}, true));
}

void begin_replay(const std::shared_ptr<Plan>& plan, uintptr_t base, size_t size, int device,
                  uintptr_t stream, const std::optional<at::Tensor>& owner) {
  TORCH_CHECK(g_alloc.load() != nullptr, "sharedmem: the CUDA routing allocator is not installed");
  TORCH_CHECK(base % 64 == 0, "sharedmem: the arena's address is not 64-byte aligned");
  open_scope({device, stream}, g_state.replay_scope(plan, base, size, storage_of(owner)));
}

std::map<std::string, int64_t> end_replay(int device, uintptr_t stream) {
  return g_state.replayed(*close_scope({device, stream}, false));
}

// The stream's scope set aside (0: none), and put back: what runs between is not the step's
// (an optimizer step that makes the state it keeps across steps).
uintptr_t suspend(int device, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(g_scopes_mutex);
  auto it = g_scopes.find(StreamKey{device, stream});
  if (it == g_scopes.end()) return 0;
  Scope* scope = it->second;
  g_scopes.erase(it);
  g_open.fetch_sub(1, std::memory_order_release);
  return reinterpret_cast<uintptr_t>(scope);
}

void resume(int device, uintptr_t stream, uintptr_t scope) {
  if (scope == 0) return;
  std::lock_guard<std::mutex> lock(g_scopes_mutex);
  StreamKey key{device, stream};
  TORCH_CHECK(g_scopes.count(key) == 0,
              "sharedmem: a step's scope was opened on this stream while one was set aside");
  g_scopes[key] = reinterpret_cast<Scope*>(scope);
  g_open.fetch_add(1, std::memory_order_release);
}

bool active(int device, uintptr_t stream) {
  std::lock_guard<std::mutex> lock(g_scopes_mutex);
  return g_scopes.count(StreamKey{device, stream}) != 0;
}

int64_t live_bytes(uintptr_t base) { return g_state.live_bytes(base); }

std::vector<std::pair<int64_t, int64_t>> live_ranges(uintptr_t base) {
  return g_state.live_ranges(base);
}

}  // namespace

// The pair CUDAPluggableAllocator loads by name (torch/csrc/cuda/CUDAPluggableAllocator.h).
extern "C" {
__attribute__((visibility("default"))) void* sharedmem_cuda_alloc(size_t size, int device,
                                                                  void* stream) {
  return route_alloc(size, device, reinterpret_cast<uintptr_t>(stream));
}
__attribute__((visibility("default"))) void sharedmem_cuda_free(void* ptr, size_t size,
                                                                int device, void* stream) {
  (void)size;
  (void)device;
  route_free(reinterpret_cast<uintptr_t>(ptr), reinterpret_cast<uintptr_t>(stream));
}
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  sharedmem_route::bind_plan(m);
  m.def("set_upstream", &set_upstream);
  m.def("begin_record", &begin_record, pybind11::arg("base"), pybind11::arg("size"),
        pybind11::arg("device"), pybind11::arg("stream"), pybind11::arg("owner") = pybind11::none());
  m.def("end_record", &end_record);
  m.def("begin_replay", &begin_replay, pybind11::arg("plan"), pybind11::arg("base"),
        pybind11::arg("size"), pybind11::arg("device"), pybind11::arg("stream"),
        pybind11::arg("owner") = pybind11::none());
  m.def("end_replay", &end_replay);
  m.def("active", &active);
  m.def("suspend", &suspend);
  m.def("resume", &resume);
  m.def("live_bytes", &live_bytes);
  m.def("live_ranges", &live_ranges);
  // The allocator's two calls as PyTorch makes them, for the tests (same code, no C ABI).
  m.def("alloc", [](size_t size, int device, uintptr_t stream) {
    return reinterpret_cast<uintptr_t>(route_alloc(size, device, stream));
  });
  m.def("free", [](uintptr_t ptr, uintptr_t stream) { route_free(ptr, stream); });
}
