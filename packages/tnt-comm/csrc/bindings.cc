// pybind11 face of the core (module tnt_comm._core). Thin: the Python layer validates
// arrays and owns the user-facing messages; here arrays become pointers, every wait
// runs with the GIL released, and C++ exceptions become tnt_comm exceptions.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "collectives.h"
#include "errors.h"
#include "fused.h"
#include "plan.h"
#include "runtime.h"

namespace py = pybind11;

namespace tnt {
namespace {

ArrayDesc describe(const py::array& a) {
  ArrayDesc d;
  d.dtype = py::str(a.dtype().attr("name"));
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

class PyFused {
 public:
  PyFused(const std::vector<std::tuple<std::string, std::int64_t, std::string>>& specs,
          std::int64_t threshold, int op, std::vector<py::object> dtypes)
  {
    for (auto& d : dtypes) dtypes_.push_back(py::dtype::from_args(d));
    auto parsed = to_specs(specs);
    Engine& engine = runtime_engine();
    py::gil_scoped_release release;
    impl_ = std::make_unique<FusedAllreduce>(engine, std::move(parsed), threshold,
                                             static_cast<ReduceOp>(op));
  }

  Plan plan() const { return impl_->plan(); }

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

 private:
  // Releasing the GIL costs more than copying a small tensor (and invites a thread
  // switch per tensor); only copies of this many bytes or more run without it. A submit
  // never waits on communication either way.
  static constexpr std::int64_t kReleaseGilBytes = 64 * 1024;

  FusedAllreduce::Item checked_item(std::int64_t index, py::handle obj, const char* method) const {
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
    return {index, a.data(), a.size(), spec.dtype};
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
  std::unique_ptr<FusedAllreduce> impl_;
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

  m.def("barrier", [] {
    Engine& e = runtime_engine();
    py::gil_scoped_release release;
    barrier(e);
  });
  m.def("allreduce", [](const py::array& in, py::array& out, int op) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(in);
    const void* src = in.data();
    void* dst = out.mutable_data();
    py::gil_scoped_release release;
    allreduce(e, src, dst, d, static_cast<ReduceOp>(op));
  });
  m.def("broadcast", [](py::array& buf, int root) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(buf);
    void* p = buf.mutable_data();
    py::gil_scoped_release release;
    broadcast(e, p, d, root);
  });
  m.def("allgather", [](const py::array& in) {
    Engine& e = runtime_engine();
    const ArrayDesc d = describe(in);
    const void* src = in.data();
    Gathered g;
    {
      py::gil_scoped_release release;
      g = allgather(e, src, d);
    }
    const py::dtype dt = in.dtype();
    std::vector<py::ssize_t> shape(g.shape.begin(), g.shape.end());
    void* data = g.data->data();
    return py::array(dt, shape, data, owner(std::move(g.data)));
  });

  m.def("plan_buckets",
        [](const std::vector<std::tuple<std::string, std::int64_t, std::string>>& specs,
           std::int64_t threshold) { return plan_buckets(to_specs(specs), threshold); });

  py::class_<PyFused>(m, "FusedAllreduce")
      .def(py::init<const std::vector<std::tuple<std::string, std::int64_t, std::string>>&,
                    std::int64_t, int, std::vector<py::object>>())
      .def_property_readonly("plan", &PyFused::plan)
      .def("submit", &PyFused::submit)
      .def("submit_many", &PyFused::submit_many)
      .def("wait", &PyFused::wait)
      .def("wait_buckets", &PyFused::wait_buckets)
      .def("close", &PyFused::close);
}
