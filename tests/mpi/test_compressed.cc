// The 1-bit compressed all-reduce (comm/compressed.h) against a reference
// that simulates every worker and server of the group in one process and
// decompresses exactly: the same result bits and errors on every rank, over
// several calls (the errors carry), for every group size; the identity codec
// against the group's own average; the bytes in the record; and error
// feedback's promise (the mean of the outputs approaches the mean input).
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "loom/comm/compressed.h"
#include "loom/comm/record.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;

std::vector<std::shared_ptr<MpiProcessGroup>> groups_of_every_size() {
  return test::groups_of_every_size(CommOptions{});
}

// Rank r's input at call t: random, the same on every rank that asks.
std::vector<float> input(int r, int t, size_t n) {
  std::mt19937 gen(static_cast<uint32_t>(1000 * t + r + 7));
  std::normal_distribution<float> d(0.5f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = d(gen);
  if (n > 3) x[3] = 0.0f;  // sign(0) = +1
  return x;
}

// The algorithm of comm/compressed.h written out over all W workers and
// servers at once.
struct Reference {
  size_t n, N, C;
  int W;
  std::vector<std::vector<float>> ew, es;  // per worker (N), per server (C)
  Reference(size_t n_, int W_) : n(n_), W(W_) {
    N = (n + 8 * size_t(W) - 1) / (8 * size_t(W)) * (8 * size_t(W));
    C = N / size_t(W);
    ew.assign(size_t(W), std::vector<float>(N, 0.0f));
    es.assign(size_t(W), std::vector<float>(C, 0.0f));
  }
  static float sgn(float v, float s) { return v >= 0.0f ? s : -s; }
  std::vector<float> step(int t) {
    std::vector<std::vector<float>> c(static_cast<size_t>(W), std::vector<float>(N));
    for (int w = 0; w < W; ++w) {
      std::vector<float> x = ew[size_t(w)];
      const std::vector<float> in = input(w, t, n);
      for (size_t i = 0; i < n; ++i) x[i] += in[i];
      double ss = 0;
      for (float v : x) ss += double(v) * double(v);
      const float s = float(std::sqrt(ss / double(N)));
      for (size_t i = 0; i < N; ++i) {
        c[size_t(w)][i] = sgn(x[i], s);
        ew[size_t(w)][i] = x[i] - c[size_t(w)][i];
      }
    }
    std::vector<float> out(N);
    for (int r = 0; r < W; ++r) {
      std::vector<float> y(C);
      for (size_t j = 0; j < C; ++j) {
        float acc = 0;
        for (int w = 0; w < W; ++w) acc += c[size_t(w)][size_t(r) * C + j];
        y[j] = es[size_t(r)][j] + acc * (1.0f / float(W));
      }
      double ss = 0;
      for (float v : y) ss += double(v) * double(v);
      const float s = float(std::sqrt(ss / double(C)));
      for (size_t j = 0; j < C; ++j) {
        out[size_t(r) * C + j] = sgn(y[j], s);
        es[size_t(r)][j] = y[j] - out[size_t(r) * C + j];
      }
    }
    out.resize(n);
    return out;
  }
};

TEST(Compressed, OneBitAllReduceMatchesTheReferenceBitForBit) {
  for (auto& g : groups_of_every_size()) {
    for (size_t n : {size_t{1}, size_t{13}, size_t{64}, size_t{1000}, size_t{4099}}) {
      CompressedAllReduce ar(g, n, Codec::kSign);
      Reference ref(n, g->size());
      ASSERT_EQ(ar.padded(), ref.N);
      ASSERT_EQ(ar.padded() % (8 * size_t(g->size())), 0u);
      for (int t = 0; t < 4; ++t) {
        std::vector<float> x = input(g->rank(), t, n), out(n, -7.0f);
        ar.run(x.data(), out.data());
        const std::vector<float> want = ref.step(t);
        for (size_t i = 0; i < n; ++i)
          ASSERT_EQ(out[i], want[i]) << g->name() << " n " << n << " call " << t << " at " << i;
        for (size_t i = 0; i < ar.padded(); ++i)
          ASSERT_EQ(ar.worker_error()[i], ref.ew[size_t(g->rank())][i]) << "worker error " << i;
        for (size_t j = 0; j < ar.chunk(); ++j)
          ASSERT_EQ(ar.server_error()[j], ref.es[size_t(g->rank())][j]) << "server error " << j;
        // The output is one magnitude per chunk.
        for (size_t i = 1; i < n; ++i) {
          if (i / ar.chunk() == (i - 1) / ar.chunk()) {
            ASSERT_EQ(std::fabs(out[i]), std::fabs(out[i - 1]));
          }
        }
      }
    }
  }
}

TEST(Compressed, IdentityCodecIsTheGroupsAverage) {
  for (auto& g : groups_of_every_size()) {
    const size_t n = 1031;
    CompressedAllReduce ar(g, n, Codec::kIdentity);
    std::vector<float> x = input(g->rank(), 0, n), out(n);
    ar.run(x.data(), out.data());
    // The rank-order sum times 1 / size.
    std::vector<std::vector<float>> all;
    for (int r = 0; r < g->size(); ++r) all.push_back(input(r, 0, n));
    for (size_t i = 0; i < n; ++i) {
      float acc = 0;
      for (int r = 0; r < g->size(); ++r) acc += all[size_t(r)][i];
      ASSERT_EQ(out[i], acc * (1.0f / float(g->size()))) << g->name() << " at " << i;
    }
    // Two ranks: bit for bit the plain f32 all-reduce.
    if (g->size() <= 2) {
      std::vector<float> plain = x;
      g->all_reduce(plain.data(), plain.data(), n, DType::kF32, ReduceOp::kAvg)->wait();
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[i], plain[i]) << "at " << i;
    }
  }
}

