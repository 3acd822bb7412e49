// The part of convforge's native fast paths that knows no array library: included by
// convforge/torch/native.cpp (torch tensors) and convforge/backends/cupy_native.cpp (CuPy arrays).
//
// What is here: the CUDA driver entry points (resolved from libcuda at load, no toolkit link); the
// call key (shapes, device and conv2d's keyword arguments, in the form the caller gave them) and
// the parse of conv2d's arguments 3..13 into it; a program (an executable's launches with their
// argument layouts, as CudaExecutable.native_program describes them) and its launch; the table of
// filed programs; and ``wrap``, conv2d as a C callable whose warm calls never enter Python.
//
// A translation unit that includes this file defines ``PyObject* run_filed(PyObject* const* a)``:
// the output of a filed call of conv2d's 14 arguments (a new reference), None when the call has no
// entry, nullptr with the Python error set when a launch failed.
#pragma once

#include <Python.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

// ---- the driver entry points ----
using CUresult = int;
using CUfunction = void*;
using CUstream = void*;
using CUcontext = void*;
using LaunchFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void**, void**);
using CtxGetFn = CUresult (*)(CUcontext*);
using CtxPushFn = CUresult (*)(CUcontext);
using CtxPopFn = CUresult (*)(CUcontext*);
using CapturingFn = CUresult (*)(CUstream, int*);
using ErrNameFn = CUresult (*)(CUresult, const char**);
// cuTensorMapEncodeTiled / cuTensorMapEncodeIm2col (CUDA 12): enums as int, cuuint32/64 as uint32/64
using EncodeTiledFn = CUresult (*)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const uint32_t*,
                                   const uint32_t*, int, int, int, int);
using EncodeIm2colFn = CUresult (*)(void*, int, uint32_t, void*, const uint64_t*, const uint64_t*, const int*,
                                    const int*, uint32_t, uint32_t, const uint32_t*, int, int, int, int);

struct Driver {
  LaunchFn launch = nullptr;
  CtxGetFn ctx_get = nullptr;
  CtxPushFn ctx_push = nullptr;
  CtxPopFn ctx_pop = nullptr;
  CapturingFn is_capturing = nullptr;
  ErrNameFn err_name = nullptr;
  EncodeTiledFn encode_tiled = nullptr;  // absent before CUDA 12: programs with tensor maps are refused
  EncodeIm2colFn encode_im2col = nullptr;
};
Driver drv;

bool load_driver(std::string& why) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    why = "libcuda.so.1 not found";
    return false;
  }
  drv.launch = reinterpret_cast<LaunchFn>(dlsym(lib, "cuLaunchKernel"));
  drv.ctx_get = reinterpret_cast<CtxGetFn>(dlsym(lib, "cuCtxGetCurrent"));
  drv.ctx_push = reinterpret_cast<CtxPushFn>(dlsym(lib, "cuCtxPushCurrent_v2"));
  drv.ctx_pop = reinterpret_cast<CtxPopFn>(dlsym(lib, "cuCtxPopCurrent_v2"));
  drv.is_capturing = reinterpret_cast<CapturingFn>(dlsym(lib, "cuStreamIsCapturing"));
  drv.err_name = reinterpret_cast<ErrNameFn>(dlsym(lib, "cuGetErrorName"));
  drv.encode_tiled = reinterpret_cast<EncodeTiledFn>(dlsym(lib, "cuTensorMapEncodeTiled"));
  drv.encode_im2col = reinterpret_cast<EncodeIm2colFn>(dlsym(lib, "cuTensorMapEncodeIm2col"));
  if (!drv.launch || !drv.ctx_get || !drv.ctx_push || !drv.ctx_pop || !drv.is_capturing || !drv.err_name) {
    why = "libcuda lacks an entry point the fast path needs";
    return false;
  }
  return true;
}

[[maybe_unused]] bool capturing(CUstream stream) {
  int status = 0;
  return drv.is_capturing(stream, &status) != 0 || status != 0;  // an error asking counts as capturing
}

