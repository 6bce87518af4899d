// A recorded launch program (``tape.py``) and its replay: slots of tensors filled by the inputs and
// then by each step's results, ATen calls through the dispatcher, kernel launches through the CUDA
// driver with each call's addresses patched in. Included by native.cpp only.

#pragma once

#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dash_replay {

namespace py = pybind11;
using at::Tensor;


// ---- the CUDA driver, loaded on first use (dlopen: this file builds without CUDA headers) ----

using Launch = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                       unsigned, void*, void**, void**);
using CooperativeLaunch = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned,
                                  unsigned, unsigned, void*, void**);
using Encode = int (*)(void*, int, unsigned, void*, const uint64_t*, const uint64_t*,
                       const uint32_t*, const uint32_t*, int, int, int, int);
using ErrorString = int (*)(int, const char**);

struct Driver {
  Launch launch;
  CooperativeLaunch cooperative;
  Encode encode;
  ErrorString error;
};

const Driver& driver() {
  static const Driver loaded = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(lib != nullptr, "dash attention: libcuda.so.1 did not load");
    auto symbol = [lib](const char* name) {
      void* found = dlsym(lib, name);
      TORCH_CHECK(found != nullptr, "dash attention: libcuda has no ", name);
      return found;
    };
    return Driver{reinterpret_cast<Launch>(symbol("cuLaunchKernel")),
                  reinterpret_cast<CooperativeLaunch>(symbol("cuLaunchCooperativeKernel")),
                  reinterpret_cast<Encode>(symbol("cuTensorMapEncodeTiled")),
                  reinterpret_cast<ErrorString>(symbol("cuGetErrorString"))};
  }();
  return loaded;
}

void check(int status, const char* what) {
  if (status == 0) return;
  const char* text = nullptr;
  driver().error(status, &text);
  TORCH_CHECK(false, "dash attention: ", what, " failed: CUDA ", text ? text : "error ", status);
}

// ---- a program: slots of tensors, filled by the inputs, then by each ATen call's results ----

constexpr size_t kMapBytes = 128;  // a CUtensorMap: 128 opaque bytes, 64-byte aligned

struct Pointer {  // a parameter that holds a slot's address plus a byte offset
  int64_t at, slot, offset;
};

// A step calls one signature once per layer, each with its own addresses, and the caching
// allocator hands them out again the next step: keep the encodings of that many bases.
constexpr size_t kEncodingsKept = 32;

struct Encoding {
  uint64_t base = 0;  // the base address ``bytes`` was made for (0: none yet)
  alignas(64) std::array<uint8_t, kMapBytes> bytes;
};

struct TensorMap {  // a TMA descriptor over a slot: cuTensorMapEncodeTiled's arguments
  int64_t at, slot, offset;
  int elem_type, rank, swizzle, fill;
  std::array<uint64_t, 5> dims;
  std::array<uint64_t, 5> strides;
  std::array<uint32_t, 5> box;
  std::array<Encoding, kEncodingsKept> kept;
  size_t next = 0;  // the entry a new base replaces (round robin)
};

struct KernelLaunch {
  void* function;
  std::array<unsigned, 3> grid;
  unsigned threads, shared;
  bool cooperative;
  std::vector<uint8_t> params;  // the parameter block as recorded, maps at 64-byte offsets
  std::vector<int64_t> offsets;  // each parameter's offset in it
  std::vector<Pointer> pointers;
  std::vector<TensorMap> maps;
};

struct Argument {  // an ATen argument: a slot (slot >= 0) or a constant
  int64_t slot;
  c10::IValue constant;
};

struct AtenCall {
  c10::OperatorHandle op;
  std::vector<Argument> arguments;
};

struct Step {
  std::unique_ptr<AtenCall> aten;
  std::unique_ptr<KernelLaunch> launch;
};

class FillGuard {  // allocations are written before they are read: no NaN fill
 public:
  FillGuard() : was_(at::globalContext().deterministicFillUninitializedMemory()) {
    at::globalContext().setDeterministicFillUninitializedMemory(false);
  }
  ~FillGuard() { at::globalContext().setDeterministicFillUninitializedMemory(was_); }

