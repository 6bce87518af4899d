// The dispatcher kernels of ``dash::attention`` and ``dash::attention_backward`` once the replayer
// has loaded: a call bound to a recorded signature runs its program with no Python frame (the
// custom op's way into Python costs more host time than the launches); any other call goes to
// the op's Python kernel, which records and binds new signatures. Included by native.cpp only.

#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <unordered_map>
#include <vector>

#include "native_table.h"

namespace dash_replay {

// A call's signature as ``signatures.key`` takes it: the tensors' layouts, flags, choices and
// the modes that the first call's checks and plans depended on.
struct CallKey {
  std::vector<int64_t> numbers;
  std::string names;
  bool operator==(const CallKey& other) const {
    return numbers == other.numbers && names == other.names;
  }
};

struct CallKeyHash {
  size_t operator()(const CallKey& key) const {
    size_t h = std::hash<std::string>()(key.names);
    for (int64_t x : key.numbers) h = h * 1000003u ^ std::hash<int64_t>()(x);
    return h;
  }
};

inline void add_tensor(std::vector<int64_t>& numbers, const Tensor& t) {
  numbers.push_back(t.dim());
  numbers.insert(numbers.end(), t.sizes().begin(), t.sizes().end());
  numbers.insert(numbers.end(), t.strides().begin(), t.strides().end());
  numbers.push_back(static_cast<int64_t>(t.scalar_type()));
  numbers.push_back(static_cast<int64_t>(t.device().type()));
  numbers.push_back(t.device().index());
  numbers.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16));
}

// Where the key's arguments sit in an op's schema (found by name: the two ops order them apart).
struct Positions {
  size_t q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, window, schedule, max_spin,
      cpu_backend, kernel_path;
  size_t grad_out = 0, out = 0, logsumexp = 0;  // the backward's
  size_t count;

  explicit Positions(const c10::FunctionSchema& schema) : count(schema.arguments().size()) {
    auto at = [&schema](const char* name) {
      auto index = schema.argumentIndexWithName(name);
      TORCH_CHECK(index.has_value(), "dash attention: ", schema.name(), " has no ", name);
      return static_cast<size_t>(*index);
    };
    q = at("q"), k = at("k"), v = at("v"), mask = at("attn_mask"), dropout_p = at("dropout_p");
    is_causal = at("is_causal"), scale = at("scale"), enable_gqa = at("enable_gqa");
    window = at("window_size"), schedule = at("schedule"), max_spin = at("max_spin");
    cpu_backend = at("cpu_backend"), kernel_path = at("kernel_path");
    if (schema.argumentIndexWithName("grad_out").has_value()) {
      grad_out = at("grad_out"), out = at("out"), logsumexp = at("logsumexp");
    }
  }
};

inline int64_t as_int(const c10::IValue& value) {
  return value.isSymInt() ? value.toSymInt().guard_int(__FILE__, __LINE__) : value.toInt();
}

// The key of a call whose arguments are ``args`` (the op's, in schema order).
inline CallKey call_key(const Positions& at, const c10::IValue* args) {
  CallKey key;
  key.numbers.reserve(48);
  for (size_t i : {at.q, at.k, at.v}) add_tensor(key.numbers, args[i].toTensor());
  const c10::IValue& scale = args[at.scale];
  double scale_value = scale.isNone() ? 0.0 : scale.toDouble();
  int64_t scale_bits;
  std::memcpy(&scale_bits, &scale_value, sizeof(scale_bits));
  auto window = args[at.window].toIntList();
  auto& context = at::globalContext();
  key.numbers.insert(key.numbers.end(), {
      args[at.is_causal].toBool(), scale.isNone(), scale_bits, args[at.enable_gqa].toBool(),
      window.get(0), window.get(1), as_int(args[at.max_spin]), context.allowTF32CuBLAS(),
      context.deterministicAlgorithms(), context.deterministicAlgorithmsWarnOnly()});
  for (size_t i : {at.schedule, at.cpu_backend, at.kernel_path}) {
    key.names += args[i].toStringRef();
    key.names += '\0';
  }
  return key;
}

// The bound calls, the Python side each op falls back to, and the checks a replay runs there.
struct OpState {
  std::mutex mutex;
  std::unordered_map<CallKey, int64_t, CallKeyHash> bound;  // key -> handle
  py::object forward_fallback, backward_fallback;  // the ops' Python kernels, positionally
  // torch.library's Python autograd kernels, (keyset, *arguments): for calls that want gradients
  py::object forward_autograd, backward_autograd;
  py::object hooked;  // () -> bool: Triton's launch hooks are set (they see Python's launches)
  py::object watch;  // (handle) -> None: an ordered backward's bounded waits, watched
  std::unique_ptr<Positions> forward_at, backward_at;
  std::unique_ptr<torch::Library> library, autograd_library;
};

inline OpState& op_state() {
  static OpState* made = new OpState();  // never destroyed: it holds Python objects
  return *made;
}

inline int64_t bound_handle(const Positions& at, const c10::IValue* args) {
  if (!args[at.mask].isNone() || args[at.dropout_p].toDouble() != 0.0) return -1;
  CallKey key = call_key(at, args);
  OpState& state = op_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto found = state.bound.find(key);
  return found == state.bound.end() ? -1 : found->second;
}

// Every argument to Python (after ``keys``, for an autograd kernel), the Python kernel called
// positionally, its tensors pushed back.
inline void call_python(const py::object& kernel, size_t count, torch::jit::Stack* stack,
                        const c10::DispatchKeySet* keys = nullptr) {
  py::gil_scoped_acquire gil;
  const size_t first = keys ? 1 : 0;
  py::tuple args(first + count);
  if (keys) args[0] = py::cast(*keys);
  for (size_t i = 0; i < count; ++i) {
    args[first + i] = torch::jit::toPyObject((*stack)[stack->size() - count + i]);
  }
  py::tuple results = kernel(*args);
  torch::jit::drop(*stack, count);
  for (const auto& result : results) stack->emplace_back(result.cast<Tensor>());
}

