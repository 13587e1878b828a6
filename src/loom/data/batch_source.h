// Batches of (inputs, targets): windows of seq_len + 1 tokens drawn from
// (seed, step, global sample index) alone, so any parallel layout and any
// resumed run sees exactly the same samples.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace loom {

class BatchSource {
 public:
  virtual ~BatchSource() = default;
  // inputs and targets (B, T) for global samples [sample0, sample0 + B) of `step`.
  virtual void fill(uint64_t step, uint64_t sample0, int64_t B, int64_t Tn, int32_t* inputs,
                    int32_t* targets) const = 0;
  virtual std::string describe() const = 0;
};

// Uniform random tokens in [0, vocab): for benchmarks and tests, no dataset.
std::unique_ptr<BatchSource> make_synthetic_source(uint64_t seed, int vocab_size);

// How windows are chosen from a token file:
//   random:     the start of sample g of step s is drawn from (seed, s, g);
//   sequential: epoch-style, non-overlapping windows in file order; global
//               sample number n = s * samples_per_step + g takes window
//               n mod (windows in the file), so epoch e starts at n = e * windows.
enum class Sampling { kRandom, kSequential };

// Windows of a token file. Checks that the file's tokens fit the model's
// vocabulary and that it holds at least one window of seq_len + 1. `what`
// names the config key in messages ("data.train").
std::unique_ptr<BatchSource> make_token_file_source(const std::string& path,
                                                    const std::string& what, uint64_t seed,
                                                    int vocab_size, int seq_len,
                                                    Sampling sampling = Sampling::kRandom,
                                                    uint64_t samples_per_step = 1);

}  // namespace loom
