#include "loom/comm/compressed.h"

#include <cmath>
#include <cstring>

#include "loom/comm/record.h"
#include "loom/core/error.h"

namespace loom {

const char* codec_name(Codec c) {
  return c == Codec::kSign ? "sign" : "identity";
}

namespace {

size_t padded_count(size_t n, int size) {
  const size_t m = 8 * static_cast<size_t>(size);
  return (n + m - 1) / m * m;
}

// The signs of x (n, a multiple of 8) packed 8 per byte into bits, bit
// i % 8 of byte i / 8 set where x[i] >= 0, and x - scale sign(x) left in x:
// the error. One pass.
void sign_compress(float* x, size_t n, float scale, uint8_t* bits) {
  for (size_t i = 0; i < n; i += 8) {
    uint8_t b = 0;
    for (size_t k = 0; k < 8; ++k) {
      const float v = x[i + k];
      const bool up = v >= 0.0f;
      b = static_cast<uint8_t>(b | (up ? 1u << k : 0u));
      x[i + k] = v - (up ? scale : -scale);
    }
    bits[i / 8] = b;
  }
}

double sum_squares(const float* x, size_t n) {
  double ss = 0;
  for (size_t i = 0; i < n; ++i) ss += double(x[i]) * double(x[i]);
  return ss;
}

// Compresses x (n, a multiple of 8) into block = [scale][signs] with one
// scale ||x|| / sqrt(n), and leaves the error in x.
void compress_into(float* x, size_t n, uint8_t* block) {
  const float scale = n ? static_cast<float>(std::sqrt(sum_squares(x, n) / double(n))) : 0.0f;
  std::memcpy(block, &scale, sizeof(float));
  sign_compress(x, n, scale, block + sizeof(float));
}

float block_scale(const uint8_t* block) {
  float s;
  std::memcpy(&s, block, sizeof(float));
  return s;
}

}  // namespace

CompressedAllReduce::CompressedAllReduce(std::shared_ptr<ProcessGroup> group, size_t count,
                                         Codec codec)
    : group_(std::move(group)),
      count_(count),
      rank_(group_ ? group_->rank() : 0),
      size_(group_ ? group_->size() : 1),
      codec_(codec) {
  LOOM_CHECK(group_ != nullptr, "a compressed all-reduce needs a group");
  padded_ = padded_count(count_, size_);
  const bool sign = codec_ == Codec::kSign;
  worker_error_ = Buffer(sign ? padded_ * sizeof(float) : 0, MemCategory::kComm);
  server_error_ = Buffer(sign ? chunk() * sizeof(float) : 0, MemCategory::kComm);
  const size_t all = block_bytes() * static_cast<size_t>(size_);
  send_ = Buffer(all, MemCategory::kComm, false);
  recv_ = Buffer(all, MemCategory::kComm, false);
  gathered_ = Buffer(all, MemCategory::kComm, false);
}

size_t CompressedAllReduce::block_bytes() const {
  return codec_ == Codec::kSign ? sizeof(float) + chunk() / 8 : chunk() * sizeof(float);
}

double CompressedAllReduce::run(const float* in, float* out) {
  if (padded_ == 0) return 0;
  const size_t C = chunk(), B = block_bytes(), W = static_cast<size_t>(size_);
  const bool sign = codec_ == Codec::kSign;
  auto* send = send_.as<uint8_t>();
  auto* recv = recv_.as<uint8_t>();
  auto* gathered = gathered_.as<uint8_t>();
  double seconds = 0;
  auto wait = [&seconds](const WorkPtr& w) {
    const double t0 = comm_clock();
    w->wait();
    seconds += comm_clock() - t0;
  };

  if (sign) {
    // The worker: x = in + e_w over the padded vector, one scale for all of
    // it, each chunk's signs in its block.
    float* x = worker_error();
    double ss = 0;
    for (size_t i = 0; i < count_; ++i) {
      x[i] += in[i];
      ss += double(x[i]) * double(x[i]);
    }
    ss += sum_squares(x + count_, padded_ - count_);
    const float scale = static_cast<float>(std::sqrt(ss / double(padded_)));
    for (size_t r = 0; r < W; ++r) {
      uint8_t* block = send + r * B;
      std::memcpy(block, &scale, sizeof(float));
      sign_compress(x + r * C, C, scale, block + sizeof(float));
    }
  } else {
    auto* x = reinterpret_cast<float*>(send);
    std::memcpy(x, in, count_ * sizeof(float));
    std::memset(x + count_, 0, (padded_ - count_) * sizeof(float));
  }

  const std::vector<size_t> counts(W, B);
  wait(group_->all_to_all(send, counts, recv, counts, DType::kU8));

  // The server of chunk rank_: every worker's chunk summed in rank order,
  // times 1 / W (then the server error, re-compressed).
  uint8_t* mine = send;  // reused: this rank's block of the result
  const float inv = 1.0f / static_cast<float>(size_);
  if (sign) {
    std::vector<float> acc(C, 0.0f);
    for (size_t w = 0; w < W; ++w) {
      const uint8_t* block = recv + w * B;
      const float s = block_scale(block);
      const uint8_t* bits = block + sizeof(float);
      for (size_t j = 0; j < C; j += 8)
        for (size_t k = 0; k < 8; ++k) acc[j + k] += (bits[j / 8] >> k) & 1u ? s : -s;
    }
    float* e = server_error();
    for (size_t j = 0; j < C; ++j) e[j] += acc[j] * inv;
    compress_into(e, C, mine);
  } else {
    std::vector<float> acc(C);
    std::memcpy(acc.data(), recv, C * sizeof(float));
    for (size_t w = 1; w < W; ++w) {
      const auto* v = reinterpret_cast<const float*>(recv + w * B);
      for (size_t j = 0; j < C; ++j) acc[j] += v[j];
    }
    auto* avg = reinterpret_cast<float*>(mine);
    for (size_t j = 0; j < C; ++j) avg[j] = acc[j] * inv;
  }

  wait(group_->all_gather(mine, gathered, B, DType::kU8));

  // Every rank decodes every chunk alike.
  for (size_t r = 0; r < W; ++r) {
    const size_t lo = r * C;
    if (lo >= count_) break;
    const size_t n = std::min(C, count_ - lo);
    const uint8_t* block = gathered + r * B;
    if (sign) {
      const float s = block_scale(block);
      const uint8_t* bits = block + sizeof(float);
      for (size_t j = 0; j < n; ++j) out[lo + j] = (bits[j / 8] >> (j % 8)) & 1u ? s : -s;
    } else {
      std::memcpy(out + lo, block, n * sizeof(float));
    }
  }
  return seconds;
}

}  // namespace loom
