// The routing allocator: PyTorch's CPU allocator, except inside a step's scope on the
// calling thread, where the n-th allocation is served from the pool's arena at the offset the
// plan (made in Python) chose for it. The plan stays in Python; this file only records a
// step's allocation sequence, hands out planned addresses, checks them and counts.
//
// Contract (see sharedmem/_routing/__init__.py):
// - Outside a scope, in other threads, for an allocation the plan leaves out, or once a call
//   has diverged from its plan, the upstream allocator (the one installed before us) serves.
// - A planned address is handed out only when its size is the planned size and no arena
//   allocation still alive overlaps it: a call that frees later than its recording did (a
//   hook that keeps an activation) can never have its bytes overwritten.
// - c10's raw_allocate asserts that a DataPtr's context is its data pointer, so every DataPtr
//   we hand out is (ptr, ptr, route_delete) and the deleter finds the arena from the address.
#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

c10::Allocator* g_upstream = nullptr;
c10::DeleterFnPtr g_upstream_delete = nullptr;

// One lock for the arenas' live maps and the recordings' pending frees: frees may come from
// any thread (a tensor dropped elsewhere), and it is held for a map operation only.
std::mutex& g_mutex = *new std::mutex;  // never destroyed: see g_router
// How many arenas hold live allocations plus how many allocations recordings wait on: the
// deleter takes the lock only while this is non-zero.
std::atomic<int64_t> g_watched{0};

struct Arena {
  uintptr_t base = 0;
  size_t size = 0;
  std::map<uintptr_t, uintptr_t> live;  // start -> end of every arena allocation alive
  size_t live_bytes = 0;
};
auto& g_arenas = *new std::vector<std::shared_ptr<Arena>>;  // under g_mutex; never destroyed

struct Recording {
  std::vector<int64_t> sizes, alloc_at, free_at;  // per allocation; free_at -1: still alive
  int64_t clock = 0;  // one tick per allocation and per free, in order
};
struct Pending {
  std::shared_ptr<Recording> recording;
  size_t index;
};
// Recorded allocations not yet freed (never destroyed: see g_router).
auto& g_pending = *new std::unordered_map<void*, Pending>;

struct Plan {
  // offset -1: served upstream, it outlived the recorded call (watched: if it dies inside a
  // call, the recording is stale); -2: served upstream, the plan left it out.
  std::vector<int64_t> sizes, offsets;
};

struct Counts {
  int64_t served = 0, served_bytes = 0;  // from the arena
  int64_t planned_out = 0, planned_out_bytes = 0;  // upstream, as planned
  int64_t fell_back = 0, fell_back_bytes = 0;  // upstream after a divergence or an overlap
  int64_t diverged_at = -1;  // the allocation where the call left its plan
  int64_t allocations = 0;
};

struct Scope {
  bool recording = false;
  std::shared_ptr<Recording> rec;
  std::shared_ptr<Plan> plan;
  std::shared_ptr<Arena> arena;
  Counts counts;
};
thread_local Scope* t_scope = nullptr;

