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

}  // namespace quilt::pipeline
