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
#include <ATen/ops/empty.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include "native_core.h"  // after torch's headers: its driver types shadow cuda.h's here

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

// A 4-D tensor in channels_last memory format that is not also NCHW-contiguous (C == 1 or 1x1
// images are both, and count as NCHW): NHWC plans read it as it lies.
bool nhwc(const at::Tensor& t) {
  return t.dim() == 4 && !t.is_contiguous() && t.is_contiguous(at::MemoryFormat::ChannelsLast);
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

// The arguments of convforge.conv2d, positionally: x, w, bias, stride, padding, dilation, algo,
// backend, workspace_limit, relu, params, precision, max_error, groups. False: not a call this path runs.
bool parse_call(PyObject* const* a, Key& k, const at::Tensor*& x, const at::Tensor*& w, const at::Tensor*& b) {
  if (!THPVariable_CheckExact(a[0]) || !THPVariable_CheckExact(a[1])) return false;
  x = &THPVariable_Unpack(a[0]);
  w = &THPVariable_Unpack(a[1]);
  b = nullptr;
  if (a[2] != Py_None) {
    if (!THPVariable_CheckExact(a[2])) return false;
    b = &THPVariable_Unpack(a[2]);
  }
  if (!tensors_ok(*x, *w, b) || !parse_options(a, k)) return false;
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
std::atomic<uint64_t> transforms{0}, op_fallbacks{0}, pass_runs{0}, block_runs{0};  // pass_runs: backward calls
// run here, block_runs: conv -> batch norm blocks run by BlockNode

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

// ---- parts: where a warm call's host time goes (scripts/host_cost.py --parts) ----
// parts(conv2d's 14 arguments, piece, n) -> seconds that n repetitions of one piece of the filed
// call take, timed in C: "call" (the whole run and the output's release), "parse", "find" (parse
// and lookup), "stream", "context", "capture", "filters" (the per-weight cache hit), "alloc"
// (the output from the caching allocator, released), "wrap" (the same as a Python object),
// "launch" (the plan's warm launches on prepared pointers).
PyObject* py_parts(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs + 2 || !PyUnicode_Check(a[kArgs]) || !PyLong_Check(a[kArgs + 1])) {
    PyErr_SetString(PyExc_TypeError, "parts takes conv2d's 14 arguments, a piece's name and a count");
    return nullptr;
  }
  Key k;
  const at::Tensor *x = nullptr, *w = nullptr, *b = nullptr;
  std::shared_ptr<Program> p = parse_call(a, k, x, w, b) ? find(k) : nullptr;
  if (!p) {
    PyErr_SetString(PyExc_ValueError, "parts: this call is not filed (make it once first)");
    return nullptr;
  }
  const char* name = PyUnicode_AsUTF8(a[kArgs]);
  long reps = PyLong_AsLong(a[kArgs + 1]);
  if (!name || PyErr_Occurred()) return nullptr;
  std::string piece = name;
  HANDLE_TH_ERRORS
  CUstream stream = c10::cuda::getCurrentCUDAStream(x->get_device()).stream();
  at::Tensor y = at::detail::empty_cuda(p->y_shape, at::kFloat, x->device(), std::nullopt);
  auto wp = reinterpret_cast<uintptr_t>(w->const_data_ptr());
  uint64_t slot[kMaxArgs] = {reinterpret_cast<uintptr_t>(x->const_data_ptr()), wp,
                             reinterpret_cast<uintptr_t>(y.data_ptr()),
                             b ? reinterpret_cast<uintptr_t>(b->const_data_ptr()) : 0, 0};
  at::Tensor packed = p->offsets.empty() ? at::Tensor() : filters_for(*p, *w, wp, slot, stream);
  const std::vector<LaunchRec>& runs = packed.defined() ? p->rest : p->all;
  for (size_t j = 0; j < p->offsets.size(); ++j)
    slot[kFixedSlots + j] = packed.defined() ? reinterpret_cast<uintptr_t>(packed.const_data_ptr()) + p->offsets[j]
                                             : p->ws_derived[j];
  static const char* const pieces[] = {"call",    "parse", "find", "stream", "context", "capture",
                                       "filters", "alloc", "wrap", "launch"};
  int which = -1;
  for (int i = 0; i < 10; ++i)
    if (piece == pieces[i]) which = i;
  if (which < 0) {
    PyErr_Format(PyExc_ValueError, "parts: no piece %s", piece.c_str());
    return nullptr;
  }
  volatile uintptr_t sink = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < reps; ++i) {
    switch (which) {
      case 0: {
        PyObject* r = run_filed(a);
        if (!r) return nullptr;
        Py_DECREF(r);
        break;
      }
      case 1:
      case 2: {
        Key kk;
        const at::Tensor *xx = nullptr, *ww = nullptr, *bb = nullptr;
        sink = parse_call(a, kk, xx, ww, bb);
        if (which == 2) sink = reinterpret_cast<uintptr_t>(find(kk).get());
        break;
      }
      case 3:
        sink = reinterpret_cast<uintptr_t>(c10::cuda::getCurrentCUDAStream(x->get_device()).stream());
        break;
      case 4: {
        CUcontext cur = nullptr;
        drv.ctx_get(&cur);
        sink = reinterpret_cast<uintptr_t>(cur);
        break;
      }
      case 5:
        sink = capturing(stream);
        break;
      case 6:
        if (packed.defined()) sink = reinterpret_cast<uintptr_t>(filters_for(*p, *w, wp, slot, stream).data_ptr());
        break;
      case 7:
        sink = reinterpret_cast<uintptr_t>(
            at::detail::empty_cuda(p->y_shape, at::kFloat, x->device(), std::nullopt).data_ptr());
        break;
      case 8:
        Py_DECREF(THPVariable_Wrap(at::detail::empty_cuda(p->y_shape, at::kFloat, x->device(), std::nullopt)));
        break;
      default:
        launch_checked(*p, runs, slot, stream);
    }
  }
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
  (void)sink;
  return PyFloat_FromDouble(took.count());
  END_HANDLE_TH_ERRORS
}

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