inline bool launch_hooked() {
  py::gil_scoped_acquire gil;
  return op_state().hooked().cast<bool>();
}

inline void forward_kernel(const c10::OperatorHandle&, c10::DispatchKeySet,
                           torch::jit::Stack* stack) {
  OpState& state = op_state();
  const Positions& at = *state.forward_at;
  const c10::IValue* args = stack->data() + stack->size() - at.count;
  int64_t handle = bound_handle(at, args);
  if (handle < 0 || launch_hooked()) return call_python(state.forward_fallback, at.count, stack);
  auto outputs = signature(handle)->forward->run(
      {args[at.q].toTensor(), args[at.k].toTensor(), args[at.v].toTensor()});
  note(handle, -1);
  torch::jit::drop(*stack, at.count);
  stack->emplace_back(std::move(outputs[0]));
  stack->emplace_back(std::move(outputs[1]));
}

inline void backward_kernel(const c10::OperatorHandle&, c10::DispatchKeySet,
                            torch::jit::Stack* stack) {
  OpState& state = op_state();
  const Positions& at = *state.backward_at;
  const c10::IValue* args = stack->data() + stack->size() - at.count;
  int64_t handle = bound_handle(at, args);
  if (handle < 0 || launch_hooked()) return call_python(state.backward_fallback, at.count, stack);
  auto bound = signature(handle);
  auto ran = run_backward(bound, args[at.grad_out].toTensor(), args[at.q].toTensor(),
                          args[at.k].toTensor(), args[at.v].toTensor(), args[at.out].toTensor(),
                          args[at.logsumexp].toTensor());
  if (ran.first < 0) return call_python(state.backward_fallback, at.count, stack);
  note(handle, ran.first);
  if (bound->watched) {  // as the Python path: watched after the launch
    py::gil_scoped_acquire gil;
    state.watch(handle);
  }
  torch::jit::drop(*stack, at.count);
  for (auto& grad : ran.second) stack->emplace_back(std::move(grad));
}

// A custom op's autograd kernel is torch.library's Python function, which runs even where no
// gradient is wanted (always so in a compiled graph): such a call goes below autograd from C++,
// any other to that function.
template <bool kBackward>
void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                     torch::jit::Stack* stack) {
  OpState& state = op_state();
  const size_t count = (kBackward ? state.backward_at : state.forward_at)->count;
  const c10::IValue* args = stack->data() + stack->size() - count;
  bool wanted = false;
  if (c10::GradMode::is_enabled()) {
    for (size_t i = 0; i < count && !wanted; ++i) {
      wanted = args[i].isTensor() && args[i].toTensor().requires_grad();
    }
  }
  if (!wanted) {
    at::AutoDispatchBelowAutograd below;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
    return;
  }
  call_python(kBackward ? state.backward_autograd : state.forward_autograd, count, stack, &keys);
}

class QuietWarnings : public c10::WarningHandler {  // the override below is the point
 public:
  void process(const c10::Warning&) override {}
};

// Put the kernels above the Python ones at ``key`` and its autograd key (registrations of their
// own, removed again by ``uninstall``: the Python kernels below them then take every call again).
// Once installed, a further install changes nothing.
inline void install(const std::string& key, py::object forward, py::object backward,
                    py::object hooked, py::object watch, py::object forward_autograd,
                    py::object backward_autograd) {
  OpState& state = op_state();
  if (state.library) return;
  auto& dispatcher = c10::Dispatcher::singleton();
  state.forward_at = std::make_unique<Positions>(
      dispatcher.findSchemaOrThrow("dash::attention", "").schema());
  state.backward_at = std::make_unique<Positions>(
      dispatcher.findSchemaOrThrow("dash::attention_backward", "").schema());
  state.forward_fallback = std::move(forward);
  state.backward_fallback = std::move(backward);
  state.hooked = std::move(hooked);
  state.watch = std::move(watch);
  state.forward_autograd = std::move(forward_autograd);
  state.backward_autograd = std::move(backward_autograd);
  QuietWarnings quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
  state.library = std::make_unique<torch::Library>(
      torch::Library::IMPL, "dash", c10::parseDispatchKey(key), __FILE__, __LINE__);
  state.library->impl("attention", torch::CppFunction::makeFromBoxedFunction<&forward_kernel>());
  state.library->impl("attention_backward",
                      torch::CppFunction::makeFromBoxedFunction<&backward_kernel>());
  if (state.forward_autograd.is_none()) return;  // this torch's autograd kernels stay
  state.autograd_library = std::make_unique<torch::Library>(
      torch::Library::IMPL, "dash", c10::parseDispatchKey("Autograd" + key), __FILE__, __LINE__);
  state.autograd_library->impl(
      "attention", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<false>>());
  state.autograd_library->impl(
      "attention_backward", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<true>>());
}

inline void uninstall() {
  op_state().autograd_library.reset();
  op_state().library.reset();
}

// Replay calls with the forward's arguments ``args`` (in schema order) under ``handle``.
inline void bind(int64_t handle, const c10::IValue* args) {
  OpState& state = op_state();
  TORCH_CHECK(state.forward_at, "dash attention: bind before install_ops");
  CallKey key = call_key(*state.forward_at, args);
  std::lock_guard<std::mutex> lock(state.mutex);
  state.bound[std::move(key)] = handle;
}

inline void unbind_all() {
  OpState& state = op_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  state.bound.clear();
}

}  // namespace dash_replay
