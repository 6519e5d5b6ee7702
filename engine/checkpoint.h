// Activation checkpointing: run a piece of the forward without keeping its intermediate
// tensors, and recompute them during backward. Memory for activations inside `fn` drops to
// its inputs; the price is one more forward of `fn`.
//
//   Generator gen(seed);                              // the one dropout inside fn draws from
//   Tensor y = checkpoint([&](const Tensor& x) { return (*block)(x); }, x, &gen);
//   y.sum().backward();     // block's parameters get .grad exactly as without checkpointing
//
// Backward re-runs fn with the generator's counter set back to its value at forward time, so
// dropout draws identical masks, then restores the counter. It backpropagates through the
// recomputed graph with run_backward(), so parameters used inside fn accumulate .grad and fire
// their post-accumulate hooks (as FSDP/DDP need). Because of that, quilt::grad() through a
// checkpoint still accumulates into those parameters' .grad; create_graph is not supported.
#pragma once

#include <functional>
#include <vector>

#include "engine/random.h"
#include "engine/tensor.h"

namespace quilt {

/// A checkpointed function: tensors in, tensors out, written in ops (no in-place on inputs).
using CheckpointFn = std::function<std::vector<Tensor>(const std::vector<Tensor>& inputs)>;

/// Which activations a checkpointed region keeps from its first forward.
enum class CheckpointMode {
  full,            // only the inputs: everything inside is recomputed
  save_matmuls,    // also every linear() output: only the cheap ops between them are recomputed
};

/// Runs fn(inputs) without recording its graph and returns its outputs as one graph node whose
/// backward recomputes fn. `gen` is the generator fn draws randomness from (null: the calling
/// thread's default_generator()).
std::vector<Tensor> checkpoint(CheckpointFn fn, const std::vector<Tensor>& inputs, Generator* gen = nullptr,
                               CheckpointMode mode = CheckpointMode::full);

/// checkpoint() of a one-tensor function.
Tensor checkpoint(std::function<Tensor(const Tensor&)> fn, const Tensor& input, Generator* gen = nullptr,
                  CheckpointMode mode = CheckpointMode::full);

/// linear(x, w, bias) that takes part in selective checkpointing: inside a save_matmuls region
/// its output is kept at the first forward and reused by the recomputation, whose backward
/// still gives the gradients of x, w and bias (nn::Linear calls this).
Tensor checkpointable_linear(const Tensor& x, const Tensor& w, const Tensor& bias);

/// Values a checkpointed region must not recompute (an MoE router's choice of experts, so the
/// recomputed token dispatch is the forward's): inside a region of any mode, the first forward
/// runs fn and keeps its outputs (detached); the recomputation returns the kept ones, in call
/// order, without running fn. Outside a region: fn().
std::vector<Tensor> checkpoint_keep(const std::function<std::vector<Tensor>()>& fn);

/// True while this thread recomputes a checkpointed region (state that a forward updates, like
/// an MoE router's token counts, must not be updated twice).
bool in_checkpoint_recompute();

}  // namespace quilt
