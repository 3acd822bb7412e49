// A probe of native_core.h for tests/test_native_core.py (CPU, no GPU, no driver): it reads a
// program as the native fast paths do (CudaExecutable.native_program) and launches it through
// launch_all with a recording driver, so a test can compare every launch and every tensor-map
// encoding with what the Python fast path (backends/cuda.py launch_raw) makes of the same program.
#include "native_core.h"

namespace {

PyObject* run_filed(PyObject* const*) { Py_RETURN_NONE; }  // no table here

PyObject* g_log = nullptr;  // list of records, filled by the fakes below while run() runs

CUresult fake_ctx(CUcontext* c) {
  if (c) *c = nullptr;
  return 0;
}
CUresult fake_push(CUcontext) { return 0; }

// The map the fake encoders write: the address in the first 8 bytes, then a count of encodings.
uint64_t g_encodings = 0;

void stamp(void* out, void* address) {
  std::memset(out, 0, 128);
  uint64_t a = reinterpret_cast<uint64_t>(address);
  ++g_encodings;
  std::memcpy(out, &a, 8);
  std::memcpy(static_cast<unsigned char*>(out) + 8, &g_encodings, 8);
}

PyObject* ints(const void* p, int n, bool wide, bool sign = false) {
  PyObject* t = PyTuple_New(n);
  for (int i = 0; i < n; ++i) {
    PyObject* v = wide ? PyLong_FromUnsignedLongLong(static_cast<const uint64_t*>(p)[i])
                       : sign ? PyLong_FromLong(static_cast<const int*>(p)[i])
                              : PyLong_FromUnsignedLong(static_cast<const uint32_t*>(p)[i]);
    PyTuple_SET_ITEM(t, i, v);
  }
  return t;
}

CUresult fake_tiled(void* out, int dtype, uint32_t rank, void* address, const uint64_t* dims, const uint64_t* strides,
                    const uint32_t* box, const uint32_t* elem, int il, int sw, int l2, int oob) {
  stamp(out, address);
  PyObject* rec = Py_BuildValue("(sKiINNNNNN(iiii))", "encode", reinterpret_cast<unsigned long long>(address), dtype,
                                rank, PyBool_FromLong(0), ints(dims, rank, true), ints(strides, rank - 1, true),
                                ints(box, rank, false), ints(elem, rank, false), PyTuple_New(0), il, sw, l2, oob);
  PyList_Append(g_log, rec);
  Py_DECREF(rec);
  return 0;
}

CUresult fake_im2col(void* out, int dtype, uint32_t rank, void* address, const uint64_t* dims, const uint64_t* strides,
                     const int* lower, const int* upper, uint32_t cpp, uint32_t ppc, const uint32_t* elem, int il,
                     int sw, int l2, int oob) {
  stamp(out, address);
  uint32_t box[2] = {cpp, ppc};
  PyObject* corners = Py_BuildValue("(NN)", ints(lower, rank - 2, false, true), ints(upper, rank - 2, false, true));
  PyObject* rec = Py_BuildValue("(sKiINNNNNN(iiii))", "encode", reinterpret_cast<unsigned long long>(address), dtype,
                                rank, PyBool_FromLong(1), ints(dims, rank, true), ints(strides, rank - 1, true),
                                ints(box, 2, false), ints(elem, rank, false), corners, il, sw, l2, oob);
  PyList_Append(g_log, rec);
  Py_DECREF(rec);
  return 0;
}

const std::vector<LaunchRec>* g_runs = nullptr;  // the launches being made, in order (which arguments are maps)
size_t g_next = 0;

CUresult fake_launch(CUfunction fn, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                     unsigned smem, CUstream stream, void** params, void**) {
  const LaunchRec& L = (*g_runs)[g_next++];
  PyObject* args = PyTuple_New(static_cast<Py_ssize_t>(L.cells.size()));
  for (size_t i = 0; i < L.cells.size(); ++i) {
    bool is_map = false;
    for (const auto& m : L.maps) is_map = is_map || m->cell == static_cast<int>(i);
    bool aligned = (reinterpret_cast<uintptr_t>(params[i]) & 63) == 0;
    PyObject* v = is_map ? Py_BuildValue("(sNO)", "map", PyBytes_FromStringAndSize(static_cast<const char*>(params[i]), 128),
                                         aligned ? Py_True : Py_False)
                         : PyLong_FromUnsignedLongLong(*static_cast<const uint64_t*>(params[i]));
    PyTuple_SET_ITEM(args, static_cast<Py_ssize_t>(i), v);
  }
  PyObject* rec = Py_BuildValue("(sK(III)(III)IKN)", "launch", reinterpret_cast<unsigned long long>(fn), gx, gy, gz,
                                bx, by, bz, smem, reinterpret_cast<unsigned long long>(stream), args);
  PyList_Append(g_log, rec);
  Py_DECREF(rec);
  return 0;
}

struct Probe : ProgramBase {};

// run(program, slots, steps, times) -> records: the program read as native_core reads it, then
// ``times`` launches of its ``steps`` list ("all", "rest", "weights") on the pointer slots given
// (x, w, y, bias, res, derived...), each list of slots in turn.
PyObject* run(PyObject*, PyObject* args) {
  PyObject *program, *slot_lists;
  const char* steps;
  if (!PyArg_ParseTuple(args, "OOs", &program, &slot_lists, &steps)) return nullptr;
  drv.launch = fake_launch;
  drv.ctx_get = fake_ctx;
  drv.ctx_push = fake_push;
  drv.ctx_pop = fake_ctx;
  drv.encode_tiled = fake_tiled;
  drv.encode_im2col = fake_im2col;
  Probe p;
  if (!read_program(program, p)) return nullptr;
  const std::vector<LaunchRec>& runs = std::string(steps) == "rest" ? p.rest : std::string(steps) == "weights" ? p.weights : p.all;
  PyObject* log = PyList_New(0);
  g_log = log;
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(slot_lists); ++k) {
    uint64_t slot[kMaxArgs] = {};
    PyObject* t = PyList_GET_ITEM(slot_lists, k);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(t) && i < kMaxArgs; ++i) slot[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(t, i));
    g_runs = &runs;
    g_next = 0;
    CUresult bad = launch_all(p, runs, slot, reinterpret_cast<CUstream>(77));
    g_runs = nullptr;
    if (bad) {
      Py_DECREF(log);
      g_log = nullptr;
      return PyErr_Format(PyExc_RuntimeError, "%s", launch_error(p, bad).c_str());
    }
  }
  g_log = nullptr;
  return log;
}

}  // namespace

static PyMethodDef methods[] = {{"run", run, METH_VARARGS, "run(program, slot_lists, steps) -> records"},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "core_probe", nullptr, -1, methods};

PyMODINIT_FUNC PyInit_core_probe() { return PyModule_Create(&module_def); }
