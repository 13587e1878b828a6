#include <gtest/gtest.h>
#if __has_include(<malloc.h>)
#include <malloc.h>
#endif
#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/rng.h"
#include "loom/core/shape.h"
#include "loom/core/threads.h"

namespace loom {
namespace {

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is halfway between two bf16 values: ties go to the even one (1.0).
  EXPECT_EQ(f32_to_bf16(1.00390625f), 0x3f80);
  // 1 + 3 * 2^-8 is halfway too; the even neighbour is 1 + 2^-6.
  EXPECT_EQ(f32_to_bf16(1.01171875f), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(-3.5f)), -3.5f);
}

TEST(DType, F16ExactValuesAndRounding) {
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(-2.0f), 0xc000);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);                      // largest finite
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);                      // rounds up to infinity
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);         // smallest subnormal
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -14)), 0x0400);         // smallest normal
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie to even
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f16_to_f32(0x7c00), std::numeric_limits<float>::infinity());
  // Every finite f16 survives the round trip through f32.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    if (((h >> 10) & 0x1f) == 0x1f) continue;
    ASSERT_EQ(f32_to_f16(f16_to_f32(static_cast<uint16_t>(h))), h) << std::hex << h;
  }
}

TEST(DType, BulkConvertRoundTrips) {
  std::vector<float> x(12), back(12);
  std::vector<uint16_t> h(12), b(12);
  for (int i = 0; i < 12; ++i) x[i] = static_cast<float>(i) * 0.25f - 1.0f;
  convert(x.data(), DType::kF32, h.data(), DType::kF16, 12);
  convert(h.data(), DType::kF16, back.data(), DType::kF32, 12);
  EXPECT_EQ(back, x);
  convert(x.data(), DType::kF32, b.data(), DType::kBF16, 12);
  convert(b.data(), DType::kBF16, back.data(), DType::kF32, 12);
  EXPECT_EQ(back, x);
}

TEST(Memory, TrackerCountsCurrentAndPeakPerCategory) {
  auto before = memory_tracker().stats();
  int k = static_cast<int>(MemCategory::kComm);
  {
    Buffer a(1000, MemCategory::kComm);
    {
      Buffer b(500, MemCategory::kComm);
      EXPECT_EQ(memory_tracker().stats().current[k], before.current[k] + 1500);
    }
    EXPECT_EQ(memory_tracker().stats().current[k], before.current[k] + 1000);
    EXPECT_GE(memory_tracker().stats().peak[k], before.current[k] + 1500);
    Buffer moved = std::move(a);
    EXPECT_EQ(memory_tracker().stats().current[k], before.current[k] + 1000);
  }
  EXPECT_EQ(memory_tracker().stats().current[k], before.current[k]);
  memory_tracker().reset_peaks();
  EXPECT_EQ(memory_tracker().stats().peak[k], before.current[k]);
}

// A step's buffers freed and allocated again reuse their memory, at the
// same addresses, instead of getting fresh mappings that fault every page
// in anew (and glibc's aligned blocks, which Buffer no longer uses, had
// fragmented its heap so that they moved and faulted for rounds).
TEST(Memory, FreedHostBuffersAreReusedWithoutFaults) {
#if defined(__GLIBC__) && defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
#define LOOM_SANITIZER_ALLOCATOR 1
#endif
#endif
#if !defined(__GLIBC__) || defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__) || \
    defined(LOOM_SANITIZER_ALLOCATOR)
  GTEST_SKIP() << "glibc's own allocator only";
#else
  if (host_allocator_tuned()) GTEST_SKIP() << "this environment tunes glibc's allocator";
  ::setenv("MALLOC_TRIM_THRESHOLD_", "131072", 1);
  EXPECT_TRUE(host_allocator_tuned());
  EXPECT_FALSE(keep_freed_host_memory()) << "the user's tuning is left alone";
  ::unsetenv("MALLOC_TRIM_THRESHOLD_");
  ::setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0", 1);
  EXPECT_FALSE(host_allocator_tuned()) << "a tunable of another part of glibc";
  ::setenv("GLIBC_TUNABLES", "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=131072", 1);
  EXPECT_TRUE(host_allocator_tuned());
  ::unsetenv("GLIBC_TUNABLES");
  ASSERT_TRUE(keep_freed_host_memory());
  auto faults = [] {
    rusage u{};
    getrusage(RUSAGE_SELF, &u);
    return u.ru_minflt;
  };
  // Past glibc's largest mmap threshold (32 MiB), and four of them past its
  // trim threshold.
  const size_t bytes = size_t(40) << 20;
  const char* first = nullptr;
  long last = 0;
  for (int round = 0; round < 4; ++round) {
    const long before = faults();
    const size_t mapped = mallinfo2().hblkhd;
    std::vector<Buffer> step;
    for (int i = 0; i < 4; ++i) step.emplace_back(bytes, MemCategory::kWorkspace, true);
    EXPECT_EQ(mallinfo2().hblkhd, mapped) << "round " << round << ": blocks mapped on their own";
    if (round == 0) first = step[0].as<char>();
    EXPECT_EQ(step[0].as<char>(), first) << "round " << round;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(step[3].data()) % 64, 0u);
    step.clear();
    last = faults() - before;
  }
  // 40,960 pages a round when they are handed back to the system.
  EXPECT_LT(last, 1000);
