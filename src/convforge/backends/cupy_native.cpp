// convforge's native fast path for CuPy arrays (built at run time by convforge/backends/native.py;
// needs Python's headers and a C++ compiler, not torch or the CUDA toolkit).
//
// What it does: a warm convforge.conv2d call with CuPy arrays in C++: the call's key from the
// arrays' attributes (shape, dtype, contiguity, device) and the keyword arguments, a table lookup,
// the output from CuPy's memory pool on the current device, the plan's launches through
// cuLaunchKernel on CuPy's current stream. Every step of the plan runs, filter transforms
// included: a CuPy array has no version counter, so nothing says when its weights changed.
//
// CuPy's current device, current stream and array constructor come from its Cython C API (the
// ``__pyx_capi__`` capsules of cupy.cuda.device, cupy_backends.cuda.stream and cupy._core.core).
// ``setup`` checks each capsule's signature: native.py passes them only when all three match, and
// otherwise this path is not used (calls take Python's, correct and slower).
//
// Why it is safe: as the torch path (native_core.h): the table is filled only by Python's
// validating slow path (``register``), under a key parsed by the same function as the lookup; an
// array of another type (a subclass included), dtype or layout, another device than CuPy's current
// one, or an unaligned pointer answers "no entry" and Python's path runs.
#include "native_core.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace {

// ---- CuPy's C API, from setup() ----
using StreamPtrFn = intptr_t (*)();  // cupy_backends.cuda.stream.get_current_stream_ptr
using DeviceIdFn = int (*)(int);  // cupy.cuda.device.get_device_id (cpdef: skip_dispatch)
using NdarrayInitFn = PyObject* (*)(PyObject*, const std::vector<Py_ssize_t>&, PyObject*, PyObject*);

const char* const kStreamSig = "intptr_t (void)";
const char* const kDeviceSig = "int (int __pyx_skip_dispatch)";
const char* const kInitSig =
    "struct __pyx_obj_4cupy_5_core_4core__ndarray_base *(PyObject *, __pyx_t_4cupy_5_core_7_carray_shape_t const &, "
    "PyObject *, PyObject *)";

struct Cupy {
  PyObject* ndarray = nullptr;  // the exact type cupy.ndarray
  PyObject* float32 = nullptr;  // numpy.dtype('float32')
  StreamPtrFn stream_ptr = nullptr;
  DeviceIdFn device_id = nullptr;
  NdarrayInitFn ndarray_init = nullptr;
};
Cupy cupy;

PyObject *s_shape, *s_dtype, *s_c_contiguous, *s_data, *s_ptr, *s_device_id;

// An attribute as int64; false (error cleared) when missing or not an exact int.
bool int_attr(PyObject* o, PyObject* name, int64_t& out) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (!v) {
    PyErr_Clear();
    return false;
  }
  bool ok = int_from_py(v, out);
  Py_DECREF(v);
  return ok;
}

// ``o`` as the fast path runs it: exactly cupy.ndarray, float32, C-contiguous, of rank ``rank``;
// its shape into dims, its device and data pointer.
bool array_of(PyObject* o, Py_ssize_t rank, int64_t* dims, int64_t& device, uint64_t& ptr) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(o)) != cupy.ndarray) return false;
  PyObject* dtype = PyObject_GetAttr(o, s_dtype);
  PyObject* contiguous = PyObject_GetAttr(o, s_c_contiguous);
  bool ok = dtype == cupy.float32 && contiguous == Py_True;
  Py_XDECREF(dtype);
  Py_XDECREF(contiguous);
  PyObject* shape = ok ? PyObject_GetAttr(o, s_shape) : nullptr;
  ok = shape && PyTuple_CheckExact(shape) && PyTuple_GET_SIZE(shape) == rank;
  for (Py_ssize_t i = 0; ok && i < rank; ++i) ok = int_from_py(PyTuple_GET_ITEM(shape, i), dims[i]);
  Py_XDECREF(shape);
  PyObject* data = ok ? PyObject_GetAttr(o, s_data) : nullptr;
  int64_t p = 0;
  ok = data && int_attr(data, s_ptr, p) && int_attr(data, s_device_id, device);
  Py_XDECREF(data);
  if (PyErr_Occurred()) PyErr_Clear();
  ptr = static_cast<uint64_t>(p);
  return ok;
}

struct Call {
  uint64_t x = 0, w = 0, bias = 0;
};

// The arguments of convforge.conv2d, positionally (native_core.h); false: not a call this path runs.
bool parse_call(PyObject* const* a, Key& k, Call& c) {
  int64_t dx = -1, dw = -1, db = -1;
  if (!array_of(a[0], 4, k.xs, dx, c.x) || !array_of(a[1], 4, k.ws, dw, c.w) || dw != dx) return false;
  if (a[2] != Py_None && (!array_of(a[2], 1, &k.bias_k, db, c.bias) || db != dx)) return false;
  k.device = static_cast<int32_t>(dx);
  return parse_options(a, k);
}

