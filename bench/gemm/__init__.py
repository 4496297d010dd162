"""GEMM investigation tools: the FP8 ragged-row and ragged-reduction GEMMs' kernels and tilings next to
DeepGEMM (``ragged_rows``, ``ragged_reduction``), each FP8 grouped GEMM against its roofline (``breakdown``),
Nsight Compute on one GEMM (``ncu.sh``), our GEMMs on DeepGEMM's splits (``vs_deepgemm``), the ragged-row GEMM's
cycles tile by tile in an instrumented copy (``tile_probe``)."""
