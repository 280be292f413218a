// Host side of the ops' CUDA path in C++: the autograd Functions of approx_act, the MS norms and the gated
// MLP, their allocations, and the launch of the Triton-compiled kernels through the driver's cuLaunchKernelEx.
//
// Why: on a GPU a converted training step of a mid-sized model is bound by host time. A Python
// autograd.Function with two direct C launches already costs ~13 µs per op call over the native op; here one
// Python -> C++ call does forward and the graph node, and backward never enters Python.
//
// What is cached: per kernel "slot" (a Triton kernel with fixed constexprs and num_warps, numbered by the
// Python side, ops/backends/cuda_host.py) and per specialisation class of its runtime arguments (what Triton
// specialises on: pointee dtype and 16-byte alignment of every pointer, width / == 1 / % 16 of every int; the device),
// the compiled kernel's launch entry: CUfunction, num_warps, shared bytes, cooperative / PDL flags, which
// runtime arguments are kernel parameters (ints equal to 1 are constexpr) and each parameter's type. A miss
// calls back into Python, which launches through the ordinary path (Triton compiles if needed) and describes
// the compiled kernel; kernels that need anything else (scratch buffers, clusters, launch hooks, another
// device) are never cached here and keep Triton's own launcher.
//
// The launch passes exactly what Triton 3.8's C launcher (backends/nvidia/driver.c, `_launch`) passes: every
// non-constexpr argument in order at its type's width, then the global and profile scratch pointers (NULL),
// gridDimX * num_ctas (num_ctas == 1 here), blockDimX = 32 * num_warps, the kernel's shared bytes, the current
// torch stream, and the PDL / cooperative attributes. No CUDA headers: the few driver types are declared below
// and cuLaunchKernelEx is found with dlopen("libcuda.so.1"), the symbol Triton calls.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/TensorUtils.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ------------------------------------------------------------------------------------------- driver ABI
typedef int CUresult;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUcontext;
typedef int CUdevice;

struct CUlaunchAttribute {  // CUlaunchAttribute_st (cuda.h, 12.x / 13.x)
  int id;
  char pad[4];
  char value[64];
};
struct CUlaunchConfig {  // CUlaunchConfig_st
  unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned numAttrs;
};
constexpr int kAttrCooperative = 2;        // CU_LAUNCH_ATTRIBUTE_COOPERATIVE
constexpr int kAttrProgrammaticSerial = 6;  // CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION

typedef CUresult (*LaunchEx_t)(const CUlaunchConfig*, CUfunction, void**, void**);
typedef CUresult (*CtxGetCurrent_t)(CUcontext*);
typedef CUresult (*DeviceGet_t)(CUdevice*, int);
typedef CUresult (*PrimaryCtxRetain_t)(CUcontext*, CUdevice);
typedef CUresult (*CtxSetCurrent_t)(CUcontext);
typedef CUresult (*GetErrorString_t)(CUresult, const char**);

struct Driver {
  LaunchEx_t launch = nullptr;
  CtxGetCurrent_t ctx_get = nullptr;
  DeviceGet_t device_get = nullptr;
  PrimaryCtxRetain_t retain = nullptr;
  CtxSetCurrent_t ctx_set = nullptr;
  GetErrorString_t error_string = nullptr;
};

Driver* driver() {
  static Driver* d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_LAZY);
    if (!lib) throw std::runtime_error("lmbp cuda_host: cannot open libcuda.so.1");
    auto* drv = new Driver();
    drv->launch = reinterpret_cast<LaunchEx_t>(dlsym(lib, "cuLaunchKernelEx"));
    drv->ctx_get = reinterpret_cast<CtxGetCurrent_t>(dlsym(lib, "cuCtxGetCurrent"));
    drv->device_get = reinterpret_cast<DeviceGet_t>(dlsym(lib, "cuDeviceGet"));
    drv->retain = reinterpret_cast<PrimaryCtxRetain_t>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    drv->ctx_set = reinterpret_cast<CtxSetCurrent_t>(dlsym(lib, "cuCtxSetCurrent"));
    drv->error_string = reinterpret_cast<GetErrorString_t>(dlsym(lib, "cuGetErrorString"));
    if (!drv->launch || !drv->ctx_get || !drv->device_get || !drv->retain || !drv->ctx_set)
      throw std::runtime_error("lmbp cuda_host: libcuda.so.1 lacks cuLaunchKernelEx or the context calls");
    return drv;
  }();
  return d;
}

void check(CUresult rc, const char* what) {
  if (rc == 0) return;
  const char* s = nullptr;
  if (driver()->error_string) driver()->error_string(rc, &s);
  throw std::runtime_error(std::string("lmbp cuda_host: ") + what + " failed: " + (s ? s : "unknown error") +
                           " (" + std::to_string(rc) + ")");
}