// ---- the key: what the slow path validated, in the form the caller gave it ----
// A sequence argument keeps its form (tag: 1 int, 2 tuple, 3 list; n values) so two spellings
// map to one entry only when Python reads them the same way.
struct Seq {
  int8_t tag = 0, n = 0;
  int64_t v[4] = {0, 0, 0, 0};
  bool operator==(const Seq& o) const {
    return tag == o.tag && n == o.n && std::memcmp(v, o.v, sizeof v) == 0;
  }
};

struct Key {
  int64_t xs[4], ws[4];
  int64_t bias_k = -1;  // -1: no bias
  int64_t workspace_limit = -1;  // -1: None
  int64_t groups = 1;  // part of the key: a default-groups call of grouped shapes is Python's to refuse
  int32_t device = 0;
  Seq stride, padding, dilation;
  bool relu = false, has_precision = false, has_max_error = false;
  bool residual = false;  // a plan that adds a residual tensor (FusedConv2d's run_res); relu then follows the add
  int8_t pass = 0;  // 0 the forward (conv2d), 1 dgrad (conv2d_input), 2 wgrad (conv2d_weight)
  int64_t size[4] = {0, 0, 0, 0};  // a backward op's input_size / weight_size (its output's shape)
  int8_t dtype = 0;  // the activations' storage: 0 float32, 1 float16, 2 bfloat16 (torch path; CuPy: 0)
  int8_t nhwc = 0;  // 1: channels_last activations (NHWC plans; outputs allocated channels_last)
  double max_error = 0.0;
  std::string algo, precision;
  bool operator==(const Key& o) const {
    return std::memcmp(xs, o.xs, sizeof xs) == 0 && std::memcmp(ws, o.ws, sizeof ws) == 0 && bias_k == o.bias_k &&
           workspace_limit == o.workspace_limit && groups == o.groups && device == o.device && stride == o.stride &&
           padding == o.padding && dilation == o.dilation && relu == o.relu && residual == o.residual &&
           has_precision == o.has_precision &&
           has_max_error == o.has_max_error && max_error == o.max_error && algo == o.algo && precision == o.precision &&
           pass == o.pass && std::memcmp(size, o.size, sizeof size) == 0 && dtype == o.dtype && nhwc == o.nhwc;
  }
};

inline void mix(size_t& h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
}

struct KeyHash {
  size_t operator()(const Key& k) const {
    size_t h = 0;
    for (int i = 0; i < 4; ++i) {
      mix(h, static_cast<uint64_t>(k.xs[i]));
      mix(h, static_cast<uint64_t>(k.ws[i]));
    }
    mix(h, static_cast<uint64_t>(k.bias_k));
    mix(h, static_cast<uint64_t>(k.device) << 3 | static_cast<uint64_t>(k.pass) << 1 | static_cast<uint64_t>(k.residual));
    mix(h, static_cast<uint64_t>(k.dtype) << 1 | static_cast<uint64_t>(k.nhwc));
    for (int64_t v : k.size) mix(h, static_cast<uint64_t>(v));
    for (const Seq* s : {&k.stride, &k.padding, &k.dilation}) {
      mix(h, static_cast<uint64_t>(s->tag * 8 + s->n));
      for (int i = 0; i < s->n; ++i) mix(h, static_cast<uint64_t>(s->v[i]));
    }
    mix(h, std::hash<std::string>()(k.algo));
    return h;
  }
};

// A Python int as int64 (exact int type only); false, with no error set, otherwise.
bool int_from_py(PyObject* o, int64_t& out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  out = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow || (out == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  return true;
}

bool seq_from_py(PyObject* o, Seq& s) {
  if (PyLong_CheckExact(o)) {
    s.tag = 1;
    s.n = 1;
    return int_from_py(o, s.v[0]);
  }
  bool tuple = PyTuple_CheckExact(o);
  if (!tuple && !PyList_CheckExact(o)) return false;
  Py_ssize_t n = tuple ? PyTuple_GET_SIZE(o) : PyList_GET_SIZE(o);
  if (n < 1 || n > 4) return false;
  s.tag = tuple ? 2 : 3;
  s.n = static_cast<int8_t>(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!int_from_py(tuple ? PyTuple_GET_ITEM(o, i) : PyList_GET_ITEM(o, i), s.v[i])) return false;
  }
  return true;
}

