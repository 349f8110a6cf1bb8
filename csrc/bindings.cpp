// relaygr_engine._C: Python binding of relaygr::PrefixBlockPool.
//
// Argument conversion only; every decision is made by the plain C++ class. Arguments are converted exactly as the
// pure-Python pool (relaygr_engine/_pool_py.py) converts them (operator.index for ids and counts, float() for
// times), in the same order, with the same messages, so both implementations raise the same errors for the same
// calls. The GIL is released around each core call; result arrays are built after it is re-acquired.
//
// The pool's methods are called once or more per ranking request, so they skip pybind11's generic dispatcher and
// take CPython's fast-call convention (METH_FASTCALL | METH_KEYWORDS) with keyword names interned once: pybind11
// 3.1 interns every parameter name on each call that passes keywords, which costs more than the pool operation
// itself (about +0.6 us per call of pin(u, f, now=t)). The class, constructor, properties and dunders are plain
// pybind11.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <array>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "relaygr/block_pool.h"

namespace py = pybind11;
using relaygr::PageId;
using relaygr::PrefixBlockPool;
using relaygr::PrefixKey;

namespace {

using MaybeTime = std::optional<double>;

std::string type_name_of(py::handle v) { return py::str(py::type::handle_of(v).attr("__name__")); }
std::string repr_of(py::handle v) { return py::repr(v); }
std::string str_of(py::handle v) { return py::str(v); }

// operator.index(v): a new reference to an int, or nullptr when v is not an integer (TypeError swallowed; any
// other error from a custom __index__ propagates as it would in Python).
PyObject* as_index(py::handle v) {
  if (PyLong_Check(v.ptr())) return py::reinterpret_borrow<py::object>(v).release().ptr();
  PyObject* i = PyNumber_Index(v.ptr());
  if (i == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();
  }
  return i;
}

// _u64: an integer in [0, 2**64).
std::uint64_t to_u64(const char* name, py::handle v) {
  PyObject* raw = as_index(v);
  if (raw == nullptr)
    throw py::value_error(std::string(name) + " must be an integer in [0, 2**64), got " + type_name_of(v));
  py::object i = py::reinterpret_steal<py::object>(raw);
  const unsigned long long x = PyLong_AsUnsignedLongLong(i.ptr());
  if (x == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_OverflowError)) throw py::error_already_set();
    PyErr_Clear();  // negative or >= 2**64
    throw py::value_error(std::string(name) + " must be an integer in [0, 2**64), got " + str_of(i));
  }
  return static_cast<std::uint64_t>(x);
}

// _count: an integer >= minimum. Values >= 2**63 saturate to INT64_MAX: past num_pages < 2**31 pages whatever the
// page size, they are refused exactly as the Python pool refuses the exact value.
std::int64_t to_count(const char* name, py::handle v, std::int64_t minimum) {
  const std::string bound = std::string(name) + " must be an integer >= " + std::to_string(minimum) + ", got ";
  PyObject* raw = as_index(v);
  if (raw == nullptr) throw py::value_error(bound + type_name_of(v));
  py::object i = py::reinterpret_steal<py::object>(raw);
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(i.ptr(), &overflow);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow > 0) x = std::numeric_limits<long long>::max();
  if (overflow < 0 || x < minimum) throw py::value_error(bound + str_of(i));
  return static_cast<std::int64_t>(x);
}

// _seconds: float(value), finite and >= 0 (> 0 when positive).
double to_seconds(const char* name, py::handle v, bool positive) {
  double x;
  if (PyFloat_CheckExact(v.ptr())) {
    x = PyFloat_AS_DOUBLE(v.ptr());
  } else {
    PyObject* f = PyNumber_Float(v.ptr());
    if (f == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError))
        throw py::error_already_set();  // e.g. OverflowError, as float() raises it
      PyErr_Clear();
      throw py::value_error(std::string(name) + " must be a finite number of seconds, got " + repr_of(v));
    }
    x = PyFloat_AS_DOUBLE(f);
    Py_DECREF(f);
  }
  if (!std::isfinite(x) || x < 0 || (positive && x == 0))
    throw py::value_error(std::string(name) + " must be a finite number of seconds " + (positive ? "> 0" : ">= 0") +
                          ", got " + repr_of(v));
  return x;
}

