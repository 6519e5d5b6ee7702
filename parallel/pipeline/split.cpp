// Stage split: see split.h.
#include "parallel/pipeline/split.h"

#include <algorithm>
#include <cmath>

#include "engine/error.h"

namespace quilt::pipeline {

std::vector<StageSpan> split_layers(int64_t num_layers, int64_t num_stages, int64_t input_weight,
                                    int64_t output_weight) {
  QUILT_CHECK(num_stages >= 1 && num_layers >= 1 && input_weight >= 0 && output_weight >= 0,
              "[pipeline] cannot split ", num_layers, " layers into ", num_stages, " stages");
  const int64_t units = num_layers + input_weight + output_weight;
  std::vector<StageSpan> out(static_cast<size_t>(num_stages));
  int64_t unit = 0;  // units handed out so far: the embedding's, then the layers', then the head's
  for (int64_t s = 0; s < num_stages; ++s) {
    const int64_t take = units / num_stages + (s < units % num_stages ? 1 : 0);
    const int64_t begin = unit, end = unit + take;
    StageSpan& st = out[size_t(s)];
    st.embed = s == 0;
    st.head = s == num_stages - 1;
    st.first_layer = std::clamp(begin - input_weight, int64_t(0), num_layers);
    st.end_layer = std::clamp(end - input_weight, int64_t(0), num_layers);
    if (st.head) st.end_layer = num_layers;
    QUILT_CHECK(st.end_layer > st.first_layer || st.embed || st.head, "[pipeline] ", num_layers, " layers (with the "
                "embedding as ", input_weight, " and the head as ", output_weight, ") do not fill ", num_stages,
                " stages: stage ", s, " would hold nothing; use fewer stages (distributed.pp_size x stages per rank)");
    unit = end;
  }
  return out;
}

PseudoLayerWeights pseudo_layer_weights(int64_t num_layers, int64_t num_stages, double input_cost,
                                        double output_cost) {
  QUILT_CHECK(std::isfinite(input_cost) && std::isfinite(output_cost) && input_cost >= 0 && output_cost >= 0,
              "[pipeline] the embedding and head costs must be finite and >= 0, not ", input_cost, " and ",
              output_cost);
  PseudoLayerWeights w{std::llround(input_cost), std::llround(output_cost)};
  if (num_layers + w.input + w.output < num_stages) w.output = std::max<int64_t>(w.output, 1);
  if (num_layers + w.input + w.output < num_stages) w.input = std::max<int64_t>(w.input, 1);
  return w;
}

}  // namespace quilt::pipeline
