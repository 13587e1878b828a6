// The 1-bit compressed all-reduce with error feedback on both sides (the
// collective of 1-bit Adam and 0/1 Adam), built from a group's all-to-all
// and all-gather, so that it runs on any ProcessGroup and every byte it
// sends is in the group's record.
//
// Of a vector of n elements on every rank of a group of W, padded with zeros
// to N, a multiple of 8 W (every rank's chunk of N / W elements is a whole
// number of bytes of signs):
//   worker  x = in + e_w; scale_w = ||x|| / sqrt(N); e_w = x - scale_w sign(x)
//           (sign(0) = +1); the signs packed 8 per byte, least significant
//           bit first;
//   a compressed reduce-scatter: one all-to-all sends chunk r's signs, with
//           scale_w in front, to rank r;
//   server  rank r: y = (sum over w in rank order of scale_w sign_w) / W
//           + e_s over its chunk; scale_s = ||y|| / sqrt(N / W);
//           e_s = y - scale_s sign(y);
//   an all-gather of every rank's chunk signs and scale_s returns
//           out = scale_s(r) sign over chunk r, the same bits on every rank.
// On the wire: 2 (W - 1) / W x N / 8 bytes per rank and 8 bytes of scales
// per peer, against 2 (W - 1) / W x 4 n for an f32 all-reduce: 32x fewer.
//
// The identity codec runs the same path with f32 chunks and no error: the
// rank-order sum times 1 / W, bit for bit what the group's f32 average gives
// where it sums in rank order (always on two ranks).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "loom/comm/process_group.h"
#include "loom/core/memory.h"

namespace loom {

enum class Codec { kSign, kIdentity };
const char* codec_name(Codec c);

class CompressedAllReduce {
 public:
  // Every rank of `group` builds it with the same count and codec.
  CompressedAllReduce(std::shared_ptr<ProcessGroup> group, size_t count, Codec codec);

  // out (count) = the compressed average of every rank's in (count); in ==
  // out allowed. Collective over the group; blocks until done and returns
  // the seconds spent in its collectives.
  double run(const float* in, float* out);

  size_t count() const { return count_; }
  Codec codec() const { return codec_; }
  size_t padded() const { return padded_; }
  size_t chunk() const { return padded_ / static_cast<size_t>(size_); }
  // The errors carried to the next call: this rank's as a worker (padded()
  // elements) and as the server of its chunk (chunk() elements); zero with
  // the identity codec. Checkpoints read and write them.
  float* worker_error() { return worker_error_.as<float>(); }
  float* server_error() { return server_error_.as<float>(); }
  const float* worker_error() const { return worker_error_.as<float>(); }
  const float* server_error() const { return server_error_.as<float>(); }
  // Bytes of one message block: a scale and a chunk's signs (or, identity, its f32 values).
  size_t block_bytes() const;

 private:
  std::shared_ptr<ProcessGroup> group_;
  size_t count_, padded_;
  int rank_ = 0, size_ = 1;
  Codec codec_;
  Buffer worker_error_, server_error_;
  Buffer send_, recv_, gathered_;  // block_bytes() x size each
};

}  // namespace loom