bool str_from_py(PyObject* o, std::string& out) {
  if (!PyUnicode_CheckExact(o)) return false;
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(o, &n);
  if (!p) {
    PyErr_Clear();
    return false;
  }
  out.assign(p, static_cast<size_t>(n));
  return true;
}

// conv2d's arguments 3..13 (stride, padding, dilation, algo, backend, workspace_limit, relu,
// params, precision, max_error, groups) into k. False: not a call a fast path runs (Python's path does).
bool parse_options(PyObject* const* a, Key& k) {
  if (!seq_from_py(a[3], k.stride) || !seq_from_py(a[4], k.padding) || !seq_from_py(a[5], k.dilation)) return false;
  if (!str_from_py(a[6], k.algo)) return false;
  if (a[7] != Py_None) {  // backend: None or "cuda"
    std::string be;
    if (!str_from_py(a[7], be) || be != "cuda") return false;
  }
  if (a[8] != Py_None && (!int_from_py(a[8], k.workspace_limit) || k.workspace_limit < 0)) return false;
  if (a[9] != Py_True && a[9] != Py_False) return false;
  k.relu = a[9] == Py_True;
  if (a[10] != Py_None) return false;  // explicit params: Python's path
  if (a[11] != Py_None) {
    if (!str_from_py(a[11], k.precision)) return false;
    k.has_precision = true;
  }
  if (a[12] != Py_None) {
    if (PyFloat_CheckExact(a[12])) {
      k.max_error = PyFloat_AS_DOUBLE(a[12]);
    } else if (PyLong_CheckExact(a[12])) {
      k.max_error = PyLong_AsDouble(a[12]);
      if (k.max_error == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return false;
      }
    } else {
      return false;
    }
    k.has_max_error = true;
  }
  return int_from_py(a[13], k.groups);  // an exact int (its value was validated when the call was filed)
}

// ---- a program: an executable's launches with their argument layouts ----
constexpr int kMaxArgs = 64;  // kernel arguments of one launch (cuda.py NATIVE_MAX_ARGS)
constexpr int kFixedSlots = 5;  // x, w, y, bias, res; then one per filter-derived buffer

constexpr int kMaxMaps = 32;  // tensor-map arguments of one launch (cuda.py NATIVE_MAX_MAPS)

// A TMA tensor map argument (codegen/dialect.py TensorMap, CudaExecutable.native_program kind 3):
// the driver's encode arguments but the address, which comes from a pointer slot (or is fixed: a
// workspace buffer); the 128-byte map is encoded again only when that address moves, as the
// Python fast path does (backends/cuda.py _refresh_maps).
struct MapRec {
  int cell = 0;  // the kernel argument it is
  int slot = -1;  // pointer slot of its buffer, or -1: ``fixed``
  uint64_t fixed = 0;
  bool im2col = false;
  int dtype = 0;  // CUtensorMapDataType
  uint32_t rank = 0;
  uint64_t dims[5] = {0, 0, 0, 0, 0}, strides[4] = {0, 0, 0, 0};
  uint32_t box[5] = {0, 0, 0, 0, 0}, elem[5] = {0, 0, 0, 0, 0};
  int lower[3] = {0, 0, 0}, upper[3] = {0, 0, 0};
  int swizzle = 3;  // CUtensorMapSwizzle (3: 128 bytes, 2: 64, 1: 32)
  std::mutex mu;  // guards the two below (calls from several threads)
  uint64_t last = 0;  // the address ``encoded`` is for (0: none yet)
  unsigned char encoded[128] = {};
};