PyObject* py_clear(PyObject*, PyObject*) {
  table.clear();
  Py_RETURN_NONE;
}

PyObject* py_stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:n,s:K,s:K,s:K,s:K}", "entries", static_cast<Py_ssize_t>(table.size()), "transforms",
                       static_cast<unsigned long long>(transforms.load()), "op_fallbacks",
                       static_cast<unsigned long long>(op_fallbacks.load()), "pass_runs",
                       static_cast<unsigned long long>(pass_runs.load()), "block_runs",
                       static_cast<unsigned long long>(block_runs.load()));
}


// ---- the convforge::conv2d op's CUDA and Autograd kernels ----
PyObject* fallback_cuda = nullptr;  // ops._cuda: Python's path for a miss
PyObject* grad_apply = nullptr;  // ops._grad_apply: the autograd.Function, when a gradient is needed

using OpSig = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::IntArrayRef,
                         c10::IntArrayRef, c10::IntArrayRef, c10::string_view, std::optional<c10::string_view>,
                         std::optional<double>, int64_t);

PyObject* ints_to_list(c10::IntArrayRef a) {
  PyObject* l = PyList_New(static_cast<Py_ssize_t>(a.size()));
  for (size_t i = 0; i < a.size(); ++i) PyList_SET_ITEM(l, i, PyLong_FromLongLong(a[i]));
  return l;
}

PyObject* str_of(c10::string_view v) {
  return PyUnicode_FromStringAndSize(v.data(), static_cast<Py_ssize_t>(v.size()));
}

PyObject* str_or_none(std::optional<c10::string_view> v) {
  if (!v.has_value()) Py_RETURN_NONE;
  return str_of(*v);
}

PyObject* float_or_none(std::optional<double> v) {
  if (!v.has_value()) Py_RETURN_NONE;
  return PyFloat_FromDouble(*v);
}

// stride, padding and dilation as lists at args[at .. at + 2] (the ops' schemas put them there).
void put_geometry(PyObject* args, int at, c10::IntArrayRef stride, c10::IntArrayRef padding,
                  c10::IntArrayRef dilation) {
  PyTuple_SET_ITEM(args, at, ints_to_list(stride));
  PyTuple_SET_ITEM(args, at + 1, ints_to_list(padding));
  PyTuple_SET_ITEM(args, at + 2, ints_to_list(dilation));
}

// algo, precision and max_error at args[at .. at + 2].
void put_choice(PyObject* args, int at, c10::string_view algo, std::optional<c10::string_view> precision,
                std::optional<double> max_error) {
  PyTuple_SET_ITEM(args, at, str_of(algo));
  PyTuple_SET_ITEM(args, at + 1, str_or_none(precision));
  PyTuple_SET_ITEM(args, at + 2, float_or_none(max_error));
}

// Call Python's ``fn`` on ``args`` (stolen) and answer the tensor it returns; ``what`` names the path.
at::Tensor call_for_tensor(PyObject* fn, PyObject* args, const char* what) {
  PyObject* out = PyObject_Call(fn, args, nullptr);
  Py_DECREF(args);
  if (!out) throw python_error();
  if (!THPVariable_Check(out)) {
    Py_DECREF(out);
    TORCH_CHECK(false, "convforge: ", what, " returned no tensor");
  }
  at::Tensor y = THPVariable_Unpack(out);
  Py_DECREF(out);
  return y;
}

at::Tensor call_python(PyObject* fn, const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                       c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                       c10::string_view algo, std::optional<c10::string_view> precision,
                       std::optional<double> max_error, int64_t groups) {
  pybind11::gil_scoped_acquire gil;
  PyObject* args = PyTuple_New(10);
  PyTuple_SET_ITEM(args, 0, THPVariable_Wrap(x));
  PyTuple_SET_ITEM(args, 1, THPVariable_Wrap(w));
  if (bias.has_value() && bias->defined()) {
    PyTuple_SET_ITEM(args, 2, THPVariable_Wrap(*bias));
  } else {
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(args, 2, Py_None);
  }
  put_geometry(args, 3, stride, padding, dilation);
  put_choice(args, 6, algo, precision, max_error);
  PyTuple_SET_ITEM(args, 9, PyLong_FromLongLong(groups));
  return call_for_tensor(fn, args, "convforge::conv2d's Python path");
}

// The key fields of an op's keyword arguments (the int[] as Python's tuple(...) of them).
void op_options(Key& k, c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                c10::string_view algo, std::optional<c10::string_view> precision, std::optional<double> max_error) {
  k.groups = groups;
  k.stride = seq_from_ints(stride);
  k.padding = seq_from_ints(padding);
  k.dilation = seq_from_ints(dilation);
  k.algo.assign(algo.data(), algo.size());
  if (precision.has_value()) {
    k.has_precision = true;
    k.precision.assign(precision->data(), precision->size());
  }
  if (max_error.has_value()) {
    k.has_max_error = true;
    k.max_error = *max_error;
  }
}

at::Tensor op_cuda(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                   c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, c10::string_view algo,
                   std::optional<c10::string_view> precision, std::optional<double> max_error, int64_t groups) {
  if (stride.size() == 2 && padding.size() == 4 && dilation.size() == 2) {
    at::Tensor xc = nhwc(x) ? x : x.contiguous(), wc = w.contiguous();  // channels_last stays as it lies
    const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
    if (tensors_ok(xc, wc, b)) {  // as ops._cuda calls convforge.conv2d: tuples, no backend, params, relu
      Key k;
      op_options(k, stride, padding, dilation, groups, algo, precision, max_error);
      tensor_key(k, xc, wc, b);
      if (std::shared_ptr<Program> p = find(k)) {
        at::Tensor y;
        if (run_program(*p, xc, wc, b, y)) return y;
      }
    }
  }
  op_fallbacks.fetch_add(1, std::memory_order_relaxed);
  return call_python(fallback_cuda, x, w, bias, stride, padding, dilation, algo, precision, max_error, groups);
}

