// The argument types of the backend table (kernels/backend.h): a weight as
// a GEMM takes it, where a dropout mask applies, AdamW's hyperparameters.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "loom/core/dtype.h"
#include "loom/core/rng.h"

namespace loom {

// 16-bit weights as a GEMM keeps them in the layout it multiplies fastest
// (oneDNN's blocked bf16 weights), made on a weight's first use and kept
// until the owner of the weights clears it, which it does whenever it
// writes them: one reorder per update, read by every micro-batch, recompute
// and backward of the step. A backend without such layouts makes none
// (Backend::make_weight_packs returns null).
class WeightPacks {
 public:
  virtual ~WeightPacks() = default;
  virtual void clear() = 0;          // the weights changed: every layout is stale
  virtual size_t bytes() const = 0;  // held by the layouts
};

inline constexpr double kLayerNormEps = 1e-5;  // GPT-2's LayerNorm

// How a backward writes an input's gradient: added into what the buffer
// holds (a gradient with several contributions: a residual, a weight used
// by several micro-batches), or written over it (a layer's own scratch,
// which would otherwise be zero-filled first and read back by the adds).
enum class GradWrite { kAdd, kSet };

// A weight matrix as a layer hands it to a GEMM: T values, or, in a 16-bit
// run with 16-bit GEMM inputs, the 16-bit values (type t) the run keeps,
// which the GEMM multiplies without an f32 copy, and where the GEMM may
// keep them in its own layout (null: nowhere, it lays them out per use).
template <typename T>
struct Weight {
  const T* data = nullptr;
  const uint16_t* w16 = nullptr;
  DType t = DType::kF32;
  WeightPacks* packs = nullptr;
  Weight() = default;
  Weight(const T* p) : data(p) {}  // NOLINT: T values convert implicitly
  Weight(const uint16_t* p, DType type, WeightPacks* packs = nullptr)
      : w16(p), t(type), packs(packs) {}
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

// A layer's input as a linear's GEMMs take it: T values, and, where a block
// record packed to bf16 keeps this input (a "twin", Block::twin_ranges), its
// bf16 home in the record. A forward rounds data into r16 and multiplies
// those values, unless its producer wrote r16 itself (written: data was never
// stored in f32 and is not read); a backward multiplies r16 and does not
// read data (widened only where another kernel reads it: a shared twin). Only backends whose
// reads_inputs16() is true are handed a linear's input with a twin; the
// attention core's and GELU's 16-bit forms take theirs on any backend.
template <typename T>
struct Input {
  const T* data = nullptr;
  uint16_t* r16 = nullptr;
  bool written = false;  // r16 already holds the rounded values
  Input() = default;
  Input(const T* p) : data(p) {}  // NOLINT: T values convert implicitly
  Input(const T* p, uint16_t* twin) : data(p), r16(twin) {}
};
template <typename T>
using InputArg = std::type_identity_t<Input<T>>;

// Where a dropout mask applies to activations (B, T, C): which stream,
// which global samples (sample0 + b), and the site in the model. The
// attention's dropout on probabilities uses the same spec: keep masks drawn
// for (sample0 + b, site + head, query position), channel = key position; a
// rank holding heads [h0, h0 + NH) of the model (tensor parallelism) passes
// site + h0, so every head keeps the masks it has in one process.
//
// Activation masks are keyed on the global position: positions (Tn) maps a
// local position to it (context parallelism); null: the same.
struct DropoutSpec {
  const DropoutStream* stream = nullptr;  // null or p == 0: identity
  uint64_t sample0 = 0;
  uint32_t site = 0;
  const int32_t* positions = nullptr;
  bool active() const { return stream != nullptr && stream->p() > 0.0f; }
  uint32_t position(int64_t t) const {
    return static_cast<uint32_t>(positions ? int64_t{positions[t]} : t);
  }
};

// One chunk pair of context-parallel attention: queries at global positions
// q_pos + i (i < Tq) against keys and values at k_pos + j (j < Tk), query i
// seeing key j when k_pos + j <= q_pos + i. Layouts by strides, in elements:
//   q, dq      (b, i) row at b * q_batch + i * q_row, heads side by side (C)
//   kv, dkv    (b, j) row at b * kv_batch + j * kv_row: k at column 0, v at v_col
//   out, dout  (b, i) row at b * o_batch + i * o_row
//   lse        (b, h, i) at b * lse_batch + h * lse_head + i
struct AttentionChunk {
  int64_t B = 1, NH = 1, C = 0;  // NH heads x hs = C / NH
  int64_t Tq = 0, Tk = 0;
  int64_t q_pos = 0, k_pos = 0;
  int64_t q_row = 0, q_batch = 0;
  int64_t kv_row = 0, kv_batch = 0, v_col = 0;
  int64_t o_row = 0, o_batch = 0;
  int64_t lse_batch = 0, lse_head = 0;
  // Whether any query sees any key (else the pair is skipped).
  bool visible() const { return Tq > 0 && Tk > 0 && k_pos <= q_pos + Tq - 1; }
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
