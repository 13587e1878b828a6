// Token files and batch sources: sampling is a function of (seed, step,
// global sample index) alone; sequential mode walks the file in epochs;
// damaged files are rejected with the file and the reason.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "loom/core/error.h"
#include "loom/data/batch_source.h"
#include "loom/data/token_file.h"
#include "loom/io/fs.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;

// A path in a fresh folder, removed afterwards.
struct TempFile {
  test::TempDir dir;
  std::string path = dir.file("tokens.bin");
};

std::vector<uint32_t> iota(uint32_t n) {
  std::vector<uint32_t> v(n);
  for (uint32_t i = 0; i < n; ++i) v[i] = i;
  return v;
}

using test::error_of;

TEST(TokenFile, RoundTripsBothWidths) {
  TempFile f;
  write_token_file(f.path, {1, 2, 65535}, 65536);
  TokenFile t(f.path);
  EXPECT_EQ(t.size(), 3u);
  EXPECT_EQ(t[2], 65535u);
  EXPECT_EQ(fs::file_size(f.path), kTokenHeaderBytes + 3 * 2);
  write_token_file(f.path, {70000, 3}, 100000);
  TokenFile w(f.path);
  EXPECT_EQ(w[0], 70000u);
  EXPECT_EQ(fs::file_size(f.path), kTokenHeaderBytes + 2 * 4);
}

TEST(TokenFile, DamageIsReportedWithTheFile) {
  TempFile f;
  write_token_file(f.path, iota(100), 256);
  fs::resize_file(f.path, kTokenHeaderBytes + 50);
  EXPECT_NE(error_of([&] { TokenFile t(f.path); })
                .find("truncated or oversized body: header says 100 tokens (232 bytes) but the "
                      "file has 82 bytes"),
            std::string::npos);
  // A count whose byte size wraps around 2^64 to the file's real size.
  write_token_file(f.path, {1, 2}, 256);
  {
    std::fstream io(f.path, std::ios::in | std::ios::out | std::ios::binary);
    const uint64_t count = 2 + (uint64_t{1} << 63);  // x 2 bytes = 4 (mod 2^64)
    io.seekp(16);
    io.write(reinterpret_cast<const char*>(&count), 8);
  }
  EXPECT_NE(error_of([&] { TokenFile t(f.path); })
                .find("header says 9223372036854775810 tokens (more bytes than a file can have) "
                      "but the file has 36 bytes"),
            std::string::npos);
  write_token_file(f.path, iota(100), 256);
  EXPECT_NE(error_of([&] { make_token_file_source(f.path, "data.train", 1, 50, 8); })
                .find("data.train " + f.path +
                      ": the file's vocabulary (256) is larger than "
                      "model.vocab_size (50)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              write_token_file(f.path, {1, 300}, 256);
            }).find("token 300 at index 1 is beyond vocabulary 256"),
            std::string::npos);
}

TEST(BatchSource, RandomWindowsDependOnlyOnStepAndGlobalSample) {
  TempFile f;
  write_token_file(f.path, iota(1000), 1024);
  auto src = make_token_file_source(f.path, "data.train", 7, 1024, 16);
  std::vector<int32_t> in4(4 * 16), tg4(4 * 16), in2(2 * 16), tg2(2 * 16);
  src->fill(3, 0, 4, 16, in4.data(), tg4.data());
  src->fill(3, 2, 2, 16, in2.data(), tg2.data());  // samples 2 and 3 on their own
  EXPECT_TRUE(std::equal(in2.begin(), in2.end(), in4.begin() + 32));
  for (int i = 0; i < 16; ++i) EXPECT_EQ(tg4[i], in4[i] + 1);  // targets shifted by one
  std::vector<int32_t> other(16), t(16);
  src->fill(4, 0, 1, 16, other.data(), t.data());
  EXPECT_NE(other[0], in4[0]);  // another step, another window (with near certainty)
}

TEST(BatchSource, SequentialWalksTheFileInEpochs) {
  TempFile f;
  write_token_file(f.path, iota(100), 128);  // (100 - 1) / 16 = 6 windows
  auto src = make_token_file_source(f.path, "data.train", 7, 128, 16, Sampling::kSequential, 4);
  std::vector<int32_t> in(4 * 16), tg(4 * 16);
  src->fill(0, 0, 4, 16, in.data(), tg.data());
  for (int b = 0; b < 4; ++b) EXPECT_EQ(in[b * 16], b * 16);
  src->fill(1, 0, 4, 16, in.data(), tg.data());  // global samples 4..7: windows 4, 5, 0, 1
  EXPECT_EQ(in[0], 64);
  EXPECT_EQ(in[16], 80);
  EXPECT_EQ(in[32], 0);
  EXPECT_EQ(in[48], 16);
  EXPECT_EQ(tg[16 + 15], 96);
}

TEST(BatchSource, SyntheticTokensAreLayoutIndependent) {
  auto src = make_synthetic_source(3, 50);
  std::vector<int32_t> a(3 * 8), ta(3 * 8), b(8), tb(8);
  src->fill(2, 10, 3, 8, a.data(), ta.data());
  src->fill(2, 12, 1, 8, b.data(), tb.data());
  EXPECT_TRUE(std::equal(b.begin(), b.end(), a.begin() + 16));
  for (int i = 0; i + 1 < 8; ++i) EXPECT_EQ(ta[i], a[i + 1]);
  for (int32_t x : a) EXPECT_TRUE(x >= 0 && x < 50);
}

}  // namespace
}  // namespace loom
