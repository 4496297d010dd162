"""Input validation of docs/design.md#errors, shared by the CUDA and the reference path, the functions and the layers.

Every check runs on the host before any kernel is launched and names the argument, the expected and the
actual value. The layers (``GroupedLinear``, ``GroupedMLP``, the Megatron experts) check their arguments at
construction, each error naming the argument (``check_layer_sizes``, ``check_weight_dtype``, ``check_bool_arg``,
``check_recipe``, ``check_activation``), and their sizes with the same rules (``check_mlp_dims``) as the
functions check their weights. The C++ ops check their own arguments again (they are public ops); nothing here repeats
what only they can see. ``m_splits`` given as a list or CPU tensor is checked here (negative counts, sum ≠ T);
a device tensor is never read on the host unless the checked mode is on (``check_splits=True`` or
``MOEGEMM_CHECK_SPLITS=1``, read once at import), which validates it on the device and raises.
"""

from __future__ import annotations

import numbers
from typing import Sequence, Union

import torch

from ._env import env_flag
from .layout import (ACTIVATIONS, BLOCK, DIM_ALIGN, GLU_ACTIVATIONS, MAX_EXPERTS, MAX_TOKENS, RECIPE_IDS, act_width,
                     ceil_div)

# The default of check_splits, read once at import (tests set it directly).
CHECK_SPLITS = env_flag("MOEGEMM_CHECK_SPLITS")
RECIPES = tuple(RECIPE_IDS)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
W_DTYPES = (torch.bfloat16, torch.float32)

SplitsLike = Union[torch.Tensor, Sequence[int]]


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    return recipe


def check_activation(activation: str) -> str:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(ACTIVATIONS)}, got {activation!r}")
    return activation


def check_num_experts(E: int, what: str) -> None:
    if not 1 <= E <= MAX_EXPERTS:
        raise ValueError(f"{what} must be in [1, {MAX_EXPERTS}], got {E}")


def check_expert_dims(E: int, N: int, K: int, name: str = "weight") -> None:
    """The sizes of an expert weight ``name`` [E, N, K]: 1 <= E <= MAX_EXPERTS, N and K positive multiples
    of DIM_ALIGN. The functions check their weights' shapes with it, the layers their sizes at construction."""
    check_num_experts(E, f"{name}.shape[0] (number of experts)")
    if N <= 0 or N % DIM_ALIGN:
        raise ValueError(f"{name}.shape[1] (N, out_features) must be a positive multiple of {DIM_ALIGN}, got {N}")
    if K <= 0 or K % DIM_ALIGN:
        raise ValueError(f"{name}.shape[2] (K, in_features) must be a positive multiple of {DIM_ALIGN}, got {K}")


def check_int_arg(name: str, value) -> int:
    """A size argument of a layer's constructor: an int (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def check_bool_arg(name: str, value) -> bool:
    """A switch argument of a layer's constructor: True or False (a string or a number here is a mistake, e.g.
    a recipe passed positionally where ``bias`` is)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_weight_dtype(name: str, dtype) -> torch.dtype:
    """The dtype of a layer's weights (``name``: the argument): None (bf16), or one that the functions take."""
    if dtype is None:
        return torch.bfloat16
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype, one of {W_DTYPES}, got {type(dtype).__name__} {dtype!r}")
    if dtype not in W_DTYPES:
        raise TypeError(f"{name} must be one of {W_DTYPES} (the dtype of the expert weights), got {dtype}")
    return dtype


def check_layer_sizes(experts: tuple, *dims: tuple) -> None:
    """A layer's sizes at construction, each ``(argument name, value)``: the experts in [1, MAX_EXPERTS], the
    widths positive multiples of DIM_ALIGN (the functions' rules for its weights), named by the argument."""
    name, E = experts
    E = check_int_arg(name, E)
    check_num_experts(E, name)
    for name, v in dims:
        v = check_int_arg(name, v)
        if v <= 0 or v % DIM_ALIGN:
            raise ValueError(f"{name} must be a positive multiple of {DIM_ALIGN}, got {v}")