#endif
}

TEST(Shape, CountsAndPrints) {
  EXPECT_EQ(Shape({4, 3}).numel(), 12);
  EXPECT_EQ(Shape({768, 2304}).str(), "(768, 2304)");
  EXPECT_THROW(Shape({1, 2, 3, 4, 5}), Error);
  EXPECT_THROW(Shape({-1}), Error);
}

TEST(Memory, BuffersKnowTheirDevice) {
  Buffer host(64, MemCategory::kWorkspace);
  EXPECT_EQ(host.device(), Device::kCpu);
  int k = static_cast<int>(MemCategory::kComm);
  const size_t before = memory_tracker().stats().current[k];
  static int freed = 0;
  {
    Buffer b = Buffer::adopt(std::malloc(128), 128, MemCategory::kComm, Device::kCuda, [](void* p) {
      ++freed;
      std::free(p);
    });
    EXPECT_EQ(b.device(), Device::kCuda);
    EXPECT_EQ(memory_tracker().stats().current[k], before + 128);
    Buffer moved = std::move(b);
    EXPECT_EQ(moved.device(), Device::kCuda);
  }
  EXPECT_EQ(freed, 1);
  EXPECT_EQ(memory_tracker().stats().current[k], before);
  EXPECT_STREQ(device_name(Device::kCuda), "cuda");
}

TEST(Error, CheckRecordsConditionAndValues) {
  try {
    int a = 3, b = 4;
    LOOM_CHECK(a == b, "a={} b={}", a, b);
    FAIL() << "no throw";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("a == b"), std::string::npos) << what;
    EXPECT_NE(what.find("a=3 b=4"), std::string::npos) << what;
    EXPECT_NE(what.find("test_core.cc"), std::string::npos) << what;
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  }
}

// The lane-parallel Philox (dropout's masks) gives philox4x32's words, bit
// for bit, on every path this CPU runs: counters that differ in every
// word, keys with the top bits set (the Weyl additions wrap).
TEST(Rng, PhiloxLanesAreScalarPhiloxOnEveryPath) {
  std::mt19937 gen(3);
  for (const PhiloxKey key : {PhiloxKey{0, 0}, PhiloxKey{0xffffffffu, 0x80000001u},
                              PhiloxKey{uint32_t(gen()), uint32_t(gen())}}) {
    uint32_t in[4][kPhiloxLanes];
    for (auto& w : in)
      for (uint32_t& v : w) v = uint32_t(gen());
    in[0][0] = in[1][0] = in[2][0] = in[3][0] = 0xffffffffu;
    int ran = 0;
    for (PhiloxPath p :
         {PhiloxPath::kBest, PhiloxPath::kScalar, PhiloxPath::kAvx2, PhiloxPath::kAvx512}) {
      if (!philox_runs(p)) continue;
      ++ran;
      uint32_t x[4][kPhiloxLanes];
      std::memcpy(x, in, sizeof x);
      philox4x32_lanes(x, key, p);
      for (int l = 0; l < kPhiloxLanes; ++l) {
        const auto want = philox4x32({in[0][l], in[1][l], in[2][l], in[3][l]}, key);
        for (int w = 0; w < 4; ++w)
          ASSERT_EQ(x[w][l], want[static_cast<size_t>(w)])
              << "path " << static_cast<int>(p) << " lane " << l << " word " << w;
      }
    }
    EXPECT_GE(ran, 2);
  }
#if defined(__x86_64__)
  // The vector paths run wherever the CPU has their instructions.
  EXPECT_EQ(philox_runs(PhiloxPath::kAvx2), bool(__builtin_cpu_supports("avx2")));
  EXPECT_EQ(philox_runs(PhiloxPath::kAvx512), bool(__builtin_cpu_supports("avx512f")));
#endif
}

