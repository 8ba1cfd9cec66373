// pybind11 face of the core (module tnt_comm._core). Thin: the Python layer validates
// arrays and owns the user-facing messages; here arrays become pointers, every wait
// runs with the GIL released, and C++ exceptions become tnt_comm exceptions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "c_api.h"
#include "collectives.h"
#include "errors.h"
#include "fused.h"
#include "p2p.h"
#include "plan.h"
#include "runtime.h"

namespace py = pybind11;

namespace tnt {
namespace {

// numpy's dtype.name runs Python code (~1-10 us, more than a small collective): the
// builtin numeric types are named from the C fields, anything else asks numpy.
std::string dtype_name_of(const py::dtype& dt) {
  const char kind = dt.kind();
  const auto bits = std::to_string(8 * dt.itemsize());
  if (dt.num() < 24) {  // NPY_NTYPES_LEGACY: a builtin type, no extension dtype
    switch (kind) {
      case 'f': return "float" + bits;
      case 'i': return "int" + bits;
      case 'u': return "uint" + bits;
      case 'c': return "complex" + bits;
      case 'b': return "bool";
      default: break;
    }
  }
  return py::str(dt.attr("name"));
}

ArrayDesc describe(const py::array& a) {
  ArrayDesc d;
  d.dtype = dtype_name_of(a.dtype());
  d.itemsize = a.itemsize();
  d.shape.assign(a.shape(), a.shape() + a.ndim());
  return d;
}

py::capsule owner(std::shared_ptr<FusionBuffer> buf) {
  auto* holder = new std::shared_ptr<FusionBuffer>(std::move(buf));
  return py::capsule(holder, [](void* p) { delete static_cast<std::shared_ptr<FusionBuffer>*>(p); });
}

std::vector<TensorSpec> to_specs(const std::vector<std::tuple<std::string, std::int64_t, std::string>>& raw) {
  std::vector<TensorSpec> specs;
  specs.reserve(raw.size());
  for (const auto& [name, count, dtype] : raw) specs.push_back({name, count, parse_dtype(dtype)});
  return specs;
}

void raise_as(const char* cls, const CommError& e) {
  py::object type = py::module_::import("tnt_comm._errors").attr(cls);
  py::object inst = type(py::str(e.what()), e.code());
  PyErr_SetObject(type.ptr(), inst.ptr());
}

// Note [Buffers outlive requests] for the caller's arrays: when a call fails because
// the engine broke (a stall), its request may still be posted inside MPI, which may
// later read or write the arrays. Their references are then leaked: never freed.
template <class Fn>
void guarded(Engine& engine, std::initializer_list<py::handle> arrays, Fn&& fn) {
  std::vector<py::object> keep;
  for (py::handle a : arrays) keep.push_back(py::reinterpret_borrow<py::object>(a));
  try {
    py::gil_scoped_release release;
    fn();
  } catch (...) {
    if (!engine.broken().empty()) {
      for (auto& k : keep) (void)k.release();
    }
    throw;
  }
}

py::array as_array(const py::dtype& dt, const std::vector<std::int64_t>& shape,
                   std::shared_ptr<FusionBuffer> buf) {
  std::vector<py::ssize_t> dims(shape.begin(), shape.end());
  void* data = buf->data();
  return py::array(dt, dims, data, owner(std::move(buf)));
}

// A send or receive in flight (tnt_comm.Request wraps it).
//
// Note [Borrowed sends]: a send with copy=False holds a reference to the caller's array
// (`borrowed_`) until the message completed, so MPI never reads freed memory: wait() or
// a test() that finds it complete drops the reference; dropping the request before that
// waits for completion first. If the message failed (a stall may leave it posted inside
// MPI), the reference is leaked instead (Note [Buffers outlive requests]).
class PyMessage {
 public:
  PyMessage(std::shared_ptr<Message> m, py::object dtype, std::vector<std::int64_t> shape,
            py::object borrowed = py::object())
      : m_(std::move(m)), dtype_(std::move(dtype)), shape_(std::move(shape)), borrowed_(std::move(borrowed)) {}
  PyMessage(PyMessage&&) = default;
  PyMessage(const PyMessage&) = delete;
  PyMessage& operator=(const PyMessage&) = delete;
  PyMessage& operator=(PyMessage&&) = delete;
  ~PyMessage() {
    if (!borrowed_ || !m_) return;
    bool completed = false;
    {
      py::gil_scoped_release release;
      try {
        m_->wait();
        completed = true;
      } catch (...) {  // reported by wait() to whoever calls it; nobody can now
      }
    }
    if (!completed) (void)borrowed_.release();
  }