def check_x_tensor(x) -> None:
    """``x``: a tensor of one of X_DTYPES (before any cast of it)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in X_DTYPES:
        raise TypeError(f"x.dtype must be one of {X_DTYPES}, got {x.dtype}")


def check_tokens_input(x: torch.Tensor) -> None:
    """``x`` [T, K] for the quantizers: a tensor of one of X_DTYPES with K a positive multiple of DIM_ALIGN."""
    check_x_tensor(x)
    if x.dim() != 2 or x.shape[1] <= 0 or x.shape[1] % DIM_ALIGN:
        raise ValueError(f"x must be [T, K] with K a positive multiple of {DIM_ALIGN}, got shape {tuple(x.shape)}")


def check_weight(weight: torch.Tensor, name: str = "weight") -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(weight).__name__}")
    shape = weight.shape
    if len(shape) != 3:
        raise ValueError(f"{name} must be 3-D [E, N, K], got shape {tuple(shape)}")
    if weight.dtype not in W_DTYPES:
        raise TypeError(f"{name}.dtype must be one of {W_DTYPES}, got {weight.dtype}")
    check_expert_dims(*shape, name)


def _check_mlp_pair(E: int, F1: int, H: int, fc2_shape: tuple, activation: str) -> int:
    """fc1 [E, F1, H] and fc2 of an expert MLP agree (F1 = 2F for GLU activations); -> F."""
    F = act_width(F1, activation)
    if activation in GLU_ACTIVATIONS and F % DIM_ALIGN:
        raise ValueError(f"fc1_weight.shape[1] must be 2*ffn with ffn a multiple of {DIM_ALIGN} for {activation}, got {F1}")
    if tuple(fc2_shape) != (E, H, F):
        raise ValueError(f"fc2_weight must have shape {(E, H, F)} to match fc1_weight {(E, F1, H)}, got "
                         f"{tuple(fc2_shape)}")
    return F


def check_mlp_weights(fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, activation: str) -> tuple:
    """The expert MLP's weights, fc1 [E, F1, H] and fc2 [E, H, F]; -> (E, F1, H, F)."""
    check_weight(fc1_weight, "fc1_weight")
    check_weight(fc2_weight, "fc2_weight")
    E, F1, H = fc1_weight.shape
    F = _check_mlp_pair(E, F1, H, fc2_weight.shape, activation)
    if fc2_weight.device != fc1_weight.device:
        raise ValueError(f"fc2_weight is on {fc2_weight.device} but fc1_weight is on {fc1_weight.device}")
    return E, F1, H, F


def check_mlp_dims(E: int, H: int, F: int, activation: str, names=("fc1_weight", "fc2_weight")) -> int:
    """The sizes of an expert MLP (E experts, hidden H, ffn F) by the rules of ``check_mlp_weights``, before
    its weights exist; -> F1, fc1's output width. ``names``: the weights' names in errors."""
    F1 = 2 * F if activation in GLU_ACTIVATIONS else F
    check_expert_dims(E, F1, H, names[0])
    check_expert_dims(E, H, F, names[1])
    _check_mlp_pair(E, F1, H, (E, H, F), activation)
    return F1


def check_probs(probs, T: int, device: torch.device) -> None:
    if probs is None:
        return
    if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
        raise TypeError(f"probs must be a floating-point tensor, got {getattr(probs, 'dtype', type(probs))}")
    if tuple(probs.shape) != (T,):
        raise ValueError(f"probs must have shape [T] = {(T,)}, got {tuple(probs.shape)}")
    if probs.device != device:
        raise ValueError(f"probs is on {probs.device} but x is on {device}")