// ---- the op's autograd node in C++ (opt-in: CONVFORGE_NATIVE_AUTOGRAD=1, set_native_autograd) ----
// What ops._Conv2dFn does, without Python: forward runs the op below autograd and saves x and w;
// backward calls conv2d_input, conv2d_weight and conv2d_bias through the dispatcher (their CUDA
// kernels: run_pass above, or Python's on a miss). Plain tensors only (fake, functional and
// Python-mode tensors, as under torch.compile, keep the Python node).
bool native_autograd = false;

using InputSig = at::Tensor(c10::SymIntArrayRef, const at::Tensor&, const at::Tensor&, c10::IntArrayRef,
                            c10::IntArrayRef, c10::IntArrayRef, int64_t, c10::string_view,
                            std::optional<c10::string_view>, std::optional<double>);
using WeightSig = at::Tensor(const at::Tensor&, c10::SymIntArrayRef, const at::Tensor&, c10::IntArrayRef,
                             c10::IntArrayRef, c10::IntArrayRef, int64_t, c10::string_view,
                             std::optional<c10::string_view>, std::optional<double>);

std::optional<c10::string_view> opt_view(const at::IValue& v, std::string& keep) {
  if (v.isNone()) return std::nullopt;
  keep = v.toStringRef();
  return c10::string_view(keep);
}

// conv2d_input and conv2d_weight through the dispatcher (their CUDA kernels below), found once.
c10::TypedOperatorHandle<InputSig>& input_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convforge::conv2d_input", "").typed<InputSig>();
  return op;
}

c10::TypedOperatorHandle<WeightSig>& weight_op() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convforge::conv2d_weight", "").typed<WeightSig>();
  return op;
}

// The forward's algo, precision and max_error as a node saved them (saved_data "algo", "precision",
// "max_error"), for the backward ops' calls; views into this object: keep it in place.
struct SavedChoice {
  std::string algo, keep;
  std::optional<c10::string_view> precision;
  std::optional<double> max_error;
  explicit SavedChoice(torch::autograd::AutogradContext* ctx) : algo(ctx->saved_data["algo"].toStringRef()) {
    precision = opt_view(ctx->saved_data["precision"], keep);
    const at::IValue& me = ctx->saved_data["max_error"];
    if (!me.isNone()) max_error = me.toDouble();
  }
  SavedChoice(const SavedChoice&) = delete;
  SavedChoice& operator=(const SavedChoice&) = delete;
};