 private:
  bool was_;
};

class Program {
 public:
  Program(int64_t inputs, const py::list& steps, std::vector<int64_t> outputs,
          std::vector<Tensor> kept)
      : inputs_(inputs), outputs_(std::move(outputs)), kept_(std::move(kept)) {
    for (const auto& step : steps) {
      auto fields = step.cast<py::tuple>();
      Step made;
      if (fields[0].cast<std::string>() == "aten") {
        made.aten = aten_call(fields);
      } else {
        made.launch = kernel_launch(fields);
      }
      steps_.push_back(std::move(made));
    }
  }

  std::vector<Tensor> run(std::vector<Tensor> slots) {
    TORCH_CHECK(static_cast<int64_t>(slots.size()) == inputs_, "dash attention: a program of ",
                inputs_, " inputs called with ", slots.size());
    FillGuard fill;
    std::lock_guard<std::mutex> lock(mutex_);  // the maps' encodings are shared state
    for (auto& step : steps_) {
      if (step.aten) {
        call(*step.aten, slots);
      } else {
        launch(*step.launch, slots);
      }
    }
    std::vector<Tensor> results;
    results.reserve(outputs_.size());
    for (int64_t slot : outputs_) results.push_back(slots[slot]);
    return results;
  }

 private:
  static std::unique_ptr<AtenCall> aten_call(const py::tuple& fields) {
    auto name = fields[1].cast<std::string>();
    auto overload = fields[2].cast<std::string>();
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = op.schema().arguments();
    auto made = std::make_unique<AtenCall>(AtenCall{op, {}});
    auto arguments = fields[3].cast<py::list>();
    TORCH_CHECK(arguments.size() == schema.size(), "dash attention: ", name, " takes ",
                schema.size(), " arguments, recorded ", arguments.size());
    for (size_t i = 0; i < schema.size(); ++i) {
      auto pair = arguments[i].cast<py::tuple>();
      auto slot = pair[0].cast<int64_t>();
      c10::IValue constant;
      if (slot < 0) constant = constant_of(pair[1], schema[i].type());
      made->arguments.push_back(Argument{slot, std::move(constant)});
    }
    return made;
  }

  // A number where the schema wants a Tensor is a wrapped number, as Python's binding makes it.
  static c10::IValue constant_of(const py::handle& value, const c10::TypePtr& type) {
    if (type->kind() == c10::TypeKind::TensorType && !value.is_none()) {
      auto tensor = at::scalar_to_tensor(torch::jit::toIValue(value, c10::NumberType::get()).toScalar());
      tensor.unsafeGetTensorImpl()->set_wrapped_number(true);
      return tensor;
    }
    return torch::jit::toIValue(value, type);
  }

  static std::unique_ptr<KernelLaunch> kernel_launch(const py::tuple& fields) {
    auto made = std::make_unique<KernelLaunch>();
    made->function = reinterpret_cast<void*>(fields[1].cast<uintptr_t>());
    auto grid = fields[2].cast<std::vector<unsigned>>();
    made->grid = {grid[0], grid[1], grid[2]};
    made->threads = fields[3].cast<unsigned>();
    made->shared = fields[4].cast<unsigned>();
    made->cooperative = fields[5].cast<bool>();
    auto params = fields[6].cast<std::string>();
    made->params.assign(params.begin(), params.end());
    made->offsets = fields[7].cast<std::vector<int64_t>>();
    for (const auto& p : fields[8].cast<py::list>()) {
      auto t = p.cast<std::vector<int64_t>>();
      made->pointers.push_back(Pointer{t[0], t[1], t[2]});
    }
    for (const auto& m : fields[9].cast<py::list>()) {
      auto t = m.cast<py::tuple>();
      TensorMap map{};
      map.at = t[0].cast<int64_t>();
      map.slot = t[1].cast<int64_t>();
      map.offset = t[2].cast<int64_t>();
      map.elem_type = t[3].cast<int>();
      map.swizzle = t[4].cast<int>();
      map.fill = t[5].cast<int>();
      auto dims = t[6].cast<std::vector<uint64_t>>();
      auto strides = t[7].cast<std::vector<uint64_t>>();
      auto box = t[8].cast<std::vector<uint32_t>>();
      map.rank = static_cast<int>(dims.size());
      TORCH_CHECK(map.rank >= 1 && map.rank <= 5 && box.size() == dims.size() &&
                  strides.size() + 1 == dims.size(), "dash attention: a bad recorded TMA map");
      std::copy(dims.begin(), dims.end(), map.dims.begin());
      std::copy(strides.begin(), strides.end(), map.strides.begin());
      std::copy(box.begin(), box.end(), map.box.begin());
      made->maps.push_back(map);
    }
    return made;
  }