  // None for a send; the received array for a receive.
  py::object wait() {
    try {
      py::gil_scoped_release release;
      m_->wait();
    } catch (...) {
      if (borrowed_) (void)borrowed_.release();
      throw;
    }
    borrowed_ = py::object();
    if (dtype_.is_none()) return py::none();
    return as_array(py::dtype::from_args(dtype_), shape_, m_->buffer());
  }
  bool test() {
    bool done = false;
    {
      py::gil_scoped_release release;
      done = m_->test();
    }
    if (done && borrowed_) wait();  // complete: returns at once, drops the array
    return done;
  }

 private:
  std::shared_ptr<Message> m_;
  py::object dtype_;  // None for a send
  std::vector<std::int64_t> shape_;
  py::object borrowed_;  // a copy=False send's array, until the message completed
};

// A communicator (tnt_comm.Communicator wraps it).
class PyComm {
 public:
  explicit PyComm(CommPtr c) : c_(std::move(c)) {}
  const CommPtr& ptr() const { return c_; }
  int rank() const { return c_->rank; }
  int size() const { return c_->size; }
  std::string name() const { return c_->name; }

  void barrier() {
    Engine& e = runtime_engine();
    py::gil_scoped_release release;
    tnt::barrier(e, c_);
  }
  py::array allreduce(const py::array& in, int op) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(in);
    py::array out(in.dtype(), std::vector<py::ssize_t>(in.shape(), in.shape() + in.ndim()));
    const void* src = in.data();
    void* dst = out.mutable_data();
    guarded(e, {in, out}, [&] { tnt::allreduce(e, c_, src, dst, d, static_cast<ReduceOp>(op)); });
    return out;
  }
  void broadcast(py::array& buf, int root) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(buf);
    void* p = buf.mutable_data();
    guarded(e, {buf}, [&] { tnt::broadcast(e, c_, p, d, root); });
  }
  py::array allgather(const py::array& in) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(in);
    const void* src = in.data();
    Gathered g;
    guarded(e, {in}, [&] { g = tnt::allgather(e, c_, src, d); });
    return as_array(in.dtype(), g.shape, std::move(g.data));
  }
  // This rank's block of the reduction: counts are element counts per rank (rank order).
  py::array reduce_scatter(const py::array& in, const std::vector<std::int64_t>& counts, int op) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(in);
    const std::int64_t mine = c_->rank < static_cast<int>(counts.size()) && counts[static_cast<std::size_t>(c_->rank)] > 0
                                  ? counts[static_cast<std::size_t>(c_->rank)] : 0;
    py::array out(in.dtype(), std::vector<py::ssize_t>{static_cast<py::ssize_t>(mine)});
    const void* src = in.data();
    void* dst = out.mutable_data();
    guarded(e, {in, out}, [&] { tnt::reduce_scatter(e, c_, src, dst, d, counts, static_cast<ReduceOp>(op)); });
    return out;
  }
  PyComm split(int color, int key) {
    Engine& e = runtime_engine();
    py::gil_scoped_release release;
    return PyComm(tnt::split(e, c_, color, key));
  }
  // Its id for native code (tnt_comm_c_api.h), valid while the communicator lives.
  std::int64_t native_handle() const { return c_api_register(c_); }
  PyComm dup() {
    Engine& e = runtime_engine();
    py::gil_scoped_release release;
    return PyComm(tnt::dup(e, c_));
  }
  PyMessage isend(const py::array& a, int dest, const std::vector<std::int64_t>& header, bool copy) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(a);
    const void* src = a.data();
    std::shared_ptr<Message> m;
    {
      py::gil_scoped_release release;  // copies the array (copy=True)
      m = tnt::isend(e, c_, src, d, dest, header, copy ? SendBuffer::kCopy : SendBuffer::kBorrow);
    }
    return PyMessage(std::move(m), py::none(), {}, copy ? py::object() : py::object(a));
  }
  PyMessage irecv(int source, const std::vector<std::int64_t>& header, py::object dtype,
                  const std::vector<std::int64_t>& shape) {
    Engine& e = runtime_engine();
    const py::dtype dt = py::dtype::from_args(dtype);
    ArrayDesc d;
    d.dtype = dtype_name_of(dt);
    d.itemsize = dt.itemsize();
    d.shape = shape;
    std::shared_ptr<Message> m = tnt::irecv(e, c_, source, d, header);
    return PyMessage(std::move(m), dt, shape);
  }

 private:
  CommPtr c_;
};

