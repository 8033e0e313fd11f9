// The routing allocator: PyTorch's CPU allocator, except inside a step's scope on the
// calling thread, where the n-th allocation is served from the pool's arena at the offset the
// plan (made in Python) chose for it. The plan stays in Python; this file only records a
// step's allocation sequence, hands out planned addresses, checks them and counts.
//
// Contract (see sharedmem/_routing/__init__.py; the plan's rules are route_core.h's):
// - Outside a scope, in other threads, for an allocation the plan leaves out, or once a call
//   has diverged from its plan, the upstream allocator (the one installed before us) serves.
// - c10's raw_allocate asserts that a DataPtr's context is its data pointer, so every DataPtr
//   we hand out is (ptr, ptr, route_delete) and the deleter finds the arena from the address.
#include <torch/csrc/utils/pybind.h>

#include <c10/core/CPUAllocator.h>

#include <memory>

#include "route_core.h"

namespace {

using sharedmem_route::Decision;
using sharedmem_route::Plan;
using sharedmem_route::Scope;
using sharedmem_route::Serve;

c10::Allocator* g_upstream = nullptr;
c10::DeleterFnPtr g_upstream_delete = nullptr;
// Never destroyed: see State.
sharedmem_route::State& g_state = *new sharedmem_route::State;
thread_local Scope* t_scope = nullptr;

void route_delete(void* ptr) {
  if (g_state.release(ptr)) return;  // arena bytes belong to the pool: nothing to free
  g_upstream_delete(ptr);
}

c10::DataPtr wrap(c10::DataPtr upstream) {
  // Same bytes, our deleter (which hands them back upstream), so that raw_deleter() holds.
  void* ptr = upstream.get();
  if (ptr == nullptr || upstream.get_context() != ptr ||
      upstream.get_deleter() != g_upstream_delete) {
    return upstream;
  }
  c10::Device device = upstream.device();
  upstream.release_context();
  return c10::DataPtr(ptr, ptr, &route_delete, device);
}

struct Router final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    Scope* scope = t_scope;
    if (scope == nullptr) return wrap(g_upstream->allocate(n));
    Decision decision = g_state.decide(*scope, n);
    if (decision.serve == Serve::kArena) {
      void* ptr = decision.address;
      return c10::DataPtr(ptr, ptr, &route_delete, c10::Device(c10::DeviceType::CPU));
    }
    c10::DataPtr data = wrap(g_upstream->allocate(n));
    if (decision.serve == Serve::kWatched) {
      g_state.record(*scope, data.get(), n, data.get_deleter() == &route_delete);
    }
    return data;
  }

  c10::DeleterFnPtr raw_deleter() const override { return &route_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

// Never destroyed, like the state above.
Router& g_router = *new Router;

bool install() {
  if (c10::GetCPUAllocator() == &g_router) return true;
  c10::Allocator* upstream = c10::GetCPUAllocator();
  if (upstream == nullptr || upstream->raw_deleter() == nullptr) return false;
  g_upstream = upstream;
  g_upstream_delete = upstream->raw_deleter();
  c10::SetCPUAllocator(&g_router, /*priority=*/200);
  return c10::GetCPUAllocator() == &g_router;
}

void check_idle() {
  TORCH_CHECK(g_upstream != nullptr, "sharedmem: the routing allocator is not installed");
  TORCH_CHECK(t_scope == nullptr, "sharedmem: a step's scope is already open on this thread");
}

// The storage of a view of the arena (held while allocations live in it), or none.
c10::Storage storage_of(const std::optional<at::Tensor>& owner) {
  return owner.has_value() && owner->defined() ? owner->storage() : c10::Storage();
}

// ``size`` 0: no arena (every allocation upstream); else best fit in [base, base + size).
// ``owner``: a tensor over the arena's memory, which the arena keeps while it serves a
// tensor still alive. ``guide``: a plan of the call's predicted sequence, followed where the
// call keeps to it (``State::decide``).
void begin_record(uintptr_t base, size_t size, const std::optional<at::Tensor>& owner,
                  const std::shared_ptr<Plan>& guide) {
  check_idle();
  TORCH_CHECK(base % 64 == 0, "sharedmem: the arena's address is not 64-byte aligned");
  t_scope = g_state.recording_scope(base, size, storage_of(owner), guide).release();
}

// The recording as four lists (size, allocated at, freed at or -1, arena offset or -1), and
// the scope closed.
std::vector<std::vector<int64_t>> end_record() {
  TORCH_CHECK(t_scope != nullptr && t_scope->recording, "sharedmem: no recording is open");
  std::unique_ptr<Scope> owned(t_scope);
  t_scope = nullptr;
  return g_state.recorded(*owned);
}

void begin_replay(const std::shared_ptr<Plan>& plan, uintptr_t base, size_t size,
                  const std::optional<at::Tensor>& owner) {
  check_idle();
  TORCH_CHECK(base % 64 == 0, "sharedmem: the arena's address is not 64-byte aligned");
  t_scope = g_state.replay_scope(plan, base, size, storage_of(owner)).release();
}

// The call's counts, and the scope closed.
std::map<std::string, int64_t> end_replay() {
  TORCH_CHECK(t_scope != nullptr && !t_scope->recording, "sharedmem: no replay is open");
  std::unique_ptr<Scope> owned(t_scope);
  t_scope = nullptr;
  return g_state.replayed(*owned);
}

int64_t live_bytes(uintptr_t base) { return g_state.live_bytes(base); }

// This thread's scope set aside (0: none), and put back: what runs between is not the step's
// (a collective's own temporaries, which its process group frees on a thread of its own).
uintptr_t suspend() {
  Scope* scope = t_scope;
  t_scope = nullptr;
  return reinterpret_cast<uintptr_t>(scope);
}

void resume(uintptr_t scope) {
  TORCH_CHECK(t_scope == nullptr, "sharedmem: a step's scope was opened while one was set aside");
  t_scope = reinterpret_cast<Scope*>(scope);
}

std::vector<std::pair<int64_t, int64_t>> live_ranges(uintptr_t base) {
  return g_state.live_ranges(base);
}

bool active() { return t_scope != nullptr; }

// How many allocations this thread's open scope has made so far (-1: none is open): a hook
// that runs inside a step notes where in its sequence it ran.
int64_t allocations() { return t_scope == nullptr ? -1 : t_scope->counts.allocations; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  sharedmem_route::bind_plan(m);
  m.attr("GUIDE_SMALL") = static_cast<int64_t>(sharedmem_route::kGuideSmall);
  m.def("install", &install);
  m.def("begin_record", &begin_record, pybind11::arg("base"), pybind11::arg("size"),
        pybind11::arg("owner") = pybind11::none(), pybind11::arg("guide") = nullptr);
  m.def("end_record", &end_record);
  m.def("begin_replay", &begin_replay, pybind11::arg("plan"), pybind11::arg("base"),
        pybind11::arg("size"), pybind11::arg("owner") = pybind11::none());
  m.def("end_replay", &end_replay);
  m.def("live_bytes", &live_bytes);
  m.def("live_ranges", &live_ranges);
  m.def("active", &active);
  m.def("allocations", &allocations);
  m.def("suspend", &suspend);
  m.def("resume", &resume);
}
