// The part of the routing allocator that is the same on every device: a step's recording,
// its plan, the arenas' live allocations, and the decision for the n-th allocation of a step.
// router.cpp (CPU, over c10's allocator) and cuda_router.cpp (CUDA, a pluggable allocator)
// each compile their own copy of this state; no device header is included here.
//
// The rules (the contract of sharedmem/_routing/__init__.py):
// - A planned address is handed out only when the allocation's size is the planned size and
//   no arena allocation still alive overlaps it: a step that frees later than its recording
//   did (a hook that keeps an activation) can never have its bytes overwritten.
// - Once a call has left its plan (another size, another count, an overlap), everything after
//   is served upstream and counted.
// - A recording scope with an arena serves each allocation at the smallest free range of the
//   arena that holds it (best fit, 64-byte aligned), upstream where none does: a signature's
//   first call runs inside the pool's bytes as they are, and what it spends upstream is what
//   the arena lacked.
// - A recording scope may be guided by a plan of the call's predicted sequence (the traced
//   graph's, in allocation order): an allocation takes the place the plan gave the earliest
//   predicted allocation of its size not taken yet, if that one comes at most
//   ``kGuideWindow`` large predicted allocations past the latest one taken, and where that range
//   is free (upstream where the plan left it beside); else best fit. An allocation under
//   ``kGuideSmall`` bytes (the guide's ``small``: 1 where the prediction is a recording of
//   the same code, small ones included), foreseen or not, takes the arena's bytes above the
//   plan's top (best fit there; one of a size predicted to outlive the call, a loss, never),
//   else is left to PyTorch (the plan leaves those beside): the first call is then served
//   as planned, whatever the prediction missed (an allocation it did not foresee does not
//   pull the guide ahead, nor takes a range planned for a later one).
// - A plan may place allocations that outlive the call (gradients, the loss): they stay in the
//   arena's live map, fenced, until freed wherever that happens.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace sharedmem_route {

struct Arena {
  uintptr_t base = 0;
  size_t size = 0;
  std::map<uintptr_t, uintptr_t> live;  // start -> end of every arena allocation alive
  size_t live_bytes = 0;
  // The arena's memory, held while any allocation lives in it: a tensor the user keeps (a
  // gradient planned into the arena) must outlive the pool that owned its bytes, and those
  // bytes must not be mapped again for another arena while the tensor reads them.
  c10::Storage keep;
};

struct Recording {
  std::vector<int64_t> sizes, alloc_at, free_at;  // per allocation; free_at -1: still alive
  std::vector<int64_t> offsets;  // where a recording call served each: arena offset, or -1
  int64_t clock = 0;  // one tick per allocation and per free, in order
};

// Allocations under this many bytes are not matched in a guided recording: each takes the
// arena's bytes above the guide's plan (its rounding to whole granules) by best fit, else is
// left to PyTorch (the plan leaves them beside; ``GUIDE_SMALL`` in Python). Small ones are
// where a traced graph's decomposition and the kernels' differ most (a norm's saved
// statistics, a dropout's seed, a scalar): matched by size to a predicted peer that dies
// sooner, or unforeseen and placed by best fit below the plan's top, they would hold a range
// the plan keeps for a large allocation later, and every allocation after would drift from
// the plan (a tiny GPT-2's first call: 774 KB of gradients beside the arena). Above it, or
// upstream, they cost their own few bytes.
constexpr size_t kGuideSmall = 1024;

struct Plan {
  // offset -1: served upstream, it outlived the recorded call (watched: if it dies inside a
  // call, the recording is stale); -2: served upstream, the plan left it out.
  std::vector<int64_t> sizes, offsets;
  std::vector<uint8_t> outlives;  // per allocation: planned to outlive the call (kept, not escaped)
  // As a guide: allocations under this many bytes are not matched (``kGuideSmall``; 1 where
  // the prediction is a recording of the same block in another gradient state, whose small
  // allocations are foreseen as exactly as its large ones: DenseNet's accumulation call left
  // 478 batch-norm gradients of 512 bytes beside the arena, 21 KB over eager's peak).
  int64_t small = static_cast<int64_t>(kGuideSmall);
};

struct Counts {
  int64_t served = 0, served_bytes = 0;  // from the arena
  int64_t planned_out = 0, planned_out_bytes = 0;  // upstream, as planned
  int64_t fell_back = 0, fell_back_bytes = 0;  // upstream after a divergence or an overlap
  int64_t diverged_at = -1;  // the allocation where the call left its plan
  int64_t allocations = 0;
};

struct Served {
  uintptr_t start, end;
  int64_t index;
};