// Triton's ensureCudaContext(): autograd's device threads may have no current context yet.
void ensure_context(Driver* d) {
  CUcontext ctx = nullptr;
  check(d->ctx_get(&ctx), "cuCtxGetCurrent");
  if (!ctx) {
    CUdevice dev;
    check(d->device_get(&dev, 0), "cuDeviceGet");
    check(d->retain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(d->ctx_set(ctx), "cuCtxSetCurrent");
  }
}

// ------------------------------------------------------------------------------------------- launch args
constexpr int kMaxArgs = 16;

struct Arg {
  enum Kind : uint8_t { PTR, INT, FLOAT } kind;
  uint8_t cls;  // the specialisation class (part of the cache key)
  uint64_t u;   // pointer or int value
  double f;
};

Arg ptr_arg(const at::Tensor& t) {
  uint64_t p = reinterpret_cast<uint64_t>(t.data_ptr());
  return Arg{Arg::PTR, uint8_t(0x80 | ((p & 15) == 0 ? 0x40 : 0) | (uint8_t(t.scalar_type()) & 0x3f)), p, 0.0};
}

Arg int_arg(int64_t v) {  // Triton: i32 if it fits, constexpr if == 1, divisibility by 16
  uint8_t c = 0x20 | (v >= INT32_MIN && v <= INT32_MAX ? 1 : 0) | (v == 1 ? 2 : 0) | (v % 16 == 0 ? 4 : 0);
  return Arg{Arg::INT, c, uint64_t(v), 0.0};
}

Arg float_arg(double v) { return Arg{Arg::FLOAT, 0x10, 0, v}; }

// Parameter types, as Triton's extractor indices (driver.c, ExtractorTypeIndex).
enum : uint8_t { T_PTR = 1, T_I32 = 4, T_I64 = 5, T_U32 = 8, T_U64 = 9, T_FP32 = 12, T_FP64 = 13 };

struct Entry {
  CUfunction fn = nullptr;
  unsigned block_x = 0, shared = 0;
  bool coop = false, pdl = false;
  bool py_only = false;  // not launchable from here: the Python callback launches every time
  uint8_t nparams = 0;
  int8_t src[kMaxArgs] = {};   // runtime argument index of each kernel parameter
  uint8_t type[kMaxArgs] = {};  // its type
};

struct Key {
  uint64_t a, b, c;  // slot, device, argument count; one class byte per argument
  bool operator==(const Key& o) const { return a == o.a && b == o.b && c == o.c; }
};
struct KeyHash {
  size_t operator()(const Key& k) const {
    return std::hash<uint64_t>()((k.a * 0x9E3779B97F4A7C15ull ^ k.b) * 0x9E3779B97F4A7C15ull ^ k.c);
  }
};

std::mutex g_mu;  // the cache is read by autograd's device threads too
std::unordered_map<Key, Entry, KeyHash> g_cache;
PyObject* g_miss = nullptr;       // Python: (slot, gx, gy, gz, args, device) -> description or None
PyObject* g_runtime = nullptr;    // triton.knobs.runtime (launch hooks)
PyObject* g_hookchain = nullptr;  // triton.knobs.HookChain
std::atomic<bool> g_hooks_clear{true};
std::atomic<bool> g_self_check{true};  // compare each new CUDA entry's first launch with Triton's, bitwise
std::atomic<bool> g_failed{false};     // a self-check failed: every launch goes through Python from then on
std::atomic<int64_t> g_direct{0}, g_via_python{0}, g_checked{0};

// Whether Triton's launch hooks are unset (read under the GIL on every forward; backward uses the last value).
bool read_hooks_clear() {
  if (!g_runtime) return true;
  static PyObject* names[2] = {PyUnicode_InternFromString("launch_enter_hook"),
                               PyUnicode_InternFromString("launch_exit_hook")};
  static PyObject* calls = PyUnicode_InternFromString("calls");
  for (PyObject* name : names) {
    PyObject* h = PyObject_GetAttr(g_runtime, name);
    if (!h) { PyErr_Clear(); return false; }
    bool clear = h == Py_None;
    if (!clear && g_hookchain && PyObject_TypeCheck(h, (PyTypeObject*)g_hookchain)) {
      PyObject* c = PyObject_GetAttr(h, calls);
      if (!c) PyErr_Clear();
      clear = c && PyList_Check(c) && PyList_GET_SIZE(c) == 0;
      Py_XDECREF(c);
    }
    Py_DECREF(h);
    if (!clear) return false;
  }
  return true;
}

// A Python exception raised inside a forward (GIL held): already set, return NULL to Python.
struct PythonErrorSet : std::exception {};

// Message of the pending Python error (cleared), for errors met where no Python frame can take them.
std::string take_python_error() {
  PyObject *t, *v, *tb;
  PyErr_Fetch(&t, &v, &tb);
  std::string msg = "Python error";
  if (v) {
    PyObject* s = PyObject_Str(v);
    if (s) { const char* c = PyUnicode_AsUTF8(s); if (c) msg = c; Py_DECREF(s); }
  }
  PyErr_Clear();
  Py_XDECREF(t); Py_XDECREF(v); Py_XDECREF(tb);
  return msg;
}

struct Gil {  // acquire the GIL wherever we are (forward: held already; backward: autograd's thread)
  PyGILState_STATE s;
  Gil() : s(PyGILState_Ensure()) {}
  ~Gil() { PyGILState_Release(s); }
};

[[noreturn]] void fail_python(bool in_backward) {
  if (in_backward) throw std::runtime_error(take_python_error());
  throw PythonErrorSet();
}

// Read the Python side's description of a compiled kernel into an entry; false: keep the Python launch.
bool describe(PyObject* d, const Arg* args, int nargs, Entry* e) {
  // (function, num_warps, num_ctas, shared, coop, pdl, kept: bytes per runtime arg, types: bytes per param)
  unsigned long long fn;
  int warps, ctas, shared, coop, pdl;
  const char *kept, *types;
  Py_ssize_t nkept, ntypes;
  if (!PyArg_ParseTuple(d, "Kiiippy#y#", &fn, &warps, &ctas, &shared, &coop, &pdl, &kept, &nkept, &types,
                        &ntypes)) {
    PyErr_Clear();
    return false;
  }
  if (ctas != 1 || shared > 228 * 1024 || nkept != nargs || warps <= 0 || warps > 32) return false;
  int np = 0;
  for (int i = 0; i < nargs; ++i) {
    if (!kept[i]) {
      if (args[i].kind != Arg::INT || args[i].u != 1) return false;  // only ints == 1 become constexpr
      continue;
    }
    if (np >= ntypes) return false;
    uint8_t t = uint8_t(types[np]);
    bool ok = args[i].kind == Arg::PTR ? t == T_PTR
            : args[i].kind == Arg::INT ? (t == T_I32 || t == T_I64 || t == T_U32 || t == T_U64)
                                       : (t == T_FP32 || t == T_FP64);
    if (!ok) return false;
    e->src[np] = int8_t(i);
    e->type[np] = t;
    ++np;
  }
  if (np != ntypes) return false;
  e->fn = reinterpret_cast<CUfunction>(uintptr_t(fn));
  e->block_x = 32u * unsigned(warps);
  e->shared = unsigned(shared);
  e->coop = coop;
  e->pdl = pdl;
  e->nparams = uint8_t(np);
  return true;
}

// Everything a launch needs from the tensors: device index (-1 off CUDA) and, for a miss, the tensors.
struct Launch {
  int slot;
  int64_t gx, gy = 1;
  int alias_in = -1;  // an input argument an output overwrites (gated backward writes dg over dh)
  int device;
  int nargs = 0;
  unsigned outs = 0;  // bit j: argument j is an output the kernel writes in full (the self-check compares them)
  Arg args[kMaxArgs];
  const at::Tensor* tensors[kMaxArgs] = {};
  void ptr(const at::Tensor& t) { tensors[nargs] = &t; args[nargs++] = ptr_arg(t); }
  void out(const at::Tensor& t) { outs |= 1u << nargs; ptr(t); }
  void i(int64_t v) { args[nargs++] = int_arg(v); }
  void f(double v) { args[nargs++] = float_arg(v); }
};

void launch_direct(const Entry& e, const Launch& l) {
  Driver* d = driver();
  ensure_context(d);
  uint64_t words[kMaxArgs + 2];
  void* params[kMaxArgs + 2];
  for (int j = 0; j < e.nparams; ++j) {
    const Arg& a = l.args[e.src[j]];
    uint64_t w = 0;
    switch (e.type[j]) {
      case T_PTR: case T_I64: case T_U64: w = a.u; break;
      case T_I32: case T_U32: { uint32_t v = uint32_t(a.u); std::memcpy(&w, &v, 4); break; }
      case T_FP32: { float v = float(a.f); std::memcpy(&w, &v, 4); break; }
      case T_FP64: std::memcpy(&w, &a.f, 8); break;
    }
    words[j] = w;
    params[j] = &words[j];
  }
  words[e.nparams] = words[e.nparams + 1] = 0;  // global and profile scratch: none
  params[e.nparams] = &words[e.nparams];
  params[e.nparams + 1] = &words[e.nparams + 1];
  CUlaunchAttribute attrs[2];
  unsigned nattrs = 0;
  auto attr = [&](int id) {
    std::memset(&attrs[nattrs], 0, sizeof(CUlaunchAttribute));
    attrs[nattrs].id = id;
    int one = 1;
    std::memcpy(attrs[nattrs].value, &one, sizeof(int));
    ++nattrs;
  };
  if (e.pdl) attr(kAttrProgrammaticSerial);  // Triton's order: PDL, then cooperative
  if (e.coop) attr(kAttrCooperative);
  CUstream stream = nullptr;
  if (l.device >= 0) {
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    stream = static_cast<CUstream>(
        impl->getStreamNativeHandle(impl->getStream(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(l.device)))));
  }
  CUlaunchConfig cfg{unsigned(l.gx), unsigned(l.gy), 1u, e.block_x, 1u, 1u, e.shared, stream, attrs, nattrs};
  check(d->launch(&cfg, e.fn, params, nullptr), "cuLaunchKernelEx");
}