def check_x(x: torch.Tensor, K: int, device: torch.device, cuda_path: bool = False) -> None:
    """x [T, K] on ``device``; bf16 on the CUDA path (``cuda_path``), which its kernels take."""
    check_x_tensor(x)
    shape, dtype = x.shape, x.dtype
    if len(shape) != 2:
        raise ValueError(f"x must be 2-D [T, K], got shape {tuple(shape)}")
    if dtype is not torch.bfloat16 and cuda_path:
        raise TypeError(f"x.dtype must be torch.bfloat16 on the CUDA path, got {dtype}")
    if shape[0] > MAX_TOKENS:
        raise ValueError(f"x.shape[0] (tokens) must be at most {MAX_TOKENS}, got {shape[0]}")
    if shape[1] != K:
        raise ValueError(f"x.shape[1] must equal weight.shape[2] = {K}, got {shape[1]}")
    if x.device != device:
        raise ValueError(f"x is on {x.device} but weight is on {device}")
    if not x.is_contiguous():
        raise ValueError(f"x must be contiguous, got strides {x.stride()} for shape {tuple(shape)}")


def check_bias(bias, E: int, N: int, device: torch.device, name: str = "bias") -> None:
    if bias is None:
        return
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(bias).__name__}")
    if tuple(bias.shape) != (E, N):
        raise ValueError(f"{name} must have shape [E, N] = {(E, N)}, got {tuple(bias.shape)}")
    if bias.device != device:
        raise ValueError(f"{name} is on {bias.device} but the weights are on {device}")
    if not bias.is_floating_point():
        raise TypeError(f"{name}.dtype must be floating point, got {bias.dtype}")


