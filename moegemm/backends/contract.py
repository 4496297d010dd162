"""The contract of the layer ops, declared once and by name.

Six ops carry the layers, one per layer and direction: ``linear_fwd``, ``linear_bwd``, ``linear_wgrad``
and ``mlp_fwd``, ``mlp_bwd``, ``mlp_wgrad`` (``torch.ops.moegemm.*`` from the C++ extension, and the same
schemas as ``torch.ops.moegemm_reference.*`` from the reference backend); on the CUDA backend a
differentiable op per layer, ``grouped_linear`` and ``grouped_mlp``, runs them as one C++ autograd node
(``GROUPED_LINEAR``, ``GROUPED_MLP``: schemas only). Each of the six is declared here as a ``LayerOp``:

* its arguments, as in the schema the dispatcher registers;
* every tensor it returns (a ``Slot``): name, shape in named dimensions (``DIMS``), dtype, and when it is
  a real tensor; otherwise it is a ``[0]`` placeholder of its dtype (outputs of an op are never None);
* a forward's ``saved`` list (what its backward takes back), per recipe;
* a backward's ``made`` operands: those of a split backward's weight gradient that the backward makes
  (returned as ``made0, made1, ...``, padded with bf16 placeholders to a fixed count), per recipe;
* a wgrad op's ``wgrad_operands`` list, per recipe: each weight's group is its gradient operand pair,
  then its input operand pair (fp8: column copy and its scales; bf16: the tensors), fc2's group first;
* the weights whose FP8 copies (``quantize_weight``'s ``FP8_WEIGHT_PARTS``) it takes, four tensors each.

Who derives what from this module:

* the C++ entries: ``csrc/api/layer_contract.h``, generated from it (``python -m moegemm.backends.contract``):
  the schemas ``csrc/binding.cpp`` registers and the slot enums the entries index by (``tests/test_contract.py``
  fails while the header is stale);
* the fakes (``fakes.py``): each op's outputs, from its slots;
* the reference backend (``reference.py``): the same schemas as torch ops, lists read and written by name,
  placeholders where the slots say;
* the autograd shells: a split backward's wgrad operands, gathered by name (``Layer.wgrad_gather``).

Adding an output to an op: one ``slot(...)`` line here and ``python -m moegemm.backends.contract``; then the
C++ entry and the reference entry compute it (the fakes follow by themselves). C++ owns the checks of
shapes and dtypes; nothing here checks a tensor.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Callable, NamedTuple, Optional

import torch

from ..layout import (BF16, BLOCK, FP8_BLOCKWISE, PLAN_ROWS, act_width, block_capacity, ceil_div, col_capacity,
                      empty_row_scales, wgrad_dtype)

F8, F32, I32 = torch.float8_e4m3fn, torch.float32, torch.int32
ACT = "act"  # the activations' dtype: x's (bf16 for an FP8 x) forward, dy's backward; always bf16 in C++
PAD = torch.bfloat16  # the dtype of a made slot a recipe does not have
RECIPE_NAMES = {BF16: "bf16", FP8_BLOCKWISE: "fp8"}


class Fp8Weight(NamedTuple):
    """One weight's FP8 copies: ``quantize_weight``'s four tensors, the parts of every FP8 weight an op
    takes (the transposed ones may be None for inference)."""
    q: torch.Tensor
    s: torch.Tensor
    qT: Optional[torch.Tensor]
    sT: Optional[torch.Tensor]


FP8_WEIGHT_PARTS = Fp8Weight._fields

# The named dimensions of the slots' shapes (filled in by each op's ``dims``):
#   T tokens; E experts; E1 = E + 1; P = PLAN_ROWS; linear: N out, K in; MLP: H hidden, F ffn, F1 fc1's
#   output (2F for GLU); C = col_capacity(T, E) and B = block_capacity(T, E), the column copy's width and
#   its scale blocks; Xb = ceil(X / 128), X's scale blocks.
DIMS = "T E E1 P N K H F F1 C B Nb Kb Hb Fb F1b".split()


class Slot(NamedTuple):
    """One tensor an op returns: ``shape`` in ``DIMS`` names, ``dtype`` a torch dtype, ``ACT`` or the name
    of the weight argument whose wgrad dtype it has (``layout.wgrad_dtype``); ``when(a)`` says whether it
    is a real tensor for the op's arguments ``a``. ``row_scales``: 1x128 row scales ``[T, Kb]`` in their
    K-major strides (``layout.empty_row_scales``), else contiguous."""
    name: str
    shape: tuple
    dtype: object
    when: Callable = lambda a: True
    row_scales: bool = False


def slot(name: str, shape: str, dtype, when: Callable = lambda a: True, row_scales: bool = False) -> Slot:
    return Slot(name, tuple(shape.split()), dtype, when, row_scales)


class LayerOp(NamedTuple):
    name: str
    arguments: str  # the schema's argument list
    outputs: tuple  # the returned tensors (Slot), in order; then the saved list, then made0, made1, ...
    dims: Callable  # fills the dimensions (and derived flags) into the arguments' namespace
    saved: Optional[dict] = None  # forward: recipe id -> the saved list's slots
    saves: Optional[str] = None  # forward: the flag argument without which the saved list is empty
    made: Optional[dict] = None  # split backward: recipe id -> the made slots
    made_count: int = 0  # made0 .. made{made_count - 1}: a fixed number of outputs whatever the recipe
    wgrad_operands: Optional[dict] = None  # wgrad op: recipe id -> the wgrad_operands list's names
    fp8_weights: tuple = ()  # the weight arguments whose FP8 copies the op may take, in list order

    @property
    def schema(self) -> str:
        returns = [f"Tensor {s.name}" for s in self.outputs]
        if self.saved is not None:
            returns.append("Tensor[] saved")
        returns += [f"Tensor made{i}" for i in range(self.made_count)]
        ret = returns[0] if len(returns) == 1 else f"({', '.join(returns)})"
        return f"{self.name}({self.arguments}) -> {ret}"


# ---------------------------------------------------------------------------------------------- dimensions
def _tokens(a, rows: torch.Tensor) -> None:
    a.T = rows.shape[0]
    a.C, a.B = col_capacity(a.T, a.E), block_capacity(a.T, a.E)


def _blocks(a, *names: str) -> None:
    for n in names:
        setattr(a, n + "b", ceil_div(getattr(a, n), BLOCK))


def _linear(a, rows: Optional[str]) -> None:
    a.E, a.N, a.K = a.weight.shape
    a.E1, a.P = a.E + 1, PLAN_ROWS
    _blocks(a, "N", "K")
    if rows is not None:
        _tokens(a, getattr(a, rows))


def _mlp(a, rows: Optional[str]) -> None:
    a.E, a.F1, a.H = a.fc1_weight.shape
    a.F = a.fc2_weight.shape[2]
    a.E1, a.P = a.E + 1, PLAN_ROWS
    _blocks(a, "H", "F", "F1")
    if rows is not None:
        _tokens(a, getattr(a, rows))


def _act_of_x(a) -> None:
    a.act = torch.bfloat16 if a.x.dtype == F8 else a.x.dtype


def _linear_fwd_dims(a):
    _linear(a, "x")
    _act_of_x(a)


def _linear_bwd_dims(a):
    _linear(a, "dy")
    a.act, a.defer = a.dy.dtype, a.defer_wgrad and a.need_dw


def _mlp_fwd_dims(a):
    _mlp(a, "x")
    a.F = act_width(a.F1, a.activation)  # the op's reading of fc2's shape
    _act_of_x(a)


def _mlp_bwd_dims(a):
    _mlp(a, "dy")
    a.act, a.defer = a.dy.dtype, a.defer_wgrad and (a.need_dw1 or a.need_dw2)


# ---------------------------------------------------------------------------------------------- the ops
LINEAR_FWD = LayerOp(
    "linear_fwd",
    "Tensor x, Tensor weight, Tensor m_splits, Tensor? bias, int recipe, bool need_dx, bool need_dw, "
    "Tensor? x_scales=None, Tensor[]? fp8_weight=None",
    outputs=(slot("y", "T N", ACT), slot("plan", "P E1", I32)),
    dims=_linear_fwd_dims,
    saved={FP8_BLOCKWISE: (slot("qx", "T K", F8, lambda a: a.need_dw and a.x_scales is None),
                           slot("sx", "T Kb", F32, lambda a: a.need_dw and a.x_scales is None, row_scales=True),
                           slot("qwT", "E K N", F8, lambda a: a.need_dx and not a.fp8_weight),
                           slot("swT", "E Kb Nb", F32, lambda a: a.need_dx and not a.fp8_weight)),
           BF16: (slot("w_bf16", "E N K", ACT, lambda a: a.need_dx and a.weight.dtype != a.act),)},
    fp8_weights=("weight",),
)
LINEAR_BWD = LayerOp(
    "linear_bwd",
    "Tensor dy, Tensor plan, Tensor[] saved, Tensor? x, Tensor weight, Tensor(a!)? main_grad, int recipe, "
    "bool need_dx, bool need_dw, bool need_db, bool defer_wgrad=False, Tensor[]? fp8_weight=None, "
    "Tensor? x_scales=None, bool overwrite_main_grad=False",
    outputs=(slot("dx", "T K", ACT, lambda a: a.need_dx),
             slot("dw", "E N K", "weight", lambda a: a.need_dw and a.main_grad is None and not a.defer),
             slot("db", "E N", F32, lambda a: a.need_db)),
    dims=_linear_bwd_dims,
    made={FP8_BLOCKWISE: (slot("qdyT", "N C", F8, lambda a: a.defer), slot("sdyT", "B N", F32, lambda a: a.defer),
                          slot("qxT", "K C", F8, lambda a: a.defer), slot("sxT", "B K", F32, lambda a: a.defer)),
          BF16: ()},
    made_count=4,
    fp8_weights=("weight",),
)
LINEAR_WGRAD = LayerOp(
    "linear_wgrad",
    "Tensor plan, Tensor[] wgrad_operands, Tensor weight, Tensor(a!)? main_grad, int recipe, "
    "bool overwrite_main_grad=False",
    outputs=(slot("dw", "E N K", "weight", lambda a: a.main_grad is None),),
    dims=lambda a: _linear(a, None),
    wgrad_operands={FP8_BLOCKWISE: ("qdyT", "sdyT", "qxT", "sxT"), BF16: ("dy", "x")},
)

MLP_FWD = LayerOp(
    "mlp_fwd",
    "Tensor x, Tensor fc1_weight, Tensor fc2_weight, Tensor m_splits, Tensor? fc1_bias, Tensor? fc2_bias, "
    "Tensor? probs, int activation, int recipe, Tensor?[] fp8_weights, bool save, bool need_dw1, bool need_dw2, "
    "Tensor? x_scales=None",
    outputs=(slot("y", "T H", ACT), slot("plan", "P E1", I32)),
    dims=_mlp_fwd_dims,
    saved={FP8_BLOCKWISE: (slot("qx", "T H", F8, lambda a: a.need_dw1 and a.x_scales is None),
                           slot("sx", "T Hb", F32, lambda a: a.need_dw1 and a.x_scales is None, row_scales=True),
                           slot("h", "T F1", ACT),
                           slot("qaT", "F C", F8, lambda a: a.need_dw2),
                           slot("saT", "B F", F32, lambda a: a.need_dw2),
                           slot("qw1T", "E H F1", F8, lambda a: not a.fp8_weights),
                           slot("sw1T", "E Hb F1b", F32, lambda a: not a.fp8_weights),
                           slot("qw2T", "E F H", F8, lambda a: not a.fp8_weights),
                           slot("sw2T", "E Fb Hb", F32, lambda a: not a.fp8_weights)),
           BF16: (slot("h", "T F1", ACT),
                  slot("a", "T F", ACT),
                  slot("w1_bf16", "E F1 H", ACT, lambda a: a.fc1_weight.dtype != a.act),
                  slot("w2_bf16", "E H F", ACT, lambda a: a.fc2_weight.dtype != a.act))},
    saves="save",
    fp8_weights=("fc1_weight", "fc2_weight"),
)
MLP_BWD = LayerOp(
    "mlp_bwd",
    "Tensor dy, Tensor plan, Tensor[] saved, Tensor? x, Tensor fc1_weight, Tensor fc2_weight, Tensor? probs, "
    "Tensor?[] fp8_weights, Tensor(a!)? fc1_main_grad, Tensor(b!)? fc2_main_grad, int activation, int recipe, "
    "bool need_dx, bool need_dw1, bool need_dw2, bool need_db1, bool need_db2, bool need_dprobs, bool release_saved, "
    "bool defer_wgrad=False, Tensor? x_scales=None, bool fc1_overwrite_main_grad=False, "
    "bool fc2_overwrite_main_grad=False",
    outputs=(slot("dx", "T H", ACT, lambda a: a.need_dx),
             slot("dw1", "E F1 H", "fc1_weight", lambda a: a.need_dw1 and a.fc1_main_grad is None and not a.defer),
             slot("dw2", "E H F", "fc2_weight", lambda a: a.need_dw2 and a.fc2_main_grad is None and not a.defer),
             slot("db1", "E F1", F32, lambda a: a.need_db1),
             slot("db2", "E H", F32, lambda a: a.need_db2),
             slot("dprobs", "T", F32, lambda a: a.need_dprobs and a.probs is not None)),
    dims=_mlp_bwd_dims,
    made={FP8_BLOCKWISE: (slot("qdyT", "H C", F8, lambda a: a.defer and a.need_dw2),
                          slot("sdyT", "B H", F32, lambda a: a.defer and a.need_dw2),
                          slot("qdhT", "F1 C", F8, lambda a: a.defer and a.need_dw1),
                          slot("sdhT", "B F1", F32, lambda a: a.defer and a.need_dw1),
                          slot("qxT", "H C", F8, lambda a: a.defer and a.need_dw1),
                          slot("sxT", "B H", F32, lambda a: a.defer and a.need_dw1)),
          BF16: (slot("dh", "T F1", ACT, lambda a: a.defer and a.need_dw1),)},
    made_count=6,
    fp8_weights=("fc1_weight", "fc2_weight"),
)
MLP_WGRAD = LayerOp(
    "mlp_wgrad",
    "Tensor plan, Tensor[] wgrad_operands, Tensor fc1_weight, Tensor fc2_weight, Tensor(a!)? fc1_main_grad, "
    "Tensor(b!)? fc2_main_grad, int recipe, bool need_dw1, bool need_dw2, bool fc1_overwrite_main_grad=False, "
    "bool fc2_overwrite_main_grad=False",
    outputs=(slot("dw1", "E F1 H", "fc1_weight", lambda a: a.need_dw1 and a.fc1_main_grad is None),
             slot("dw2", "E H F", "fc2_weight", lambda a: a.need_dw2 and a.fc2_main_grad is None)),
    dims=lambda a: _mlp(a, None),
    wgrad_operands={FP8_BLOCKWISE: ("qdyT", "sdyT", "qaT", "saT", "qdhT", "sdhT", "qxT", "sxT"),
                    BF16: ("dy", "a", "dh", "x")},
)


# The differentiable layer ops of the CUDA backend: forward and backward of one call as one C++ autograd
# node (csrc/api/autograd.cpp) over the entries above, the layers' path without a split backward. x is the
# bf16 input, or with x_scales the FP8 row copy, whose dx goes to dx_target (none computed without one);
# each weight's main_grad is read from its Python attribute when backward runs.
GROUPED_LINEAR = ("grouped_linear(Tensor x, Tensor weight, Tensor m_splits, Tensor? bias, int recipe, "
                  "Tensor? x_scales=None, Tensor? dx_target=None, Tensor[]? fp8_weight=None) -> Tensor y")
GROUPED_MLP = ("grouped_mlp(Tensor x, Tensor fc1_weight, Tensor fc2_weight, Tensor m_splits, Tensor? fc1_bias, "
               "Tensor? fc2_bias, Tensor? probs, int activation, int recipe, Tensor?[] fp8_weights, "
               "Tensor? x_scales=None, Tensor? dx_target=None) -> Tensor y")


class Layer(NamedTuple):
    """A layer's three ops and its differentiable op (``autograd``, a schema). ``wgrad_gather(recipe)``:
    where each of the wgrad op's operands is in the pool ``(*made, *saved, dy, x)`` a split backward has
    (made: the backward's made outputs; saved: the forward's saved list; dy, x: the backward's
    arguments), computed once."""
    name: str
    fwd: LayerOp
    bwd: LayerOp
    wgrad: LayerOp
    autograd: str

    def wgrad_gather(self, recipe: int) -> tuple:
        made = [s.name for s in self.bwd.made[recipe]]
        made += [None] * (self.bwd.made_count - len(made))
        pool = made + [s.name for s in self.fwd.saved[recipe]] + ["dy", "x"]
        return tuple(pool.index(n) for n in self.wgrad.wgrad_operands[recipe])


LINEAR = Layer("linear", LINEAR_FWD, LINEAR_BWD, LINEAR_WGRAD, GROUPED_LINEAR)
MLP = Layer("mlp", MLP_FWD, MLP_BWD, MLP_WGRAD, GROUPED_MLP)
LAYERS = (LINEAR, MLP)
OPS = tuple(op for layer in LAYERS for op in (layer.fwd, layer.bwd, layer.wgrad))


def fp8_weight(op: LayerOp, flat, name: str) -> Optional[Fp8Weight]:
    """Weight argument ``name``'s copies in an op's flat list of FP8 weights (four tensors per weight, in
    ``op.fp8_weights`` order); None when the list is empty (the op quantizes)."""
    if not flat:
        return None
    first = op.fp8_weights.index(name) * len(FP8_WEIGHT_PARTS)
    return Fp8Weight(*flat[first:first + len(FP8_WEIGHT_PARTS)])


def by_name(declared, values) -> dict:
    """A list an op takes (saved, wgrad_operands) by the names its slots are ``declared`` with."""
    return dict(zip((s if isinstance(s, str) else s.name for s in declared), values))


# --------------------------------------------------------------------------- an op's outputs by name
class _Signature:
    """The argument names and defaults of an op's schema, parsed once."""

    def __init__(self, op: LayerOp):
        schema = torch._C.parse_schema(op.schema)
        self.names = [arg.name for arg in schema.arguments]
        self.defaults = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}

    def bind(self, args, kwargs) -> SimpleNamespace:
        a = SimpleNamespace(**self.defaults)
        a.__dict__.update(zip(self.names, args))
        a.__dict__.update(kwargs)
        return a