struct Scope {
  bool recording = false;
  std::shared_ptr<Recording> rec;  // replaying: the planned-out allocations, watched
  std::shared_ptr<Plan> plan;
  std::shared_ptr<Arena> arena;
  c10::Storage owner;  // the arena's memory (undefined: the caller gave none)
  // A recording's guide: a plan of its predicted sequence, and per size the guide's
  // allocations of that size in order with how many of them were taken so far.
  // Only its allocations of ``kGuideSmall`` bytes or more are matched: ``large`` holds their
  // indices in it, ``by_size`` their ranks among them, and ``guided_to`` counts in ranks.
  std::shared_ptr<Plan> guide;
  std::vector<int64_t> large;
  std::unordered_map<int64_t, std::pair<std::vector<int64_t>, size_t>> by_size;
  int64_t guided_to = 0;  // one past the rank of the latest predicted allocation taken
  // The guide plan's top (offset): a small allocation takes the arena's bytes above it,
  // where no planned allocation goes (the arena's rounding to whole granules, or bytes
  // another state's plan grew it by), else PyTorch's allocator.
  uintptr_t guide_top = 0;
  // Sizes of small allocations the guide predicts outlive the call (offset -1): every small
  // one of such a size is left to PyTorch, so that no tensor the user keeps (a loss) is held
  // in the arena where no plan put it.
  std::unordered_set<int64_t> small_kept;
  Counts counts;
  std::vector<Served> served;  // the arena allocations this scope handed out
};

// How far past the latest large predicted allocation taken a guided recording takes the next one of
// an allocation's size (further: the prediction is taken to lack it, and best fit serves).
constexpr int64_t kGuideWindow = 4;
// What the n-th allocation of a scope gets.
enum class Serve {
  kArena,     // the planned address (``Decision::address``)
  kWatched,   // upstream, and its free is recorded (a recording, or an outliving allocation)
  kUpstream,  // upstream, nothing to remember
};
struct Decision {
  Serve serve = Serve::kUpstream;
  void* address = nullptr;
};

struct Pending {
  std::shared_ptr<Recording> recording;
  size_t index;
};

