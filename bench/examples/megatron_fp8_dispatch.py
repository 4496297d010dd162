"""The dispatcher of the split-backward and FP8-dispatch variants of ``megatron_ep_train``: megatron-core's
all-to-all dispatcher with the tokens sent in FP8 (1x128-scaled rows, reaching the experts as
``moegemm.Fp8Rows``) and/or the layer's deferred weight gradients computed while the input gradient's
all-to-all is in flight.

Megatron's own EP overlap (``overlap_moe_expert_parallel_comm``) passes plain tensors between its schedule
nodes, so FP8 tokens cannot cross it; these variants run under Megatron's plain schedule with this
dispatcher's overlap instead (``megatron_ep_train.py``'s docstring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(out_rows: int, x: torch.Tensor, out_splits, in_splits, group, async_op: bool = False):
    out = x.new_empty((out_rows, *x.shape[1:]))
    work = dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=async_op)
    return (out, work) if async_op else out


def _grad_all_to_all_overlapping_dw(ctx, grad):
    """The backward of a dispatch all-to-all: the bf16 input gradient goes back to the ranks that sent the
    tokens; while it is in flight, ``ctx.backward_dw`` (the layer's split-backward weight gradients) runs
    on the compute stream."""
    out, work = _all_to_all(sum(ctx.in_splits), grad, ctx.in_splits, ctx.out_splits, ctx.group, async_op=True)
    if ctx.backward_dw is not None:
        ctx.backward_dw()
    work.wait()
    return out


class Fp8AllToAll(torch.autograd.Function):
    """Forward: quantize the permuted tokens ``x [T, H]`` into FP8 rows (moegemm's ``quantize_act`` row copy:
    e4m3 + 1x128 fp32 scales), send both through the all-to-all (as bytes and fp32) and return
    ``(handle, q, s)``: ``q [R, H]`` e4m3 and ``s`` of the received tokens, and ``handle``, a bf16 ``[R, H]``
    stand-in (one element, expanded) that the experts name as ``Fp8Rows.grad_target``. Backward: the bf16
    gradient of the received tokens (delivered to ``handle``) goes back through the reverse all-to-all,
    the layer's deferred weight gradients running meanwhile."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, backward_dw):
        from moegemm import quantize_act

        ctx.group, ctx.out_splits, ctx.in_splits, ctx.backward_dw = group, out_splits, in_splits, backward_dw
        R = sum(out_splits)
        q, s, _, _ = quantize_act(x, [x.shape[0]], rows=True, cols=False)
        q = _all_to_all(R, q.view(torch.uint8), out_splits, in_splits, group).view(torch.float8_e4m3fn)
        s = _all_to_all(R, s, out_splits, in_splits, group)
        handle = x.new_zeros(()).expand(R, x.shape[1])
        ctx.mark_non_differentiable(q, s)
        return handle, q, s

    @staticmethod
    def backward(ctx, grad, _q, _s):
        return _grad_all_to_all_overlapping_dw(ctx, grad), None, None, None, None


class DispatchGradAllToAll(torch.autograd.Function):
    """megatron's bf16 dispatch all-to-all whose backward runs the layer's deferred weight gradients while
    the input gradient's all-to-all is in flight (split backward with bf16 dispatch)."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, backward_dw):
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.backward_dw = group, out_splits, in_splits, backward_dw
        return _all_to_all(sum(out_splits), x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _grad_all_to_all_overlapping_dw(ctx, grad), None, None, None, None


class SortFp8Chunks(torch.autograd.Function):
    """megatron's "permutation 2" (``sort_chunks_by_idxs``: received chunks from (rank, expert) order to
    (expert, rank) order) on FP8 rows and their scales; the gradient (on the stand-in) is un-sorted the way
    megatron's combine_preprocess un-sorts the expert output."""

    @staticmethod
    def forward(ctx, handle, q, s, splits, order, back_splits, back_order):
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        ctx.back_splits, ctx.back_order = back_splits, back_order
        q, _ = sort_chunks_by_idxs(q.view(torch.uint8), splits, order)
        s, _ = sort_chunks_by_idxs(s, splits, order)
        ctx.mark_non_differentiable(q, s)
        return handle.new_zeros(()).expand(handle.shape), q.view(torch.float8_e4m3fn), s

    @staticmethod
    def backward(ctx, grad, _q, _s):
        from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs

        grad, _ = sort_chunks_by_idxs(grad.contiguous(), ctx.back_splits, ctx.back_order)
        return grad, None, None, None, None, None, None


def make_dispatcher_class():
    from megatron.core.tensor_parallel import all_to_all
    from megatron.core.transformer.moe.moe_utils import sort_chunks_by_idxs
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from moegemm import Fp8Rows

    class OverlapAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
        """megatron's all-to-all dispatcher with FP8 tokens (``fp8=True``: quantized before the all-to-all,
        handed to the experts as ``Fp8Rows``) and/or the split backward's weight gradients (``backward_dw``)
        run during the dispatch gradient's all-to-all. EP only (TP = 1), dropless, unfused permutation."""

        def __init__(self, *args, fp8: bool = False, backward_dw=None, **kwargs):
            super().__init__(*args, **kwargs)
            if self.tp_size != 1 or self.drop_and_pad or self.config.moe_permute_fusion:
                raise NotImplementedError("OverlapAlltoAllTokenDispatcher: TP = 1, dropless, unfused permutation only")
            self.fp8, self.backward_dw = fp8, backward_dw

        def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
            x = permutated_local_input_tokens
            if self.output_splits is None:  # EP = 1: megatron computes no splits
                out_splits = in_splits = [x.shape[0]]
            else:
                out_splits, in_splits = [int(n) for n in self.output_splits], [int(n) for n in self.input_splits]
            if self.fp8:
                handle, q, s = Fp8AllToAll.apply(x, self.ep_group, out_splits, in_splits, self.backward_dw)
                tokens = Fp8Rows(q, s, handle)
            else:
                tokens = DispatchGradAllToAll.apply(x, self.ep_group, out_splits, in_splits, self.backward_dw)
            probs = all_to_all(self.ep_group, permuted_probs, self.output_splits, self.input_splits)
            return tokens, probs

        def dispatch_postprocess(self, global_input_tokens, global_probs):
            if not self.fp8:
                return super().dispatch_postprocess(global_input_tokens, global_probs)
            self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_2", self.tokens_per_expert)
            tokens = global_input_tokens
            if self.num_local_experts > 1:
                splits = self.num_global_tokens_per_local_expert.ravel()
                handle, q, s = SortFp8Chunks.apply(tokens.grad_target, tokens.q, tokens.s, splits,
                                                   self.sort_input_by_local_experts,
                                                   self.num_global_tokens_per_local_expert.T.ravel(),
                                                   self.restore_output_by_local_experts)
                tokens = Fp8Rows(q, s, handle)
                global_probs, _ = sort_chunks_by_idxs(global_probs, splits, self.sort_input_by_local_experts)
            tokens_per_expert = self._maybe_dtoh_and_synchronize("before_finish", self.tokens_per_expert)
            self.tokens_per_expert = None
            return tokens, tokens_per_expert, global_probs

    return OverlapAlltoAllTokenDispatcher

