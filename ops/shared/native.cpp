// The C++ side of the replayer: recorded programs (native_program.h) kept by signature, a
// forward program and backward programs by the gradient's layout (native_table.h), an autograd
// function whose forward and backward are such programs, and the ops' dispatcher kernels that run
// them (native_ops.h). A repeated call, eager or compiled, then costs what a PyTorch op costs on
// the host: no Python frame in its launches.

#include <torch/extension.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>
#include <vector>

#include "native_ops.h"
#include "native_program.h"
#include "native_table.h"

namespace py = pybind11;
using at::Tensor;
using dash_replay::Program;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

using dash_replay::layout_key;
using dash_replay::note;
using dash_replay::signature;

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
    std::pair<int64_t, std::vector<Tensor>> ran{-1, {}};
    if (!at::GradMode::is_enabled()) {
      ran = dash_replay::run_backward(signature(handle), grad_out, saved[0], saved[1], saved[2],
                                      saved[3], saved[4]);
    }
    std::vector<Tensor> result = std::move(ran.second);
    if (ran.first >= 0) {
      note(handle, ran.first);
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
    auto& table = dash_replay::table();
    std::lock_guard<std::mutex> lock(table.mutex);
    table.signatures.push_back(std::make_shared<dash_replay::Signature>());
    table.signatures.back()->forward = std::move(forward);
    return static_cast<int64_t>(table.signatures.size()) - 1;
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
    std::pair<int64_t, std::vector<Tensor>> ran;
    {
      py::gil_scoped_release release;
      ran = dash_replay::run_backward(signature(handle), grad_out, q, k, v, out, lse);
    }
    if (ran.first < 0) return py::none();
    return py::make_tuple(ran.first, ran.second[0], ran.second[1], ran.second[2]);
  });
  m.def("layout_key", &layout_key);
  m.def("next_sequence", [] { return dash_replay::journal().sequence.fetch_add(1); });
  m.def("start_sequence", [](int64_t first) { dash_replay::journal().sequence = first; });
  m.def("journal", [] {
    auto& journal = dash_replay::journal();
    std::lock_guard<std::mutex> lock(journal.mutex);
    return std::vector<std::array<int64_t, 3>>(journal.entries.begin(), journal.entries.end());
  });
  m.def("set_fallback", [](py::object callable) { *fallback = std::move(callable); });
  m.def("attention", [](const Tensor& q, const Tensor& k, const Tensor& v, int64_t handle) {
    return Attention::apply(q, k, v, handle);
  }, py::call_guard<py::gil_scoped_release>());
  // The ops' kernels at dispatch key ``key`` ("CUDA"), over the Python kernels (forward,
  // backward: called with every argument positionally), and the calls they replay.
  m.def("install_ops", &dash_replay::install);
  m.def("uninstall_ops", &dash_replay::uninstall);
  m.def("bind", [](int64_t handle, const py::kwargs& given) {
    const auto& schema =
        c10::Dispatcher::singleton().findSchemaOrThrow("dash::attention", "").schema();
    std::vector<c10::IValue> args;  // the op's arguments in schema order, defaults filled in
    for (const auto& argument : schema.arguments()) {
      const char* name = argument.name().c_str();
      if (given.contains(name)) {
        args.push_back(torch::jit::toIValue(given[name], argument.real_type()));
      } else {
        TORCH_CHECK(argument.default_value().has_value(), "dash attention: bind needs ", name);
        args.push_back(*argument.default_value());
      }
    }
    dash_replay::bind(handle, args.data());
  });
  m.def("unbind_all", &dash_replay::unbind_all);
  m.def("set_watched", [](int64_t handle) { signature(handle)->watched = true; });
}