_SIGNATURES = {op.name: _Signature(op) for op in OPS}


def bind(op: LayerOp, args: tuple, kwargs: dict) -> SimpleNamespace:
    """The op's arguments by name, with its dimensions (``DIMS``) and derived flags."""
    a = _SIGNATURES[op.name].bind(args, kwargs)
    op.dims(a)
    return a


def _dtype(s: Slot, a) -> torch.dtype:
    if s.dtype == ACT:
        return a.act
    if isinstance(s.dtype, str):
        return wgrad_dtype(getattr(a, s.dtype))
    return s.dtype


def outputs(op: LayerOp, a: SimpleNamespace, values: Optional[dict] = None):
    """The op's outputs for arguments ``a`` (``bind``): each slot a real tensor where its ``when`` holds,
    else a ``[0]`` placeholder of its dtype. ``values``: the tensors by name (the reference backend); None:
    new empty tensors of the slots' shapes (the fakes)."""
    like = getattr(a, _SIGNATURES[op.name].names[0])

    def tensor(s: Slot):
        dtype = _dtype(s, a)
        if not s.when(a):
            return like.new_empty((0,), dtype=dtype)
        if values is None:
            shape = tuple(getattr(a, d) for d in s.shape)
            return empty_row_scales(*shape, like.device) if s.row_scales else like.new_empty(shape, dtype=dtype)
        return values[s.name]

    out = [tensor(s) for s in op.outputs]
    if op.saved is not None:
        keep = op.saves is None or getattr(a, op.saves)
        out.append([tensor(s) for s in op.saved[a.recipe]] if keep else [])
    if op.made is not None:
        made = [tensor(s) for s in op.made[a.recipe]]
        out += made + [like.new_empty((0,), dtype=PAD) for _ in range(op.made_count - len(made))]
    return out[0] if len(out) == 1 else tuple(out)


