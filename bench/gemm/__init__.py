"""GEMM investigation tools: each FP8 grouped GEMM against its roofline (``breakdown``), candidate
tilings side by side (``lab``), Nsight Compute on one GEMM (``ncu.sh``), our GEMMs on DeepGEMM's
splits (``vs_deepgemm``)."""