// The 128-byte map of m over ``address`` into out (64-byte aligned, as the driver wants it); the
// driver's error, 0 if none.
CUresult encode_map(MapRec& m, uint64_t address, unsigned char* out) {
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.last == address && address != 0) {
    std::memcpy(out, m.encoded, 128);
    return 0;
  }
  constexpr int kInterleaveNone = 0, kL2Promote128 = 2, kOobZero = 0;
  void* at = reinterpret_cast<void*>(address);
  CUresult r = m.im2col ? drv.encode_im2col(out, m.dtype, m.rank, at, m.dims, m.strides, m.lower, m.upper, m.box[0],
                                            m.box[1], m.elem, kInterleaveNone, m.swizzle, kL2Promote128, kOobZero)
                        : drv.encode_tiled(out, m.dtype, m.rank, at, m.dims, m.strides, m.box, m.elem,
                                           kInterleaveNone, m.swizzle, kL2Promote128, kOobZero);
  m.last = r ? 0 : address;
  if (!r) std::memcpy(m.encoded, out, 128);
  return r;
}

struct LaunchRec {
  CUfunction fn = nullptr;
  unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1}, smem = 0;
  std::vector<uint64_t> cells;  // fixed values: scalars (low 4 bytes), workspace pointers
  std::vector<std::pair<int, int>> slots;  // (cell, slot): pointers set per call
  std::vector<std::shared_ptr<MapRec>> maps;  // tensor-map arguments (their cells hold nothing)
};

struct ProgramBase {
  std::vector<LaunchRec> all, rest, weights;
  std::vector<int64_t> y_shape;
  std::vector<uint64_t> ws_derived;  // the executable's own filter-derived buffers ("all" steps)
  std::vector<int64_t> offsets;  // byte offsets of the derived buffers in a packed buffer
  int64_t derived_floats = 0;
  CUcontext ctx = nullptr;
  std::string name;
  PyObject* keep = nullptr;  // the Python executable: owns the workspace and the loaded module

  ProgramBase() = default;
  ProgramBase(const ProgramBase&) = delete;
  ProgramBase& operator=(const ProgramBase&) = delete;
  ~ProgramBase() {
    if (keep && Py_IsInitialized()) {
      PyGILState_STATE st = PyGILState_Ensure();
      Py_DECREF(keep);
      PyGILState_Release(st);
    }
  }
};

// Launch ``runs`` of p on the slot values (x, w, y, bias, res, derived...) on ``stream``, in p's
// context; answers the first failure (0: all launched).
CUresult launch_all(const ProgramBase& p, const std::vector<LaunchRec>& runs, const uint64_t* slot, CUstream stream) {
  CUcontext cur = nullptr;
  drv.ctx_get(&cur);
  bool pushed = p.ctx && cur != p.ctx;
  if (pushed) drv.ctx_push(p.ctx);
  CUresult bad = 0;
  for (const LaunchRec& L : runs) {
    uint64_t cells[kMaxArgs];
    void* params[kMaxArgs];
    alignas(64) unsigned char maps[kMaxMaps][128];  // the driver copies parameters at the launch
    size_t n = L.cells.size();
    std::memcpy(cells, L.cells.data(), n * sizeof(uint64_t));
    for (const auto& [cell, s] : L.slots) cells[cell] = slot[s];
    for (size_t i = 0; i < n; ++i) params[i] = &cells[i];
    for (size_t i = 0; i < L.maps.size() && !bad; ++i) {
      MapRec& m = *L.maps[i];
      bad = encode_map(m, m.slot >= 0 ? slot[m.slot] : m.fixed, maps[i]);
      params[m.cell] = maps[i];
    }
    if (bad) break;
    bad = drv.launch(L.fn, L.grid[0], L.grid[1], L.grid[2], L.block[0], L.block[1], L.block[2], L.smem, stream,
                     params, nullptr);
    if (bad) break;
  }
  if (pushed) {
    CUcontext popped = nullptr;
    drv.ctx_pop(&popped);
  }
  return bad;
}

std::string launch_error(const ProgramBase& p, CUresult r) {
  const char* name = nullptr;
  drv.err_name(r, &name);
  return "cuLaunchKernel (or cuTensorMapEncode of its tensor maps) failed for " + p.name + ": " +
         (name ? name : "unknown error") + " (" + std::to_string(r) + ")";
}