// _now: None (the core reads steady_clock) or float(now), finite. float()'s own errors propagate unchanged.
MaybeTime to_now(py::handle v) {
  if (!v || v.is_none()) return std::nullopt;  // null: argument not passed
  double x;
  if (PyFloat_CheckExact(v.ptr())) {
    x = PyFloat_AS_DOUBLE(v.ptr());
  } else {
    PyObject* f = PyNumber_Float(v.ptr());
    if (f == nullptr) throw py::error_already_set();
    x = PyFloat_AS_DOUBLE(f);
    Py_DECREF(f);
  }
  if (!std::isfinite(x)) throw py::value_error("now must be a finite time in seconds, got " + repr_of(v));
  return x;
}

// `a, b = key` with Python's unpacking errors.
std::pair<py::object, py::object> unpack2(py::handle key) {
  PyObject* k = key.ptr();
  if (PyTuple_CheckExact(k) || PyList_CheckExact(k)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(k);
    if (n == 2) {
      PyObject** items = PySequence_Fast_ITEMS(k);
      return {py::reinterpret_borrow<py::object>(items[0]), py::reinterpret_borrow<py::object>(items[1])};
    }
    if (n > 2) throw py::value_error("too many values to unpack (expected 2)");
    throw py::value_error("not enough values to unpack (expected 2, got " + std::to_string(n) + ")");
  }
  PyObject* it = PyObject_GetIter(k);
  if (it == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
    PyErr_Clear();
    throw py::type_error("cannot unpack non-iterable " + type_name_of(key) + " object");
  }
  py::object iter = py::reinterpret_steal<py::object>(it);
  py::object items[3];
  int got = 0;
  for (; got < 3; ++got) {
    PyObject* x = PyIter_Next(it);
    if (x == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      break;
    }
    items[got] = py::reinterpret_steal<py::object>(x);
  }
  if (got == 3) throw py::value_error("too many values to unpack (expected 2)");
  if (got < 2) throw py::value_error("not enough values to unpack (expected 2, got " + std::to_string(got) + ")");
  return {std::move(items[0]), std::move(items[1])};
}

// Page-list buffer for one call, borrowed from a per-thread spare so that steady-state calls do not allocate. It is
// filled without the GIL and copied into a fresh array with it; a call re-entered on the same thread while the array
// is allocated (a finalizer run by the garbage collector) finds no spare and uses its own buffer.
class ScratchPages {
 public:
  ScratchPages() : buf_(std::move(spare())) { buf_.clear(); }
  ~ScratchPages() {
    if (buf_.capacity() <= kKeep) spare() = std::move(buf_);  // do not keep a huge buffer alive forever
  }
  ScratchPages(const ScratchPages&) = delete;
  ScratchPages& operator=(const ScratchPages&) = delete;
  std::vector<PageId>* get() { return &buf_; }
  const std::vector<PageId>& operator*() const { return buf_; }

 private:
  static constexpr std::size_t kKeep = std::size_t{1} << 16;
  static std::vector<PageId>& spare() {
    thread_local std::vector<PageId> v;
    return v;
  }
  std::vector<PageId> buf_;
};

// A fresh 1-D int32 array holding `pages` (numpy C API through pybind11's table: no shape/stride vectors).
py::object to_array(const std::vector<PageId>& pages) {
  auto& api = py::detail::npy_api::get();
  Py_intptr_t dims[1] = {static_cast<Py_intptr_t>(pages.size())};
  PyObject* descr = api.PyArray_DescrFromType_(py::detail::npy_api::NPY_INT32_);  // new reference, stolen below
  if (descr == nullptr) throw py::error_already_set();
  PyObject* arr = api.PyArray_NewFromDescr_(api.PyArray_Type_, descr, 1, dims, nullptr, nullptr, 0, nullptr);
  if (arr == nullptr) throw py::error_already_set();
  if (!pages.empty()) std::memcpy(py::detail::array_proxy(arr)->data, pages.data(), pages.size() * sizeof(PageId));
  return py::reinterpret_steal<py::object>(arr);
}

