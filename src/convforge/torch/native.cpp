// convforge's native fast path for torch tensors (built at run time by convforge/torch/native.py).
//
// What it does: a warm convforge.conv2d call with torch CUDA tensors, the convforge::conv2d op's
// CUDA and Autograd kernels, and a FusedConv2d call whose plan adds the residual (run_res), in
// C++: the call's key from the tensors' sizes and the keyword arguments, a table lookup, the output from PyTorch's caching allocator (at::empty), the plan's
// launches through cuLaunchKernel with argument buffers prepared once per executable. Python's
// fast path costs microseconds per call in the interpreter; this one aims at a launch plus a few hundred ns.
//
// Why it is safe: the table is filled only by Python's validating slow path (``register``), under
// a key parsed from the same arguments by the same function as the lookup (``parse_call``), so a
// hit is a call the slow path has already checked. Anything this file does not recognise (another
// type, a list, an unaligned pointer, a tensor subclass) answers "no entry" and Python's path runs.
// The filter-derived workspace (Winograd U, packed GEMM weights) is kept per weight address and
// version as backends/base.py FilterCache keeps it; under CUDA-graph capture the whole plan runs.
//
// What knows no array library (the driver, the key's options, programs and their launches, the
// table, conv2d as a C callable) is convforge/backends/native_core.h, shared with the CuPy path.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/addcmul.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/gelu_backward.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include "native_core.h"  // after torch's headers: its driver types shadow cuda.h's here

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

// The storage dtype's code in Key::dtype (0 float32, 1 float16, 2 bfloat16), -1 for any other.
int dtype_code(c10::ScalarType t) {
  return t == at::kFloat ? 0 : t == at::kHalf ? 1 : t == at::kBFloat16 ? 2 : -1;
}

// A 4-D tensor NHWC plans read as it lies (ops.channels_last's rule): channels_last and not also
// NCHW-contiguous (C == 1 counts as NCHW), or a contiguous batch of 1x1 images of several channels
// (one memory in both layouts: a squeeze-excitation block's pooled input).
bool nhwc(const at::Tensor& t) {
  if (t.dim() != 4) return false;
  if (t.size(2) == 1 && t.size(3) == 1) return t.size(1) > 1 && t.is_contiguous();
  return !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
}

// A tensor the fast path can run: plain torch.Tensor (or Parameter), CUDA, float32, float16 or
// bfloat16, contiguous (4-D: NCHW or channels_last), with storage, no wrapper or Python dispatch
// keys, no negative bit.
bool plain(const at::Tensor& t, int64_t dim) {
  if (!t.defined() || t.dim() != dim || !t.is_cuda() || dtype_code(t.scalar_type()) < 0 ||
      t.layout() != at::kStrided)
    return false;
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->is_python_dispatch() || t.is_neg() || !(t.is_contiguous() || nhwc(t)))
    return false;
  constexpr c10::DispatchKeySet wrappers({c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                          c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Python});
  return !t.key_set().has_any(wrappers);
}

// A new output of ``shape`` (N, C, H, W) like ``like``'s dtype and device, from the caching allocator;
// channels_last (an N H W C buffer, viewed N C H W) where ``channels_last``.
at::Tensor new_output(c10::IntArrayRef shape, const at::Tensor& like, bool channels_last) {
  if (!channels_last || shape.size() != 4)
    return at::detail::empty_cuda(shape, like.scalar_type(), like.device(), std::nullopt);
  at::Tensor rows = at::detail::empty_cuda({shape[0], shape[2], shape[3], shape[1]}, like.scalar_type(),
                                           like.device(), std::nullopt);
  return rows.permute({0, 3, 1, 2});
}

Seq seq_from_ints(c10::IntArrayRef a) {  // the op's int[] as Python's tuple(...) of it
  Seq s;
  s.tag = 2;
  s.n = static_cast<int8_t>(a.size());
  for (size_t i = 0; i < a.size(); ++i) s.v[i] = a[i];
  return s;
}

void tensor_key(Key& k, const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias) {
  for (int i = 0; i < 4; ++i) {
    k.xs[i] = x.size(i);
    k.ws[i] = w.size(i);
  }
  k.bias_k = bias ? bias->size(0) : -1;
  k.device = x.get_device();
  k.dtype = static_cast<int8_t>(dtype_code(x.scalar_type()));
  k.nhwc = nhwc(x);
}