struct ConvNode : public torch::autograd::Function<ConvNode> {
  // bias an optional, not an undefined tensor: Function::apply records each tensor argument's device,
  // which an undefined tensor has not ("tensor does not have a device", torch 2.11)
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
                            c10::IntArrayRef dilation, c10::string_view algo, std::optional<c10::string_view> precision,
                            std::optional<double> max_error, int64_t groups) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["stride"] = stride.vec();
    ctx->saved_data["padding"] = padding.vec();
    ctx->saved_data["dilation"] = dilation.vec();
    ctx->saved_data["algo"] = std::string(algo);
    ctx->saved_data["precision"] = precision.has_value() ? at::IValue(std::string(*precision)) : at::IValue();
    ctx->saved_data["max_error"] = max_error.has_value() ? at::IValue(*max_error) : at::IValue();
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["bias"] = bias.has_value() && bias->defined();
    static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convforge::conv2d", "").typed<OpSig>();
    return op.call(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups);  // grad mode off here
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static auto bias_op = c10::Dispatcher::singleton()
                              .findSchemaOrThrow("convforge::conv2d_bias", "")
                              .typed<at::Tensor(const at::Tensor&)>();
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1];
    std::vector<int64_t> stride = ctx->saved_data["stride"].toIntVector();
    std::vector<int64_t> padding = ctx->saved_data["padding"].toIntVector();
    std::vector<int64_t> dilation = ctx->saved_data["dilation"].toIntVector();
    SavedChoice ch(ctx);
    int64_t groups = ctx->saved_data["groups"].toInt();
    // sum().backward() hands an expanded tensor (zero strides); a channels_last layer's gradient stays so
    at::Tensor gy = grads[0].contiguous(nhwc(x) ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
    at::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0))
      gx = input_op().call(x.sym_sizes(), w, gy, stride, padding, dilation, groups, ch.algo, ch.precision,
                           ch.max_error);
    if (ctx->needs_input_grad(1))
      gw = weight_op().call(x, w.sym_sizes(), gy, stride, padding, dilation, groups, ch.algo, ch.precision,
                            ch.max_error);
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) gb = bias_op.call(gy);
    return {gx, gw, gb, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

at::Tensor op_autograd(c10::DispatchKeySet ks, const at::Tensor& x, const at::Tensor& w,
                       const std::optional<at::Tensor>& bias, c10::IntArrayRef stride, c10::IntArrayRef padding,
                       c10::IntArrayRef dilation, c10::string_view algo, std::optional<c10::string_view> precision,
                       std::optional<double> max_error, int64_t groups) {
  bool need = at::GradMode::is_enabled() &&
              (x.requires_grad() || w.requires_grad() || (bias.has_value() && bias->defined() && bias->requires_grad()));
  if (need) {
    const at::Tensor* b = bias.has_value() && bias->defined() ? &*bias : nullptr;
    if (native_autograd && tensors_ok(x, w, b))
      return ConvNode::apply(x, w, b ? std::optional<at::Tensor>(*b) : std::nullopt, stride, padding, dilation,
                             algo, precision, max_error, groups);
    return call_python(grad_apply, x, w, bias, stride, padding, dilation, algo, precision, max_error, groups);
  }
  c10::DispatchKeySet after = ks & c10::after_autograd_keyset;
  at::AutoDispatchBelowADInplaceOrView guard;
  // The next kernel is simply our CUDA one (no fake, functional or Python-mode tensors: only
  // ADInplaceOrView, a fallthrough here, lies between): call it, saving the redispatch.
  if (after.remove(c10::DispatchKey::ADInplaceOrView).highestPriorityTypeId() == c10::DispatchKey::CUDA)
    return op_cuda(x, w, bias, stride, padding, dilation, algo, precision, max_error, groups);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("convforge::conv2d", "").typed<OpSig>();
  return op.redispatch(after, x, w, bias, stride, padding, dilation, algo, precision, max_error, groups);
}

// ---- the backward ops' CUDA kernels: convforge::conv2d_input (dgrad) and conv2d_weight (wgrad) ----
// A warm call (a signature Python's kernel ran and filed: register_pass) runs its program here; any
// other goes to Python's kernel (ops._input_cuda / ops._weight_cuda), which files it.
PyObject* fallback_pass[3] = {nullptr, nullptr, nullptr};  // [1] dgrad, [2] wgrad
constexpr int kPassOut[3] = {2, 0, 1};  // the slot each pass writes: y (forward), x (dgrad), w (wgrad)
constexpr int kPassIn[3] = {0, 1, 0};  // the slot of its operand a: x (forward), w (dgrad), x (wgrad)

// k for a backward op's call: ``a`` (dgrad: the weight, wgrad: the input) and grad_output ``g``
// plain, on one device; ``size`` the output's 4 dimensions. False: not a call the fast path runs.
bool pass_key(Key& k, int pass, c10::IntArrayRef size, const at::Tensor& a, const at::Tensor& g,
              c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
              c10::string_view algo, std::optional<c10::string_view> precision, std::optional<double> max_error) {
  if (size.size() != 4 || stride.size() != 2 || padding.size() != 4 || dilation.size() != 2) return false;
  if (!plain(a, 4) || !plain(g, 4) || a.get_device() != g.get_device() || a.scalar_type() != g.scalar_type())
    return false;
  // the activations' layout is dy's; dgrad's weight is KCRS, wgrad's input lies as dy does
  if (pass == 1 ? !a.is_contiguous() : nhwc(a) != nhwc(g)) return false;
  k.pass = static_cast<int8_t>(pass);
  for (int i = 0; i < 4; ++i) k.size[i] = size[i];
  tensor_key(k, a, g, nullptr);
  k.nhwc = nhwc(g);
  op_options(k, stride, padding, dilation, groups, algo, precision, max_error);
  return true;
}

// Run a backward program on a (slot kPassIn), g (y's slot) into a new output of the program's
// output shape (slot kPassOut); dgrad's filter-derived buffers cached per weight tensor and version
// as the forward's are, wgrad's in the executable's own workspace (it writes the filters). False
// (nothing launched) when a pointer is not 16-byte aligned.
bool run_pass(Program& p, int pass, const at::Tensor& a, const at::Tensor& g, at::Tensor& out) {
  auto ap = reinterpret_cast<uintptr_t>(a.const_data_ptr());
  auto gp = reinterpret_cast<uintptr_t>(g.const_data_ptr());
  if ((ap | gp) & 15) return false;
  CUstream stream = c10::cuda::getCurrentCUDAStream(g.get_device()).stream();
  out = new_output(p.y_shape, g, pass == 1 && nhwc(g));  // dx lies as dy does; dW is KCRS
  uint64_t slot[kMaxArgs] = {0, 0, gp, 0, 0};
  slot[kPassIn[pass]] = ap;
  slot[kPassOut[pass]] = reinterpret_cast<uintptr_t>(out.data_ptr());
  launch_filtered(p, pass == 1 ? &a : nullptr, ap, slot, stream);
  return true;
}

std::optional<std::vector<int64_t>> concrete(c10::SymIntArrayRef s) {
  std::vector<int64_t> out;
  for (const c10::SymInt& v : s) {
    std::optional<int64_t> m = v.maybe_as_int();
    if (!m.has_value()) return std::nullopt;
    out.push_back(*m);
  }
  return out;
}

at::Tensor call_pass_python(int pass, c10::SymIntArrayRef size, const at::Tensor& a, const at::Tensor& g,
                            c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation,
                            int64_t groups, c10::string_view algo, std::optional<c10::string_view> precision,
                            std::optional<double> max_error) {
  pybind11::gil_scoped_acquire gil;
  PyObject* sizes = PyList_New(static_cast<Py_ssize_t>(size.size()));
  for (size_t i = 0; i < size.size(); ++i) {
    std::optional<int64_t> m = size[i].maybe_as_int();
    TORCH_CHECK(m.has_value(), "convforge: a symbolic size reached the CUDA kernel of a backward op");
    PyList_SET_ITEM(sizes, i, PyLong_FromLongLong(*m));
  }
  PyObject* args = PyTuple_New(10);
  PyTuple_SET_ITEM(args, pass == 1 ? 0 : 1, sizes);
  PyTuple_SET_ITEM(args, pass == 1 ? 1 : 0, THPVariable_Wrap(a));
  PyTuple_SET_ITEM(args, 2, THPVariable_Wrap(g));
  put_geometry(args, 3, stride, padding, dilation);
  PyTuple_SET_ITEM(args, 6, PyLong_FromLongLong(groups));
  put_choice(args, 7, algo, precision, max_error);
  return call_for_tensor(fallback_pass[pass], args, "the Python kernel of a backward op");
}

at::Tensor pass_cuda(int pass, c10::SymIntArrayRef size, const at::Tensor& a, const at::Tensor& g,
                     c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                     c10::string_view algo, std::optional<c10::string_view> precision,
                     std::optional<double> max_error) {
  std::optional<std::vector<int64_t>> dims = concrete(size);
  Key k;
  const at::Tensor ac = pass == 1 ? a.contiguous() : a;  // dgrad's filters KCRS (a channels_last model's: a copy)
  if (dims.has_value() &&
      pass_key(k, pass, *dims, ac, g, stride, padding, dilation, groups, algo, precision, max_error)) {
    if (std::shared_ptr<Program> p = find(k)) {
      at::Tensor out;
      if (run_pass(*p, pass, ac, g, out)) {
        pass_runs.fetch_add(1, std::memory_order_relaxed);
        return out;
      }
    }
  }
  op_fallbacks.fetch_add(1, std::memory_order_relaxed);
  return call_pass_python(pass, size, a, g, stride, padding, dilation, groups, algo, precision, max_error);
}

at::Tensor op_input_cuda(c10::SymIntArrayRef input_size, const at::Tensor& w, const at::Tensor& gy,
                         c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                         c10::string_view algo, std::optional<c10::string_view> precision,
                         std::optional<double> max_error) {
  return pass_cuda(1, input_size, w, gy, stride, padding, dilation, groups, algo, precision, max_error);
}

at::Tensor op_weight_cuda(const at::Tensor& x, c10::SymIntArrayRef weight_size, const at::Tensor& gy,
                          c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                          c10::string_view algo, std::optional<c10::string_view> precision,
                          std::optional<double> max_error) {
  return pass_cuda(2, weight_size, x, gy, stride, padding, dilation, groups, algo, precision, max_error);
}

std::vector<int64_t> ints_of(PyObject* o) {  // a Python sequence of ints (empty with an error set otherwise)
  std::vector<int64_t> out;
  PyObject* seq = PySequence_Fast(o, "expected a sequence of ints");
  if (!seq) return out;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); ++i)
    out.push_back(PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i)));
  Py_DECREF(seq);
  return out;
}