// numpy array that owns a std::vector's buffer (no copy).
py::array_t<PageId> adopt(std::unique_ptr<std::vector<PageId>> v) {
  if (v->empty()) return py::array_t<PageId>(0);
  const auto n = static_cast<py::ssize_t>(v->size());
  PageId* data = v->data();
  py::capsule owner(v.get(), [](void* p) { delete static_cast<std::vector<PageId>*>(p); });
  v.release();
  return py::array_t<PageId>({n}, {static_cast<py::ssize_t>(sizeof(PageId))}, data, owner);
}

py::object pages_or_none(bool ok, const std::vector<PageId>& pages) {
  if (!ok) return py::none();
  return to_array(pages);
}

// ----------------------------------------------------------------------------------------------- fast-call methods
// A method is a spec (name, parameter names, how many are required, docstring with __text_signature__) and an
// implementation taking the pool and its arguments (null handles for optional arguments not passed).
constexpr int kMaxParams = 5;
using Impl = py::object (*)(PrefixBlockPool&, const py::handle*);

struct FastMethod {
  const char* name;
  std::array<const char*, kMaxParams> params;
  int num_params;
  int num_required;
  const char* doc;
  Impl impl;
  std::array<PyObject*, kMaxParams> interned{};  // parameter names, interned at import
  PyMethodDef def{};
};

// Binds positional and keyword arguments to parameters, with Python's TypeErrors for bad calls.
void bind_args(const FastMethod& m, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, py::handle* out) {
  auto fn = [&m] { return std::string("PrefixBlockPool.") + m.name + "()"; };  // error messages only
  if (nargs > m.num_params)
    throw py::type_error(fn() + " takes at most " + std::to_string(m.num_params) + " arguments (" +
                         std::to_string(nargs) + " given)");
  for (Py_ssize_t i = 0; i < nargs; ++i) out[i] = args[i];
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* kw = PyTuple_GET_ITEM(kwnames, k);
    int at = -1;
    for (int i = 0; i < m.num_params && at < 0; ++i)
      if (kw == m.interned[i]) at = i;  // the usual case: both interned
    for (int i = 0; i < m.num_params && at < 0; ++i)
      if (PyUnicode_Compare(kw, m.interned[i]) == 0) at = i;
    if (at < 0) throw py::type_error(fn() + " got an unexpected keyword argument '" + str_of(kw) + "'");
    if (out[at]) throw py::type_error(fn() + " got multiple values for argument '" + m.params[at] + "'");
    out[at] = args[nargs + k];
  }
  for (int i = 0; i < m.num_required; ++i)
    if (!out[i]) throw py::type_error(fn() + " missing required argument '" + m.params[i] + "'");
}

// The current C++ exception as a Python error (the pybind11 translator's mapping, for the fast-call methods).
void set_python_error() {
  try {
    throw;
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const relaygr::KeyError& e) {
    PyErr_SetString(PyExc_KeyError, e.what());
  } catch (const relaygr::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const relaygr::InvariantError& e) {
    PyErr_SetString(PyExc_AssertionError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::overflow_error& e) {
    PyErr_SetString(PyExc_OverflowError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}

// The C++ pool of `self` (an instance of the bound class: the method descriptor checked the type). pybind11 hands
// out uninitialized storage for an instance whose __init__ never ran (PrefixBlockPool.__new__(cls)); refuse it.
PrefixBlockPool& self_pool(PyObject* self) {
  auto* inst = reinterpret_cast<py::detail::instance*>(self);
  if (!inst->get_value_and_holder().holder_constructed())
    throw py::type_error("PrefixBlockPool.__init__() was not called on this instance");
  return py::cast<PrefixBlockPool&>(py::handle(self));
}

// The C++ pool of `self` for members bound through pybind11's dispatcher, which does not check the type of `self`
// when it is taken as a handle: checked here before self_pool reads it as an instance.
PrefixBlockPool& pool_of(py::handle self) {
  if (!py::isinstance<PrefixBlockPool>(self))
    throw py::type_error("descriptor of PrefixBlockPool needs a PrefixBlockPool, got " + type_name_of(self));
  return self_pool(self.ptr());
}

// A getter of the pool as a member taking `self` as a handle (so an instance whose __init__ never ran is refused).
template <typename R>
std::function<R(py::handle)> pool_getter(R (PrefixBlockPool::*get)() const) {
  return [get](py::handle self) { return (pool_of(self).*get)(); };
}

template <FastMethod* M>
PyObject* call_fast(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  try {
    py::handle a[kMaxParams];
    bind_args(*M, args, PyVectorcall_NARGS(nargs), kwnames, a);
    return M->impl(self_pool(self), a).release().ptr();
  } catch (...) {
    set_python_error();
    return nullptr;
  }
}

// ---- implementations: convert in the reference's order, release the GIL for the core call, build the result.
py::object insert_impl(PrefixBlockPool& p, const py::handle* a) {
  const std::uint64_t u = to_u64("user_id", a[0]);
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  const std::int64_t n = to_count("num_tokens", a[2], 1);
  const double ttl = a[3] ? to_seconds("ttl_s", a[3], false) : 0.0;
  const MaybeTime t = to_now(a[4]);
  ScratchPages pages;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = p.insert(u, f, n, ttl, t, pages.get());
  }
  return pages_or_none(ok, *pages);
}

py::object extend_impl(PrefixBlockPool& p, const py::handle* a) {
  const std::uint64_t nf = to_u64("new_fingerprint", a[2]);
  const std::int64_t n = to_count("num_tokens", a[3], 1);
  const MaybeTime t = to_now(a[4]);
  const std::uint64_t u = to_u64("user_id", a[0]);
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  ScratchPages pages;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = p.extend(u, f, nf, n, t, pages.get());
  }
  return pages_or_none(ok, *pages);
}

py::object pin_impl(PrefixBlockPool& p, const py::handle* a) {
  const std::uint64_t u = to_u64("user_id", a[0]);
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  const MaybeTime t = to_now(a[2]);
  ScratchPages pages;
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = p.pin(u, f, t, pages.get());
  }
  return pages_or_none(ok, *pages);
}