bool bitwise_equal(const at::Tensor& a, const at::Tensor& b) {
  auto as_int = [](const at::Tensor& t) {
    switch (t.element_size()) {
      case 1: return t.view(at::kByte);
      case 2: return t.view(at::kShort);
      case 4: return t.view(at::kInt);
      default: return t.view(at::kLong);
    }
  };
  return as_int(a).equal(as_int(b));  // NaN payloads compare too
}

// The first direct launch of a new CUDA entry writes into fresh outputs; they must equal, bit for bit, what
// Triton's launcher just wrote. Nobody ran this path on a GPU before it shipped: a mismatch turns it off.
bool self_check(const Entry& e, const Launch& l, const at::Tensor& alias_copy) {
  Launch l2 = l;
  if (l.alias_in >= 0) {  // the input as it was before Triton's launch overwrote it
    l2.tensors[l.alias_in] = &alias_copy;
    l2.args[l.alias_in] = ptr_arg(alias_copy);
  }
  std::vector<at::Tensor> fresh;
  fresh.reserve(kMaxArgs);
  for (int j = 0; j < l.nargs; ++j) {
    if (!(l.outs >> j & 1)) continue;
    fresh.push_back(at::empty_like(*l.tensors[j]));
    l2.tensors[j] = &fresh.back();
    l2.args[j] = ptr_arg(fresh.back());
  }
  launch_direct(e, l2);
  g_checked.fetch_add(1, std::memory_order_relaxed);
  for (int j = 0; j < l.nargs; ++j)
    if ((l.outs >> j & 1) && !bitwise_equal(*l.tensors[j], *l2.tensors[j])) return false;
  return true;
}

void launch(Launch& l, bool in_backward) {
  if (l.gx <= 0 || l.gy <= 0) return;
  Key k{uint64_t(l.slot) << 16 | uint64_t(uint8_t(l.device + 1)) << 8 | uint64_t(l.nargs), 0, 0};
  for (int j = 0; j < l.nargs; ++j) (j < 8 ? k.b : k.c) |= uint64_t(l.args[j].cls) << (8 * (j % 8));
  bool current = true;
  if (l.device >= 0) {  // Triton switches devices itself; launch from here only on the current one
    current = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getDevice().index() == l.device;
  }
  if (current && g_hooks_clear.load(std::memory_order_relaxed) && !g_failed.load(std::memory_order_relaxed)) {
    Entry e;
    bool hit;
    {
      std::lock_guard<std::mutex> g(g_mu);
      auto it = g_cache.find(k);
      hit = it != g_cache.end();
      if (hit) e = it->second;
    }
    if (hit && !e.py_only) {
      launch_direct(e, l);
      g_direct.fetch_add(1, std::memory_order_relaxed);
      return;
    }
  }
  // Miss (or a case Triton's own path must handle): Python launches it, and describes the kernel it used.
  Gil gil;
  if (!g_miss) throw std::runtime_error("lmbp cuda_host: no launcher registered");
  PyObject* targs = PyTuple_New(l.nargs);
  for (int j = 0; j < l.nargs; ++j) {
    PyObject* o;
    if (l.args[j].kind == Arg::PTR) o = THPVariable_Wrap(*l.tensors[j]);
    else if (l.args[j].kind == Arg::INT) o = PyLong_FromLongLong(int64_t(l.args[j].u));
    else o = PyFloat_FromDouble(l.args[j].f);
    PyTuple_SET_ITEM(targs, j, o);
  }
  at::Tensor alias_copy;
  if (l.alias_in >= 0 && l.device >= 0 && current && g_self_check.load()) alias_copy = l.tensors[l.alias_in]->clone();
  PyObject* res = PyObject_CallFunction(g_miss, "iLLiOi", l.slot, (long long)l.gx, (long long)l.gy, 1, targs,
                                        l.device);
  Py_DECREF(targs);
  if (!res) fail_python(in_backward);
  g_via_python.fetch_add(1, std::memory_order_relaxed);
  Entry e;
  if (current) e.py_only = !(res != Py_None && describe(res, l.args, l.nargs, &e));
  Py_DECREF(res);
  if (current && !e.py_only && l.device >= 0 && g_self_check.load()) {
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    if (impl->isStreamCapturing(impl->getStream(c10::Device(c10::DeviceType::CUDA, c10::DeviceIndex(l.device)))))
      return;  // no sync inside a CUDA-graph capture: checked (and cached) at a later call
  }
  if (current) {
    if (!e.py_only && l.device >= 0 && g_self_check.load() && !self_check(e, l, alias_copy)) {
      g_failed.store(true);
      e.py_only = true;
      if (PyErr_WarnEx(PyExc_RuntimeWarning,
                       "lmbp_convert: the C++ launch of a Triton kernel did not reproduce Triton's own launch "
                       "bit for bit; the C++ host path is off for this process (please report this)", 1) < 0)
        fail_python(in_backward);
    }
    std::lock_guard<std::mutex> g(g_mu);
    if (g_cache.size() >= 4096) g_cache.clear();
    g_cache[k] = e;
  }
}

// What an act kernel reads: t itself when contiguous, or in place through Python's `t.view(-1, t.size(-1))`
// strides when that view exists (cols, rs, cs: the row view's arguments), else a contiguous copy.
// `contiguous` picks the kernel slot.
struct ActSource {
  at::Tensor t;
  bool contiguous;
  int64_t cols = 1, rs = 0, cs = 1;
};

ActSource act_source(const at::Tensor& t) {
  if (t.is_contiguous()) return {t, true};
  int64_t cols = t.size(-1);
  int64_t rows = cols ? t.numel() / cols : 0;
  auto st = at::detail::computeStride(t.sizes(), t.strides(), at::IntArrayRef({rows, cols}));
  if (!st) return {t.contiguous(), true};
  return {t, false, cols, (*st)[0], (*st)[1]};
}

// ------------------------------------------------------------------------------------------- approx_act
struct ActPlan {
  int fwd_slot[2], bwd_slot[2];  // [contiguous]
  int64_t per_byte, fwd_block, bwd_block;
  PyObject* fallback_bwd;  // Python (grad, packed) -> dx, differentiable (double backward, other dtypes)
};
std::vector<const ActPlan*> g_act_plans;  // grown under the GIL; plans live for the process (backward holds them)

int device_index_of(const at::Tensor& t) { return t.is_cuda() ? int(t.get_device()) : -1; }

