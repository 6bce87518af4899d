// The C++ side of the replayer: recorded programs (native_program.h) kept by signature, a
// forward program and backward programs by the gradient's layout, and an autograd function whose
// forward and backward are such programs. A repeated eager call then costs what a PyTorch op costs
// on the host: no Python frame in its backward, none in its launches.

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "native_program.h"

namespace py = pybind11;
using at::Tensor;
using dash_replay::Program;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// ---- signatures: a forward program and backward programs by the gradient's layout ----

std::vector<int64_t> layout_key(const Tensor& grad_out, const Tensor& out, const Tensor& lse) {
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
  std::mutex mutex;

  std::pair<int64_t, std::shared_ptr<Program>> backward_for(const std::vector<int64_t>& key) {
    std::lock_guard<std::mutex> lock(mutex);
    for (size_t i = 0; i < backward.size(); ++i) {
      if (backward[i].first == key) return {static_cast<int64_t>(i), backward[i].second};
    }
    return {-1, nullptr};
  }
};

std::mutex table_mutex;
std::deque<std::shared_ptr<Signature>> table;  // by handle; kept while a graph may hold one

std::shared_ptr<Signature> signature(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  TORCH_CHECK(handle >= 0 && handle < static_cast<int64_t>(table.size()),
              "dash attention: no native signature ", handle);
  return table[handle];
}

// The journal: which programs ran, numbered in one sequence with the host's records, so that
// ``last_plans()`` keeps the order of forward and backward calls.
std::atomic<int64_t> sequence{0};
std::mutex journal_mutex;
std::deque<std::array<int64_t, 3>> journal;  // (sequence, handle, backward index)
constexpr size_t kJournal = 16;

void note_backward(int64_t handle, int64_t index) {
  int64_t number = sequence.fetch_add(1);
  std::lock_guard<std::mutex> lock(journal_mutex);
  journal.push_back({number, handle, index});
  if (journal.size() > kJournal) journal.pop_front();
}

// Python's backward for a layout (or a graph) with no program yet; never destroyed, so that no
// Python object dies after the interpreter.
py::object* fallback = new py::object();

struct Attention : public torch::autograd::Function<Attention> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                        int64_t handle) {
    auto outputs = signature(handle)->forward->run({q, k, v});
    ctx->save_for_backward({q, k, v, outputs[0], outputs[1]});
    ctx->saved_data["handle"] = handle;
    return outputs[0];
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    int64_t handle = ctx->saved_data["handle"].toInt();
    const Tensor& grad_out = grads[0];
    std::pair<int64_t, std::shared_ptr<Program>> found{-1, nullptr};
    if (!at::GradMode::is_enabled()) {
      found = signature(handle)->backward_for(layout_key(grad_out, saved[3], saved[4]));
    }
    std::vector<Tensor> result;
    if (found.second) {
      result = found.second->run({grad_out, saved[0], saved[1], saved[2], saved[3], saved[4]});
      note_backward(handle, found.first);
    } else {
      py::gil_scoped_acquire gil;
      result = (*fallback)(handle, grad_out, saved[0], saved[1], saved[2], saved[3], saved[4])
                   .cast<std::vector<Tensor>>();
    }
    return {result[0], result[1], result[2], Tensor()};
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init<int64_t, py::list, std::vector<int64_t>, std::vector<Tensor>>())
      .def("run", &Program::run, py::call_guard<py::gil_scoped_release>());
  m.def("new_signature", [](std::shared_ptr<Program> forward) {
    std::lock_guard<std::mutex> lock(table_mutex);
    table.push_back(std::make_shared<Signature>());
    table.back()->forward = std::move(forward);
    return static_cast<int64_t>(table.size()) - 1;
  });
  m.def("add_backward", [](int64_t handle, std::vector<int64_t> key,
                           std::shared_ptr<Program> program) {
    auto found = signature(handle);
    std::lock_guard<std::mutex> lock(found->mutex);
    found->backward.emplace_back(std::move(key), std::move(program));
    return static_cast<int64_t>(found->backward.size()) - 1;
  });
  m.def("run_forward", [](int64_t handle, const Tensor& q, const Tensor& k, const Tensor& v) {
    return signature(handle)->forward->run({q, k, v});
  }, py::call_guard<py::gil_scoped_release>());
  // (index of the program, dq, dk, dv), or None where no program has the gradient's layout.
  m.def("run_backward", [](int64_t handle, const Tensor& grad_out, const Tensor& q,
                           const Tensor& k, const Tensor& v, const Tensor& out,
                           const Tensor& lse) -> py::object {
    auto found = signature(handle)->backward_for(layout_key(grad_out, out, lse));
    if (!found.second) return py::none();
    std::vector<Tensor> grads;
    {
      py::gil_scoped_release release;
      grads = found.second->run({grad_out, q, k, v, out, lse});
    }
    return py::make_tuple(found.first, grads[0], grads[1], grads[2]);
  });
  m.def("layout_key", &layout_key);
  m.def("next_sequence", [] { return sequence.fetch_add(1); });
  m.def("start_sequence", [](int64_t first) { sequence = first; });
  m.def("journal", [] {
    std::lock_guard<std::mutex> lock(journal_mutex);
    return std::vector<std::array<int64_t, 3>>(journal.begin(), journal.end());
  });
  m.def("set_fallback", [](py::object callable) { *fallback = std::move(callable); });
  m.def("attention", [](const Tensor& q, const Tensor& k, const Tensor& v, int64_t handle) {
    return Attention::apply(q, k, v, handle);
  }, py::call_guard<py::gil_scoped_release>());
}