// x (NCHW or channels_last), KCRS-contiguous w and a bias, one dtype, one device.
bool tensors_ok(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias) {
  if (!plain(x, 4) || !plain(w, 4) || !w.is_contiguous() || w.get_device() != x.get_device() ||
      w.scalar_type() != x.scalar_type())
    return false;
  return !bias || (plain(*bias, 1) && bias->get_device() == x.get_device() && bias->scalar_type() == x.scalar_type());
}

// Filters a node casts itself (``kcrs_operand``): the module's own weight where the conv runs in x's
// dtype from it, float32 master weights of a half conv (an autocast region) or channels_last ones.
bool filters_ok(const at::Tensor& x, const at::Tensor& w) {
  at::ScalarType t = w.scalar_type();
  return plain(x, 4) && plain(w, 4) && w.get_device() == x.get_device() &&
         (t == x.scalar_type() || (t == at::kFloat && x.scalar_type() != at::kFloat));
}

// The KCRS filters in x's dtype a conv program reads, from filters_ok's ``w``: itself, or a copy (grad
// mode off: the node's backward casts the filters' gradient back, as autocast's cast would).
at::Tensor kcrs_operand(const at::Tensor& x, const at::Tensor& w) {
  if (w.scalar_type() == x.scalar_type() && w.is_contiguous()) return w;
  return w.to(x.scalar_type(), false, false, at::MemoryFormat::Contiguous);
}

// The arguments of convforge.conv2d, positionally: x, w, bias, stride, padding, dilation, algo,
// backend, workspace_limit, relu, params, precision, max_error, groups. False: not a call this path runs.
// ``cast``: without a bias, w may be filters the caller turns into the conv's (filters_ok, kcrs_operand).
bool parse_call(PyObject* const* a, Key& k, const at::Tensor*& x, const at::Tensor*& w, const at::Tensor*& b,
                bool cast = false) {
  if (!THPVariable_CheckExact(a[0]) || !THPVariable_CheckExact(a[1])) return false;
  x = &THPVariable_Unpack(a[0]);
  w = &THPVariable_Unpack(a[1]);
  b = nullptr;
  if (a[2] != Py_None) {
    if (!THPVariable_CheckExact(a[2])) return false;
    b = &THPVariable_Unpack(a[2]);
  }
  bool ok = tensors_ok(*x, *w, b) || (cast && !b && filters_ok(*x, *w));
  if (!ok || !parse_options(a, k)) return false;
  tensor_key(k, *x, *w, b);
  return true;
}

// ---- a program, with its transformed filters per weight tensor ----
using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Filters {  // one weight address's transformed filters
  WeakImpl owner;
  int64_t version;
  at::Tensor packed;
};

struct Program : ProgramBase {
  std::mutex mu;
  std::unordered_map<uintptr_t, Filters> filters;
};

void launch_checked(const Program& p, const std::vector<LaunchRec>& runs, const uint64_t* slot, CUstream stream) {
  CUresult bad = launch_all(p, runs, slot, stream);
  TORCH_CHECK(bad == 0, launch_error(p, bad));
}

// Counted off the hot path, for tests and the host-cost script: filter transforms run, op calls
// that went to Python (misses, layers convforge leaves to PyTorch).
std::atomic<uint64_t> transforms{0}, op_fallbacks{0}, pass_runs{0}, block_runs{0}, relu_runs{0}, pair_runs{0},
    cast_runs{0}, mlp_runs{0}, se_runs{0}, pool_runs{0}, bn_runs{0},
    transpose_runs{0};
// pass_runs: backward calls run here, block_runs: conv -> batch norm blocks run by BlockNode, relu_runs: conv ->
// ReLU layers run by ConvReluNode, pair_runs: block dgrads run with a later block's residual gradient added,
// cast_runs: blocks' master filters cast by their attached casts (attach_wcast), mlp_runs: calls run by the MLP
// nodes (native_mlp.inc), se_runs, pool_runs: calls run by SeNode, PoolNode (native_layers.inc),
// bn_runs, transpose_runs: calls run by BnNode, TransposeNode (native_nodes.inc)

