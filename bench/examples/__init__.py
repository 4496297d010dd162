"""Examples that train with moegemm: a small MoE language model (``train_lm``), a DeepSeek-V2-Lite-shaped
one at real width (``train_moe_lm``), and Megatron expert parallelism (``megatron_ep``: numerics,
``megatron_ep_train``: a timed training step; ``dist_setup``: their process group)."""