// A Python tuple of at most ``cap`` ints into out; its length in n. False: not that.
template <class T>
bool small_ints(PyObject* t, T* out, size_t cap, size_t& n) {
  if (!PyTuple_Check(t) || static_cast<size_t>(PyTuple_GET_SIZE(t)) > cap) return false;
  n = static_cast<size_t>(PyTuple_GET_SIZE(t));
  for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(PyLong_AsLongLong(PyTuple_GET_ITEM(t, i)));
  return !PyErr_Occurred();
}

// A tensor map's description, (slot, fixed, im2col, dtype, dims, strides, box, elem, lower,
// upper, swizzle) (CudaExecutable.native_program), into m; false when malformed or the driver cannot encode.
bool read_map(PyObject* v, MapRec& m) {
  if (!drv.encode_tiled || !drv.encode_im2col || !PyTuple_Check(v) || PyTuple_GET_SIZE(v) != 11) return false;
  m.slot = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(v, 0)));
  m.fixed = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(v, 1));
  m.im2col = PyObject_IsTrue(PyTuple_GET_ITEM(v, 2)) == 1;
  m.dtype = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(v, 3)));
  size_t rank = 0, ns = 0, nb = 0, ne = 0, nl = 0, nu = 0;
  bool ok = small_ints(PyTuple_GET_ITEM(v, 4), m.dims, 5, rank) && small_ints(PyTuple_GET_ITEM(v, 5), m.strides, 4, ns) &&
            small_ints(PyTuple_GET_ITEM(v, 6), m.box, 5, nb) && small_ints(PyTuple_GET_ITEM(v, 7), m.elem, 5, ne) &&
            small_ints(PyTuple_GET_ITEM(v, 8), m.lower, 3, nl) && small_ints(PyTuple_GET_ITEM(v, 9), m.upper, 3, nu);
  m.rank = static_cast<uint32_t>(rank);
  m.swizzle = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(v, 10)));
  if (!ok || PyErr_Occurred() || m.slot >= kMaxArgs || rank < 1 || ns + 1 != rank || ne != rank) return false;
  if (m.swizzle < 1 || m.swizzle > 3) return false;
  return m.im2col ? nb == 2 && nl == rank - 2 && nu == rank - 2 : nb == rank;
}

bool read_launches(PyObject* list, std::vector<LaunchRec>& out) {
  // each: (fn, gx, gy, gz, bx, by, bz, smem, args); args: ((kind, value), ...), kind 0 slot,
  // 1 fixed 64-bit value, 2 fixed 32-bit value, 3 a tensor map (read_map)
  if (!PyList_Check(list)) return false;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); ++i) {
    PyObject* t = PyList_GET_ITEM(list, i);
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 9) return false;
    LaunchRec L;
    L.fn = reinterpret_cast<CUfunction>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, 0)));
    for (int d = 0; d < 3; ++d) {
      L.grid[d] = static_cast<unsigned>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 1 + d)));
      L.block[d] = static_cast<unsigned>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 4 + d)));
    }
    L.smem = static_cast<unsigned>(PyLong_AsUnsignedLong(PyTuple_GET_ITEM(t, 7)));
    PyObject* args = PyTuple_GET_ITEM(t, 8);
    if (!PyTuple_Check(args) || PyTuple_GET_SIZE(args) > kMaxArgs) return false;
    for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(args); ++j) {
      PyObject* pair = PyTuple_GET_ITEM(args, j);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) return false;
      long kind = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
      if (kind == 3) {
        auto m = std::make_shared<MapRec>();
        m->cell = static_cast<int>(j);
        if (L.maps.size() >= kMaxMaps || !read_map(PyTuple_GET_ITEM(pair, 1), *m)) return false;
        L.maps.push_back(std::move(m));
        L.cells.push_back(0);
        continue;
      }
      unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(pair, 1));
      if (kind == 0) {
        if (v >= kMaxArgs) return false;
        L.slots.emplace_back(static_cast<int>(j), static_cast<int>(v));
        L.cells.push_back(0);
      } else if (kind == 1 || kind == 2) {
        L.cells.push_back(kind == 2 ? (v & 0xffffffffULL) : v);
      } else {
        return false;
      }
    }
    if (PyErr_Occurred()) return false;
    out.push_back(std::move(L));
  }
  return true;
}

