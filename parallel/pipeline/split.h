// How a decoder splits into pipeline stages (the model's pp plan): the embedding counts as
// `input_weight` layers on the first stage and the final norm + head as `output_weight` layers
// on the last, and those num_layers + input_weight + output_weight units spread evenly over the
// stages, the remainder going to the first ones. A stage with nothing (no layer, no embedding,
// no head) is refused naming the numbers.
//
//   split_layers(4, 2)  ->  {layers [0, 2) + embedding}, {layers [2, 4) + head}
//   split_layers(8, 4)  ->  [0, 2) + embedding, [2, 5), [5, 7), [7, 8) + head
#pragma once

#include <cstdint>
#include <vector>

namespace quilt::pipeline {

struct StageSpan {
  int64_t first_layer = 0, end_layer = 0;  // decoder layers [first, end), global indices
  bool embed = false, head = false;        // the embedding (first stage), the final norm + head (last)
};

std::vector<StageSpan> split_layers(int64_t num_layers, int64_t num_stages, int64_t input_weight = 1,
                                    int64_t output_weight = 1);

/// The weights split_layers gives the embedding and the head, from their costs in units of an
/// average decoder layer (training FLOPs per token): each rounded to the nearest whole layer,
/// and raised to one (the head's first, then the embedding's) while the layers alone cannot
/// fill every stage, so a model of as many layers as ranks still splits under two stages per
/// rank. A head that costs 0.2 layers weighs 0 and a 128k-vocabulary head over hidden 4096
/// weighs 2, where torchtitan's fixed 1 and 1 leave one pipeline rank a layer short or long.
///
///   pseudo_layer_weights(6, 4, 0.0, 0.2)  ->  {0, 0}: stages of 2, 2, 1, 1 layers
///   pseudo_layer_weights(2, 4, 0.0, 0.2)  ->  {1, 1}: embedding, layer 0, layer 1, head
struct PseudoLayerWeights {
  int64_t input = 0, output = 0;
};
PseudoLayerWeights pseudo_layer_weights(int64_t num_layers, int64_t num_stages, double input_cost,
                                        double output_cost);

}  // namespace quilt::pipeline
