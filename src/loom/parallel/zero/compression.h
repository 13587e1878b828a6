// comm.compression: how the data-parallel gradient reduction compresses
// what it sends, for any optimizer (the reducers of grad_reducer.h).
//
//   none      the plain reduction in the run's gradient type;
//   fp16/bf16 f32 gradients divided by the group size, rounded to 16 bits,
//             summed in 16 bits on the wire (accumulated in f32), widened
//             back: half the bytes of f32;
//   powersgd  rank-r PowerSGD per bucket (stages 0-1, once per step) or per
//             unit (stages 2-3, every micro-batch as the unit's gradients
//             are reduce-scattered): each matrix M of the
//             bucket or unit (with the error of the previous steps added) is
//             approximated by P Q^T: P = M Q, P summed over the group and
//             orthonormalised, Q = M^T P, Q summed, M^ = P Q^T / size, the
//             error M - M^ kept for the next step; vectors, and matrices
//             whose rows x cols / ((rows + cols) r) is below
//             min_compression_rate, are averaged uncompressed in one
//             message per bucket. The first start_iter steps reduce
//             uncompressed. warm_start keeps Q from step to step (else a
//             fresh random Q each step).
#pragma once

#include <cstdint>
#include <string>

#include "loom/nn/param.h"

namespace loom {

struct CompressionConfig {
  std::string type = "none";  // none | fp16 | bf16 | powersgd
  int rank = 1;               // PowerSGD's matrix_approximation_rank
  int64_t start_iter = 10;    // steps reduced uncompressed first
  double min_compression_rate = 2;
  bool error_feedback = true;
  bool warm_start = true;
  uint64_t seed = 0;  // PowerSGD's first Q (the run's seed: the same on every rank)
  bool any() const { return type != "none"; }
};

// The volumes of that model for a group of p ranks.
inline double all_reduce_volume(double bytes, int p) {
  return 2.0 * (p - 1) / p * bytes;
}
inline double spread_volume(double bytes, int p) {
  return double(p - 1) / p * bytes;
}

// What the reducer's compression did in the steps since the last take.
struct CompressionStats {
  bool compressed = false;  // the last step's reduction was compressed
  bool local = false;       // 0/1 Adam: the last step was local (sent nothing)
  // Bytes this rank sent for the reduction, and what the plain reduction
  // in the run's gradient type would have sent, by the volume model of the
  // communication record (comm/record.h: an all-reduce of b bytes sends
  // 2 (p - 1) / p b, a reduce-scatter, all-gather or all-to-all of b in all
  // (p - 1) / p b).
  double sent_bytes = 0, plain_bytes = 0;
  double error_sum_squares = 0;  // this rank's error feedback, after the last step
};

// One array of state that compression carries between steps, of one
// parameter on this rank (checkpoints save and restore them):
//   kError        this rank's error feedback (PowerSGD's, 1-bit Adam's
//                 worker error): the parameter's slice shape, rows x cols,
//                 different on every data-parallel rank;
//   kServerError  1-bit Adam's server error: elements [begin, end) of the
//                 parameter's slice, which this rank serves;
//   kQ            PowerSGD's Q (cols x rank of the slice), the same on every
//                 data-parallel rank.
struct CompressionState {
  enum Kind { kError, kServerError, kQ } kind = kError;
  const char* family = "powersgd";  // names it in checkpoints: "powersgd", "onebit"
  const Param* param = nullptr;
  float* data = nullptr;
  int64_t rows = 0, cols = 0;  // kError, kQ: of data
  int64_t begin = 0, end = 0;  // kServerError: the range data holds
};

}  // namespace loom
