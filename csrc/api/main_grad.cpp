// The one translation unit of the extension that talks to Python: main_grad.h.
#include "api/main_grad.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace moegemm::api {

namespace {
// getattr(weight, attr, None) on the weight's own Python object; the caller holds the GIL.
pybind11::object weight_attribute(const at::Tensor& weight, const char* attr) {
  PyObject* obj = THPVariable_Wrap(weight);  // the weight's own Python object (new reference)
  if (obj == nullptr) throw python_error();
  const auto w = pybind11::reinterpret_steal<pybind11::object>(obj);
  PyObject* value = PyObject_GetAttrString(w.ptr(), attr);
  if (value == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw python_error();
    PyErr_Clear();
    return pybind11::none();
  }
  return pybind11::reinterpret_steal<pybind11::object>(value);
}
}  // namespace

MainGradAttributes main_grad_attributes(const at::Tensor& weight, const char* name) {
  if (!weight.defined() || !Py_IsInitialized()) return {};
  pybind11::gil_scoped_acquire gil;
  const pybind11::object main_grad = weight_attribute(weight, "main_grad");
  if (main_grad.is_none()) return {};
  TORCH_CHECK_TYPE(THPVariable_Check(main_grad.ptr()), "moegemm: ", name, ".main_grad must be a float32 tensor, got ",
                   Py_TYPE(main_grad.ptr())->tp_name);
  const int overwrite = PyObject_IsTrue(weight_attribute(weight, "overwrite_main_grad").ptr());
  if (overwrite < 0) throw python_error();
  return {THPVariable_Unpack(main_grad.ptr()), overwrite == 1};
}

}  // namespace moegemm::api
