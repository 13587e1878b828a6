// The kernels of 16-bit training (bf16 or f16 storage, f32 compute): f32
// values rounded into 16 bits and widened back, the sum of squares of a
// 16-bit vector (gradient norms), and AdamW on f32 master weights that
// reads 16-bit gradients and writes the rounded 16-bit parameters. Rounding
// is to nearest, ties to even; NaN stays NaN; f16 overflow is infinity
// (core/dtype.h).
#pragma once

#include <cstdint>

#include "loom/core/dtype.h"
#include "loom/kernels/cpu/adamw.h"

namespace loom::cpu {

// out (n) = x rounded to t (kBF16 or kF16).
void round_to_16(const float* x, uint16_t* out, int64_t n, DType t);
// The same on the calling thread alone (for callers that split the work).
void round_to_16_serial(const float* x, uint16_t* out, int64_t n, DType t);
// out (n) = x (t) as f32 (exact).
void widen_16(const uint16_t* x, float* out, int64_t n, DType t);
// The same on the calling thread alone.
void widen_16_serial(const uint16_t* x, float* out, int64_t n, DType t);
// The sum of squares of x (t) in double, over the same fixed chunks as
// sum_squares<float> (equal to it on the widened values, bit for bit).
double sum_squares_16(const uint16_t* x, int64_t n, DType t);
// acc (n, t) = acc + x * scale, added in f32 and rounded once: a unit's f32
// gradients added into 16-bit gradients that accumulate over micro-batches.
void accumulate_16(const float* x, float scale, uint16_t* acc, int64_t n, DType t);
// The same with 16-bit addends (a 16-bit reduction's result).
void accumulate_16(const uint16_t* x, float scale, uint16_t* acc, int64_t n, DType t);
// x (n, t) *= s, rounded.
void scale_16(uint16_t* x, int64_t n, float s, DType t);
// Whether any element of x (n, t) is infinite or NaN.
bool any_nonfinite_16(const uint16_t* x, int64_t n, DType t);
// adamw_update on the masters with the gradients widened and multiplied by
// grad_scale (clipping and 1 / loss scale in one factor), then params (t) =
// the updated masters rounded. n elements.
void adamw_update_16(float* master, const uint16_t* grads, float grad_scale, float* m, float* v,
                     uint16_t* params, int64_t n, DType t, const AdamWParams& hp);

}  // namespace loom::cpu