struct Program : ProgramBase {
  std::vector<Py_ssize_t> shape;  // the output's, as CuPy's shape_t
};

Table<Program> table;
std::atomic<uint64_t> runs{0};

// A new C-contiguous float32 array of p's output shape from CuPy's pool on the current device,
// with its data pointer; nullptr with the Python error set when CuPy fails (out of memory).
PyObject* new_output(const Program& p, uint64_t& ptr) {
  PyObject* y = cupy.ndarray_init(cupy.ndarray, p.shape, cupy.float32, Py_None);
  if (!y) return nullptr;
  PyObject* data = PyObject_GetAttr(y, s_data);
  int64_t v = 0;
  if (!data || !int_attr(data, s_ptr, v)) {
    Py_XDECREF(data);
    Py_DECREF(y);
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "convforge: a new CuPy array has no data pointer");
    return nullptr;
  }
  Py_DECREF(data);
  ptr = static_cast<uint64_t>(v);
  return y;
}

PyObject* run_filed(PyObject* const* a) {
  Key k;
  Call c;
  if (!cupy.ndarray || !parse_call(a, k, c) || ((c.x | c.w | c.bias) & 15)) Py_RETURN_NONE;
  std::shared_ptr<Program> p = table.find(k);
  if (!p) Py_RETURN_NONE;
  int current = cupy.device_id(0);
  if (current == -1 && PyErr_Occurred()) return nullptr;
  if (current != k.device) Py_RETURN_NONE;  // Python's path allocates on the arrays' device
  intptr_t stream = cupy.stream_ptr();
  if (stream == -1 && PyErr_Occurred()) return nullptr;
  uint64_t yp = 0;
  PyObject* y = new_output(*p, yp);
  if (!y) return nullptr;
  uint64_t slot[kMaxArgs] = {c.x, c.w, yp, c.bias, 0};
  for (size_t j = 0; j < p->ws_derived.size(); ++j) slot[kFixedSlots + j] = p->ws_derived[j];
  CUresult bad = launch_all(*p, p->all, slot, reinterpret_cast<CUstream>(stream));
  if (bad) {
    Py_DECREF(y);
    PyErr_SetString(PyExc_RuntimeError, launch_error(*p, bad).c_str());
    return nullptr;
  }
  runs.fetch_add(1, std::memory_order_relaxed);
  return y;
}

// parts(conv2d's 14 arguments, piece, n) -> seconds that n repetitions of one piece of a filed
// call take, timed in C (scripts/host_cost.py --parts): "call" (the whole run and the output's
// release), "parse" (the arrays' attributes and the options into the key), "find" (parse and
// lookup), "device" (CuPy's current device), "stream" (its current stream), "alloc" (the output
// from CuPy's pool, released), "launch" (the plan's launches on prepared pointers).
PyObject* py_parts(PyObject*, PyObject* const* a, Py_ssize_t n) {
  Key k;
  Call c;
  if (n != kArgs + 2 || !PyUnicode_Check(a[kArgs]) || !PyLong_Check(a[kArgs + 1]) || !cupy.ndarray ||
      !parse_call(a, k, c)) {
    PyErr_SetString(PyExc_TypeError, "parts takes a filed call's 14 arguments, a piece's name and a count");
    return nullptr;
  }
  std::shared_ptr<Program> p = table.find(k);
  const char* name = PyUnicode_AsUTF8(a[kArgs]);
  long reps = PyLong_AsLong(a[kArgs + 1]);
  if (!p || !name || PyErr_Occurred()) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "parts: this call is not filed (make it once first)");
    return nullptr;
  }
  static const char* const pieces[] = {"call", "parse", "find", "device", "stream", "alloc", "launch"};
  int which = -1;
  for (int i = 0; i < 7; ++i)
    if (std::string(name) == pieces[i]) which = i;
  if (which < 0) {
    PyErr_Format(PyExc_ValueError, "parts: no piece %s", name);
    return nullptr;
  }
  uint64_t yp = 0;
  PyObject* y = new_output(*p, yp);
  if (!y) return nullptr;
  uint64_t slot[kMaxArgs] = {c.x, c.w, yp, c.bias, 0};
  for (size_t j = 0; j < p->ws_derived.size(); ++j) slot[kFixedSlots + j] = p->ws_derived[j];
  auto stream = reinterpret_cast<CUstream>(cupy.stream_ptr());
  volatile uintptr_t sink = 0;
  bool failed = false;
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < reps && !failed; ++i) {
    Key kk;
    Call cc;
    switch (which) {
      case 0: {
        PyObject* r = run_filed(a);
        failed = !r;
        Py_XDECREF(r);
        break;
      }
      case 1:
      case 2:
        sink = parse_call(a, kk, cc);
        if (which == 2) sink = reinterpret_cast<uintptr_t>(table.find(kk).get());
        break;
      case 3:
        sink = static_cast<uintptr_t>(cupy.device_id(0));
        break;
      case 4:
        sink = static_cast<uintptr_t>(cupy.stream_ptr());
        break;
      case 5: {
        uint64_t q = 0;
        PyObject* z = new_output(*p, q);
        failed = !z;
        Py_XDECREF(z);
        break;
      }
      default:
        failed = launch_all(*p, p->all, slot, stream) != 0;
    }
  }
  std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
  (void)sink;
  Py_DECREF(y);
  if (failed) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "parts: a launch failed");
    return nullptr;
  }
  return PyFloat_FromDouble(took.count());
}

