"""The GEMM lab (``python -m bench.gemm.lab``): its driver (``__main__.py``) and the C++/CUDA sources of
the extension it builds (``lab.h``, ``lab_binding.cpp``, ``lab_registry.cu``, ``variant.cuh``)."""