std::pair<at::Tensor, at::Tensor> act_fwd(const at::Tensor& x, const ActPlan& p, bool in_backward) {
  int64_t n = x.numel();
  int64_t nbytes = (n + p.per_byte - 1) / p.per_byte;
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  at::Tensor packed = at::empty({nbytes}, x.options().dtype(at::kByte));
  if (n == 0) return {y, packed};
  Launch l;
  l.device = device_index_of(x);
  l.gx = (nbytes + p.fwd_block - 1) / p.fwd_block;
  ActSource src = act_source(x);
  l.slot = p.fwd_slot[src.contiguous];
  l.ptr(src.t); l.out(y); l.out(packed); l.i(n); l.i(nbytes); l.i(src.cols); l.i(src.rs); l.i(src.cs);
  launch(l, in_backward);
  return {y, packed};
}

at::Tensor act_bwd(const at::Tensor& g, const at::Tensor& packed, const ActPlan& p) {
  int64_t n = g.numel();
  at::Tensor dx = at::empty_like(g, at::MemoryFormat::Contiguous);
  if (n == 0) return dx;
  int64_t nbytes = (n + p.per_byte - 1) / p.per_byte;
  if (packed.numel() != nbytes) throw std::runtime_error("approx_act: code bytes do not match the gradient");
  Launch l;
  l.device = device_index_of(g);
  l.gx = (nbytes + p.bwd_block - 1) / p.bwd_block;
  ActSource src = act_source(g);
  l.slot = p.bwd_slot[src.contiguous];
  l.ptr(src.t); l.ptr(packed); l.out(dx); l.i(n); l.i(nbytes); l.i(src.cols); l.i(src.rs); l.i(src.cs);
  launch(l, true);
  return dx;
}

bool triton_dtype(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

// Calls a Python fallback with tensors (and optional extra objects) and returns its tensor result.
at::Tensor call_fallback(PyObject* fn, std::initializer_list<const at::Tensor*> ts) {
  Gil gil;
  PyObject* args = PyTuple_New(Py_ssize_t(ts.size()));
  Py_ssize_t j = 0;
  for (const at::Tensor* t : ts) PyTuple_SET_ITEM(args, j++, THPVariable_Wrap(*t));
  PyObject* r = PyObject_CallObject(fn, args);
  Py_DECREF(args);
  if (!r) throw std::runtime_error(take_python_error());
  if (!THPVariable_Check(r)) {
    Py_DECREF(r);
    throw std::runtime_error("lmbp cuda_host: fallback returned no tensor");
  }
  at::Tensor out = THPVariable_Unpack(r);
  Py_DECREF(r);
  return out;
}

struct ApproxActFn : public torch::autograd::Function<ApproxActFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t plan) {
    const ActPlan* p = g_act_plans[size_t(plan)];
    auto yp = act_fwd(x, *p, false);
    ctx->save_for_backward({yp.second});
    ctx->saved_data["p"] = int64_t(reinterpret_cast<intptr_t>(p));  // not the index: the vector may grow
    return yp.first;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const ActPlan& p = *reinterpret_cast<const ActPlan*>(intptr_t(ctx->saved_data["p"].toInt()));
    at::Tensor packed = ctx->get_saved_variables()[0];
    const at::Tensor& g = grads[0];
    at::Tensor dx;
    // Double backward (create_graph) and non-Triton grad dtypes: the PyTorch path, as the Python Function.
    if (!triton_dtype(g.scalar_type()) || (g.requires_grad() && at::GradMode::is_enabled()))
      dx = call_fallback(p.fallback_bwd, {&g, &packed});
    else
      dx = act_bwd(g, packed, p);
    return {dx, at::Tensor()};
  }
};

// ------------------------------------------------------------------------------------------- MS norms
struct NormPlan {
  int fwd_slot[2], bwd_slot[2];  // [is_rms]
};
std::unordered_map<int64_t, NormPlan> g_norm_plans;  // row length -> slots
PyObject* g_norm_plan_cb = nullptr;  // Python: n -> (fwd_ln, fwd_rms, bwd_ln, bwd_rms) slots
PyObject* g_norm_fallback = nullptr;  // Python: (g, y, rstd, is_rms, x dtype) under create_graph: refuses

const NormPlan& norm_plan(int64_t n) {  // called with the GIL (forward)
  auto it = g_norm_plans.find(n);
  if (it != g_norm_plans.end()) return it->second;
  PyObject* r = PyObject_CallFunction(g_norm_plan_cb, "L", (long long)n);
  if (!r) throw PythonErrorSet();
  NormPlan p;
  int ok = PyArg_ParseTuple(r, "iiii", &p.fwd_slot[0], &p.fwd_slot[1], &p.bwd_slot[0], &p.bwd_slot[1]);
  Py_DECREF(r);
  if (!ok) throw PythonErrorSet();
  if (g_norm_plans.size() >= 4096) g_norm_plans.clear();
  return g_norm_plans[n] = p;
}

// Python's rows_view: t itself when contiguous (row stride n), else a (rows, n) view with unit column stride.
at::Tensor rows_view(const at::Tensor& t, int64_t n, int64_t* stride) {
  if (t.is_contiguous()) { *stride = n; return t; }
  at::Tensor t2 = t.reshape({-1, n});
  if (n > 1 && t2.stride(1) != 1) t2 = t2.contiguous();
  *stride = t2.stride(0);
  return t2;
}

struct MSNormFn : public torch::autograd::Function<MSNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t n, double eps, bool is_rms,
                            int64_t out_dtype, int64_t fwd_slot, int64_t bwd_slot) {
    int64_t stride_x;
    at::Tensor x2 = rows_view(x, n, &stride_x);
    int64_t m = x.numel() / n;
    at::Tensor y = at::empty_like(x, x.options().dtype(at::ScalarType(out_dtype)), at::MemoryFormat::Contiguous);
    at::Tensor rstd = at::empty({m}, x.options().dtype(at::kFloat));
    Launch l;
    l.device = device_index_of(x);
    l.gx = m;
    l.slot = int(fwd_slot);
    l.ptr(x2); l.out(y); l.out(rstd); l.i(stride_x); l.i(n); l.i(n); l.f(eps);
    launch(l, false);
    if (ctx) {
      ctx->save_for_backward({y, rstd});
      ctx->saved_data["s"] = bwd_slot;
      ctx->saved_data["r"] = is_rms;
      ctx->saved_data["d"] = int64_t(x.scalar_type());
    }
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &y = saved[0], &rstd = saved[1];
    const at::Tensor& g = grads[0];
    bool is_rms = ctx->saved_data["r"].toBool();
    auto x_dtype = at::ScalarType(ctx->saved_data["d"].toInt());
    at::Tensor dx;
    if (at::GradMode::is_enabled()) {  // create_graph: the Python callback, which refuses (an LmbpError, kept)
      Gil gil;
      PyObject* args = Py_BuildValue("(NNNOO)", THPVariable_Wrap(g), THPVariable_Wrap(y), THPVariable_Wrap(rstd),
                                     is_rms ? Py_True : Py_False,
                                     reinterpret_cast<PyObject*>(torch::getTHPDtype(x_dtype)));
      PyObject* r = args ? PyObject_CallObject(g_norm_fallback, args) : nullptr;
      Py_XDECREF(args);
      if (!r) throw python_error();  // the Python exception itself, re-raised by autograd's engine
      dx = THPVariable_Unpack(r);
      Py_DECREF(r);
    } else {
      int64_t m = rstd.numel();
      int64_t n = y.numel() / m;
      int64_t sg, sy;
      at::Tensor g2 = rows_view(g, n, &sg);
      at::Tensor y2 = rows_view(y, n, &sy);
      dx = at::empty_like(y, y.options().dtype(x_dtype), at::MemoryFormat::Contiguous);
      Launch l;
      l.device = device_index_of(y);
      l.gx = m;
      l.slot = int(ctx->saved_data["s"].toInt());
      l.ptr(g2); l.ptr(y2); l.ptr(rstd); l.out(dx); l.i(sg); l.i(sy); l.i(n); l.i(n);
      launch(l, true);
    }
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// ------------------------------------------------------------------------------------------- Python API
PyObject* not_implemented() { Py_RETURN_NOTIMPLEMENTED; }

#define GUARD_BEGIN try {
#define GUARD_END                                               \
  }                                                             \
  catch (const PythonErrorSet&) { return nullptr; }             \
  catch (const c10::Error& e) {                                 \
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace()); \
    return nullptr;                                             \
  }                                                             \
  catch (const std::exception& e) {                             \
    PyErr_SetString(PyExc_RuntimeError, e.what());              \
    return nullptr;                                             \
  }

