// What the replayer keeps: signatures (a forward program, backward programs by the gradient's
// layout) by handle, and the journal of what ran. Included by native.cpp and native_ops.h.

#pragma once

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "native_program.h"

namespace dash_replay {

inline std::vector<int64_t> layout_key(const Tensor& grad_out, const Tensor& out,
                                       const Tensor& lse) {
  std::vector<int64_t> key;
  for (const Tensor* t : {&grad_out, &out, &lse}) {
    auto strides = t->strides();
    key.insert(key.end(), strides.begin(), strides.end());
    key.push_back(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16);
    key.push_back(static_cast<int64_t>(t->scalar_type()));
  }
  key.push_back(at::globalContext().allowTF32CuBLAS() ? 1 : 0);
  return key;
}

struct Signature {
  std::shared_ptr<Program> forward;
  std::vector<std::pair<std::vector<int64_t>, std::shared_ptr<Program>>> backward;
  std::atomic<bool> watched{false};  // its backward waits boundedly: Python watches the flag
  std::mutex mutex;

  std::pair<int64_t, std::shared_ptr<Program>> backward_for(const std::vector<int64_t>& key) {
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < backward.size(); ++i) {
      if (backward[i].first == key) return {static_cast<int64_t>(i), backward[i].second};
    }
    return {-1, nullptr};
  }
};

// The gradients from the signature's program for the gradient's layout, with its index; index -1
// and none where it has no such program.
inline std::pair<int64_t, std::vector<Tensor>> run_backward(
    const std::shared_ptr<Signature>& signature, const Tensor& grad_out, const Tensor& q,
    const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) {
  auto found = signature->backward_for(layout_key(grad_out, out, lse));
  if (!found.second) return {-1, {}};
  return {found.first, found.second->run({grad_out, q, k, v, out, lse})};
}

struct Table {
  std::mutex mutex;
  std::deque<std::shared_ptr<Signature>> signatures;  // by handle; kept while a graph may hold one
};

inline Table& table() {
  static Table* made = new Table();  // never destroyed: no program outlives the interpreter
  return *made;
}

inline std::shared_ptr<Signature> signature(int64_t handle) {
  Table& t = table();
  std::lock_guard<std::mutex> lock(t.mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(t.signatures.size()),
              "dash attention: no native signature ", handle);
  return t.signatures[handle];
}

// The journal: which programs ran, numbered in one sequence with the host's records, so that
// ``last_plans()`` keeps the order of forward and backward calls. A forward is index -1.
struct Journal {
  std::atomic<int64_t> sequence{0};
  std::mutex mutex;
  std::deque<std::array<int64_t, 3>> entries;  // (sequence, handle, backward index)
};

constexpr size_t kJournal = 16;

inline Journal& journal() {
  static Journal* made = new Journal();
  return *made;
}

inline void note(int64_t handle, int64_t index) {
  Journal& j = journal();
  int64_t number = j.sequence.fetch_add(1);
  std::lock_guard<std::mutex> lock(j.mutex);
  j.entries.push_back({number, handle, index});
  if (j.entries.size() > kJournal) j.entries.pop_front();
}

}  // namespace dash_replay