// f(user_id, fingerprint, now=None), validating `now` first as the reference does.
template <class R, R (PrefixBlockPool::*Method)(std::uint64_t, std::uint64_t, MaybeTime)>
py::object keyed_impl(PrefixBlockPool& p, const py::handle* a) {
  const MaybeTime t = to_now(a[2]);
  const std::uint64_t u = to_u64("user_id", a[0]);
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  if constexpr (std::is_void_v<R>) {
    {
      py::gil_scoped_release nogil;
      (p.*Method)(u, f, t);
    }
    return py::none();
  } else {
    R r;
    {
      py::gil_scoped_release nogil;
      r = (p.*Method)(u, f, t);
    }
    return py::bool_(r);
  }
}

py::object lease_impl(PrefixBlockPool& p, const py::handle* a) {
  const double ttl = to_seconds("ttl_s", a[2], true);
  const MaybeTime t = to_now(a[3]);
  const std::uint64_t u = to_u64("user_id", a[0]);
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  bool ok;
  {
    py::gil_scoped_release nogil;
    ok = p.lease(u, f, ttl, t);
  }
  return py::bool_(ok);
}

py::object expire_impl(PrefixBlockPool& p, const py::handle* a) {
  const MaybeTime t = to_now(a[0]);
  std::int64_t n;
  {
    py::gil_scoped_release nogil;
    n = p.expire(t);
  }
  return py::int_(n);
}

py::object lookup_impl(PrefixBlockPool& p, const py::handle* a) {
  const std::uint64_t u = to_u64("user_id", a[0]);
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  std::optional<std::int64_t> n;
  {
    py::gil_scoped_release nogil;
    n = p.lookup(u, f);
  }
  if (!n) return py::none();
  return py::int_(*n);
}

py::object entries_of_impl(PrefixBlockPool& p, const py::handle* a) {
  const std::uint64_t u = to_u64("user_id", a[0]);
  std::vector<std::pair<std::uint64_t, std::int64_t>> entries;
  {
    py::gil_scoped_release nogil;
    entries = p.entries_of(u);
  }
  py::list out(entries.size());
  for (std::size_t i = 0; i < entries.size(); ++i)
    out[i] = py::make_tuple(py::int_(entries[i].first), py::int_(entries[i].second));
  return out;
}

py::object pages_of_impl(PrefixBlockPool& p, const py::handle* a) {
  const std::uint64_t u = to_u64("user_id", a[0]);  // the reference converts under its lock: same order
  const std::uint64_t f = to_u64("fingerprint", a[1]);
  ScratchPages pages;
  {
    py::gil_scoped_release nogil;
    p.pages_of(u, f, pages.get());
  }
  return to_array(*pages);
}