PyObject* py_run(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs) {
    PyErr_SetString(PyExc_TypeError, "run takes conv2d's 14 arguments");
    return nullptr;
  }
  return run_filed(a);
}

// register(14 conv2d arguments..., program): files a call Python's path validated and ran.
PyObject* py_register(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != kArgs + 1) {
    PyErr_SetString(PyExc_TypeError, "register takes conv2d's 14 arguments and a program");
    return nullptr;
  }
  Key k;
  Call c;
  if (!cupy.ndarray || !parse_call(a, k, c)) Py_RETURN_FALSE;
  auto p = std::make_shared<Program>();
  if (!read_program(a[kArgs], *p)) return nullptr;
  for (int64_t d : p->y_shape) p->shape.push_back(static_cast<Py_ssize_t>(d));
  table.put(k, std::move(p));
  Py_RETURN_TRUE;
}

template <class F>
bool capsule(PyObject* o, const char* sig, F& out) {
  if (!PyCapsule_IsValid(o, sig)) {
    PyErr_Format(PyExc_ValueError, "a CuPy C API capsule does not have the signature %s", sig);
    return false;
  }
  out = reinterpret_cast<F>(PyCapsule_GetPointer(o, sig));
  return out != nullptr;
}

// setup(ndarray, float32, get_current_stream_ptr, get_device_id, _ndarray_init): CuPy's type,
// dtype and C API capsules (their signatures are checked here).
PyObject* py_setup(PyObject*, PyObject* const* a, Py_ssize_t n) {
  if (n != 5 || !PyType_Check(a[0])) {
    PyErr_SetString(PyExc_TypeError, "setup takes cupy.ndarray, float32 and three capsules");
    return nullptr;
  }
  Cupy c;
  if (!capsule(a[2], kStreamSig, c.stream_ptr) || !capsule(a[3], kDeviceSig, c.device_id) ||
      !capsule(a[4], kInitSig, c.ndarray_init))
    return nullptr;
  Py_INCREF(a[0]);
  Py_INCREF(a[1]);
  c.ndarray = a[0];
  c.float32 = a[1];
  cupy = c;
  Py_RETURN_NONE;
}

PyObject* py_clear(PyObject*, PyObject*) {
  table.clear();
  Py_RETURN_NONE;
}

PyObject* py_stats(PyObject*, PyObject*) {
  return Py_BuildValue("{s:n,s:K}", "entries", static_cast<Py_ssize_t>(table.size()), "runs",
                       static_cast<unsigned long long>(runs.load()));
}

PyObject* py_signatures(PyObject*, PyObject*) {
  return Py_BuildValue("(sss)", kStreamSig, kDeviceSig, kInitSig);
}

PyMethodDef methods[] = {
    {"setup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_setup)), METH_FASTCALL,
     "setup(cupy.ndarray, float32, stream capsule, device capsule, ndarray-init capsule)"},
    {"signatures", py_signatures, METH_NOARGS, "the C API signatures setup() accepts (stream, device, init)"},
    {"run", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_run)), METH_FASTCALL,
     "run(conv2d's 14 arguments) -> the output array, or None when the call has no entry"},
    {"register", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_register)), METH_FASTCALL,
     "register(conv2d's 14 arguments, program) -> whether the call was filed"},
    {"clear", py_clear, METH_NOARGS, "forget every entry"},
    {"wrap", py_wrap, METH_O, "wrap(impl) -> conv2d whose warm CuPy calls stay in C; others go to impl"},
    {"stats", py_stats, METH_NOARGS, "{entries, runs}: table size and calls run here"},
    {"parts", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(py_parts)), METH_FASTCALL,
     "parts(conv2d's 14 arguments, piece, n) -> seconds of n repetitions of one piece of a warm call"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "convforge_cupy_native", "convforge's native fast path (CuPy)", -1,
                          methods};

}  // namespace

PyMODINIT_FUNC PyInit_convforge_cupy_native() {
  if (!init_core()) return nullptr;
  s_shape = PyUnicode_InternFromString("shape");
  s_dtype = PyUnicode_InternFromString("dtype");
  s_c_contiguous = PyUnicode_InternFromString("_c_contiguous");
  s_data = PyUnicode_InternFromString("data");
  s_ptr = PyUnicode_InternFromString("ptr");
  s_device_id = PyUnicode_InternFromString("device_id");
  return PyModule_Create(&module_def);
}
