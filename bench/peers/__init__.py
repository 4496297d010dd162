"""The peers moegemm is measured against, one module each. The suite's peers (``torch_grouped_mm``,
``torchao_rowwise``, ``te_grouped_linear``, ``expert_loop``) offer what ``interface.py`` describes;
``deepgemm`` builds DeepGEMM from a carried source tree and times its grouped FP8 GEMMs."""
