// The argument types of the backend table (kernels/backend.h): a weight as
// a GEMM takes it, where a dropout mask applies, AdamW's hyperparameters.
#pragma once

#include <cstdint>
#include <type_traits>

#include "loom/core/dtype.h"
#include "loom/core/rng.h"

namespace loom {

inline constexpr double kLayerNormEps = 1e-5;  // GPT-2's LayerNorm

// A weight matrix as a layer hands it to a GEMM: T values, or, in a 16-bit
// run with 16-bit GEMM inputs, the 16-bit values (type t) the run keeps,
// which the GEMM multiplies without an f32 copy.
template <typename T>
struct Weight {
  const T* data = nullptr;
  const uint16_t* w16 = nullptr;
  DType t = DType::kF32;
  Weight() = default;
  Weight(const T* p) : data(p) {}  // NOLINT: T values convert implicitly
  Weight(const uint16_t* p, DType type) : w16(p), t(type) {}
  // Element i as T (a 16-bit value widened, exactly): for lookups.
  T operator[](int64_t i) const {
    if (w16 == nullptr) return data[i];
    return static_cast<T>(t == DType::kBF16 ? bf16_to_f32(w16[i]) : f16_to_f32(w16[i]));
  }
};
// Weight parameters take T pointers too (the element type comes from the
// other arguments).
template <typename T>
using WeightArg = std::type_identity_t<Weight<T>>;

// Where a dropout mask applies to activations (B, T, C): which stream,
// which global samples (sample0 + b), and the site in the model. The
// attention's dropout on probabilities uses the same spec: keep masks drawn
// for (sample0 + b, site + head, query position), channel = key position; a
// rank holding heads [h0, h0 + NH) of the model (tensor parallelism) passes
// site + h0, so every head keeps the masks it has in one process.
struct DropoutSpec {
  const DropoutStream* stream = nullptr;  // null or p == 0: identity
  uint64_t sample0 = 0;
  uint32_t site = 0;
  bool active() const { return stream != nullptr && stream->p() > 0.0f; }
};

struct AdamWParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // decoupled: p -= lr * wd * p
  int64_t step = 1;           // 1-based, for bias correction
};

}  // namespace loom