// The key of a backward call from register_pass's first 11 arguments (pass, size, a, g, stride,
// padding, dilation, groups, algo, precision, max_error): 1 filled, 0 not a call the fast path runs,
// -1 malformed (the Python error set; ``who`` names the caller).
int pass_args(PyObject* const* a, Key& k, const char* who) {
  if (!PyLong_Check(a[0]) || !THPVariable_CheckExact(a[2]) || !THPVariable_CheckExact(a[3])) {
    PyErr_Format(PyExc_TypeError, "%s takes pass, size, a, g, stride, padding, dilation, groups, algo, precision, "
                 "max_error first", who);
    return -1;
  }
  long pass = PyLong_AsLong(a[0]);
  std::vector<int64_t> size = ints_of(a[1]), stride = ints_of(a[4]), padding = ints_of(a[5]),
                       dilation = ints_of(a[6]);
  int64_t groups = PyLong_AsLongLong(a[7]);
  std::string algo, precision;
  if (PyErr_Occurred() || (pass != 1 && pass != 2) || !str_from_py(a[8], algo) ||
      (a[9] != Py_None && !str_from_py(a[9], precision)) || (a[10] != Py_None && !PyFloat_Check(a[10]))) {
    if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: malformed arguments (pass 1 dgrad or 2 wgrad)", who);
    return -1;
  }
  std::optional<c10::string_view> prec;
  if (a[9] != Py_None) prec = c10::string_view(precision);
  std::optional<double> max_error;
  if (a[10] != Py_None) max_error = PyFloat_AS_DOUBLE(a[10]);
  return pass_key(k, static_cast<int>(pass), size, THPVariable_Unpack(a[2]), THPVariable_Unpack(a[3]), stride,
                  padding, dilation, groups, algo, prec, max_error)
             ? 1
             : 0;
}

// register_pass(pass, size, a, g, stride, padding, dilation, groups, algo, precision, max_error,
// program, seed, out_shape): file a backward op's call that Python's kernel just ran (pass 1 dgrad:
// size = input_size, a = the weight; 2 wgrad: size = weight_size, a = the input) with its
// executable's program (CudaExecutable.native_program), seed = None or (w, version, packed) as
// register's (dgrad), out_shape the output's shape. Answers whether the call was filed.
PyObject* py_register_pass(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 14) {
    PyErr_SetString(PyExc_TypeError, "register_pass takes 14 arguments");
    return nullptr;
  }
  Key k;
  int got = pass_args(a, k, "register_pass");
  if (got < 0) return nullptr;
  if (got == 0) Py_RETURN_FALSE;
  std::vector<int64_t> out_shape = ints_of(a[13]);
  auto p = std::make_shared<Program>();
  if (PyErr_Occurred() || !read_program(a[11], *p)) return nullptr;
  p->y_shape = out_shape;  // the program's output is the pass's (the plan's y is its input here)
  if (k.pass == 1 && !seed_filters(*p, a[12])) return nullptr;
  table.put(k, std::move(p));
  Py_RETURN_TRUE;
}

// forget_pass(register_pass's first 11 arguments): drop a filed backward call (its check failed).
PyObject* py_forget_pass(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 11) {
    PyErr_SetString(PyExc_TypeError, "forget_pass takes register_pass's first 11 arguments");
    return nullptr;
  }
  Key k;
  int got = pass_args(a, k, "forget_pass");
  if (got < 0) return nullptr;
  if (got > 0) table.erase(k);
  Py_RETURN_NONE;
}

// ---- a conv -> batch norm [-> + residual] [-> ReLU] block in training: one C++ autograd node ----
// What FusedConv2d.unfused runs through ops._Conv2dFn and batchnorm._BnAct (two Python autograd
// nodes, the batch norm's launches through ctypes), as one node whose forward and backward never
// enter Python on a warm call: forward, the conv's filed program and the batch norm's three (or
// one) kernels; backward, the batch norm's backward kernels, then conv2d_input and conv2d_weight
// through the dispatcher (their CUDA kernels above: filed programs, or Python's on a miss). The same
// kernels on the same operands in the same order as the Python nodes: results bit-identical.
// Filed per batch-norm shape by Python (register_bn, torch/batchnorm.py); a call this path does not
// recognise answers None and Python's nodes run.
enum BnSlot { kY, kRes, kZ, kGamma, kBeta, kRmean, kRvar, kNbt, kSt, kPart, kGz, kGm, kDg, kCf, kDy, kBnSlots };
constexpr int64_t kNst = 5;  // kernels/batchnorm.py ST: the statistics buffer's rows, C values each