# --------------------------------------------------------------------------------- the C++ header
HEADER = "csrc/api/layer_contract.h"


def _cpp_name(name: str) -> str:
    """``qxT`` -> ``kQxT``, ``w_bf16`` -> ``kWBf16``, ``fc1_weight`` -> ``kFc1Weight``."""
    return "k" + "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def _enum(namespace: str, names, step: int = 1) -> str:
    """``namespace ns { enum : size_t { kA, kB, kCount }; }``; with ``step``, offsets of groups that long."""
    names = list(names)
    if step == 1:
        items = [_cpp_name(n) for n in names] + ["kCount"]
    else:
        items = [f"{_cpp_name(n)} = {i * step}" for i, n in enumerate(names)] + [f"kCount = {len(names) * step}"]
    return f"namespace {namespace} {{ enum : size_t {{ {', '.join(items)} }}; }}"


def _schema_literal(name: str, schema: str) -> str:
    lines, line = [], ""
    for word in re.split(r"(?<=, )", schema):
        if line and len(line) + len(word) > 100:
            lines.append(line)
            line = ""
        line += word
    lines.append(line)
    return f"inline constexpr char {name}[] =\n" + "\n".join(f'    "{s}"' for s in lines) + ";"


def header() -> str:
    """The text of ``csrc/api/layer_contract.h``."""
    out = ["// The layer ops' contract for the C++ entries, generated from moegemm/backends/contract.py (its one",
           "// declaration): edit that file and run `python -m moegemm.backends.contract`; tests/test_contract.py",
           "// fails while this header is stale. The schemas csrc/binding.cpp registers, and by name the slots",
           "// of each list an entry reads or writes (saved, made, wgrad_operands, fp8 weights).",
           "#pragma once", "", "#include <cstddef>", "", "namespace moegemm::api::contract {", "",
           "// quantize_weight's four tensors: the parts of every FP8 weight an op takes",
           _enum("fp8_weight_part", FP8_WEIGHT_PARTS)]
    for layer in LAYERS:
        out += ["", f"// {'-' * 86} {layer.name}", f"namespace {layer.name} {{", ""]
        for op, const in ((layer.fwd, "kFwdSchema"), (layer.bwd, "kBwdSchema"), (layer.wgrad, "kWgradSchema")):
            out.append(_schema_literal(const, op.schema))
        out.append(_schema_literal("kAutogradSchema", layer.autograd))
        out.append("")
        for recipe, what in sorted(RECIPE_NAMES.items()):
            out.append(_enum(f"saved_{what}", [s.name for s in layer.fwd.saved[recipe]]))
        for recipe, what in sorted(RECIPE_NAMES.items()):
            out.append(_enum(f"made_{what}", [s.name for s in layer.bwd.made[recipe]]))
        out.append(f"inline constexpr size_t kMadeCount = {layer.bwd.made_count};")
        for recipe, what in sorted(RECIPE_NAMES.items()):
            out.append(_enum(f"wgrad_operands_{what}", layer.wgrad.wgrad_operands[recipe]))
        out.append(_enum("fp8_weights", layer.fwd.fp8_weights, len(FP8_WEIGHT_PARTS)))
        out += ["", f"}}  // namespace {layer.name}"]
    out += ["", "}  // namespace moegemm::api::contract", ""]
    return "\n".join(out)


def main() -> None:
    from .._build import csrc_dir

    path = csrc_dir() / "api" / "layer_contract.h"
    path.write_text(header())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