class PyFused {
 public:
  // Reduces over a private duplicate of `comm` (nullptr: the world), Note [One
  // communicator per engine].
  PyFused(const std::vector<std::tuple<std::string, std::int64_t, std::string>>& specs,
          std::int64_t threshold, int op, std::vector<py::object> dtypes, const PyComm* comm,
          std::int64_t slot_align_bytes)
  {
    for (auto& d : dtypes) dtypes_.push_back(py::dtype::from_args(d));
    auto parsed = to_specs(specs);
    Engine& engine = runtime_engine();
    CommPtr over = comm != nullptr ? comm->ptr() : engine.world_comm();
    py::gil_scoped_release release;
    impl_ = std::make_shared<FusedAllreduce>(engine, dup(engine, over), std::move(parsed), threshold,
                                             static_cast<ReduceOp>(op), slot_align_bytes);
  }

  Plan plan() const { return impl_->plan(); }
  // Bucket indices in the order they go on the wire (Note [Large buckets first], fused.cc).
  std::vector<std::size_t> launch_order() const { return impl_->launch_order(); }
  // Element offset of each tensor inside its bucket (spec order).
  std::vector<std::int64_t> slot_offsets() const {
    std::vector<std::int64_t> out;
    for (const TensorSlot& s : impl_->layout().slots) out.push_back(s.offset);
    return out;
  }

  // The Python layer checks the array of submit() against its spec and owns that message;
  // every array is re-checked here (cheaply) so a direct caller cannot corrupt a bucket.
  void submit(std::int64_t index, const py::array& a) {
    submit_items({checked_item(index, a, "submit")});
  }

  // Many tensors in one call: all are checked (errors name the tensor) before any is taken.
  void submit_many(const std::vector<std::int64_t>& indices, const py::sequence& arrays) {
    if (indices.size() != static_cast<std::size_t>(py::len(arrays))) {
      throw std::invalid_argument("FusedAllreduce.submit_many: " + std::to_string(indices.size()) +
                                  " indices but " + std::to_string(py::len(arrays)) + " arrays");
    }
    std::vector<FusedAllreduce::Item> items;
    items.reserve(indices.size());
    for (std::size_t k = 0; k < indices.size(); ++k) {
      items.push_back(checked_item(indices[k], arrays[k], "submit_many"));
    }
    submit_items(items);
  }

  py::list wait() { return results(false); }
  py::list wait_buckets() { return results(true); }

  void close() { impl_->close(); }
  // Its id for native code (tnt_comm_c_api.h), valid while the engine lives.
  std::int64_t native_handle() const { return c_api_register(impl_); }