// One device's routing state: never destroyed (each file keeps it behind a pointer it never
// deletes), since tensors freed while the process exits must find it intact, whatever order
// C++ destroys statics in.
class State {
 public:
  // The n-th allocation of ``scope`` (``n`` bytes). The caller serializes allocations of one
  // scope (a thread-local scope is; a stream's scope is locked by its caller).
  Decision decide(Scope& scope, size_t n) {
    Counts& c = scope.counts;
    int64_t index = c.allocations++;
    if (scope.recording) {
      if (scope.arena && n > 0) {
        std::lock_guard<std::mutex> lock(mutex_);
        Arena& arena = *scope.arena;
        uintptr_t from = 0;  // best fit at or above this address (0: the arena's base)
        if (scope.guide && static_cast<int64_t>(n) < scope.guide->small) {
          // A small one, foreseen or not, is not matched: the small ones are where the
          // prediction and the kernels differ most (T5: a predicted 128-byte one that never
          // came held the guide back, and every large allocation after it missed its planned
          // place). Nor does it go below the plan's top: the prediction may have swapped it
          // with a peer of its size that lives longer (the loss and a temporary), and there it
          // would split the ranges the plan keeps for large ones. One of a size predicted to
          // outlive the call is left to PyTorch: no tensor the user keeps is held where no
          // plan put it.
          if (scope.small_kept.count(static_cast<int64_t>(n))) return {Serve::kWatched, nullptr};
          from = arena.base + scope.guide_top;
        } else if (scope.guide) {
          auto found = scope.by_size.find(static_cast<int64_t>(n));
          if (found != scope.by_size.end() && found->second.second < found->second.first.size() &&
              found->second.first[found->second.second] <= scope.guided_to + kGuideWindow) {
            int64_t rank = found->second.first[found->second.second++];
            scope.guided_to = std::max(scope.guided_to, rank + 1);
            int64_t offset = scope.guide->offsets[static_cast<size_t>(scope.large[rank])];
            if (offset < 0) return {Serve::kWatched, nullptr};  // planned beside the arena
            uintptr_t at = arena.base + static_cast<uintptr_t>(offset);
            if (at + n <= arena.base + arena.size && free_range(arena, at, at + n)) {
              take(arena, scope, at, n, index);
              append(scope, reinterpret_cast<void*>(at), n, offset);
              return {Serve::kArena, reinterpret_cast<void*>(at)};
            }
          }
        }
        uintptr_t start = best_fit(arena, n, from);
        if (start != 0) {
          take(arena, scope, start, n, index);
          append(scope, reinterpret_cast<void*>(start), n, static_cast<int64_t>(start - arena.base));
          return {Serve::kArena, reinterpret_cast<void*>(start)};
        }
      }
      return {Serve::kWatched, nullptr};
    }
    const Plan& plan = *scope.plan;
    if (c.diverged_at < 0 &&
        (index >= static_cast<int64_t>(plan.sizes.size()) ||
         plan.sizes[index] != static_cast<int64_t>(n))) {
      c.diverged_at = index;
    }
    if (c.diverged_at < 0 && plan.offsets[index] >= 0 && n > 0) {
      Arena& arena = *scope.arena;
      uintptr_t start = arena.base + static_cast<uintptr_t>(plan.offsets[index]);
      uintptr_t end = start + n;
      if (end <= arena.base + arena.size) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (free_range(arena, start, end)) {
          take(arena, scope, start, n, index);
          return {Serve::kArena, reinterpret_cast<void*>(start)};
        }
      }
      c.diverged_at = index;  // an overlap (or no room): the call is not its recording
    }
    if (c.diverged_at < 0) {
      c.planned_out++;
      c.planned_out_bytes += static_cast<int64_t>(n);
      // Watched: one that outlived the recorded call but dies inside this one was recorded
      // in another state (a gradient present now, absent then): the plan could serve it.
      return {plan.offsets[index] == -1 ? Serve::kWatched : Serve::kUpstream, nullptr};
    }
    c.fell_back++;
    c.fell_back_bytes += static_cast<int64_t>(n);
    return {Serve::kUpstream, nullptr};
  }

  // An upstream allocation ``ptr`` of ``n`` bytes the decision said to watch: appended to the
  // scope's recording, its free ticked when it comes (``watch``: ``ptr`` will reach
  // ``release``; a zero-byte allocation has no pointer, is never freed and stays "alive").
  void record(const Scope& scope, void* ptr, size_t n, bool watch) {
    std::lock_guard<std::mutex> lock(mutex_);
    append(scope, watch ? ptr : nullptr, n, -1);
  }

  // ``ptr`` is being freed: true where it was an arena allocation (its bytes belong to the
  // pool: nothing to give back upstream); a watched one has its free recorded.
  bool release(void* ptr) {
    if (watched_.load(std::memory_order_acquire) == 0) return false;
    // Declared before the lock, so destroyed after it is released: the last reference to an
    // arena's memory may run a deleter that takes Python's lock (a ``torch.frombuffer``
    // block), which must never wait while this lock is held.
    c10::Storage dropped;
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = pending_.find(ptr);
    if (it != pending_.end()) {  // a recording's allocation (in the arena or upstream)
      Recording& rec = *it->second.recording;
      rec.free_at[it->second.index] = rec.clock++;
      pending_.erase(it);
      watched_.fetch_sub(1);
    }
    auto at = reinterpret_cast<uintptr_t>(ptr);
    for (auto& arena : arenas_) {
      if (at < arena->base || at >= arena->base + arena->size) continue;
      auto live = arena->live.find(at);
      if (live != arena->live.end()) {
        arena->live_bytes -= live->second - live->first;
        arena->live.erase(live);
        if (arena->live.empty()) {
          watched_.fetch_sub(1);
          dropped = std::move(arena->keep);
        }
        return true;
      }
    }
    return false;
  }

  // ``size`` 0: no arena, every allocation upstream.
  // ``owner``: the arena's memory, held by the arena while allocations live in it.
  // ``guide``: a plan of the call's predicted sequence (or none: best fit alone).
  std::unique_ptr<Scope> recording_scope(uintptr_t base, size_t size, c10::Storage owner = {},
                                         std::shared_ptr<Plan> guide = nullptr) {
    auto scope = std::make_unique<Scope>();
    scope->recording = true;
    scope->owner = std::move(owner);
    scope->rec = std::make_shared<Recording>();
    if (size > 0) scope->arena = arena_at(base, size);
    if (size > 0 && guide) {
      for (size_t i = 0; i < guide->sizes.size(); ++i) {
        if (guide->sizes[i] < guide->small) {
          if (guide->offsets[i] == -1) scope->small_kept.insert(guide->sizes[i]);
          continue;
        }
        int64_t rank = static_cast<int64_t>(scope->large.size());
        scope->large.push_back(static_cast<int64_t>(i));
        scope->by_size[guide->sizes[i]].first.push_back(rank);
        if (guide->offsets[i] >= 0) {
          uintptr_t top = static_cast<uintptr_t>(guide->offsets[i] + guide->sizes[i]);
          scope->guide_top = std::max(scope->guide_top, (top + 63) / 64 * 64);
        }
      }
      scope->guide = std::move(guide);
    }
    return scope;
  }

  std::unique_ptr<Scope> replay_scope(const std::shared_ptr<Plan>& plan, uintptr_t base,
                                      size_t size, c10::Storage owner = {}) {
    auto scope = std::make_unique<Scope>();
    scope->owner = std::move(owner);
    scope->plan = plan;
    scope->rec = std::make_shared<Recording>();
    scope->arena = arena_at(base, size);
    return scope;
  }

  // A closed recording as four lists (size, allocated at, freed at or -1, arena offset or -1).
  std::vector<std::vector<int64_t>> recorded(const Scope& scope) {
    std::lock_guard<std::mutex> lock(mutex_);
    const Recording& rec = *scope.rec;
    std::vector<std::vector<int64_t>> out{rec.sizes, rec.alloc_at, rec.free_at, rec.offsets};
    forget_pending(rec);  // what is still alive outlives the call: its free_at stays -1
    return out;
  }

  // A closed replay's counts.
  std::map<std::string, int64_t> replayed(const Scope& scope) {
    const Counts& c = scope.counts;
    int64_t planned = static_cast<int64_t>(scope.plan->sizes.size());
    int64_t diverged_at = c.diverged_at;
    if (diverged_at < 0 && c.allocations != planned) diverged_at = c.allocations;
    std::lock_guard<std::mutex> lock(mutex_);
    int64_t out_freed = 0;
    const Recording& rec = *scope.rec;
    for (size_t i = 0; i < rec.sizes.size(); ++i) {
      if (rec.free_at[i] >= 0) out_freed += rec.sizes[i];
    }
    forget_pending(rec);
    // Arena allocations of this call alive now: kept where the plan said they outlive it,
    // escaped where it said they die inside it.
    // From the last served back: bytes handed out again after a free belong to the latest.
    int64_t kept = 0, escaped = 0;
    std::set<uintptr_t> seen;
    for (auto it = scope.served.rbegin(); it != scope.served.rend(); ++it) {
      const Served& s = *it;
      if (!seen.insert(s.start).second) continue;
      auto live = scope.arena->live.find(s.start);
      if (live == scope.arena->live.end() || live->second != s.end) continue;
      size_t i = static_cast<size_t>(s.index);
      bool outlives = i < scope.plan->outlives.size() && scope.plan->outlives[i];
      (outlives ? kept : escaped) += static_cast<int64_t>(s.end - s.start);
    }
    return {
        {"kept_bytes", kept},
        {"escaped_bytes", escaped},
        {"planned_out_freed_bytes", out_freed},
        {"allocations", c.allocations},
        {"served", c.served},
        {"served_bytes", c.served_bytes},
        {"planned_out", c.planned_out},
        {"planned_out_bytes", c.planned_out_bytes},
        {"fell_back", c.fell_back},
        {"fell_back_bytes", c.fell_back_bytes},
        {"diverged_at", diverged_at},
        {"live", static_cast<int64_t>(scope.arena->live.size())},
        {"live_bytes", static_cast<int64_t>(scope.arena->live_bytes)},
    };
  }

  // The arena allocations alive now in the arena at ``base``, as ``(offset, end)`` pairs.
  std::vector<std::pair<int64_t, int64_t>> live_ranges(uintptr_t base) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::pair<int64_t, int64_t>> out;
    for (auto& arena : arenas_) {
      if (arena->base != base) continue;
      for (const auto& [start, end] : arena->live) {
        out.emplace_back(static_cast<int64_t>(start - base), static_cast<int64_t>(end - base));
      }
    }
    return out;
  }

  // Bytes of arena allocations alive now in the arena at ``base`` (0 for an unknown arena).
  int64_t live_bytes(uintptr_t base) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& arena : arenas_) {
      if (arena->base == base) return static_cast<int64_t>(arena->live_bytes);
    }
    return 0;
  }

 private:
  static bool free_range(const Arena& arena, uintptr_t start, uintptr_t end) {
    auto next = arena.live.lower_bound(start);
    if (next != arena.live.end() && next->first < end) return false;
    if (next != arena.live.begin() && std::prev(next)->second > start) return false;
    return true;
  }

  // The 64-byte aligned start of the smallest free range of ``arena`` that holds ``n`` bytes
  // (best fit: the large ranges stay whole for the large allocations to come), at ``from``
  // or above (a 64-byte aligned address; 0: the arena's base), or 0.
  static uintptr_t best_fit(const Arena& arena, size_t n, uintptr_t from = 0) {
    uintptr_t cursor = std::max(arena.base, from), best = 0, top = arena.base + arena.size;
    size_t best_gap = SIZE_MAX;
    auto consider = [&](uintptr_t end) {
      if (end > cursor && end - cursor >= n && end - cursor < best_gap) {
        best = cursor;
        best_gap = end - cursor;
      }
    };
    for (const auto& [start, end] : arena.live) {
      if (start >= top) break;
      consider(start);
      cursor = std::max(cursor, (end + 63) / 64 * 64);
    }
    consider(top);
    return best;
  }

  // Hand out [start, start + n) of ``arena`` to ``scope`` (the caller holds the lock).
  void take(Arena& arena, Scope& scope, uintptr_t start, size_t n, int64_t index) {
    if (arena.live.empty()) watched_.fetch_add(1);
    if (!arena.keep) arena.keep = scope.owner;
    arena.live.emplace(start, start + n);
    arena.live_bytes += n;
    scope.counts.served++;
    scope.counts.served_bytes += static_cast<int64_t>(n);
    scope.served.push_back(Served{start, start + n, index});
  }

  // Append an allocation to the scope's recording, its free watched where ``ptr`` is given
  // (the caller holds the lock).
  void append(const Scope& scope, void* ptr, size_t n, int64_t offset) {
    Recording& rec = *scope.rec;
    size_t index = rec.sizes.size();
    rec.sizes.push_back(static_cast<int64_t>(n));
    rec.alloc_at.push_back(rec.clock++);
    rec.free_at.push_back(-1);
    rec.offsets.push_back(offset);
    if (ptr != nullptr) {
      pending_[ptr] = Pending{scope.rec, index};
      watched_.fetch_add(1);
    }
  }

  // Stop watching the allocations of ``rec`` still alive (the caller holds the lock).
  void forget_pending(const Recording& rec) {
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second.recording.get() == &rec) {
        it = pending_.erase(it);
        watched_.fetch_sub(1);
      } else {
        ++it;
      }
    }
  }

  std::shared_ptr<Arena> arena_at(uintptr_t base, size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& arena : arenas_) {
      if (arena->base == base) {
        // Grown in place, or back to the buffer's bytes after a recording served past them
        // (``Route._reach``): never below an allocation still alive, whose free looks it up.
        size_t top = arena->live.empty() ? 0 : std::prev(arena->live.end())->second - base;
        arena->size = std::max(size, top);
        return arena;
      }
    }
    // Arenas that moved away, hold nothing alive and serve no open scope are forgotten (an
    // open scope's arena must stay findable: its allocations' frees look it up here).
    std::vector<std::shared_ptr<Arena>> kept;
    for (auto& arena : arenas_) {
      if (!arena->live.empty() || arena.use_count() > 1) kept.push_back(arena);
    }
    auto arena = std::make_shared<Arena>();
    arena->base = base;
    arena->size = size;
    kept.push_back(arena);
    arenas_.swap(kept);
    return arena;
  }

  // One lock for the arenas' live maps and the recordings' pending frees: frees may come from
  // any thread (a tensor dropped elsewhere), and it is held for a map operation only.
  std::mutex mutex_;
  // How many arenas hold live allocations plus how many allocations recordings wait on: a
  // free takes the lock only while this is non-zero.
  std::atomic<int64_t> watched_{0};
  std::vector<std::shared_ptr<Arena>> arenas_;
  std::unordered_map<void*, Pending> pending_;  // recorded allocations not yet freed
};

// The plan's Python class, one per module (``module_local``: pybind11 would otherwise refuse
// the second module's registration of the same C++ type).
inline void bind_plan(pybind11::module_& m) {
  pybind11::class_<Plan, std::shared_ptr<Plan>>(m, "Plan", pybind11::module_local())
      .def(pybind11::init([](std::vector<int64_t> sizes, std::vector<int64_t> offsets,
                             std::vector<uint8_t> outlives, int64_t small) {
             TORCH_CHECK(sizes.size() == offsets.size() && outlives.size() == sizes.size(),
                         "sharedmem: a plan needs an offset and an outlives flag per size");
             TORCH_CHECK(small >= 1, "sharedmem: a guide's small size is at least 1 byte");
             auto plan = std::make_shared<Plan>();
             plan->sizes = std::move(sizes);
             plan->offsets = std::move(offsets);
             plan->outlives = std::move(outlives);
             plan->small = small;
             return plan;
           }),
           pybind11::arg("sizes"), pybind11::arg("offsets"), pybind11::arg("outlives"),
           pybind11::arg("small") = static_cast<int64_t>(kGuideSmall));
}

}  // namespace sharedmem_route
