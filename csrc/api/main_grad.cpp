// The one translation unit of the extension that talks to Python: main_grad.h.
#include "api/main_grad.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace moegemm::api {

namespace {
// getattr(w, attr, None); the caller holds the GIL.
pybind11::object attribute(const pybind11::object& w, const char* attr) {
  PyObject* value = PyObject_GetAttrString(w.ptr(), attr);
  if (value == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw python_error();
    PyErr_Clear();
    return pybind11::none();
  }
  return pybind11::reinterpret_steal<pybind11::object>(value);
}
}  // namespace

MainGrad main_grad_attributes(const at::Tensor& weight, const char* name) {
  if (!weight.defined() || !Py_IsInitialized()) return {};
  pybind11::gil_scoped_acquire gil;
  PyObject* obj = THPVariable_Wrap(weight);  // the weight's own Python object (new reference)
  if (obj == nullptr) throw python_error();
  const auto w = pybind11::reinterpret_steal<pybind11::object>(obj);
  const pybind11::object main_grad = attribute(w, "main_grad");
  if (main_grad.is_none()) return {};
  TORCH_CHECK_TYPE(THPVariable_Check(main_grad.ptr()), "moegemm: ", name, ".main_grad must be a float32 tensor, got ",
                   Py_TYPE(main_grad.ptr())->tp_name);
  const int overwrite = PyObject_IsTrue(attribute(w, "overwrite_main_grad").ptr());
  if (overwrite < 0) throw python_error();
  return {THPVariable_Unpack(main_grad.ptr()), overwrite == 1};
}

}  // namespace moegemm::api
