"""The layers check their constructor arguments at construction, before allocating anything, with a
ValueError/TypeError naming the argument: not at the first forward (a float16 dtype used to pass
construction and fail in forward)."""

from __future__ import annotations

import pytest
import torch

import moegemm

LINEAR = (4, 32, 48)  # num_experts, in_features, out_features
MLP = (4, 32, 16)  # num_experts, hidden_size, ffn_hidden_size


@pytest.mark.parametrize("cls, args", [(moegemm.GroupedLinear, LINEAR), (moegemm.GroupedMLP, MLP)])
@pytest.mark.parametrize("dtype, error, message", [
    (torch.float16, TypeError, "dtype must be one of (torch.bfloat16, torch.float32) (the dtype of the expert weights), "
                               "got torch.float16"),
    (torch.float64, TypeError, "dtype must be one of (torch.bfloat16, torch.float32) (the dtype of the expert weights), "
                               "got torch.float64"),
    (torch.int32, TypeError, "dtype must be one of (torch.bfloat16, torch.float32) (the dtype of the expert weights), "
                             "got torch.int32"),
    ("bfloat16", TypeError, "dtype must be a torch.dtype, one of (torch.bfloat16, torch.float32), got str 'bfloat16'"),
])
def test_dtype(cls, args, dtype, error, message):
    with pytest.raises(error) as err:
        cls(*args, dtype=dtype)
    assert str(err.value) == message


@pytest.mark.parametrize("cls, args", [(moegemm.GroupedLinear, LINEAR), (moegemm.GroupedMLP, MLP)])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float32])
def test_accepted_dtypes(cls, args, dtype):
    layer = cls(*args, dtype=dtype)
    assert all(p.dtype == (dtype or torch.bfloat16) for p in layer.parameters())


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((0, 32, 48), {}, ValueError, "num_experts must be in [1, 1024], got 0"),
    ((1025, 32, 48), {}, ValueError, "num_experts must be in [1, 1024], got 1025"),
    ((-3, 32, 48), {}, ValueError, "num_experts must be in [1, 1024], got -3"),
    ((4, 0, 48), {}, ValueError, "in_features must be a positive multiple of 16, got 0"),
    ((4, -32, 48), {}, ValueError, "in_features must be a positive multiple of 16, got -32"),
    ((4, 32, 40), {}, ValueError, "out_features must be a positive multiple of 16, got 40"),
    ((4.0, 32, 48), {}, TypeError, "num_experts must be an int, got float 4.0"),
    ((4, "32", 48), {}, TypeError, "in_features must be an int, got str '32'"),
    ((True, 32, 48), {}, TypeError, "num_experts must be an int, got bool True"),
    ((4, 32, 48, "bf16"), {}, TypeError, "bias must be True or False, got str 'bf16'"),  # a recipe in bias's place
    (LINEAR, {"recipe": "fp8"}, ValueError, "recipe must be one of ('bf16', 'fp8_blockwise'), got 'fp8'"),
    (LINEAR, {"recipe": None}, ValueError, "recipe must be one of ('bf16', 'fp8_blockwise'), got None"),
    (LINEAR, {"delay_wgrad_compute": "yes"}, TypeError, "delay_wgrad_compute must be True or False, got str 'yes'"),
    (LINEAR, {"fp8_weight_cache": 0}, TypeError, "fp8_weight_cache must be True or False, got int 0"),
])
def test_grouped_linear_arguments(args, kwargs, error, message):
    with pytest.raises(error) as err:
        moegemm.GroupedLinear(*args, **kwargs)
    assert str(err.value) == message


@pytest.mark.parametrize("args, kwargs, error, message", [
    ((0, 32, 16), {}, ValueError, "num_experts must be in [1, 1024], got 0"),
    ((4, 24, 16), {}, ValueError, "hidden_size must be a positive multiple of 16, got 24"),
    ((4, 32, 0), {}, ValueError, "ffn_hidden_size must be a positive multiple of 16, got 0"),
    ((4, 32, 16.5), {}, TypeError, "ffn_hidden_size must be an int, got float 16.5"),
    (MLP, {"activation": "silu"}, ValueError,
     "activation must be one of ('swiglu', 'geglu', 'gelu', 'relu', 'squared_relu'), got 'silu'"),
    (MLP, {"activation": torch.nn.functional.silu}, ValueError, "activation must be one of "),
    (MLP, {"recipe": "fp8"}, ValueError, "recipe must be one of ('bf16', 'fp8_blockwise'), got 'fp8'"),
    (MLP, {"bias": None}, TypeError, "bias must be True or False, got NoneType None"),
    (MLP, {"fp8_weight_cache": "off"}, TypeError, "fp8_weight_cache must be True or False, got str 'off'"),
    (MLP, {"delay_wgrad_compute": 1}, TypeError, "delay_wgrad_compute must be True or False, got int 1"),
])
def test_grouped_mlp_arguments(args, kwargs, error, message):
    with pytest.raises(error) as err:
        moegemm.GroupedMLP(*args, **kwargs)
    assert str(err.value).startswith(message), str(err.value)
    if not message.endswith(" "):
        assert str(err.value) == message


def test_no_allocation_before_the_checks(monkeypatch):
    """The checks come first: a bad dtype with sizes no memory could hold is a TypeError, not an allocation."""
    def no_alloc(*a, **k):
        raise AssertionError("allocated before checking the arguments")

    monkeypatch.setattr(torch, "empty", no_alloc)
    with pytest.raises(TypeError, match=r"^dtype must be one of"):
        moegemm.GroupedLinear(1024, 1 << 30, 1 << 30, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"^dtype must be one of"):
        moegemm.GroupedMLP(1024, 1 << 30, 1 << 30, dtype=torch.float16)


def test_good_arguments_still_build_and_run():
    lin = moegemm.GroupedLinear(*LINEAR, bias=False, recipe="bf16", dtype=torch.float32)
    mlp = moegemm.GroupedMLP(*MLP, activation="gelu", bias=True, recipe="bf16", fp8_weight_cache=False,
                             delay_wgrad_compute=False)
    x = torch.randn(10, 32, dtype=torch.bfloat16)
    assert lin(x, [3, 0, 7, 0]).shape == (10, 48)
    assert mlp(x, [3, 0, 7, 0]).shape == (10, 32)


@pytest.mark.parametrize("attr", ["fp8_weight_cache", "delay_wgrad_compute"])
@pytest.mark.parametrize("layer", ["GroupedLinear", "GroupedMLP"])
def test_switches_set_on_an_instance_are_checked(layer, attr):
    """The switches settable after construction take True or False only, as the constructor does ("False" would turn
    the split backward on)."""
    m = getattr(moegemm, layer)(2, 128, 128)
    for bad in ("False", "no", 1, None):
        with pytest.raises(TypeError, match=rf"{attr} must be True or False"):
            setattr(m, attr, bad)
    before = getattr(m, attr)
    setattr(m, attr, not before)
    assert getattr(m, attr) is (not before)
