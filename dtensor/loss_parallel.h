// Loss parallel (Megatron's vocab-parallel cross entropy, PyTorch's loss_parallel): cross
// entropy on logits whose class dim is sharded over one mesh axis (the tensor-parallel axis),
// computed without gathering the logits. Each rank works on its slice of the classes and only
// per-row statistics cross the axis, in two all-reduces of the class axis's group:
//   max over the local classes          -> all-reduce(max)            (N values)
//   [sum exp(x - max), target's logit]  -> all-reduce(sum) of (2, N)  (the target's logit is
//                                          picked by the rank whose class range holds it, 0 elsewhere)
//   loss = log(sumexp) + max - target_logit, 0 for ignore_index rows.
// The backward is local: grad = (softmax - onehot) * g on this rank's slice, from the log-sum-exp
// saved by the forward, in the logits' own layout. Uneven class shards (V not divisible by the
// axis size) are fine. bf16/f16 logits are computed in f32, f64 in f64, as the engine's op does.
//
// Nothing to call: the dispatcher (dtensor/dispatch.h) asks these handlers before the sharding
// rule table whenever cross_entropy gets distributed logits. They apply when the logits (N, C)
// are Shard(1) on exactly one mesh axis of size > 1 and Replicate or Shard(0) on every other,
// and the targets are plain or distributed without Partial and not sharded on the class axis;
// otherwise the rule table decides (which gathers the classes). The loss rows come out
// Replicate on the class axis and Shard(0) where the logits' rows are sharded, so the mean and
// sum that cross_entropy applies afterwards combine across row shards as usual.
//
//   DeviceMesh mesh(world_ptr(), {2, 4}, {"dp", "tp"});
//   Tensor logits = matmul(h, w_out);                    // (B*T, V), (Shard(0), Shard(1))
//   Tensor loss = cross_entropy(logits, targets);        // two all-reduces of B*T/2 rows over tp
//   loss.backward();                                     // logits.grad: (Shard(0), Shard(1)), no communication
#pragma once

#include <optional>
#include <vector>

#include "engine/primitive.h"

namespace quilt::detail {

/// The distributed handler of "cross_entropy" (logits (N, C), target (N)) -> loss (N): loss
/// parallel when the layout is its case (see above), nullopt otherwise.
std::optional<std::vector<Tensor>> loss_parallel_cross_entropy(Primitive& p, const std::vector<Tensor>& inputs);

/// The distributed handler of "cross_entropy_backward" (g (N), logits, target) -> grad_logits
/// in the logits' layout, computed locally from the statistics its forward saved.
std::optional<std::vector<Tensor>> loss_parallel_cross_entropy_backward(Primitive& p,
                                                                        const std::vector<Tensor>& inputs);

}  // namespace quilt::detail