// approx_act(plan, x) -> y, or NotImplemented (not a plain tensor: the Python path handles it)
PyObject* py_approx_act(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  GUARD_BEGIN
  if (nargs != 2 || !THPVariable_CheckExact(args[1])) return not_implemented();
  const at::Tensor& x = THPVariable_Unpack(args[1]);
  int64_t plan = PyLong_AsLongLong(args[0]);
  if (plan < 0 || size_t(plan) >= g_act_plans.size()) {
    PyErr_SetString(PyExc_ValueError, "approx_act: unknown plan");
    return nullptr;
  }
  g_hooks_clear.store(read_hooks_clear(), std::memory_order_relaxed);
  if (x.requires_grad() && at::GradMode::is_enabled())
    return THPVariable_Wrap(ApproxActFn::apply(x, plan));
  return THPVariable_Wrap(act_fwd(x, *g_act_plans[size_t(plan)], false).first);
  GUARD_END
}

// ms_norm(x, n, eps, is_rms) -> y in the autocast dtype (or x's), or NotImplemented
PyObject* py_ms_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  GUARD_BEGIN
  if (nargs != 4 || !THPVariable_CheckExact(args[0])) return not_implemented();
  const at::Tensor& x = THPVariable_Unpack(args[0]);
  int64_t n = PyLong_AsLongLong(args[1]);
  double eps = PyFloat_AsDouble(args[2]);
  bool is_rms = args[3] == Py_True;
  if (PyErr_Occurred()) return nullptr;
  if (n <= 0 || x.numel() == 0 || x.numel() % n) return not_implemented();
  at::ScalarType out = x.scalar_type();
  auto dev_type = x.device().type();
  if (at::autocast::is_autocast_enabled(dev_type) && at::isFloatingType(out) && out != at::kDouble)
    out = at::autocast::get_autocast_dtype(dev_type);
  if (!g_norm_plan_cb || !g_norm_fallback) return not_implemented();
  const NormPlan& p = norm_plan(n);
  g_hooks_clear.store(read_hooks_clear(), std::memory_order_relaxed);
  int64_t fs = p.fwd_slot[is_rms], bs = p.bwd_slot[is_rms];
  if (x.requires_grad() && at::GradMode::is_enabled())
    return THPVariable_Wrap(MSNormFn::apply(x, n, eps, is_rms, int64_t(out), fs, bs));
  at::AutoGradMode no_grad(false);
  return THPVariable_Wrap(MSNormFn::forward(nullptr, x, n, eps, is_rms, int64_t(out), fs, bs));
  GUARD_END
}

// ------------------------------------------------------------------------------------------- gated MLP
// The port of ops/gated_mlp.py's GatedMLPFunction (forward and its non-create_graph backward), step for step:
// the same ATen calls in the same order and dtypes, so results are bitwise the Python Function's.
struct GatedPlan {
  int64_t block;
  int fwd_slot, bwd_slot[2];  // bwd_slot[store_h]
};
std::unordered_map<int64_t, GatedPlan> g_gated_plans;  // (act code, row length) -> kernels
PyObject* g_gated_plan_cb = nullptr;   // Python: (code, n) -> (block, fwd slot, bwd slot, bwd slot storing h)
PyObject* g_gated_fallback = nullptr;  // Python: create_graph backward (the Function's differentiable one)
PyObject* g_parameter_type = nullptr;  // torch.nn.Parameter

const GatedPlan& gated_plan(int64_t code, int64_t n) {  // called with the GIL (forward)
  int64_t key = code << 48 | n;
  auto it = g_gated_plans.find(key);
  if (it != g_gated_plans.end()) return it->second;
  PyObject* r = PyObject_CallFunction(g_gated_plan_cb, "LL", (long long)code, (long long)n);
  if (!r) throw PythonErrorSet();
  GatedPlan p;
  long long block;
  int ok = PyArg_ParseTuple(r, "Liii", &block, &p.fwd_slot, &p.bwd_slot[0], &p.bwd_slot[1]);
  Py_DECREF(r);
  if (!ok) throw PythonErrorSet();
  p.block = block;
  if (g_gated_plans.size() >= 4096) g_gated_plans.clear();
  return g_gated_plans[key] = p;
}

at::Tensor gated_fwd(const at::Tensor& g, const at::Tensor& u, int64_t block, int slot, at::ScalarType h_dtype,
                     bool in_backward) {
  int64_t n = g.size(-1);
  int64_t sg, su;
  at::Tensor g2 = rows_view(g, n, &sg), u2 = rows_view(u, n, &su);
  at::Tensor h = at::empty_like(g, g.options().dtype(h_dtype), at::MemoryFormat::Contiguous);
  Launch l;
  l.device = device_index_of(g);
  l.gx = g.numel() / n;
  l.gy = (n + block - 1) / block;
  l.slot = slot;
  l.ptr(g2); l.ptr(u2); l.out(h); l.i(sg); l.i(su); l.i(n); l.i(n);
  launch(l, in_backward);
  return h;
}

// (dg, du, h or undefined); dg is written over dh when dh is contiguous and of g's dtype (dh not needed after)
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_bwd(const at::Tensor& dh, const at::Tensor& g,
                                                         const at::Tensor& u, int64_t block, const int* slots,
                                                         std::optional<at::ScalarType> h_dtype) {
  int64_t n = g.size(-1);
  bool dh_contiguous = dh.is_contiguous();
  int64_t sdh, sg, su;
  at::Tensor dh2 = rows_view(dh, n, &sdh), g2 = rows_view(g, n, &sg), u2 = rows_view(u, n, &su);
  bool into_dh = dh_contiguous && dh.scalar_type() == g.scalar_type();
  at::Tensor dg = into_dh ? dh.view(g.sizes()) : at::empty_like(g, at::MemoryFormat::Contiguous);
  at::Tensor du = at::empty_like(u, at::MemoryFormat::Contiguous);
  at::Tensor h;
  if (h_dtype) h = at::empty_like(g, g.options().dtype(*h_dtype), at::MemoryFormat::Contiguous);
  Launch l;
  l.device = device_index_of(g);
  l.gx = g.numel() / n;
  l.gy = (n + block - 1) / block;
  l.slot = slots[h_dtype ? 1 : 0];
  if (into_dh) l.alias_in = 0;
  l.ptr(dh2); l.ptr(g2); l.ptr(u2); l.out(dg); l.out(du);
  if (h_dtype) l.out(h); else l.ptr(du);  // never written when STORE_H is off
  l.i(sdh); l.i(sg); l.i(su); l.i(n); l.i(n); l.i(n); l.i(n);
  launch(l, true);
  return {dg, du, h};
}