void route_delete(void* ptr) {
  if (g_watched.load(std::memory_order_acquire) != 0) {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_pending.find(ptr);
    if (it != g_pending.end()) {
      Recording& rec = *it->second.recording;
      rec.free_at[it->second.index] = rec.clock++;
      g_pending.erase(it);
      g_watched.fetch_sub(1);
    } else {
      auto at = reinterpret_cast<uintptr_t>(ptr);
      for (auto& arena : g_arenas) {
        if (at < arena->base || at >= arena->base + arena->size) continue;
        auto live = arena->live.find(at);
        if (live != arena->live.end()) {
          arena->live_bytes -= live->second - live->first;
          arena->live.erase(live);
          if (arena->live.empty()) g_watched.fetch_sub(1);
          return;  // arena bytes belong to the pool: nothing to free
        }
      }
    }
  }
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
    Counts& c = scope->counts;
    int64_t index = c.allocations++;
    if (scope->recording) return record(*scope->rec, n);
    const Plan& plan = *scope->plan;
    if (c.diverged_at < 0 &&
        (index >= static_cast<int64_t>(plan.sizes.size()) ||
         plan.sizes[index] != static_cast<int64_t>(n))) {
      c.diverged_at = index;
    }
    if (c.diverged_at < 0 && plan.offsets[index] >= 0 && n > 0) {
      Arena& arena = *scope->arena;
      uintptr_t start = arena.base + static_cast<uintptr_t>(plan.offsets[index]);
      uintptr_t end = start + n;
      if (end <= arena.base + arena.size) {
        std::lock_guard<std::mutex> lock(g_mutex);
        if (free_range(arena, start, end)) {
          if (arena.live.empty()) g_watched.fetch_add(1);
          arena.live.emplace(start, end);
          arena.live_bytes += n;
          c.served++;
          c.served_bytes += static_cast<int64_t>(n);
          void* ptr = reinterpret_cast<void*>(start);
          return c10::DataPtr(ptr, ptr, &route_delete, c10::Device(c10::DeviceType::CPU));
        }
      }
      c.diverged_at = index;  // an overlap (or no room): the call is not its recording
    }
    if (c.diverged_at < 0) {
      c.planned_out++;
      c.planned_out_bytes += static_cast<int64_t>(n);
      // Watched: one that outlived the recorded call but dies inside this one was recorded
      // in another state (a gradient present now, absent then): the plan could serve it.
      if (plan.offsets[index] == -1) return record(*scope->rec, n);
      return wrap(g_upstream->allocate(n));
    }
    c.fell_back++;
    c.fell_back_bytes += static_cast<int64_t>(n);
    return wrap(g_upstream->allocate(n));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &route_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

 private:
  static bool free_range(const Arena& arena, uintptr_t start, uintptr_t end) {
    auto next = arena.live.lower_bound(start);
    if (next != arena.live.end() && next->first < end) return false;
    if (next != arena.live.begin() && std::prev(next)->second > start) return false;
    return true;
  }

  static c10::DataPtr record(Recording& rec, size_t n) {
    c10::DataPtr data = wrap(g_upstream->allocate(n));
    std::lock_guard<std::mutex> lock(g_mutex);
    size_t index = rec.sizes.size();
    rec.sizes.push_back(static_cast<int64_t>(n));
    rec.alloc_at.push_back(rec.clock++);
    rec.free_at.push_back(-1);
    // A zero-byte allocation has no pointer and is never freed: it stays "alive" (-1).
    if (data.get() != nullptr && data.get_deleter() == &route_delete) {
      g_pending[data.get()] = Pending{t_scope->rec, index};
      g_watched.fetch_add(1);
    }
    return data;
  }
};

// Never destroyed, like the state above: tensors freed while the process exits (by another
// library's static destructors, or a thread still running) must find the router, its lock
// and its maps intact, whatever order C++ destroys statics in.
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

// Stop watching the allocations of ``rec`` still alive (the caller holds g_mutex).
void forget_pending(const Recording& rec) {
  for (auto it = g_pending.begin(); it != g_pending.end();) {
    if (it->second.recording.get() == &rec) {
      it = g_pending.erase(it);
      g_watched.fetch_sub(1);
    } else {
      ++it;
    }
  }
}

void begin_record() {
  check_idle();
  auto* scope = new Scope();
  scope->recording = true;
  scope->rec = std::make_shared<Recording>();
  t_scope = scope;
}

// The recording as three lists (size, allocated at, freed at or -1), and the scope closed.
std::vector<std::vector<int64_t>> end_record() {
  Scope* scope = t_scope;
  TORCH_CHECK(scope != nullptr && scope->recording, "sharedmem: no recording is open");
  t_scope = nullptr;
  std::unique_ptr<Scope> owned(scope);
  std::lock_guard<std::mutex> lock(g_mutex);
  Recording& rec = *scope->rec;
  std::vector<std::vector<int64_t>> out{rec.sizes, rec.alloc_at, rec.free_at};
  forget_pending(rec);  // what is still alive outlives the call: its free_at stays -1
  return out;
}