struct BnProg : ProgramBase {  // all: the forward launches, rest: the backward ones
  int64_t n = 0, c = 0, hw = 0, part = 0;  // shape (kernels/batchnorm.py BnTrain), scratch floats
  bool relu = false, residual = false, affine = false, track = false;
  at::ScalarType act = at::kFloat, param = at::kFloat;  // activations' and parameters' dtypes (BnTrain.dtype, pdtype)
  bool nhwc = false;  // channels_last activations
  at::MemoryFormat format() const { return nhwc ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous; }
};

std::mutex bn_mu;
std::vector<std::shared_ptr<BnProg>> bn_programs;  // a handle is an index; never shrinks (one per layer shape)

std::shared_ptr<BnProg> bn_at(int64_t handle) {
  std::lock_guard<std::mutex> lock(bn_mu);
  return handle >= 0 && handle < static_cast<int64_t>(bn_programs.size()) ? bn_programs[handle] : nullptr;
}

uintptr_t addr(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uintptr_t>(t.const_data_ptr()) : 0;
}

at::Tensor scratch(int64_t floats, const at::Tensor& like) {
  return at::detail::empty_cuda({floats}, at::kFloat, like.device(), std::nullopt);
}

// An activation-sized batch-norm tensor: y's sizes, the program's dtype and memory format.
at::Tensor bn_like(const BnProg& b, const at::Tensor& y) {
  return at::detail::empty_cuda(y.sizes(), b.act, y.device(), b.format());
}

void launch_bn(const BnProg& b, bool backward, const uint64_t* slot, CUstream stream) {
  CUresult bad = launch_all(b, backward ? b.rest : b.all, slot, stream);
  TORCH_CHECK(bad == 0, launch_error(b, bad));
}

struct BlockCall {  // what block() hands the node's forward (non-tensor arguments of apply)
  Program* conv = nullptr;
  std::shared_ptr<BnProg> bn;
  int64_t handle = 0;
  at::Tensor rmean, rvar, nbt;  // undefined when the module tracks no running statistics
  std::vector<int64_t> geometry;  // stride (2), padding (4), dilation (2), groups
  std::string algo;
  at::IValue precision, max_error;  // None or str / float
};

// Gradients computed outside autograd, as @once_differentiable hands them back under create_graph=True
// (what batchnorm._BnAct does): differentiating them again raises, naming the block, instead of a silent zero.
torch::autograd::variable_list once_differentiable(torch::autograd::variable_list grads) {
  at::AutoGradMode on(true);
  torch::autograd::variable_list leaves;
  for (const at::Tensor& t : grads) leaves.push_back(t.defined() ? t.detach().requires_grad_(true) : at::Tensor());
  auto err = std::make_shared<torch::autograd::DelayedError>(
      "convforge: trying to differentiate twice through a fused conv -> batch norm block (its backward is "
      "differentiable once, as torch/batchnorm.py's)", static_cast<int64_t>(leaves.size()));
  return err->apply(std::move(leaves));
}

struct BlockNode : public torch::autograd::Function<BlockNode> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const std::optional<at::Tensor>& res, const std::optional<at::Tensor>& gamma,
                            const std::optional<at::Tensor>& beta, BlockCall* call) {
    const BnProg& b = *call->bn;
    at::Tensor y;
    TORCH_CHECK(run_program(*call->conv, x, w, nullptr, y), "convforge: block operands not 16-byte aligned");
    TORCH_CHECK(y.scalar_type() == b.act && y.is_contiguous(b.format()),
                "convforge: a block's conv output is not in its batch norm's dtype and layout");
    at::Tensor z = bn_like(b, y);
    at::Tensor ws = scratch(kNst * b.c + b.part, y);
    uint64_t slot[kMaxArgs] = {};
    slot[kY] = addr(y);
    slot[kRes] = res.has_value() ? addr(*res) : 0;
    slot[kZ] = addr(z);
    slot[kGamma] = gamma.has_value() ? addr(*gamma) : 0;
    slot[kBeta] = beta.has_value() ? addr(*beta) : 0;
    slot[kRmean] = addr(call->rmean);
    slot[kRvar] = addr(call->rvar);
    slot[kNbt] = addr(call->nbt);
    slot[kSt] = addr(ws);
    slot[kPart] = slot[kSt] + 4 * kNst * b.c;
    launch_bn(b, false, slot, c10::cuda::getCurrentCUDAStream(y.get_device()).stream());
    if (b.track) {  // the running statistics changed: folds cached by version see it
      torch::autograd::impl::bump_version(call->rmean);
      torch::autograd::impl::bump_version(call->rvar);
      torch::autograd::impl::bump_version(call->nbt);
    }
    ctx->save_for_backward({x, w, y, b.relu && b.residual ? z : at::Tensor(), ws});
    ctx->saved_data["bn"] = call->handle;
    ctx->saved_data["geometry"] = call->geometry;
    ctx->saved_data["algo"] = call->algo;
    ctx->saved_data["precision"] = call->precision;
    ctx->saved_data["max_error"] = call->max_error;
    return z;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    bool create_graph = at::GradMode::is_enabled();  // backward(create_graph=True): see the end
    at::AutoGradMode no_graph(false);
    auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &y = saved[2], &z = saved[3], &st = saved[4];
    std::shared_ptr<BnProg> bp = bn_at(ctx->saved_data["bn"].toInt());
    TORCH_CHECK(bp, "convforge: a block's batch-norm program is gone");
    const BnProg& b = *bp;
    at::Tensor gz = grads[0];
    if (!gz.is_contiguous(b.format()) || addr(gz) % 16) gz = gz.clone(b.format());
    at::Tensor dy = bn_like(b, y);
    at::Tensor gm = b.relu && b.residual ? bn_like(b, y) : at::Tensor();
    at::Tensor ws = scratch(4 * b.c + b.part, y);
    // dgamma, dbeta: at the start of ws in float32, apart in the parameters' half dtype
    at::Tensor dg = b.param == at::kFloat ? ws : at::detail::empty_cuda({2 * b.c}, b.param, y.device(), std::nullopt);
    uint64_t slot[kMaxArgs] = {};
    slot[kGz] = addr(gz);
    slot[kY] = addr(y);
    slot[kZ] = addr(z);
    slot[kSt] = addr(st);
    slot[kGm] = addr(gm);
    slot[kDg] = addr(dg);
    slot[kCf] = addr(ws) + 8 * b.c;
    slot[kPart] = addr(ws) + 16 * b.c;
    slot[kDy] = addr(dy);
    launch_bn(b, true, slot, c10::cuda::getCurrentCUDAStream(y.get_device()).stream());
    std::vector<int64_t> g = ctx->saved_data["geometry"].toIntVector();
    c10::IntArrayRef stride(g.data(), 2), padding(g.data() + 2, 4), dilation(g.data() + 6, 2);
    SavedChoice ch(ctx);
    // gradients in the order of apply's arguments (x, w, res, gamma, beta, call); edges count only
    // the tensors given: x 0, w 1, then res, then gamma and beta
    torch::autograd::variable_list out(6);
    if (ctx->needs_input_grad(0))
      out[0] = input_op().call(x.sym_sizes(), w, dy, stride, padding, dilation, g[8], ch.algo, ch.precision,
                               ch.max_error);
    if (ctx->needs_input_grad(1))
      out[1] = weight_op().call(x, w.sym_sizes(), dy, stride, padding, dilation, g[8], ch.algo, ch.precision,
                                ch.max_error);
    size_t edge = 2;
    if (b.residual && ctx->needs_input_grad(edge++)) out[2] = b.relu ? gm : gz;
    if (b.affine) {
      if (ctx->needs_input_grad(edge)) out[3] = dg.slice(0, 0, b.c);
      if (ctx->needs_input_grad(edge + 1)) out[4] = dg.slice(0, b.c, 2 * b.c);
    }
    if (create_graph) return once_differentiable(std::move(out));
    return out;
  }
};