// The packed filter-derived buffer for w (transformed now if missing or stale), or undefined:
// inference tensors (no version counter) run the whole plan, as in Python.
at::Tensor filters_for(Program& p, const at::Tensor& w, uintptr_t wp, uint64_t* slot, CUstream stream) {
  if (w.is_inference()) return at::Tensor();
  int64_t version = static_cast<int64_t>(w._version());
  std::lock_guard<std::mutex> lock(p.mu);
  auto it = p.filters.find(wp);
  if (it != p.filters.end() && it->second.version == version) {
    auto owner = it->second.owner.lock();
    if (owner && (owner.get() == w.unsafeGetTensorImpl() ||
                  reinterpret_cast<uintptr_t>(at::Tensor(std::move(owner)).const_data_ptr()) == wp))
      return it->second.packed;
  }
  for (auto e = p.filters.begin(); e != p.filters.end();) {  // forget freed weights
    e = e->second.owner.expired() ? p.filters.erase(e) : std::next(e);
  }
  it = p.filters.find(wp);
  // a buffer of floats, whatever w's dtype (the derived sizes count 4-byte words, as Python's FilterCache does)
  at::Tensor packed = it != p.filters.end()
                          ? it->second.packed
                          : at::empty({p.derived_floats}, w.options().dtype(at::kFloat).requires_grad(false));
  auto base = reinterpret_cast<uintptr_t>(packed.data_ptr());
  for (size_t j = 0; j < p.offsets.size(); ++j) slot[kFixedSlots + j] = base + p.offsets[j];
  launch_checked(p, p.weights, slot, stream);
  transforms.fetch_add(1, std::memory_order_relaxed);
  p.filters.insert_or_assign(wp, Filters{WeakImpl(w.getIntrusivePtr()), version, packed});
  return packed;
}

// Launch p on the filled pointer slots: with the filter-derived buffers cached for weights ``w``
// (at ``wp``; not while capturing) the "rest" steps, else every step on the executable's own
// buffers (``w`` null: a plan that writes the filters, or none to cache).
void launch_filtered(Program& p, const at::Tensor* w, uintptr_t wp, uint64_t* slot, CUstream stream) {
  const std::vector<LaunchRec>* runs = &p.all;
  if (!p.offsets.empty()) {
    at::Tensor packed;
    if (w && !capturing(stream)) packed = filters_for(p, *w, wp, slot, stream);
    if (packed.defined()) {
      auto base = reinterpret_cast<uintptr_t>(packed.const_data_ptr());
      for (size_t j = 0; j < p.offsets.size(); ++j) slot[kFixedSlots + j] = base + p.offsets[j];
      runs = &p.rest;
    } else {
      for (size_t j = 0; j < p.ws_derived.size(); ++j) slot[kFixedSlots + j] = p.ws_derived[j];
    }
  }
  launch_checked(p, *runs, slot, stream);
}

// Run p on validated tensors (``res``: the residual's address, for a plan that adds one); false
// (nothing launched) when a pointer is not 16-byte aligned.
bool run_program(Program& p, const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias, at::Tensor& y,
                 uintptr_t res = 0) {
  auto xp = reinterpret_cast<uintptr_t>(x.const_data_ptr());
  auto wp = reinterpret_cast<uintptr_t>(w.const_data_ptr());
  uintptr_t bp = bias ? reinterpret_cast<uintptr_t>(bias->const_data_ptr()) : 0;
  if ((xp | wp | bp | res) & 15) return false;
  CUstream stream = c10::cuda::getCurrentCUDAStream(x.get_device()).stream();
  y = new_output(p.y_shape, x, nhwc(x));  // the caching allocator, no dispatch; x's dtype and layout
  uint64_t slot[kMaxArgs] = {xp, wp, reinterpret_cast<uintptr_t>(y.data_ptr()), bp, res};
  launch_filtered(p, &w, wp, slot, stream);
  return true;
}

// ---- the table ----
Table<Program> table;

std::shared_ptr<Program> find(const Key& k) {
  return table.find(k);
}

