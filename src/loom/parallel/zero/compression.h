// comm.compression: how the data-parallel gradient reduction compresses
// what it sends, for any optimizer (the reducers of grad_reducer.h).
//
//   none      the plain reduction in the run's gradient type;
//   fp16/bf16 f32 gradients divided by the group size, rounded to 16 bits,
//             summed in 16 bits on the wire (accumulated in f32), widened
//             back: half the bytes of f32;
//   powersgd  rank-r PowerSGD per bucket (stages 0-1): each matrix M of the
//             bucket (with the error of the previous steps added) is
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

// What the reducer's compression did in the steps since the last take.
struct CompressionStats {
  bool compressed = false;  // the last step's reduction was compressed
  // Bytes of gradient payload handed to collectives, and what the plain
  // reduction in the run's gradient type would have handed them.
  double payload_bytes = 0, plain_bytes = 0;
  double error_sum_squares = 0;  // this rank's error feedback, after the last step
};

}  // namespace loom