 private:
  // Releasing the GIL costs more than copying a small tensor (and invites a thread
  // switch per tensor); only copies of this many bytes or more run without it. A submit
  // never waits on communication either way.
  static constexpr std::int64_t kReleaseGilBytes = 64 * 1024;

  // The messages are built only on failure: formatting them cost more than the copy of a
  // 1 KiB tensor (1000 tensors of 256 float32 took ~0.27 ms per round outside MPI).
  FusedAllreduce::Item checked_item(std::int64_t index, py::handle obj, const char* method) const {
    const auto& specs = impl_->specs();
    if (index >= 0 && index < static_cast<std::int64_t>(specs.size()) && py::isinstance<py::array>(obj)) {
      const TensorSpec& spec = specs[static_cast<std::size_t>(index)];
      auto a = py::reinterpret_borrow<py::array>(obj);
      const py::dtype& want = dtypes_[static_cast<std::size_t>(index)];
      PyObject* have = reinterpret_cast<PyObject*>(py::detail::array_proxy(a.ptr())->descr);
      if ((have == want.ptr() || a.dtype().equal(want)) && a.size() == spec.count &&
          (a.flags() & py::array::c_style)) {
        return {index, a.data(), spec.count, spec.dtype};
      }
    }
    throw_bad_item(index, obj, method);
  }

  [[noreturn]] void throw_bad_item(std::int64_t index, py::handle obj, const char* method) const {
    const auto& specs = impl_->specs();
    const std::string where = std::string("FusedAllreduce.") + method + ": ";
    if (index < 0 || index >= static_cast<std::int64_t>(specs.size())) {
      throw std::out_of_range(where + "index " + std::to_string(index) + " is not a tensor index (0.." +
                              std::to_string(specs.size() - 1) + ")");
    }
    const TensorSpec& spec = specs[static_cast<std::size_t>(index)];
    const std::string tensor = "tensor " + std::to_string(index) + " ('" + spec.name + "')";
    if (!py::isinstance<py::array>(obj)) {
      throw TypeError_(where + tensor + " must be a numpy.ndarray, got " +
                       std::string(py::str(obj.get_type().attr("__name__"))) +
                       "; convert it with np.asarray(...)");
    }
    auto a = py::reinterpret_borrow<py::array>(obj);
    const py::dtype& want = dtypes_[static_cast<std::size_t>(index)];
    if (!a.dtype().is(want) && !a.dtype().equal(want)) {
      throw TypeError_(where + tensor + " is " + dtype_name(spec.dtype) +
                       " in the specs but the array is " + std::string(py::str(a.dtype().attr("name"))) +
                       "; convert with array.astype(...)");
    }
    if (a.size() != spec.count) {
      throw std::invalid_argument(where + tensor + " has " + std::to_string(spec.count) +
                                  " elements in the specs but the array has " + std::to_string(a.size()));
    }
    if (!(a.flags() & py::array::c_style)) {
      throw std::invalid_argument(where + tensor + " is not C-contiguous; pass np.ascontiguousarray(array)");
    }
    throw std::logic_error(where + tensor + " failed a check that passes here");
  }

  void submit_items(const std::vector<FusedAllreduce::Item>& items) {
    std::int64_t nbytes = 0;
    for (const auto& it : items) nbytes += it.count * static_cast<std::int64_t>(dtype_size(it.dtype));
    if (nbytes < kReleaseGilBytes) {
      impl_->submit_many(items);
      return;
    }
    py::gil_scoped_release release;
    impl_->submit_many(items);
  }

  py::list results(bool per_bucket) {
    std::vector<FusedResult> results;
    {
      py::gil_scoped_release release;
      results = per_bucket ? impl_->wait_buckets() : impl_->wait();
    }
    const Plan& plan = impl_->plan();
    py::list out;
    // One capsule per bucket buffer; each tensor is a 1-D view into it.
    std::shared_ptr<FusionBuffer> last;
    py::capsule cap;
    for (std::size_t i = 0; i < results.size(); ++i) {
      auto& r = results[i];
      if (r.buffer != last) {
        last = r.buffer;
        cap = owner(r.buffer);
      }
      const py::dtype& dt = dtypes_[per_bucket ? static_cast<std::size_t>(plan[i].front()) : i];
      py::array arr(dt, {r.count}, {dt.itemsize()}, r.buffer->data() + r.offset_bytes, cap);
      out.append(std::move(arr));
    }
    return out;
  }