// The output of a filed call of conv2d's 14 arguments (a new reference); None when the call has
// no entry or cannot run here; nullptr with the Python error set when a launch fails.
PyObject* run_filed(PyObject* const* a) {
  Key k;
  const at::Tensor *x = nullptr, *w = nullptr, *b = nullptr;
  if (!parse_call(a, k, x, w, b)) Py_RETURN_NONE;
  std::shared_ptr<Program> p = find(k);
  if (!p) Py_RETURN_NONE;
  HANDLE_TH_ERRORS
  at::Tensor y;
  if (!run_program(*p, *x, *w, b, y)) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

// The output of a filed FusedConv2d call whose plan adds the residual: conv2d's 14 arguments (relu:
// the ReLU after the add) and the residual ``a[kArgs]``, a tensor of the output's shape on the same
// device; None when the call has no entry or the residual does not fit; nullptr when a launch fails.
PyObject* run_filed_res(PyObject* const* a) {
  Key k;
  k.residual = true;
  const at::Tensor *x = nullptr, *w = nullptr, *b = nullptr;
  if (!parse_call(a, k, x, w, b) || !THPVariable_CheckExact(a[kArgs])) Py_RETURN_NONE;
  std::shared_ptr<Program> p = find(k);
  const at::Tensor& res = THPVariable_Unpack(a[kArgs]);
  if (!p || !plain(res, 4) || res.get_device() != x->get_device() || res.sizes() != c10::IntArrayRef(p->y_shape) ||
      res.scalar_type() != x->scalar_type() || nhwc(res) != nhwc(*x))
    Py_RETURN_NONE;
  HANDLE_TH_ERRORS
  at::Tensor y;
  if (!run_program(*p, *x, *w, b, y, reinterpret_cast<uintptr_t>(res.const_data_ptr()))) Py_RETURN_NONE;
  return THPVariable_Wrap(std::move(y));
  END_HANDLE_TH_ERRORS
}

#ifdef CONVFORGE_NATIVE_PROFILE  // scripts/host_cost.py --parts builds with it (a library of its own)
#include "native_profile.inc"
#endif

// ---- Python: run, register, clear, stats ----
PyObject* py_run(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs) {
    PyErr_SetString(PyExc_TypeError, "run takes conv2d's 14 arguments");
    return nullptr;
  }
  return run_filed(a);
}

PyObject* py_run_res(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs + 1) {
    PyErr_SetString(PyExc_TypeError, "run_res takes conv2d's 14 arguments and the residual");
    return nullptr;
  }
  return run_filed_res(a);
}

// register(14 conv2d arguments..., program, seed[, residual]): program = (all, rest, weights,
// y_shape, ws_derived, offsets, derived_floats, context, name, executable); seed = None or (w,
// version, packed): filters Python's path already made for w; residual True: the plan adds a
// residual (found by run_res, never by run). Answers whether the call was filed.
// Seed p's filter cache with the filters Python's path made: ``seed`` None or (w, version, packed).
// False with the Python error set when the version is not an int.
bool seed_filters(Program& p, PyObject* seed) {
  if (seed == Py_None || !PyTuple_Check(seed) || PyTuple_GET_SIZE(seed) != 3 ||
      !THPVariable_CheckExact(PyTuple_GET_ITEM(seed, 0)) || !THPVariable_CheckExact(PyTuple_GET_ITEM(seed, 2)))
    return true;
  const at::Tensor& sw = THPVariable_Unpack(PyTuple_GET_ITEM(seed, 0));
  int64_t version = PyLong_AsLongLong(PyTuple_GET_ITEM(seed, 1));
  if (PyErr_Occurred()) return false;
  p.filters.insert_or_assign(reinterpret_cast<uintptr_t>(sw.const_data_ptr()),
                             Filters{WeakImpl(sw.getIntrusivePtr()), version,
                                     THPVariable_Unpack(PyTuple_GET_ITEM(seed, 2))});
  return true;
}

PyObject* py_register(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs + 2 && n != kArgs + 3) {
    PyErr_SetString(PyExc_TypeError, "register takes conv2d's 14 arguments, a program, a seed and a residual flag");
    return nullptr;
  }
  Key k;
  k.residual = n == kArgs + 3 && a[kArgs + 2] == Py_True;
  const at::Tensor *x = nullptr, *w = nullptr, *b = nullptr;
  if (!parse_call(a, k, x, w, b)) Py_RETURN_FALSE;
  auto p = std::make_shared<Program>();
  if (!read_program(a[kArgs], *p)) return nullptr;
  if (!seed_filters(*p, a[kArgs + 1])) return nullptr;
  table.put(k, std::move(p));
  Py_RETURN_TRUE;
}