bool read_ints(PyObject* seq, std::vector<int64_t>& out) {
  if (!PyTuple_Check(seq)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i) out.push_back(PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i)));
  return !PyErr_Occurred();
}

// program = (all, rest, weights, y_shape, ws_derived, offsets, derived_floats, context, name,
// executable) into p (CudaExecutable.native_program); false with a Python error set when malformed.
bool read_program(PyObject* prog, ProgramBase& p) {
  if (!PyTuple_Check(prog) || PyTuple_GET_SIZE(prog) != 10) {
    PyErr_SetString(PyExc_TypeError, "program must be a 10-tuple (CudaExecutable.native_program)");
    return false;
  }
  std::vector<int64_t> ws;
  bool ok = read_launches(PyTuple_GET_ITEM(prog, 0), p.all) && read_launches(PyTuple_GET_ITEM(prog, 1), p.rest) &&
            read_launches(PyTuple_GET_ITEM(prog, 2), p.weights) && read_ints(PyTuple_GET_ITEM(prog, 3), p.y_shape) &&
            read_ints(PyTuple_GET_ITEM(prog, 4), ws) && read_ints(PyTuple_GET_ITEM(prog, 5), p.offsets);
  p.derived_floats = PyLong_AsLongLong(PyTuple_GET_ITEM(prog, 6));
  p.ctx = reinterpret_cast<CUcontext>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(prog, 7)));
  if (!ok || PyErr_Occurred() || !str_from_py(PyTuple_GET_ITEM(prog, 8), p.name) || ws.size() != p.offsets.size() ||
      kFixedSlots + p.offsets.size() > kMaxArgs) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "malformed native program");
    return false;
  }
  for (int64_t v : ws) p.ws_derived.push_back(static_cast<uint64_t>(v));
  p.keep = PyTuple_GET_ITEM(prog, 9);
  Py_INCREF(p.keep);
  return true;
}

// ---- the table of filed programs ----
template <class P>
struct Table {
  std::mutex mu;
  std::unordered_map<Key, std::shared_ptr<P>, KeyHash> map;

  std::shared_ptr<P> find(const Key& k) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = map.find(k);
    return it == map.end() ? nullptr : it->second;
  }
  void put(const Key& k, std::shared_ptr<P> p) {
    std::lock_guard<std::mutex> lock(mu);
    map[k] = std::move(p);
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return map.size();
  }
  void erase(const Key& k) {  // with the GIL held (the program may release its executable)
    std::shared_ptr<P> gone;
    {
      std::lock_guard<std::mutex> lock(mu);
      auto it = map.find(k);
      if (it == map.end()) return;
      gone = std::move(it->second);
      map.erase(it);
    }
  }
  void clear() {  // with the GIL held: programs release their executables here
    std::unordered_map<Key, std::shared_ptr<P>, KeyHash> gone;
    {
      std::lock_guard<std::mutex> lock(mu);
      gone.swap(map);
    }
  }
};

// ---- conv2d itself as a C callable: wrap(impl) ----
// Takes conv2d's arguments as Python passes them (positions and keywords), runs a filed call, and
// hands any other call, unchanged, to the callable it wraps (Python's conv2d, which validates and
// files, or another fast path's wrapper).
PyObject* run_filed(PyObject* const* a);

constexpr int kArgs = 14;
const char* const kNames[kArgs] = {"x",    "w",       "bias",   "stride",          "padding",
                                   "dilation", "algo", "backend", "workspace_limit", "relu",
                                   "params",   "precision", "max_error", "groups"};
PyObject* name_objs[kArgs];
PyObject* defaults[kArgs];