struct Casts {  // eager F.linear's dtypes under autocast (``_lin_dtype`` / ``_cast`` / ``_to`` in gated_mlp.py)
  std::optional<at::ScalarType> ac;
  at::ScalarType lin(at::ScalarType d) const {
    return ac && at::isFloatingType(d) && d != at::kDouble ? *ac : d;
  }
  at::Tensor cast(const at::Tensor& t) const {
    if (!t.defined()) return t;
    auto d = lin(t.scalar_type());
    return d == t.scalar_type() ? t : t.to(d);
  }
  static at::Tensor to(const at::Tensor& t, at::ScalarType d) {
    return !t.defined() || t.scalar_type() == d ? t : t.to(d);
  }
};

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// Autograd's inputs are the defined tensors only: the bias is an optional argument, and the LoRA list holds A, B
// and (where bit i of ``bb_mask`` is set) B's bias of each adapter. These map full positions (g, u, weight, bias,
// then A, B, B-bias per adapter) to input-edge indices (-1: no tensor there).
std::vector<int> edge_index(bool has_bias, size_t k, int64_t bb_mask) {
  std::vector<int> e(4 + 3 * k, -1);
  int next = 0;
  for (int j = 0; j < 3; ++j) e[size_t(j)] = next++;
  if (has_bias) e[3] = next++;
  for (size_t i = 0; i < k; ++i) {
    e[4 + 3 * i] = next++;
    e[4 + 3 * i + 1] = next++;
    if (bb_mask >> i & 1) e[4 + 3 * i + 2] = next++;
  }
  return e;
}

std::vector<at::Tensor> full_lora(at::TensorList defined, size_t k, int64_t bb_mask) {
  std::vector<at::Tensor> out(3 * k);
  size_t j = 0;
  for (size_t i = 0; i < k; ++i) {
    out[3 * i] = defined[j++];
    out[3 * i + 1] = defined[j++];
    if (bb_mask >> i & 1) out[3 * i + 2] = defined[j++];
  }
  return out;
}