py::object page_table_impl(PrefixBlockPool& p, const py::handle* a) {
  // Convert keys in order; a bad key is reported only if no earlier key is missing (the reference resolves key by
  // key, so a KeyError for an earlier key wins).
  std::vector<PrefixKey> keys;
  std::exception_ptr bad_key;
  try {
    const Py_ssize_t hint = PyObject_LengthHint(a[0].ptr(), 0);
    if (hint > 0) keys.reserve(static_cast<std::size_t>(hint));
    else if (hint < 0) PyErr_Clear();
    for (py::handle key : py::iter(a[0])) {
      auto kv = unpack2(key);
      const std::uint64_t u = to_u64("user_id", kv.first);
      const std::uint64_t f = to_u64("fingerprint", kv.second);
      keys.push_back(PrefixKey{u, f});
    }
  } catch (...) {
    bad_key = std::current_exception();
  }
  const std::size_t n = keys.size();
  py::array_t<std::int32_t> indptr(static_cast<py::ssize_t>(n + 1));
  py::array_t<std::int32_t> last(static_cast<py::ssize_t>(n));
  std::int32_t* indptr_data = indptr.mutable_data();
  std::int32_t* last_data = last.mutable_data();
  auto indices = std::make_unique<std::vector<PageId>>();
  {
    py::gil_scoped_release nogil;
    p.page_table(keys.data(), n, indptr_data, last_data, indices.get());
  }
  if (bad_key) std::rethrow_exception(bad_key);
  return py::make_tuple(indptr, adopt(std::move(indices)), last);
}

FastMethod kInsert{
    "insert", {"user_id", "fingerprint", "num_tokens", "ttl_s", "now"}, 5, 3,
    "insert($self, /, user_id, fingerprint, num_tokens, ttl_s=0.0, now=None)\n--\n\n"
    "Create an entry for a prefix of ``num_tokens`` tokens and return its pages.\n\n"
    "The new entry is pinned by one reference (the caller writes its KV, then calls ``unpin``) and, when\n"
    "``ttl_s > 0``, holds a lease for ``ttl_s`` seconds. LRU entries are evicted as needed.\n\n"
    "Returns\n-------\nnumpy.ndarray of int32, shape [ceil(num_tokens / page_size)], or None\n"
    "    The entry's page ids in token order; None when the pages cannot be had (``refused_inserts``) or the\n"
    "    pinned-page budget would be exceeded (``refused_leases``). On None nothing changed.",
    &insert_impl};
FastMethod kExtend{
    "extend", {"user_id", "fingerprint", "new_fingerprint", "num_tokens", "now"}, 5, 4,
    "extend($self, /, user_id, fingerprint, new_fingerprint, num_tokens, now=None)\n--\n\n"
    "Grow a pinned entry to ``num_tokens`` tokens and re-key it to ``new_fingerprint``.\n\n"
    "Returns all of the entry's pages (int32, token order), or None when the extra pages cannot be had or would\n"
    "cross the pinned-page budget (nothing changed).",
    &extend_impl};
FastMethod kPin{"pin", {"user_id", "fingerprint", "now"}, 3, 2,
                "pin($self, /, user_id, fingerprint, now=None)\n--\n\n"
                "Take a reference on a cached entry (a ranking read); return its pages, or None on a miss.",
                &pin_impl};
FastMethod kUnpin{"unpin", {"user_id", "fingerprint", "now"}, 3, 2,
                  "unpin($self, /, user_id, fingerprint, now=None)\n--\n\n"
                  "Drop a reference taken by ``insert`` or ``pin``; the entry becomes most-recently-used.",
                  &keyed_impl<void, &PrefixBlockPool::unpin>};
FastMethod kLease{"lease", {"user_id", "fingerprint", "ttl_s", "now"}, 4, 3,
                  "lease($self, /, user_id, fingerprint, ttl_s, now=None)\n--\n\n"
                  "Pin a cached entry for ``ttl_s`` seconds (or extend its lease). False if over the pinned budget.",
                  &lease_impl};
FastMethod kReleaseLease{
    "release_lease", {"user_id", "fingerprint", "now"}, 3, 2,
    "release_lease($self, /, user_id, fingerprint, now=None)\n--\n\n"
    "End an entry's lease. True when a live lease ended, False when it had already expired (the expiry is\n"
    "counted). Raises ValueError when the entry has no lease to end (never leased, or already released).",
    &keyed_impl<bool, &PrefixBlockPool::release_lease>};