struct FastConv {
  PyObject_HEAD vectorcallfunc vectorcall;
  PyObject* impl;
  PyObject* dict;
};

bool gather(PyObject* const* args, size_t nargsf, PyObject* kwnames, PyObject** a) {
  Py_ssize_t np = PyVectorcall_NARGS(nargsf);
  if (np < 2 || np > kArgs) return false;
  for (int i = 0; i < kArgs; ++i) a[i] = i < np ? args[i] : defaults[i];
  Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t j = 0; j < nk; ++j) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, j);
    int at = -1;
    for (int i = static_cast<int>(np); i < kArgs && at < 0; ++i) {
      if (name == name_objs[i] || PyUnicode_Compare(name, name_objs[i]) == 0) at = i;
    }
    if (at < 0) return false;  // unknown or repeated: Python's function says so
    a[at] = args[np + j];
  }
  return true;
}

PyObject* fast_call(PyObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  auto* f = reinterpret_cast<FastConv*>(self);
  PyObject* a[kArgs];
  if (gather(args, nargsf, kwnames, a)) {
    PyObject* y = run_filed(a);
    if (y != Py_None) return y;  // the output, or nullptr: a launch failed
    Py_DECREF(y);
  }
  return PyObject_Vectorcall(f->impl, args, nargsf, kwnames);
}

void fast_dealloc(PyObject* self) {
  auto* f = reinterpret_cast<FastConv*>(self);
  Py_XDECREF(f->impl);
  Py_XDECREF(f->dict);
  Py_TYPE(self)->tp_free(self);
}

PyGetSetDef fast_getset[] = {{"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, nullptr, nullptr},
                             {nullptr, nullptr, nullptr, nullptr, nullptr}};

PyTypeObject FastConvType = {PyVarObject_HEAD_INIT(nullptr, 0) "convforge_native.conv2d"};

// wrap(impl) -> a callable with conv2d's signature whose warm calls stay in C.
PyObject* py_wrap(PyObject*, PyObject* impl) {
  if (!PyCallable_Check(impl)) {
    PyErr_SetString(PyExc_TypeError, "wrap takes a callable with conv2d's signature");
    return nullptr;
  }
  auto* f = PyObject_New(FastConv, &FastConvType);
  if (!f) return nullptr;
  f->vectorcall = fast_call;
  Py_INCREF(impl);
  f->impl = impl;
  f->dict = PyDict_New();
  return reinterpret_cast<PyObject*>(f);
}

// The module's shared set-up: the driver, the wrapper type, conv2d's argument names and defaults
// (convforge/frontends/fast_path.py checks that they are the Python function's before it installs a wrapper).
bool init_core() {
  std::string why;
  if (!load_driver(why)) {
    PyErr_SetString(PyExc_ImportError, why.c_str());
    return false;
  }
  FastConvType.tp_basicsize = sizeof(FastConv);
  FastConvType.tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL;
  FastConvType.tp_vectorcall_offset = offsetof(FastConv, vectorcall);
  FastConvType.tp_call = PyVectorcall_Call;
  FastConvType.tp_dictoffset = offsetof(FastConv, dict);
  FastConvType.tp_dealloc = fast_dealloc;
  FastConvType.tp_getattro = PyObject_GenericGetAttr;
  FastConvType.tp_setattro = PyObject_GenericSetAttr;
  FastConvType.tp_getset = fast_getset;
  if (PyType_Ready(&FastConvType) < 0) return false;
  for (int i = 0; i < kArgs; ++i) name_objs[i] = PyUnicode_InternFromString(kNames[i]);
  PyObject* one = PyLong_FromLong(1);
  defaults[0] = defaults[1] = defaults[2] = Py_None;
  defaults[3] = one;
  defaults[4] = PyLong_FromLong(0);
  defaults[5] = one;
  defaults[6] = PyUnicode_InternFromString("auto");
  defaults[7] = defaults[8] = Py_None;
  defaults[9] = Py_False;
  defaults[10] = defaults[11] = defaults[12] = Py_None;
  defaults[13] = one;
  return true;
}

}  // namespace