struct GatedMLPFn : public torch::autograd::Function<GatedMLPFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias_opt, at::TensorList lora_defined, int64_t code,
                            const std::vector<double>& scales, int64_t casts, int64_t bb_mask) {
    at::Tensor bias = bias_opt ? *bias_opt : at::Tensor();
    std::vector<at::Tensor> lora = full_lora(lora_defined, scales.size(), bb_mask);
    auto dev_type = g.device().type();
    Casts c;
    if (at::autocast::is_autocast_enabled(dev_type)) c.ac = at::autocast::get_autocast_dtype(dev_type);
    auto h_dtype = g.scalar_type() == u.scalar_type() ? g.scalar_type()
                                                      : at::promote_types(g.scalar_type(), u.scalar_type());
    const GatedPlan& p = gated_plan(code, g.size(-1));
    at::Tensor out;
    {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      at::Tensor h = gated_fwd(g, u, p.block, p.fwd_slot, h_dtype, false);
      out = c.ac ? at::linear(c.cast(h), c.cast(weight), opt(c.cast(bias))) : at::linear(h, weight, opt(bias));
      auto out_dtype = out.scalar_type();
      at::Tensor acc = out;
      for (size_t i = 0; i < scales.size(); ++i) {
        const at::Tensor &a_w = lora[3 * i], &b_w = lora[3 * i + 1], &b_b = lora[3 * i + 2];
        at::Tensor hx = (casts >> i & 1) ? Casts::to(h, a_w.scalar_type()) : h;
        at::Tensor t = at::linear(c.cast(hx), c.cast(a_w));
        acc = acc + at::linear(c.cast(t), c.cast(b_w), opt(c.cast(b_b))) * scales[i];
      }
      out = Casts::to(acc, out_dtype);
    }
    if (ctx) {
      bool need_dh = ctx->needs_input_grad(0) || ctx->needs_input_grad(1);
      std::vector<at::Tensor> saved{g, u, need_dh ? weight : at::Tensor()};
      saved.insert(saved.end(), lora.begin(), lora.end());
      ctx->save_for_backward(saved);
      ctx->saved_data["ac"] = int64_t(c.ac ? int64_t(*c.ac) : -1);
      ctx->saved_data["h"] = int64_t(h_dtype);
      ctx->saved_data["w"] = int64_t(weight.scalar_type());
      ctx->saved_data["b"] = int64_t(bias.defined() ? int64_t(bias.scalar_type()) : -1);
      ctx->saved_data["code"] = code;
      ctx->saved_data["sc"] = scales;
      ctx->saved_data["cast"] = casts;
      ctx->saved_data["block"] = p.block;
      ctx->saved_data["slots"] = std::vector<int64_t>{p.fwd_slot, p.bwd_slot[0], p.bwd_slot[1]};
      ctx->saved_data["bb"] = bb_mask;
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &g = saved[0], &u = saved[1], &weight = saved[2];
    size_t k = (saved.size() - 3) / 3;
    auto lora = [&](size_t j) -> const at::Tensor& { return saved[3 + j]; };
    std::vector<double> scales = ctx->saved_data["sc"].toDoubleVector();
    int64_t casts = ctx->saved_data["cast"].toInt();
    int64_t ac_i = ctx->saved_data["ac"].toInt();
    Casts c;
    if (ac_i >= 0) c.ac = at::ScalarType(ac_i);
    auto h_dtype = at::ScalarType(ctx->saved_data["h"].toInt());
    auto weight_dtype = at::ScalarType(ctx->saved_data["w"].toInt());
    int64_t bias_i = ctx->saved_data["b"].toInt();
    int64_t bb_mask = ctx->saved_data["bb"].toInt();
    std::vector<int> edge = edge_index(bias_i >= 0, k, bb_mask);
    std::vector<bool> needs(4 + 3 * k);
    for (size_t j = 0; j < needs.size(); ++j) needs[j] = edge[j] >= 0 && ctx->needs_input_grad(size_t(edge[j]));
    variable_list full(4 + 3 * k);  // gradients by full position; returned below in autograd's argument layout
    auto& out = full;
    const at::Tensor& dy = grads[0];
    if (at::GradMode::is_enabled()) {  // create_graph: the Python backward, differentiable (recomputed forward)
      Gil gil;
      PyObject* ts = PyTuple_New(Py_ssize_t(saved.size()));
      for (size_t j = 0; j < saved.size(); ++j) PyTuple_SET_ITEM(ts, j, THPVariable_Wrap(saved[j]));
      PyObject* nd = PyTuple_New(Py_ssize_t(needs.size()));
      for (size_t j = 0; j < needs.size(); ++j) PyTuple_SET_ITEM(nd, j, PyBool_FromLong(needs[j]));
      PyObject* sc = PyTuple_New(Py_ssize_t(k));
      for (size_t j = 0; j < k; ++j) PyTuple_SET_ITEM(sc, j, PyFloat_FromDouble(scales[j]));
      auto dtype = [](int64_t st) -> PyObject* {
        if (st < 0) Py_RETURN_NONE;
        PyObject* o = reinterpret_cast<PyObject*>(torch::getTHPDtype(at::ScalarType(st)));
        Py_INCREF(o);
        return o;
      };
      PyObject* args = Py_BuildValue("(NNNNNLNLNN)", THPVariable_Wrap(dy), ts, nd, dtype(ac_i),
                                     dtype(int64_t(h_dtype)), (long long)ctx->saved_data["code"].toInt(), sc,
                                     (long long)casts, dtype(int64_t(weight_dtype)), dtype(bias_i));
      PyObject* r = args ? PyObject_CallObject(g_gated_fallback, args) : nullptr;
      Py_XDECREF(args);
      if (!r) throw std::runtime_error(take_python_error());
      // (dg, du, dw, db, None, None, *grads_lora): the Python Function's inputs
      Py_ssize_t nr = PySequence_Check(r) ? PySequence_Size(r) : -1;
      if (nr != Py_ssize_t(6 + 3 * k)) {
        Py_DECREF(r);
        throw std::runtime_error("lmbp cuda_host: gated backward fallback returned a wrong gradient count");
      }
      for (Py_ssize_t j = 0; j < nr; ++j) {
        if (j == 4 || j == 5) continue;
        PyObject* o = PySequence_GetItem(r, j);
        size_t dst = j < 4 ? size_t(j) : size_t(j - 2);
        if (o && THPVariable_Check(o)) out[dst] = THPVariable_Unpack(o);
        Py_XDECREF(o);
      }
      Py_DECREF(r);
      return layout(full, k, bb_mask);
    }
    bool need_dh = needs[0] || needs[1];
    bool need_h = needs[2];
    for (size_t i = 0; i < k; ++i) need_h = need_h || needs[4 + 3 * i] || needs[4 + 3 * i + 1];
    int64_t f = g.size(-1);
    at::Tensor dy2 = dy.dim() == 2 ? dy : dy.reshape({-1, dy.size(-1)});
    at::Tensor dyc = c.ac ? c.cast(dy2) : dy2;
    at::Tensor dg, du, dw, db, h;
    int64_t block = ctx->saved_data["block"].toInt();
    auto slot_list = ctx->saved_data["slots"].toIntVector();
    int bwd_slots[2] = {int(slot_list[1]), int(slot_list[2])};
    {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      std::vector<at::Tensor> gys(k), gts(k);
      for (size_t i = 0; i < k; ++i) {
        const at::Tensor &a_w = lora(3 * i), &b_w = lora(3 * i + 1);
        auto y_dtype = c.lin((casts >> i & 1) ? a_w.scalar_type() : h_dtype);
        bool used = need_dh || needs[4 + 3 * i] || needs[4 + 3 * i + 1] || needs[4 + 3 * i + 2];
        if (used) gys[i] = Casts::to(dy2, y_dtype) * scales[i];
        if (need_dh || needs[4 + 3 * i]) gts[i] = gys[i].matmul(c.cast(b_w));
      }
      if (need_dh) {
        at::Tensor dh = Casts::to(dyc.matmul(c.ac ? c.cast(weight) : weight), h_dtype);
        for (size_t i = 0; i < k; ++i) {
          const at::Tensor& a_w = lora(3 * i);
          auto hx_dtype = (casts >> i & 1) ? a_w.scalar_type() : h_dtype;
          dh = dh + Casts::to(Casts::to(gts[i].matmul(c.cast(a_w)), hx_dtype), h_dtype);
        }
        dh = dh.view(g.sizes());
        auto r = gated_bwd(dh, g, u, block, bwd_slots,
                           need_h ? std::optional<at::ScalarType>(h_dtype) : std::nullopt);
        dh.reset();
        if (needs[0]) dg = std::get<0>(r);
        if (needs[1]) du = std::get<1>(r);
        h = std::get<2>(r);
      } else if (need_h) {
        h = gated_fwd(g, u, block, int(slot_list[0]), h_dtype, true);
      }
      if (need_h) {
        at::Tensor h2 = h.reshape({-1, f});
        if (needs[2]) dw = Casts::to(dyc.t().matmul(c.cast(h2)), weight_dtype);
        for (size_t i = 0; i < k; ++i) {
          const at::Tensor &a_w = lora(3 * i), &b_w = lora(3 * i + 1);
          if (!(needs[4 + 3 * i] || needs[4 + 3 * i + 1])) continue;
          at::Tensor hxc = c.cast((casts >> i & 1) ? Casts::to(h2, a_w.scalar_type()) : h2);
          if (needs[4 + 3 * i]) out[4 + 3 * i] = Casts::to(gts[i].t().matmul(hxc), a_w.scalar_type());
          if (needs[4 + 3 * i + 1]) {
            at::Tensor t = at::linear(hxc, c.cast(a_w));  // A(h) recomputed, never saved
            out[4 + 3 * i + 1] = Casts::to(gys[i].t().matmul(c.cast(t)), b_w.scalar_type());
          }
        }
      }
      if (needs[3]) db = Casts::to(dyc.sum(0), at::ScalarType(bias_i));
      for (size_t i = 0; i < k; ++i) {
        const at::Tensor& b_b = lora(3 * i + 2);
        if (needs[4 + 3 * i + 2] && b_b.defined()) out[4 + 3 * i + 2] = Casts::to(gys[i].sum(0), b_b.scalar_type());
      }
    }
    out[0] = dg, out[1] = du, out[2] = dw, out[3] = db;
    return layout(full, k, bb_mask);
  }

  // Autograd's layout: one entry per forward argument (g, u, weight, bias, each defined LoRA tensor, then the
  // four non-tensor arguments).
  static variable_list layout(const variable_list& full, size_t k, int64_t bb_mask) {
    variable_list out{full[0], full[1], full[2], full[3]};
    for (size_t i = 0; i < k; ++i) {
      out.push_back(full[4 + 3 * i]);
      out.push_back(full[4 + 3 * i + 1]);
      if (bb_mask >> i & 1) out.push_back(full[4 + 3 * i + 2]);
    }
    out.resize(out.size() + 4);
    return out;
  }
};

bool plain_tensor(PyObject* o) {  // torch.Tensor or nn.Parameter (no __torch_function__ of its own)
  return THPVariable_CheckExact(o) || (g_parameter_type && Py_TYPE(o) == (PyTypeObject*)g_parameter_type);
}