TEST(Compressed, TheRecordShowsOneThirtySecondOfTheBytes) {
  auto world = runtime().world(CommOptions{});
  if (world->size() < 2) GTEST_SKIP() << "needs two ranks";
  const int W = world->size();
  const size_t n = size_t{1} << 16;
  CompressedAllReduce ar(world, n, Codec::kSign);
  std::vector<float> x = input(world->rank(), 0, n), out(n);
  CommRecord& record = *world->record();
  record.take();
  ar.run(x.data(), out.data());
  double sent = 0;
  for (const CommEvent& e : record.take()) sent += e.sent_bytes;
  // (W - 1) blocks of N / W / 8 bytes and a scale, out and back.
  const double want = 2.0 * (W - 1) * (4.0 + double(ar.padded()) / W / 8);
  EXPECT_EQ(sent, want);
  const double f32 = 2.0 * (W - 1) / W * 4.0 * double(n);
  EXPECT_GT(f32 / sent, 31.5);  // the scales cost 4 bytes a block
}

TEST(Compressed, ErrorFeedbackDeliversTheMeanInTheLongRun) {
  auto world = runtime().world(CommOptions{});
  const size_t n = 512;
  CompressedAllReduce ar(world, n, Codec::kSign);
  // A constant input per rank: the outputs' mean approaches the ranks'
  // mean input as the errors stay bounded.
  const std::vector<float> x = input(world->rank(), 0, n);
  std::vector<float> mean(n, 0.0f);
  for (int r = 0; r < world->size(); ++r) {
    const std::vector<float> xr = input(r, 0, n);
    for (size_t i = 0; i < n; ++i) mean[i] += xr[i] / float(world->size());
  }
  std::vector<double> sum(n, 0.0);
  std::vector<float> out(n);
  auto err = [&](int calls) {
    double e2 = 0, m2 = 0;
    for (size_t i = 0; i < n; ++i) {
      const double d = sum[i] / calls - mean[i];
      e2 += d * d;
      m2 += double(mean[i]) * mean[i];
    }
    return std::sqrt(e2 / m2);
  };
  double at20 = 0;
  for (int t = 1; t <= 400; ++t) {
    ar.run(x.data(), out.data());
    for (size_t i = 0; i < n; ++i) sum[i] += out[i];
    if (t == 20) at20 = err(t);
  }
  const double at400 = err(400);
  EXPECT_LT(at400, 0.05) << "relative error of the mean after 400 calls";
  EXPECT_LT(at400, at20 / 5) << "the error of the mean falls like 1 / calls";
}

}  // namespace
}  // namespace loom