  std::vector<py::dtype> dtypes_;
  std::shared_ptr<FusedAllreduce> impl_;
};

}  // namespace
}  // namespace tnt

PYBIND11_MODULE(_core, m) {
  using namespace tnt;
  m.doc() = "tnt_comm's C++ core (use the tnt_comm package, not this module)";

  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const StallError& e) {
      raise_as("StallError", e);
    } catch (const CommError& e) {
      raise_as("CommError", e);
    } catch (const TypeError_& e) {
      PyErr_SetString(PyExc_TypeError, e.what());
    }
  });

  m.def("init", [] {
    py::gil_scoped_release release;
    runtime_init();
  });
  m.def("finalize", [] {
    py::gil_scoped_release release;
    runtime_finalize();
  });
  m.def("is_initialized", &runtime_is_initialized);
  m.def("rank", [] { return runtime_engine().world().rank; });
  m.def("size", [] { return runtime_engine().world().size; });
  m.def("local_rank", [] { return runtime_engine().world().local_rank; });
  m.def("local_size", [] { return runtime_engine().world().local_size; });
  m.def("library_version", [] { return runtime_engine().world().library; });
  m.def("timeout", [] { return runtime_engine().config().timeout_s; });
  m.def("abort", [](int code) {
    py::gil_scoped_release release;
    runtime_abort(code);
  });

  m.def("reducible_dtypes", &dtype_names);
  m.def("c_api_address", [] { return reinterpret_cast<std::uintptr_t>(c_api_table()); });
  m.def("world", [] { return PyComm(runtime_engine().world_comm()); });
  m.def("begin_local_work", [] { runtime_engine().begin_local_work(); });
  m.def("end_local_work", [] { runtime_engine().end_local_work(); });

  py::class_<PyComm>(m, "Comm")
      .def_property_readonly("rank", &PyComm::rank)
      .def_property_readonly("size", &PyComm::size)
      .def_property_readonly("name", &PyComm::name)
      .def("barrier", &PyComm::barrier)
      .def("allreduce", &PyComm::allreduce)
      .def("broadcast", &PyComm::broadcast)
      .def("allgather", &PyComm::allgather)
      .def("reduce_scatter", &PyComm::reduce_scatter)
      .def("split", &PyComm::split)
      .def("dup", &PyComm::dup)
      .def("native_handle", &PyComm::native_handle)
      .def("isend", &PyComm::isend)
      .def("irecv", &PyComm::irecv);

  py::class_<PyMessage>(m, "Message")
      .def("wait", &PyMessage::wait)
      .def("test", &PyMessage::test);

  m.def("plan_buckets",
        [](const std::vector<std::tuple<std::string, std::int64_t, std::string>>& specs,
           std::int64_t threshold) { return plan_buckets(to_specs(specs), threshold); });

  py::class_<PyFused>(m, "FusedAllreduce")
      .def(py::init<const std::vector<std::tuple<std::string, std::int64_t, std::string>>&,
                    std::int64_t, int, std::vector<py::object>, const PyComm*, std::int64_t>())
      .def_property_readonly("plan", &PyFused::plan)
      .def_property_readonly("launch_order", &PyFused::launch_order)
      .def_property_readonly("slot_offsets", &PyFused::slot_offsets)
      .def("submit", &PyFused::submit)
      .def("submit_many", &PyFused::submit_many)
      .def("wait", &PyFused::wait)
      .def("wait_buckets", &PyFused::wait_buckets)
      .def("close", &PyFused::close)
      .def("native_handle", &PyFused::native_handle);
}