PyObject* py_stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:n,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "entries", static_cast<Py_ssize_t>(table.size()),
                       "transforms", static_cast<unsigned long long>(transforms.load()), "op_fallbacks",
                       static_cast<unsigned long long>(op_fallbacks.load()), "pass_runs",
                       static_cast<unsigned long long>(pass_runs.load()), "block_runs",
                       static_cast<unsigned long long>(block_runs.load()), "relu_runs",
                       static_cast<unsigned long long>(relu_runs.load()), "pair_runs",
                       static_cast<unsigned long long>(pair_runs.load()), "cast_runs",
                       static_cast<unsigned long long>(cast_runs.load()), "mlp_runs",
                       static_cast<unsigned long long>(mlp_runs.load()), "se_runs",
                       static_cast<unsigned long long>(se_runs.load()), "pool_runs",
                       static_cast<unsigned long long>(pool_runs.load()), "bn_runs",
                       static_cast<unsigned long long>(bn_runs.load()), "transpose_runs",
                       static_cast<unsigned long long>(transpose_runs.load()));
}


#include "native_ops.inc"    // the ops' CUDA and Autograd kernels
#include "native_nodes.inc"  // the C++ autograd nodes
#include "native_mlp.inc"    // ConvNeXt's MLP nodes in training
#include "native_layers.inc"  // max pooling and squeeze-and-excitation

PyObject* py_clear(PyObject*, PyObject*) {
  table.clear();
  relu_backs.clear();  // their programs hold executables planned under the old settings
  Py_RETURN_NONE;
}

bool take_two(PyObject* const* a, Py_ssize_t n, std::unique_ptr<torch::Library>& lib, const char* who,
              PyObject*& first, PyObject*& second) {
  if (n != 2 || !PyCallable_Check(a[0]) || !PyCallable_Check(a[1])) {
    PyErr_Format(PyExc_TypeError, "%s takes two callables", who);
    return false;
  }
  if (lib) {
    PyErr_Format(PyExc_RuntimeError, "%s: the kernels are registered already", who);
    return false;
  }
  Py_INCREF(a[0]);
  Py_INCREF(a[1]);
  first = a[0];
  second = a[1];
  lib = std::make_unique<torch::Library>(torch::Library::IMPL, "convforge", std::nullopt, __FILE__, __LINE__);
  return true;
}

std::unique_ptr<torch::Library> pass_library;

// register_pass_ops(input_fallback, weight_fallback): conv2d_input's and conv2d_weight's CUDA
// kernels become op_input_cuda / op_weight_cuda, misses going to these Python kernels.
PyObject* py_register_pass_ops(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (!take_two(a, n, pass_library, "register_pass_ops", fallback_pass[1], fallback_pass[2])) return nullptr;
  pass_library->impl("conv2d_input", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(op_input_cuda)));
  pass_library->impl("conv2d_weight", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(op_weight_cuda)));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

std::unique_ptr<torch::Library> op_library;

// register_op(cuda_fallback, grad_apply): the op's CUDA and Autograd kernels become these.
PyObject* py_register_op(PyObject*, PyObject* const* a, Py_ssize_t n) {
  HANDLE_TH_ERRORS
  if (!take_two(a, n, op_library, "register_op", fallback_cuda, grad_apply)) return nullptr;
  op_library->impl("conv2d", torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(op_cuda)));
  op_library->impl("conv2d", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(op_autograd)));
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

PyObject* py_set_native_autograd(PyObject*, PyObject* on) {
  native_autograd = PyObject_IsTrue(on) == 1;
  Py_RETURN_NONE;
}

