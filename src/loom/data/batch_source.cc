#include "loom/data/batch_source.h"

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/data/token_file.h"

namespace loom {

namespace {

PhiloxKey data_key(uint64_t seed, uint32_t stream) {
  return {static_cast<uint32_t>(seed) ^ stream, static_cast<uint32_t>(seed >> 32) ^ 0x64617461u};
}

class SyntheticSource : public BatchSource {
 public:
  SyntheticSource(uint64_t seed, int vocab) : key_(data_key(seed, 0x73796e74u)), vocab_(vocab) {}

  void fill(uint64_t step, uint64_t sample0, int64_t B, int64_t Tn, int32_t* inputs,
            int32_t* targets) const override {
    for (int64_t b = 0; b < B; ++b) {
      uint64_t s = sample0 + static_cast<uint64_t>(b);
      auto token = [&](int64_t pos) {
        auto r = philox4x32({static_cast<uint32_t>(step), static_cast<uint32_t>(s),
                             static_cast<uint32_t>(s >> 32), static_cast<uint32_t>(pos / 4)},
                            key_);
        return static_cast<int32_t>(r[pos % 4] % static_cast<uint32_t>(vocab_));
      };
      for (int64_t t = 0; t < Tn; ++t) {
        inputs[b * Tn + t] = token(t);
        targets[b * Tn + t] = token(t + 1);
      }
    }
  }
  std::string describe() const override {
    return format("synthetic tokens (uniform over {} ids)", vocab_);
  }

 private:
  PhiloxKey key_;
  int vocab_;
};

class TokenFileSource : public BatchSource {
 public:
  TokenFileSource(const std::string& path, const std::string& what, uint64_t seed, int vocab,
                  int seq_len, Sampling sampling, uint64_t samples_per_step)
      : file_(path),
        key_(data_key(seed, 0x77696e64u)),
        sampling_(sampling),
        samples_per_step_(samples_per_step) {
    LOOM_CHECK_KIND(kData, file_.size() >= static_cast<uint64_t>(seq_len) + 1,
                    "{} {}: {} tokens, fewer than one window of model.seq_len + 1 = {}", what, path,
                    file_.size(), seq_len + 1);
    LOOM_CHECK_KIND(kData, file_.vocab_size() <= static_cast<uint32_t>(vocab),
                    "{} {}: the file's vocabulary ({}) is larger than model.vocab_size ({})", what,
                    path, file_.vocab_size(), vocab);
    for (uint64_t i = 0; i < file_.size(); ++i)
      LOOM_CHECK_KIND(kData, file_[i] < static_cast<uint32_t>(vocab),
                      "{} {}: token {} at index {} is beyond model.vocab_size {}", what, path,
                      file_[i], i, vocab);
  }

  void fill(uint64_t step, uint64_t sample0, int64_t B, int64_t Tn, int32_t* inputs,
            int32_t* targets) const override {
    LOOM_CHECK_KIND(kData, file_.size() >= static_cast<uint64_t>(Tn) + 1,
                    "{}: {} tokens, fewer than one window of {}", file_.path(), file_.size(),
                    Tn + 1);
    const uint64_t starts = file_.size() - static_cast<uint64_t>(Tn);
    const uint64_t windows = (file_.size() - 1) / static_cast<uint64_t>(Tn);
    for (int64_t b = 0; b < B; ++b) {
      uint64_t s = sample0 + static_cast<uint64_t>(b);
      uint64_t start = 0;
      if (sampling_ == Sampling::kSequential) {
        start = (step * samples_per_step_ + s) % windows * static_cast<uint64_t>(Tn);
      } else {
        auto r = philox4x32({static_cast<uint32_t>(step), static_cast<uint32_t>(step >> 32),
                             static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32)},
                            key_);
        start = ((static_cast<uint64_t>(r[0]) << 32) | r[1]) % starts;
      }
      for (int64_t t = 0; t < Tn; ++t) {
        inputs[b * Tn + t] = static_cast<int32_t>(file_[start + t]);
        targets[b * Tn + t] = static_cast<int32_t>(file_[start + t + 1]);
      }
    }
  }
  std::string describe() const override {
    return format("{} ({} tokens)", file_.path(), file_.size());
  }

 private:
  TokenFile file_;
  PhiloxKey key_;
  Sampling sampling_;
  uint64_t samples_per_step_;
};

}  // namespace

std::unique_ptr<BatchSource> make_synthetic_source(uint64_t seed, int vocab_size) {
  return std::make_unique<SyntheticSource>(seed, vocab_size);
}

std::unique_ptr<BatchSource> make_token_file_source(const std::string& path,
                                                    const std::string& what, uint64_t seed,
                                                    int vocab_size, int seq_len, Sampling sampling,
                                                    uint64_t samples_per_step) {
  return std::make_unique<TokenFileSource>(path, what, seed, vocab_size, seq_len, sampling,
                                           samples_per_step);
}

}  // namespace loom