FastMethod kHasLease{"has_lease", {"user_id", "fingerprint", "now"}, 3, 2,
                     "has_lease($self, /, user_id, fingerprint, now=None)\n--\n\n"
                     "True while the entry holds a live lease.",
                     &keyed_impl<bool, &PrefixBlockPool::has_lease>};
FastMethod kFree{"free", {"user_id", "fingerprint", "now"}, 3, 2,
                 "free($self, /, user_id, fingerprint, now=None)\n--\n\n"
                 "Drop an unpinned entry and return its pages to the free list.",
                 &keyed_impl<void, &PrefixBlockPool::free>};
FastMethod kExpire{"expire", {"now"}, 1, 0,
                   "expire($self, /, now=None)\n--\n\n"
                   "Expire leases whose deadline has passed; return how many expired.",
                   &expire_impl};
FastMethod kLookup{"lookup", {"user_id", "fingerprint"}, 2, 2,
                   "lookup($self, /, user_id, fingerprint)\n--\n\n"
                   "The cached entry's token count, or None. Does not touch LRU order or counters.",
                   &lookup_impl};
FastMethod kEntriesOf{"entries_of", {"user_id"}, 1, 1,
                      "entries_of($self, /, user_id)\n--\n\n"
                      "``[(fingerprint, num_tokens), ...]`` of a user's cached entries, oldest insert first.",
                      &entries_of_impl};
FastMethod kPagesOf{"pages_of", {"user_id", "fingerprint"}, 2, 2,
                    "pages_of($self, /, user_id, fingerprint)\n--\n\n"
                    "The entry's page ids (int32) in token order. KeyError if not cached.",
                    &pages_of_impl};
FastMethod kPageTable{
    "page_table", {"keys"}, 1, 1,
    "page_table($self, /, keys)\n--\n\n"
    "Paged-KV page table of a batch of entries (FlashInfer / NVIDIA HSTU layout).\n\n"
    "Parameters\n----------\nkeys : iterable of (user_id, fingerprint), length B\n\n"
    "Returns\n-------\nkv_indptr : int32 [B+1]\n    Offsets into ``kv_indices``.\n"
    "kv_indices : int32 [nnz]\n    Page ids, entry after entry, in token order.\n"
    "kv_last_page_len : int32 [B]\n    Tokens in each entry's last page, in ``1 .. page_size``.",
    &page_table_impl};

template <FastMethod* M>
void add_fast_method(py::class_<PrefixBlockPool>& cls) {
  for (int i = 0; i < M->num_params; ++i) {
    M->interned[i] = PyUnicode_InternFromString(M->params[i]);  // kept for the life of the process
    if (M->interned[i] == nullptr) throw py::error_already_set();
  }
  M->def = PyMethodDef{M->name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(&call_fast<M>)),
                       METH_FASTCALL | METH_KEYWORDS, M->doc};
  PyObject* descr = PyDescr_NewMethod(reinterpret_cast<PyTypeObject*>(cls.ptr()), &M->def);
  if (descr == nullptr) throw py::error_already_set();
  cls.attr(M->name) = py::reinterpret_steal<py::object>(descr);
}

constexpr const char* kPoolDoc = R"doc(Paged pool of cached user prefixes (C++ core).

Leases, LRU eviction and a pinned-page budget over preallocated pages.

Same API, return values and errors as the pure-Python ``relaygr_engine._pool_py.PrefixBlockPool``; every method is
thread safe and releases the GIL while the pool works.

Parameters
----------
num_pages : int
    Number of preallocated pages, in ``[1, 2**31)``.
page_size : int
    Tokens per page, in ``[1, 2**31)``.