  static void call(const AtenCall& aten, std::vector<Tensor>& slots) {
    torch::jit::Stack stack;
    stack.reserve(aten.arguments.size());
    for (const auto& argument : aten.arguments) {
      if (argument.slot >= 0) {
        stack.emplace_back(slots[argument.slot]);
      } else {
        stack.push_back(argument.constant);
      }
    }
    aten.op.callBoxed(stack);
    for (auto& value : stack) {  // the returns, in order: a slot each (the tape checked: Tensors)
      slots.push_back(std::move(value).toTensor());
    }
  }

  static void launch(KernelLaunch& kernel, const std::vector<Tensor>& slots) {
    const Driver& cuda = driver();
    // The block as recorded, then this call's addresses and descriptors over it.
    std::vector<uint8_t> storage(kernel.params.size() + 64);
    auto* block = reinterpret_cast<uint8_t*>(
        (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
    std::memcpy(block, kernel.params.data(), kernel.params.size());
    for (const auto& p : kernel.pointers) {
      uint64_t address = reinterpret_cast<uint64_t>(slots[p.slot].data_ptr()) + p.offset;
      std::memcpy(block + p.at, &address, sizeof(address));
    }
    for (auto& map : kernel.maps) {
      uint64_t base = reinterpret_cast<uint64_t>(slots[map.slot].data_ptr()) + map.offset;
      std::memcpy(block + map.at, encoding(cuda, map, base).data(), kMapBytes);
    }
    std::vector<void*> params(kernel.offsets.size());
    for (size_t i = 0; i < params.size(); ++i) params[i] = block + kernel.offsets[i];
    auto device = slots[0].device();
    void* stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device).native_handle();
    const auto& g = kernel.grid;
    int status = kernel.cooperative
        ? cuda.cooperative(kernel.function, g[0], g[1], g[2], kernel.threads, 1, 1, kernel.shared,
                           stream, params.data())
        : cuda.launch(kernel.function, g[0], g[1], g[2], kernel.threads, 1, 1, kernel.shared,
                      stream, params.data(), nullptr);
    check(status, "a kernel launch");
  }

  static const std::array<uint8_t, kMapBytes>& encoding(const Driver& cuda, TensorMap& map,
                                                         uint64_t base) {
    for (const auto& kept : map.kept) {
      if (kept.base == base) return kept.bytes;
    }
    Encoding& made = map.kept[map.next];
    map.next = (map.next + 1) % kEncodingsKept;
    std::array<uint32_t, 5> unit{1, 1, 1, 1, 1};
    made.base = 0;  // invalid until the encoding succeeds
    check(cuda.encode(made.bytes.data(), map.elem_type, map.rank, reinterpret_cast<void*>(base),
                      map.dims.data(), map.strides.data(), map.box.data(), unit.data(), 0,
                      map.swizzle, 2, map.fill),
          "cuTensorMapEncodeTiled");
    made.base = base;
    return made.bytes;
  }

  int64_t inputs_;
  std::vector<Step> steps_;
  std::vector<int64_t> outputs_;
  std::vector<Tensor> kept_;  // tensors whose addresses the program holds (the spin flag)
  std::mutex mutex_;
};

}  // namespace dash_replay