// A batch-norm parameter or buffer the block's kernels may read: None (absent: ``present`` false),
// or a contiguous CUDA tensor of ``n`` elements of ``dtype`` on ``device``. False: not that.
bool bn_tensor(PyObject* o, int64_t n, at::ScalarType dtype, int8_t device, bool present, at::Tensor& out) {
  if (o == Py_None) return !present;
  if (!present || !THPVariable_CheckExact(o)) return false;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (!t.is_cuda() || t.scalar_type() != dtype || !t.is_contiguous() || t.numel() != n || t.get_device() != device)
    return false;
  out = t;
  return true;
}

// A residual the block's kernels may read: y's sizes on x's device, the program's dtype and memory
// format, 16-byte aligned, a plain tensor (as plain() asks of conv operands).
bool bn_residual(const at::Tensor& r, const BnProg& b, const Program& p, int8_t device) {
  if (!r.defined() || r.dim() != 4 || !r.is_cuda() || r.scalar_type() != b.act || r.layout() != at::kStrided ||
      !r.is_contiguous(b.format()) || r.get_device() != device || r.sizes() != c10::IntArrayRef(p.y_shape) ||
      addr(r) % 16)
    return false;
  const c10::TensorImpl* impl = r.unsafeGetTensorImpl();
  constexpr c10::DispatchKeySet wrappers({c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchBatched,
                                          c10::DispatchKey::FuncTorchGradWrapper, c10::DispatchKey::Python});
  return impl->has_storage() && !impl->is_python_dispatch() && !r.is_neg() && !r.key_set().has_any(wrappers);
}

// Whether the conv program's output is what the batch-norm program reads: run_program writes y in
// x's dtype and memory format (a batch-norm program filed for another dtype or layout, by another
// call of the same module, is not this call's).
bool conv_output_fits(const BnProg& b, const at::Tensor& x) {
  return b.act == x.scalar_type() && b.nhwc == nhwc(x);
}