max_pinned_pages : int, optional
    Upper bound on pages held by pinned entries, in ``[1, num_pages]``; defaults to ``num_pages``.
)doc";

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "relaygr-engine C++ core: the prefix KV block pool.";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const relaygr::KeyError& e) {
      PyErr_SetString(PyExc_KeyError, e.what());
    } catch (const relaygr::ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const relaygr::InvariantError& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });

  m.def("monotonic", &relaygr::monotonic_seconds,
        "Seconds on the clock the pool reads when ``now`` is None (steady_clock; time.monotonic() on Linux).");

  py::class_<PrefixBlockPool> cls(m, "PrefixBlockPool", kPoolDoc);
  cls.attr("implementation") = "cpp";

  cls.def(py::init([](py::handle num_pages, py::handle page_size, py::handle max_pinned_pages) {
            const std::int64_t n = to_count("num_pages", num_pages, 1);
            const std::int64_t ps = to_count("page_size", page_size, 1);
            PrefixBlockPool::check_shape(n, ps);
            std::optional<std::int64_t> mp;
            if (!max_pinned_pages.is_none()) mp = to_count("max_pinned_pages", max_pinned_pages, 1);
            return std::make_unique<PrefixBlockPool>(n, ps, mp);
          }),
          py::arg("num_pages"), py::arg("page_size"), py::arg("max_pinned_pages") = py::none());

  // Trivial getters keep the GIL: the core never waits on the GIL while holding its mutex, so this cannot deadlock.
  // Every member takes `self` as a handle and goes through pool_of (see there).
  cls.def_property_readonly("num_pages", pool_getter(&PrefixBlockPool::num_pages))
      .def_property_readonly("page_size", pool_getter(&PrefixBlockPool::page_size))
      .def_property_readonly("max_pinned_pages", pool_getter(&PrefixBlockPool::max_pinned_pages))
      .def_property_readonly("num_free_pages", pool_getter(&PrefixBlockPool::num_free_pages), "Pages owned by no entry.")
      .def_property_readonly("num_evictable_pages", pool_getter(&PrefixBlockPool::num_evictable_pages),
                             "Pages owned by unpinned entries (reclaimable by eviction).")
      .def_property_readonly("num_pinned_pages", pool_getter(&PrefixBlockPool::num_pinned_pages),
                             "Pages owned by pinned entries.")
      .def_property_readonly("num_used_pages", pool_getter(&PrefixBlockPool::num_used_pages))
      .def_property_readonly("num_entries", pool_getter(&PrefixBlockPool::num_entries))
      .def("__len__", [](py::handle self) { return pool_of(self).num_entries(); })
      .def("__contains__",
           [](py::handle self, py::handle key) {
             const PrefixBlockPool& p = pool_of(self);
             auto kv = unpack2(key);
             const std::uint64_t u = to_u64("user_id", kv.first);
             const std::uint64_t f = to_u64("fingerprint", kv.second);
             return p.contains(u, f);
           })
      .def("__repr__", [](py::handle self) {
        const PrefixBlockPool& p = pool_of(self);
        return "PrefixBlockPool(implementation='cpp', num_pages=" + std::to_string(p.num_pages()) +
               ", page_size=" + std::to_string(p.page_size()) +
               ", max_pinned_pages=" + std::to_string(p.max_pinned_pages()) +
               ", entries=" + std::to_string(p.num_entries()) + ", used_pages=" + std::to_string(p.num_used_pages()) +
               ")";
      });

  add_fast_method<&kInsert>(cls);
  add_fast_method<&kExtend>(cls);
  add_fast_method<&kPin>(cls);
  add_fast_method<&kUnpin>(cls);
  add_fast_method<&kLease>(cls);
  add_fast_method<&kReleaseLease>(cls);
  add_fast_method<&kHasLease>(cls);
  add_fast_method<&kFree>(cls);
  add_fast_method<&kExpire>(cls);
  add_fast_method<&kLookup>(cls);
  add_fast_method<&kEntriesOf>(cls);
  add_fast_method<&kPagesOf>(cls);
  add_fast_method<&kPageTable>(cls);

  cls.def(
      "stats",
      [](py::handle self) {
        const PrefixBlockPool& p = pool_of(self);
        PrefixBlockPool::Stats s;
        {
          py::gil_scoped_release nogil;
          s = p.stats();
        }
        py::dict out;
        for (const auto& kv : s) out[kv.first] = py::int_(kv.second);
        return out;
      },
      "Counters and gauges as a flat dict of ints (the same keys as the Python pool).");

  cls.def(
      "check_invariants",
      [](py::handle self) {
        const PrefixBlockPool& p = pool_of(self);
        py::gil_scoped_release nogil;
        p.check_invariants();
      },
      "Assert the pool's internal invariants (tests and debugging); raises AssertionError.");
}