std::shared_ptr<Arena> arena_at(uintptr_t base, size_t size) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& arena : g_arenas) {
    if (arena->base == base) {
      arena->size = std::max(arena->size, size);  // grown in place
      return arena;
    }
  }
  // Arenas that moved away and hold nothing alive are forgotten.
  std::vector<std::shared_ptr<Arena>> kept;
  for (auto& arena : g_arenas) {
    if (!arena->live.empty()) kept.push_back(arena);
  }
  auto arena = std::make_shared<Arena>();
  arena->base = base;
  arena->size = size;
  kept.push_back(arena);
  g_arenas.swap(kept);
  return arena;
}

void begin_replay(const std::shared_ptr<Plan>& plan, uintptr_t base, size_t size) {
  check_idle();
  TORCH_CHECK(base % 64 == 0, "sharedmem: the arena's address is not 64-byte aligned");
  auto* scope = new Scope();
  scope->plan = plan;
  scope->rec = std::make_shared<Recording>();  // the planned-out allocations, watched
  scope->arena = arena_at(base, size);
  t_scope = scope;
}

// The call's counts, and the scope closed.
std::map<std::string, int64_t> end_replay() {
  Scope* scope = t_scope;
  TORCH_CHECK(scope != nullptr && !scope->recording, "sharedmem: no replay is open");
  t_scope = nullptr;
  std::unique_ptr<Scope> owned(scope);
  const Counts& c = scope->counts;
  int64_t planned = static_cast<int64_t>(scope->plan->sizes.size());
  int64_t diverged_at = c.diverged_at;
  if (diverged_at < 0 && c.allocations != planned) diverged_at = c.allocations;
  std::lock_guard<std::mutex> lock(g_mutex);
  int64_t out_freed = 0;
  Recording& rec = *scope->rec;
  for (size_t i = 0; i < rec.sizes.size(); ++i) {
    if (rec.free_at[i] >= 0) out_freed += rec.sizes[i];
  }
  forget_pending(rec);
  return {
      {"planned_out_freed_bytes", out_freed},
      {"allocations", c.allocations},
      {"served", c.served},
      {"served_bytes", c.served_bytes},
      {"planned_out", c.planned_out},
      {"planned_out_bytes", c.planned_out_bytes},
      {"fell_back", c.fell_back},
      {"fell_back_bytes", c.fell_back_bytes},
      {"diverged_at", diverged_at},
      {"live", static_cast<int64_t>(scope->arena->live.size())},
      {"live_bytes", static_cast<int64_t>(scope->arena->live_bytes)},
  };
}

// Bytes of arena allocations alive now in the arena at ``base`` (0 for an unknown arena).
int64_t live_bytes(uintptr_t base) {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& arena : g_arenas) {
    if (arena->base == base) return static_cast<int64_t>(arena->live_bytes);
  }
  return 0;
}

bool active() { return t_scope != nullptr; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Plan, std::shared_ptr<Plan>>(m, "Plan")
      .def(pybind11::init([](std::vector<int64_t> sizes, std::vector<int64_t> offsets) {
        TORCH_CHECK(sizes.size() == offsets.size(), "sharedmem: a plan needs an offset per size");
        auto plan = std::make_shared<Plan>();
        plan->sizes = std::move(sizes);
        plan->offsets = std::move(offsets);
        return plan;
      }));
  m.def("install", &install);
  m.def("begin_record", &begin_record);
  m.def("end_record", &end_record);
  m.def("begin_replay", &begin_replay);
  m.def("end_replay", &end_replay);
  m.def("live_bytes", &live_bytes);
  m.def("active", &active);
}
