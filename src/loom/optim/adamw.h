// AdamW over the flat parameter buffer, with weight decay on matrices and
// embeddings only (biases and LayerNorm parameters are not decayed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/memory.h"
#include "loom/kernels/backend.h"
#include "loom/nn/param.h"

namespace loom {

struct OptimizerConfig {
  // "AdamW"; "Adam" means the same (DeepSpeed's adam_w_mode default);
  // "OneBitAdam": AdamW until freeze_step, then 1-bit compressed momentum;
  // "ZeroOneAdam": the variance updated at exponentially spaced steps,
  // 1-bit compressed momentum at the others (parallel/zero/onebit.h).
  std::string type = "AdamW";
  double lr = 3e-4;
  double beta1 = 0.9, beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  int64_t freeze_step = 100000;  // OneBitAdam: optimizer steps of plain AdamW first
  // ZeroOneAdam: the last step that may update the variance; variance
  // updates per interval before it doubles; steps between doublings of the
  // local-step interval, and its largest value.
  int64_t var_freeze_step = 100000, var_update_scaler = 16;
  int64_t local_step_scaler = 32678, local_step_clipper = 16;
  bool one_bit() const { return type == "OneBitAdam" || type == "ZeroOneAdam"; }
  bool zero_one() const { return type == "ZeroOneAdam"; }
};

// Which elements one AdamW instance updates: `length` elements starting at
// param_offset in the parameter array, grad_offset in the gradient array and
// state_offset in its own moments, all with the same weight-decay setting.
// Unsharded, all three offsets are the flat offset; a ZeRO shard maps its
// slices of the flat layout onto contiguous moments.
struct AdamWSegment {
  int64_t param_offset = 0, grad_offset = 0, state_offset = 0, length = 0;
  bool decay = false;
};

// The segments covering [begin, end) of a layout's flat buffers, split where
// weight decay changes (padding joins the preceding parameter: it is zero in
// parameters and gradients and stays zero under the update).
std::vector<AdamWSegment> adamw_segments(const ParamLayout& layout, int64_t begin, int64_t end);

class AdamW {
 public:
  // The whole layout, unsharded. Updates run on `backend` (it must outlive
  // the optimizer).
  AdamW(const ParamLayout& layout, const OptimizerConfig& config,
        const Backend<float>& backend = default_backend<float>());
  // `state_elements` moments, updated per segment; held in m and v when
  // given (not owned: memory-mapped files), else allocated on the backend.
  AdamW(std::vector<AdamWSegment> segments, int64_t state_elements, const OptimizerConfig& config,
        float* m = nullptr, float* v = nullptr,
        const Backend<float>& backend = default_backend<float>());
  // One update with rate `lr` of segments [first, last) (all by default);
  // `step` is 1-based. `params` and `grads` are the arrays the segments'
  // offsets index.
  void step(float* params, const float* grads, double lr, int64_t step, size_t first = 0,
            size_t last = SIZE_MAX);
  // The same with 16-bit parameters and gradients (t: kBF16 or kF16): the
  // f32 master weights (indexed like the moments) are updated from the
  // gradients times grad_scale, and the parameters set to them rounded.
  void step_16(float* master, uint16_t* params, const uint16_t* grads, DType t, float grad_scale,
               double lr, int64_t step, size_t first = 0, size_t last = SIZE_MAX);
  const OptimizerConfig& config() const { return config_; }
  // First and second moments (state_elements each).
  float* exp_avg() const { return m_; }
  float* exp_avg_sq() const { return v_; }

 private:
  OptimizerConfig config_;
  const Backend<float>* be_;
  std::vector<AdamWSegment> segments_;
  int64_t state_elements_ = 0;
  Buffer m_owned_, v_owned_;
  float *m_ = nullptr, *v_ = nullptr;
};

}  // namespace loom