def check_fp8_weight(fp8, weight: torch.Tensor, name: str, weight_name: str = "weight",
                     transposed: bool = True) -> None:
    """``name``: the FP8 copies of ``weight`` given to a function, as ``quantize_weight(weight)`` returns them:
    ``(q [E,N,K], s [E,Nb,Kb], qT [E,K,N], sT [E,Kb,Nb])``, float8_e4m3fn and float32 on the weight's device
    (``qT`` and ``sT`` may both be None unless ``transposed``: FP8 inference keeps no transposed copy). Copies of
    a weight of another shape would be read as this one's."""
    parts = ("q", "s", "qT", "sT")
    if not isinstance(fp8, (tuple, list)) or len(fp8) != len(parts):
        got = f"{type(fp8).__name__} of length {len(fp8)}" if isinstance(fp8, (tuple, list)) else type(fp8).__name__
        raise TypeError(f"{name} must be the 4-tuple (q, s, qT, sT) that quantize_weight({weight_name}) returns, "
                        f"got {got}")
    E, N, K = weight.shape
    nb, kb = ceil_div(N, BLOCK), ceil_div(K, BLOCK)
    want = ((torch.float8_e4m3fn, (E, N, K)), (torch.float32, (E, nb, kb)),
            (torch.float8_e4m3fn, (E, K, N)), (torch.float32, (E, kb, nb)))
    if (fp8[2] is None) != (fp8[3] is None):
        raise ValueError(f"{name}: qT and sT must both be tensors or both be None, got "
                         f"{type(fp8[2]).__name__} and {type(fp8[3]).__name__}")
    if transposed and fp8[2] is None:
        raise ValueError(f"{name}: qT and sT are needed here (the call records gradients, or the function takes "
                         "all four copies), got None")
    device = weight.device
    for i, (t, (dtype, shape)) in enumerate(zip(fp8, want)):
        if t is None and i >= 2:
            continue
        if isinstance(t, torch.Tensor) and t.dtype == dtype and t.shape == shape and t.device == device:
            continue  # the common case, with no message built (the layers pass their copies in every call)
        what = f"{name}[{i}] ({parts[i]} of quantize_weight({weight_name}), {weight_name} of shape {(E, N, K)})"
        if not isinstance(t, torch.Tensor) or t.dtype != dtype:
            raise TypeError(f"{what} must be a {dtype} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if t.shape != shape:
            raise ValueError(f"{what} must have shape {shape}, got {tuple(t.shape)}")
        raise ValueError(f"{what} is on {t.device} but {weight_name} is on {device}")


def check_fp8_weights_recipe(fp8, recipe: str, name: str) -> None:
    """FP8 copies of the weights are for the fp8_blockwise recipe: given with another one they would be ignored."""
    if recipe != "fp8_blockwise" and fp8 is not None and not (isinstance(fp8, (tuple, list)) and len(fp8) == 0):
        raise ValueError(f"{name} is for recipe='fp8_blockwise' (the FP8 copies of the weights), but recipe is "
                         f"{recipe!r}: pass {name}=None")


def check_fp8_weight_pair(fp8_weights, fc1_weight: torch.Tensor, fc2_weight: torch.Tensor, transposed: bool) -> None:
    """``fp8_weights`` of the MLP: None (or empty), or
    ``(quantize_weight(fc1_weight), quantize_weight(fc2_weight))``; the transposed copies needed when
    ``transposed`` (a call that records gradients)."""
    if fp8_weights is None or (isinstance(fp8_weights, (tuple, list)) and len(fp8_weights) == 0):
        return
    if not isinstance(fp8_weights, (tuple, list)) or len(fp8_weights) != 2:
        got = (f"{type(fp8_weights).__name__} of length {len(fp8_weights)}" if isinstance(fp8_weights, (tuple, list))
               else type(fp8_weights).__name__)
        raise TypeError("fp8_weights must be the pair (quantize_weight(fc1_weight), quantize_weight(fc2_weight)), "
                        f"got {got}")
    check_fp8_weight(fp8_weights[0], fc1_weight, "fp8_weights[0]", "fc1_weight", transposed)
    check_fp8_weight(fp8_weights[1], fc2_weight, "fp8_weights[1]", "fc2_weight", transposed)


def check_optional_bool(name: str, value) -> None:
    """A per-call switch (``check_splits``, ``is_first_microbatch``): None, True or False."""
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be None, True or False, got {type(value).__name__} {value!r}")


def check_main_grad(weight: torch.Tensor, name: str = "weight") -> None:
    """Megatron's gradient-accumulation fusion: ``weight.main_grad`` must be an fp32 buffer like weight (``name``:
    the weight's argument name in messages)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is None:
        return
    if not isinstance(main_grad, torch.Tensor):
        raise TypeError(f"{name}.main_grad must be a float32 tensor, got {type(main_grad).__name__}")
    if main_grad.dtype != torch.float32:
        raise TypeError(f"{name}.main_grad must be a float32 tensor, got {main_grad.dtype}")
    if main_grad.shape != weight.shape or main_grad.device != weight.device or not main_grad.is_contiguous():
        raise ValueError(f"{name}.main_grad must be contiguous with {name}'s shape {tuple(weight.shape)} on "
                         f"{weight.device}, got {tuple(main_grad.shape)} with strides {main_grad.stride()} on "
                         f"{main_grad.device}")


def checked_mode(check_splits) -> bool:
    return CHECK_SPLITS if check_splits is None else bool(check_splits)


def num_splits(m_splits) -> int:
    """E of a public function's ``m_splits`` (a list, tuple or 1-D tensor): its length, after checking its type and
    rank (the layers take E from their weights)."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1:
            raise ValueError(f"m_splits must be 1-D, got shape {tuple(m_splits.shape)}")
    elif not isinstance(m_splits, (list, tuple)):
        raise TypeError(f"m_splits must be a list of ints or an int32/int64 tensor, got {type(m_splits).__name__}")
    return len(m_splits)


def check_token_count(name: str, T) -> int:
    """A token count given as an argument (make_plan's T): an int in [0, MAX_TOKENS] (a symbolic size under
    torch.compile passes as it is: a tensor's size, checked with the tensor)."""
    if isinstance(T, torch.SymInt):
        return T
    T = check_int_arg(name, T)
    if not 0 <= T <= MAX_TOKENS:
        raise ValueError(f"{name} (tokens) must be in [0, {MAX_TOKENS}], got {T}")
    return T


def splits_to_device(m_splits: SplitsLike, E: int, T: int, device: torch.device, check_splits=None) -> torch.Tensor:
    """Validate ``m_splits`` and return it as an int32/int64 tensor on ``device``.

    Host input (list, tuple, CPU tensor) is checked on the host and copied asynchronously. A tensor on
    ``device`` is returned as it is (never read on the host) unless the checked mode is on. Under
    torch.compile a CPU tensor's counts cannot be read while tracing: the graph checks them when it runs
    (``_assert_host_counts_in_graph``)."""
    check_optional_bool("check_splits", check_splits)
    count = num_splits(m_splits)
    if isinstance(m_splits, torch.Tensor) and m_splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"m_splits.dtype must be torch.int32 or torch.int64, got {m_splits.dtype}")
    if count != E:
        raise ValueError(f"len(m_splits) must equal the number of experts E = {E}, got {count}")
    if isinstance(m_splits, torch.Tensor):
        if m_splits.device.type == "cpu" and device.type != "cpu":
            _check_host_tensor_counts(m_splits, T)
            src = m_splits.contiguous().pin_memory() if torch.cuda.is_available() else m_splits
            return src.to(device, non_blocking=True)
        if m_splits.device != device:
            raise ValueError(f"m_splits is on {m_splits.device} but x is on {device}")
        if m_splits.device.type == "cpu":
            _check_host_tensor_counts(m_splits, T)
        elif checked_mode(check_splits):
            _check_device_counts(m_splits, T)
        return m_splits.contiguous()
    counts = []
    for i, m in enumerate(m_splits):
        if isinstance(m, bool) or not isinstance(m, numbers.Integral):
            raise TypeError(f"m_splits[{i}] must be an int, got {type(m).__name__}")
        counts.append(int(m))
    _check_host_counts(counts, T)
    t = torch.tensor(counts, dtype=torch.int64)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _check_host_counts(counts, T: int) -> None:
    for i, m in enumerate(counts):
        if m < 0:
            raise ValueError(f"m_splits[{i}] must be non-negative, got {m}")
    if sum(counts) != T:
        raise ValueError(f"sum(m_splits) must equal x.shape[0] = {T}, got {sum(counts)}")