TEST(Rng, PhiloxKnownAnswer) {
  // Known-answer vectors of Philox-4x32-10 (Random123's kat_vectors).
  auto r = philox4x32({0, 0, 0, 0}, {0, 0});
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  r = philox4x32({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu});
  EXPECT_EQ(r[0], 0x408f276du);
  EXPECT_EQ(r[1], 0x41c83b0eu);
  EXPECT_EQ(r[2], 0xa20bc7c6u);
  EXPECT_EQ(r[3], 0x6d5451fdu);
}

TEST(Rng, InitIsAFunctionOfSeedNameAndIndexOnly) {
  // However a tensor is split, element i gets the same value: draw the whole
  // tensor, then each of 3 shards drawing only its own range, in reverse order.
  const std::string name = "transformer.h.3.mlp.c_fc.weight";
  const uint64_t n = 1001;
  NormalStream whole(42, name);
  std::vector<float> full(n);
  for (uint64_t i = 0; i < n; ++i) full[i] = whole.at(i);
  for (int shard = 2; shard >= 0; --shard) {
    NormalStream s(42, name);
    uint64_t begin = n * shard / 3, end = n * (shard + 1) / 3;
    for (uint64_t i = end; i-- > begin;) ASSERT_EQ(s.at(i), full[i]) << i;
  }
  // Other names and seeds give other streams.
  EXPECT_NE(NormalStream(42, "transformer.h.3.mlp.c_proj.weight").at(0), full[0]);
  EXPECT_NE(NormalStream(43, name).at(0), full[0]);
  // And the values are standard normal.
  double mean = 0, var = 0;
  NormalStream big(7, "x");
  const int m = 200000;
  for (int i = 0; i < m; ++i) {
    double v = big.at(static_cast<uint64_t>(i));
    mean += v / m;
    var += v * v / m;
  }
  EXPECT_NEAR(mean, 0.0, 0.01);
  EXPECT_NEAR(var, 1.0, 0.02);
}

// Dropout sites: no two (layer, place, head) of the largest model the
// config allows share a site id, so no mask repeats across layers (with 8
// bits for the layer they repeated every 256 layers).
TEST(Rng, DropoutSitesAreDistinctForEveryLayerPlaceAndHead) {
  std::vector<uint32_t> ids;
  for (int layer = -1; layer < 4096; ++layer)
    for (DropoutSite s : {DropoutSite::kEmbedding, DropoutSite::kAttnProbs, DropoutSite::kAttnResid,
                          DropoutSite::kMlpResid})
      for (uint32_t head : {0u, 1u, 65535u}) ids.push_back(dropout_site(layer, s, head));
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end());
  // Layers 0 and 256 draw different masks.
  DropoutStream d(7, 1, 0.5f);
  std::vector<float> a(64), b(64);
  d.row(0, dropout_site(0, DropoutSite::kMlpResid), 3, 0, 64, a.data());
  d.row(0, dropout_site(256, DropoutSite::kMlpResid), 3, 0, 64, b.data());
  EXPECT_NE(a, b);
  // Positions 4096 apart too (the position has its own counter word).
  d.row(0, dropout_site(0, DropoutSite::kMlpResid), 3 + 4096, 0, 64, b.data());
  EXPECT_NE(a, b);
}

// MFU's denominator counts the cores the ranks have: 4 ranks of 1 thread on
// a 2-core host share its peak (not 4 x the 1-thread peak), one rank of 4
// threads on 2 cores gets the 2 cores' peak, 2 hosts of 2 ranks x 1 thread
// on 2 cores each have 4 cores in all.
TEST(Threads, JobPeakCountsTheCoresTheRanksHave) {
  ThreadConfig t;
  t.cores = 2, t.threads = 1, t.ranks_on_node = 4;
  EXPECT_DOUBLE_EQ(job_peak_gflops(150, t, 4), 300);
  t.threads = 4, t.ranks_on_node = 1;
  EXPECT_DOUBLE_EQ(job_peak_gflops(300, t, 1), 300);
  t.threads = 1, t.ranks_on_node = 2;
  EXPECT_DOUBLE_EQ(job_peak_gflops(150, t, 4), 600);
  t.threads = 2, t.ranks_on_node = 1;
  EXPECT_DOUBLE_EQ(job_peak_gflops(300, t, 1), 300);
}

}  // namespace
}  // namespace loom