// gated_mlp(g, u, weight, bias|None, act code, lora (A, B, B-bias|None)*, scales, cast mask) -> out | NotImplemented
PyObject* py_gated_mlp(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  GUARD_BEGIN
  if (nargs != 8 || !g_gated_plan_cb || !g_gated_fallback) return not_implemented();
  if (!plain_tensor(args[0]) || !plain_tensor(args[1]) || !plain_tensor(args[2]) ||
      (args[3] != Py_None && !plain_tensor(args[3])) || !PyTuple_Check(args[5]) || !PyTuple_Check(args[6]))
    return not_implemented();
  const at::Tensor& g = THPVariable_Unpack(args[0]);
  const at::Tensor& u = THPVariable_Unpack(args[1]);
  const at::Tensor& weight = THPVariable_Unpack(args[2]);
  at::Tensor bias = args[3] == Py_None ? at::Tensor() : THPVariable_Unpack(args[3]);
  int64_t code = PyLong_AsLongLong(args[4]);
  int64_t casts = PyLong_AsLongLong(args[7]);
  if (PyErr_Occurred()) return nullptr;
  Py_ssize_t nl = PyTuple_GET_SIZE(args[5]), k = PyTuple_GET_SIZE(args[6]);
  if (nl != 3 * k || k > 60 || g.numel() == 0 || g.dim() == 0) return not_implemented();
  std::vector<at::Tensor> lora;  // the defined ones (B's bias may be None)
  int64_t bb_mask = 0;
  for (Py_ssize_t j = 0; j < nl; ++j) {
    PyObject* o = PyTuple_GET_ITEM(args[5], j);
    if (o == Py_None && j % 3 == 2) continue;
    if (!plain_tensor(o)) return not_implemented();
    if (j % 3 == 2) bb_mask |= int64_t(1) << (j / 3);
    lora.push_back(THPVariable_Unpack(o));
  }
  std::vector<double> scales(static_cast<size_t>(k));
  for (Py_ssize_t j = 0; j < k; ++j) scales[size_t(j)] = PyFloat_AsDouble(PyTuple_GET_ITEM(args[6], j));
  if (PyErr_Occurred()) return nullptr;
  g_hooks_clear.store(read_hooks_clear(), std::memory_order_relaxed);
  bool grad = at::GradMode::is_enabled() && (g.requires_grad() || u.requires_grad() || weight.requires_grad() ||
                                             (bias.defined() && bias.requires_grad()));
  for (const auto& t : lora) grad = grad || (at::GradMode::is_enabled() && t.defined() && t.requires_grad());
  std::optional<at::Tensor> bias_opt = bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt;
  if (grad)
    return THPVariable_Wrap(
        GatedMLPFn::apply(g, u, weight, bias_opt, at::TensorList(lora), code, scales, casts, bb_mask));
  at::AutoGradMode no_grad(false);
  return THPVariable_Wrap(GatedMLPFn::forward(nullptr, g, u, weight, bias_opt, at::TensorList(lora), code, scales,
                                              casts, bb_mask));
  GUARD_END
}

PyObject* py_set_gated_callbacks(PyObject*, PyObject* args) {
  PyObject *plan_cb, *fallback, *param;
  if (!PyArg_ParseTuple(args, "OOO", &plan_cb, &fallback, &param)) return nullptr;
  Py_INCREF(plan_cb); Py_INCREF(fallback); Py_INCREF(param);
  Py_XDECREF(g_gated_plan_cb); Py_XDECREF(g_gated_fallback); Py_XDECREF(g_parameter_type);
  g_gated_plan_cb = plan_cb, g_gated_fallback = fallback, g_parameter_type = param;
  Py_RETURN_NONE;
}

PyObject* py_register_act_plan(PyObject*, PyObject* args) {
  ActPlan p;
  PyObject* fb;
  if (!PyArg_ParseTuple(args, "iiiiLLLO", &p.fwd_slot[0], &p.fwd_slot[1], &p.bwd_slot[0], &p.bwd_slot[1],
                        &p.per_byte, &p.fwd_block, &p.bwd_block, &fb))
    return nullptr;
  Py_INCREF(fb);
  p.fallback_bwd = fb;
  g_act_plans.push_back(new ActPlan(p));
  return PyLong_FromSize_t(g_act_plans.size() - 1);
}

PyObject* py_set_launcher(PyObject*, PyObject* args) {
  PyObject *miss, *runtime, *hookchain;
  if (!PyArg_ParseTuple(args, "OOO", &miss, &runtime, &hookchain)) return nullptr;
  for (PyObject* o : {miss, runtime, hookchain}) Py_INCREF(o);
  for (PyObject** slot : {&g_miss, &g_runtime, &g_hookchain}) Py_XDECREF(*slot);
  g_miss = miss;
  g_runtime = runtime == Py_None ? nullptr : runtime;
  g_hookchain = hookchain == Py_None ? nullptr : hookchain;
  Py_RETURN_NONE;
}

PyObject* py_set_norm_callbacks(PyObject*, PyObject* args) {
  PyObject *plan_cb, *fallback;
  if (!PyArg_ParseTuple(args, "OO", &plan_cb, &fallback)) return nullptr;
  Py_INCREF(plan_cb); Py_INCREF(fallback);
  Py_XDECREF(g_norm_plan_cb); Py_XDECREF(g_norm_fallback);
  g_norm_plan_cb = plan_cb, g_norm_fallback = fallback;
  Py_RETURN_NONE;
}

PyObject* py_clear(PyObject*, PyObject*) {
  std::lock_guard<std::mutex> g(g_mu);
  g_cache.clear();
  g_norm_plans.clear();
  g_gated_plans.clear();
  Py_RETURN_NONE;
}

PyObject* py_stats(PyObject*, PyObject*) {
  size_t entries, direct_entries = 0;
  {
    std::lock_guard<std::mutex> g(g_mu);
    entries = g_cache.size();
    for (auto& kv : g_cache) direct_entries += !kv.second.py_only;
  }
  return Py_BuildValue("{s:L,s:L,s:n,s:n,s:L,s:O}", "direct", (long long)g_direct.load(), "via_python",
                       (long long)g_via_python.load(), "entries", (Py_ssize_t)entries, "direct_entries",
                       (Py_ssize_t)direct_entries, "self_checked", (long long)g_checked.load(), "self_check_failed",
                       g_failed.load() ? Py_True : Py_False);
}

PyObject* py_set_self_check(PyObject*, PyObject* arg) {
  g_self_check.store(PyObject_IsTrue(arg) == 1);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"approx_act", (PyCFunction)(void (*)(void))py_approx_act, METH_FASTCALL, "approx_act(plan, x) -> y"},
    {"ms_norm", (PyCFunction)(void (*)(void))py_ms_norm, METH_FASTCALL, "ms_norm(x, n, eps, is_rms) -> y"},
    {"register_act_plan", py_register_act_plan, METH_VARARGS, "register an approx_act plan, returns its id"},
    {"set_launcher", py_set_launcher, METH_VARARGS, "(miss callback, triton.knobs.runtime, HookChain)"},
    {"set_norm_callbacks", py_set_norm_callbacks, METH_VARARGS, "(row length -> slots, create_graph backward)"},
    {"gated_mlp", (PyCFunction)(void (*)(void))py_gated_mlp, METH_FASTCALL,
     "gated_mlp(g, u, weight, bias, act code, lora, scales, cast mask) -> out"},
    {"set_gated_callbacks", py_set_gated_callbacks, METH_VARARGS, "((code, n) -> slots, create_graph backward, "
     "nn.Parameter)"},
    {"clear", py_clear, METH_NOARGS, "drop every cached launch entry and norm plan"},
    {"stats", py_stats, METH_NOARGS, "launch counters"},
    {"set_self_check", py_set_self_check, METH_O, "compare each new CUDA entry's first launch with Triton's"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "lmbp_cuda_host", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_lmbp_cuda_host() { return PyModule_Create(&module); }