PyObject* py_set_residual_grad(PyObject*, PyObject* on) {
  residual_grad = PyObject_IsTrue(on) == 1;
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"set_native_autograd", py_set_native_autograd, METH_O,
     "set_native_autograd(on): the op's autograd node in C++ (True) or Python's ops._Conv2dFn (False)"},
    {"set_residual_grad", py_set_residual_grad, METH_O,
     "set_residual_grad(on): pair a block's dgrad with a later block's residual gradient (PairToken) or not"},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_run)), METH_FASTCALL,
     "run(conv2d's 14 arguments) -> the output tensor, or None when the call has no entry"},
    {"run_res", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_run_res)), METH_FASTCALL,
     "run_res(conv2d's 14 arguments, res) -> the output of a filed plan that adds res, or None"},
    {"register", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register)), METH_FASTCALL,
     "register(conv2d's 14 arguments, program, seed[, residual]) -> whether the call was filed"},
    {"register_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_op)), METH_FASTCALL,
     "register_op(cuda_fallback, grad_apply): the op's CUDA and Autograd kernels in C++"},
    {"register_pass", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_pass)), METH_FASTCALL,
     "register_pass(pass, size, a, g, stride, padding, dilation, groups, algo, precision, max_error, program, "
     "seed, out_shape) -> whether a backward op's call was filed"},
    {"forget_pass", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_forget_pass)), METH_FASTCALL,
     "forget_pass(register_pass's first 11 arguments): drop a filed backward call"},
    {"register_pass_ops", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_pass_ops)),
     METH_FASTCALL, "register_pass_ops(input_fallback, weight_fallback): the backward ops' CUDA kernels in C++"},
    {"block", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_block)), METH_FASTCALL,
     "block(conv2d's 14 arguments, res, gamma, beta, running_mean, running_var, num_batches_tracked, handle) -> "
     "a conv -> batch norm block's output through one C++ autograd node, or None"},
    {"attach_wcast", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_attach_wcast)), METH_FASTCALL,
     "attach_wcast(handle, program, shape, dtype, cl, dims) -> whether a block's filter casts were attached"},
    {"attach_res_dgrad", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_attach_res_dgrad)),
     METH_FASTCALL, "attach_res_dgrad(handle, program, out_shape) -> whether a block's residual-adding dgrad was attached"},
    {"conv_relu", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_conv_relu)), METH_FASTCALL,
     "conv_relu(conv2d's 14 arguments) -> a conv -> ReLU layer's output through one C++ autograd node, or None"},
    {"register_relu_back", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_relu_back)),
     METH_FASTCALL, "register_relu_back(conv2d's 14 arguments, rows, mask, fixed, dgrad, wgrad, scratch) -> whether "
     "a float32 conv -> ReLU layer's backward was filed"},
    {"bn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_bn)), METH_FASTCALL,
     "bn(y, res, gamma, beta, running_mean, running_var, num_batches_tracked, handle) -> a batch norm's output "
     "through one C++ autograd node, or None"},
    {"conv_transpose", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_conv_transpose)), METH_FASTCALL,
     "conv_transpose(x, w, bias, size, stride, padding, dilation, groups, algo, precision, max_error) -> "
     "conv_transpose2d through one C++ autograd node, or None"},
    {"register_bn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_bn)), METH_FASTCALL,
     "register_bn(program, n, c, hw, relu, residual, affine, track, st, part, dtype, pdtype, nhwc[, stats_conv]) -> "
     "a batch-norm program's handle"},
    {"register_mlp", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_mlp)), METH_FASTCALL,
     "register_mlp(node, the GEMM's conv2d arguments (14), norm program or None, part, affine) -> an MLP node's "
     "handle, or None"},
    {"mlp_a", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_mlp_a)), METH_FASTCALL,
     "mlp_a(x, norm weight, norm bias, w, b, handle) -> layer norm -> linear -> GELU through one C++ node, or None"},
    {"mlp_b", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_mlp_b)), METH_FASTCALL,
     "mlp_b(g, res, w, b, scale, noise, handle) -> res + linear(g) x scale x noise through one C++ node, or None"},
    {"register_se", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_se)), METH_FASTCALL,
     "register_se(program, n, c, hw, s, part, sv, bs, dtype, pdtype, nhwc) -> a squeeze-and-excitation's handle"},
    {"se", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_se)), METH_FASTCALL,
     "se(x, w1, b1, w2, b2, handle) -> a squeeze-and-excitation's output through one C++ autograd node, or None"},
    {"register_pool", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_pool)), METH_FASTCALL,
     "register_pool(program, n, c, h, w, p, q, taps, dtype, nhwc, aligned) -> a max pooling's handle"},
    {"pool", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_pool)), METH_FASTCALL,
     "pool(x, handle) -> a max pooling's output through one C++ autograd node, or None"},
    {"clear", py_clear, METH_NOARGS, "forget every entry"},
    {"wrap", py_wrap, METH_O, "wrap(python_conv2d) -> conv2d whose warm torch calls stay in C"},
#ifdef CONVFORGE_NATIVE_PROFILE
    {"parts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_parts)), METH_FASTCALL,
     "parts(conv2d's 14 arguments, piece, n) -> seconds of n repetitions of one piece of a warm call"},
#endif
    {"stats", py_stats, METH_NOARGS,
     "{entries, transforms, op_fallbacks, pass_runs, block_runs, relu_runs, pair_runs, cast_runs, mlp_runs, "
     "se_runs, pool_runs, bn_runs, transpose_runs}: table size and counters"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "convforge_native", "convforge's native fast path (torch)", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit_convforge_native() {
  if (!init_core()) return nullptr;
  return PyModule_Create(&module_def);
}
