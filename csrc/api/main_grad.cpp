// The one translation unit of the extension that talks to Python: main_grad.h.
#include "api/main_grad.h"

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace moegemm::api {

std::optional<at::Tensor> main_grad_attribute(const at::Tensor& weight, const char* name) {
  if (!weight.defined() || !Py_IsInitialized()) return std::nullopt;
  pybind11::gil_scoped_acquire gil;
  PyObject* obj = THPVariable_Wrap(weight);  // the weight's own Python object (new reference)
  if (obj == nullptr) throw python_error();
  const auto w = pybind11::reinterpret_steal<pybind11::object>(obj);
  PyObject* attr = PyObject_GetAttrString(w.ptr(), "main_grad");
  if (attr == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw python_error();
    PyErr_Clear();
    return std::nullopt;
  }
  const auto main_grad = pybind11::reinterpret_steal<pybind11::object>(attr);
  if (main_grad.is_none()) return std::nullopt;
  TORCH_CHECK_TYPE(THPVariable_Check(main_grad.ptr()), "moegemm: ", name, ".main_grad must be a float32 tensor, got ",
                   Py_TYPE(main_grad.ptr())->tp_name);
  return THPVariable_Unpack(main_grad.ptr());
}

bool overwrite_main_grad_attribute(const at::Tensor& weight) {
  if (!weight.defined() || !Py_IsInitialized()) return false;
  pybind11::gil_scoped_acquire gil;
  PyObject* obj = THPVariable_Wrap(weight);
  if (obj == nullptr) throw python_error();
  const auto w = pybind11::reinterpret_steal<pybind11::object>(obj);
  PyObject* attr = PyObject_GetAttrString(w.ptr(), "overwrite_main_grad");
  if (attr == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw python_error();
    PyErr_Clear();
    return false;
  }
  const auto flag = pybind11::reinterpret_steal<pybind11::object>(attr);
  const int truth = PyObject_IsTrue(flag.ptr());
  if (truth < 0) throw python_error();
  return truth == 1;
}

}  // namespace moegemm::api