// block(conv2d's 14 arguments, res, gamma, beta, running_mean, running_var, num_batches_tracked,
// handle) -> z = [ReLU](batch_norm(conv2d(x, w)) [+ res]) through BlockNode, or None when the call
// is not one this path runs (no filed conv program, another shape, a bias, grad mode off...).
PyObject* py_block(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs + 7) {
    PyErr_SetString(PyExc_TypeError, "block takes conv2d's 14 arguments, res, gamma, beta, running_mean, "
                    "running_var, num_batches_tracked and a handle");
    return nullptr;
  }
  Key k;
  const at::Tensor *x = nullptr, *w = nullptr, *bias = nullptr;
  if (!at::GradMode::is_enabled() || !parse_call(a, k, x, w, bias) || bias || !PyLong_Check(a[kArgs + 6]))
    Py_RETURN_NONE;
  std::shared_ptr<Program> p = find(k);
  std::shared_ptr<BnProg> bp = bn_at(PyLong_AsLongLong(a[kArgs + 6]));
  if (PyErr_Occurred()) return nullptr;
  if (!p || !bp || p->y_shape.size() != 4 || p->y_shape[0] != bp->n || p->y_shape[1] != bp->c ||
      p->y_shape[2] * p->y_shape[3] != bp->hw || !conv_output_fits(*bp, *x))
    Py_RETURN_NONE;
  std::optional<at::Tensor> res, gamma, beta;
  if (a[kArgs] != Py_None) {
    if (!bp->residual || !THPVariable_CheckExact(a[kArgs])) Py_RETURN_NONE;
    const at::Tensor& r = THPVariable_Unpack(a[kArgs]);
    if (!bn_residual(r, *bp, *p, x->get_device())) Py_RETURN_NONE;
    res = r;
  } else if (bp->residual) {
    Py_RETURN_NONE;
  }
  BlockCall call;
  at::Tensor g, bt;
  int8_t dev = x->get_device();
  if (!bn_tensor(a[kArgs + 1], bp->c, bp->param, dev, bp->affine, g) ||
      !bn_tensor(a[kArgs + 2], bp->c, bp->param, dev, bp->affine, bt) ||
      !bn_tensor(a[kArgs + 3], bp->c, bp->param, dev, bp->track, call.rmean) ||
      !bn_tensor(a[kArgs + 4], bp->c, bp->param, dev, bp->track, call.rvar) ||
      !bn_tensor(a[kArgs + 5], 1, at::kLong, dev, bp->track, call.nbt))
    Py_RETURN_NONE;
  if (bp->affine) {
    gamma = g;
    beta = bt;
  }
  if ((addr(*x) | addr(*w)) % 16) Py_RETURN_NONE;
  call.conv = p.get();
  call.bn = bp;
  call.handle = PyLong_AsLongLong(a[kArgs + 6]);
  call.geometry.reserve(9);
  for (const Seq* s : {&k.stride, &k.padding, &k.dilation})
    for (int i = 0; i < s->n; ++i) call.geometry.push_back(s->v[i]);
  if (call.geometry.size() != 8) Py_RETURN_NONE;
  call.geometry.push_back(k.groups);
  call.algo = k.algo;
  if (k.has_precision) call.precision = k.precision;
  if (k.has_max_error) call.max_error = k.max_error;
  HANDLE_TH_ERRORS
  at::Tensor z = BlockNode::apply(*x, *w, res, gamma, beta, &call);
  block_runs.fetch_add(1, std::memory_order_relaxed);
  return THPVariable_Wrap(std::move(z));
  END_HANDLE_TH_ERRORS
}

// A dtype's name as kernels/batchnorm.py spells it ("float32", "float16", "bfloat16"); false: another.
bool bn_dtype(PyObject* o, at::ScalarType& out) {
  const char* name = PyUnicode_Check(o) ? PyUnicode_AsUTF8(o) : nullptr;
  if (!name) return false;
  std::string s(name);
  out = s == "float32" ? at::kFloat : s == "float16" ? at::kHalf : s == "bfloat16" ? at::kBFloat16 : at::kDouble;
  return out != at::kDouble;
}

// register_bn(program, n, c, hw, relu, residual, affine, track, part, dtype, pdtype, nhwc) -> a handle
// for block(): program as register's (read_program), its "all" launches the batch norm's forward,
// "rest" its backward, every argument a pointer slot of BnSlot (torch/batchnorm.py BN_SLOTS); dtype
// and pdtype the activations' and the parameters' (BnTrain's), nhwc true for channels_last.
PyObject* py_register_bn(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 12) {
    PyErr_SetString(PyExc_TypeError, "register_bn takes a program, n, c, hw, relu, residual, affine, track, part, "
                    "dtype, pdtype and nhwc");
    return nullptr;
  }
  auto b = std::make_shared<BnProg>();
  if (!read_program(a[0], *b)) return nullptr;
  b->n = PyLong_AsLongLong(a[1]);
  b->c = PyLong_AsLongLong(a[2]);
  b->hw = PyLong_AsLongLong(a[3]);
  b->relu = PyObject_IsTrue(a[4]) == 1;
  b->residual = PyObject_IsTrue(a[5]) == 1;
  b->affine = PyObject_IsTrue(a[6]) == 1;
  b->track = PyObject_IsTrue(a[7]) == 1;
  b->part = PyLong_AsLongLong(a[8]);
  if (PyErr_Occurred()) return nullptr;
  if (!bn_dtype(a[9], b->act) || !bn_dtype(a[10], b->param)) {
    PyErr_SetString(PyExc_ValueError, "register_bn: dtype and pdtype must be float32, float16 or bfloat16");
    return nullptr;
  }
  b->nhwc = PyObject_IsTrue(a[11]) == 1;
  for (const auto* runs : {&b->all, &b->rest})
    for (const LaunchRec& L : *runs)
      for (const auto& cs : L.slots)
        if (cs.second >= kBnSlots) {
          PyErr_SetString(PyExc_ValueError, "register_bn: a slot outside the batch norm's buffers");
          return nullptr;
        }
  std::lock_guard<std::mutex> lock(bn_mu);
  bn_programs.push_back(std::move(b));
  return PyLong_FromSsize_t(static_cast<Py_ssize_t>(bn_programs.size()) - 1);
}

// Two Python callables for kernels registered in C++ (kept for the process) and a new IMPL
// library for them; false with the Python error set when ``a`` is not two callables or ``lib``
// exists already (``who`` names the caller).
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

PyMethodDef methods[] = {
    {"set_native_autograd", py_set_native_autograd, METH_O,
     "set_native_autograd(on): the op's autograd node in C++ (True) or Python's ops._Conv2dFn (False)"},
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
    {"register_bn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register_bn)), METH_FASTCALL,
     "register_bn(program, n, c, hw, relu, residual, affine, track, part, dtype, pdtype, nhwc) -> a batch-norm "
     "program's handle"},
    {"clear", py_clear, METH_NOARGS, "forget every entry"},
    {"wrap", py_wrap, METH_O, "wrap(python_conv2d) -> conv2d whose warm torch calls stay in C"},
    {"parts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_parts)), METH_FASTCALL,
     "parts(conv2d's 14 arguments, piece, n) -> seconds of n repetitions of one piece of a warm call"},
    {"stats", py_stats, METH_NOARGS,
     "{entries, transforms, op_fallbacks, pass_runs, block_runs}: table size and counters"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "convforge_native", "convforge's native fast path (torch)", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit_convforge_native() {
  if (!init_core()) return nullptr;
  return PyModule_Create(&module_def);
}