def _check_host_tensor_counts(m: torch.Tensor, T: int) -> None:
    if torch.compiler.is_compiling():
        _assert_host_counts_in_graph(m, T)
    else:
        _check_host_counts(m.tolist(), T)


def _assert_host_counts_in_graph(m: torch.Tensor, T) -> None:
    """The host check of a CPU tensor's counts as graph ops (torch._assert_async), for torch.compile, whose tracing
    cannot read them: on the CPU a failed assert raises RuntimeError when the graph runs. T may be symbolic."""
    m = m.long()
    at_most = f" = {T}" if isinstance(T, int) else ""
    torch._assert_async((m >= 0).all(), "moegemm: m_splits must be non-negative")
    torch._assert_async((m <= T).all(), f"moegemm: every count of m_splits must be at most x.shape[0]{at_most}")
    torch._assert_async(m.clamp(0, T).sum() == T, f"moegemm: sum(m_splits) must equal x.shape[0]{at_most}")


def _check_device_counts(m: torch.Tensor, T: int) -> None:
    """Checked mode: one device reduction and one host read (a deliberate sync). The sum is taken over
    counts clamped to [0, T] (E * T cannot overflow int64), so huge counts cannot wrap it to T."""
    m = m.long()
    lo, hi, total = torch.stack([m.min(), m.max(), m.clamp(0, T).sum()]).tolist()
    if lo < 0:
        raise ValueError(f"m_splits must be non-negative, got a count of {lo}")
    if hi > T:
        raise ValueError(f"every count of m_splits must be at most x.shape[0] = {T}, got {hi}")
    if total != T:
        raise ValueError(f"sum(m_splits) must equal x.shape[0] = {T}, got {total}")
