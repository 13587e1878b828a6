// Every collective and every all-reduce algorithm against MPI's own result and
// an exact expectation, for group sizes 1 to the world size, counts 0, 1,
// primes and large, and each dtype. Inputs are small integers, so every sum
// is exact in f32, bf16 and f16 and results must match bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>

#include "loom/comm/grid.h"
#include "loom/comm/record.h"
#include "loom/core/error.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;

// Integer-valued input of rank r: small enough that sums over 8 ranks stay
// exact in bf16 (8 significant bits).
float input(int r, size_t i) {
  return static_cast<float>(static_cast<int>((i * 7 + r * 3) % 9) - 4);
}

std::vector<uint16_t> narrow(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> out(x.size());
  convert(x.data(), DType::kF32, out.data(), t, x.size());
  return out;
}

std::vector<float> widen(const void* x, DType t, size_t n) {
  std::vector<float> out(n);
  convert(x, t, out.data(), DType::kF32, n);
  return out;
}

using test::groups_of_every_size;

TEST(Collectives, AllReduceEveryAlgorithmMatchesMpiExactly) {
  CommOptions opt;
  opt.timeout_s = 120;
  opt.ranks_per_node = 2;  // two "nodes" on this machine for the hierarchical algorithm
  for (auto& g : groups_of_every_size(opt)) {
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{13}, size_t{1031}, size_t{65537},
                         size_t{(1 << 20) + 3}}) {
      for (DType t : {DType::kF32, DType::kBF16, DType::kF16}) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax, ReduceOp::kAvg}) {
          std::vector<float> x(count);
          for (size_t i = 0; i < count; ++i) x[i] = input(g->rank(), i);
          std::vector<float> want(count);
          for (size_t i = 0; i < count; ++i) {
            float acc = op == ReduceOp::kMax ? -1e30f : 0.0f;
            for (int r = 0; r < g->size(); ++r)
              acc = op == ReduceOp::kMax ? std::max(acc, input(r, i)) : acc + input(r, i);
            // An average is the sum times 1 / size (on the backend).
            want[i] = op == ReduceOp::kAvg ? acc * (1.0f / static_cast<float>(g->size())) : acc;
          }
          std::vector<uint16_t> mpi_result;
          for (const char* algo : {"mpi", "ring", "rhd", "hierarchical"}) {
            std::vector<float> got;
            if (t == DType::kF32) {
              got = x;  // in place
              g->all_reduce_with(algo, got.data(), got.data(), count, t, op)->wait();
            } else {
              std::vector<uint16_t> in = narrow(x, t), out(count);
              g->all_reduce_with(algo, in.data(), out.data(), count, t, op)->wait();
              got = widen(out.data(), t, count);
            }
            std::vector<float> expect = want;
            if (t != DType::kF32) expect = widen(narrow(want, t).data(), t, count);
            for (size_t i = 0; i < count; ++i)
              ASSERT_EQ(got[i], expect[i])
                  << algo << " group " << g->name() << " size " << g->size() << " count " << count
                  << " " << dtype_name(t) << " " << reduce_op_name(op) << " at " << i;
          }
        }
      }
    }
  }
}

TEST(Collectives, ReduceScatterAllGatherBroadcast) {
  for (auto& g : groups_of_every_size(CommOptions{})) {
    const int p = g->size(), r = g->rank();
    for (size_t count : {size_t{1}, size_t{5}, size_t{4099}}) {
      for (DType t : {DType::kF32, DType::kBF16}) {
        std::vector<float> x(count * p);
        for (size_t i = 0; i < x.size(); ++i) x[i] = input(r, i);
        auto xin = t == DType::kF32 ? std::vector<uint16_t>() : narrow(x, t);
        std::vector<float> out32(count);
        std::vector<uint16_t> out16(count);
        const void* src = t == DType::kF32 ? static_cast<const void*>(x.data()) : xin.data();
        void* dst = t == DType::kF32 ? static_cast<void*>(out32.data()) : out16.data();
        g->reduce_scatter(src, dst, count, t, ReduceOp::kSum)->wait();
        auto got = t == DType::kF32 ? out32 : widen(out16.data(), t, count);
        for (size_t i = 0; i < count; ++i) {
          float s = 0;
          for (int q = 0; q < p; ++q) s += input(q, r * count + i);
          ASSERT_EQ(got[i], s) << "reduce-scatter " << g->name() << " " << dtype_name(t);
        }
        // All-gather in place: my block already sits at offset r * count.
        std::vector<float> all(count * p, -99.0f);
        for (size_t i = 0; i < count; ++i) all[r * count + i] = input(r, i);
        g->all_gather(all.data() + r * count, all.data(), count, DType::kF32)->wait();
        for (int q = 0; q < p; ++q)
          for (size_t i = 0; i < count; ++i) ASSERT_EQ(all[q * count + i], input(q, i));
        // in == out (the interface's promise): my block at the start, on
        // every rank, not only where it already sits.
        std::vector<float> same(count * p, -99.0f);
        for (size_t i = 0; i < count; ++i) same[i] = input(r, i);
        g->all_gather(same.data(), same.data(), count, DType::kF32)->wait();
        for (int q = 0; q < p; ++q)
          for (size_t i = 0; i < count; ++i)
            ASSERT_EQ(same[q * count + i], input(q, i)) << "in == out, rank " << r;
      }
      std::vector<float> b(count, r == p - 1 ? 3.5f : 0.0f);
      g->broadcast(b.data(), count, DType::kF32, p - 1)->wait();
      for (float v : b) ASSERT_EQ(v, 3.5f);
    }
  }
}

TEST(Collectives, AllToAllWithPerRankCountsAndPointToPoint) {
  auto g = runtime().world(CommOptions{});
  const int p = g->size(), r = g->rank();
  // Rank r sends (r + q) % 3 + 1 elements, valued 100 r + q, to rank q.
  std::vector<size_t> sc(p), rc(p);
  std::vector<float> in, want;
  for (int q = 0; q < p; ++q) {
    sc[q] = static_cast<size_t>((r + q) % 3 + 1);
    rc[q] = static_cast<size_t>((q + r) % 3 + 1);
    for (size_t k = 0; k < sc[q]; ++k) in.push_back(static_cast<float>(100 * r + q));
    for (size_t k = 0; k < rc[q]; ++k) want.push_back(static_cast<float>(100 * q + r));
  }
  std::vector<float> out(want.size());
  g->all_to_all(in.data(), sc, out.data(), rc, DType::kF32)->wait();
  EXPECT_EQ(out, want);
  // A ring of send/recv, every rank sending before it receives, with messages
  // far beyond the eager limit: the send must not hold up the receive.
  if (p > 1) {
    const size_t n = 4 << 20;
    std::vector<float> token(n, static_cast<float>(r)), got(n, -1.0f);
    auto s = g->send(token.data(), n, DType::kF32, (r + 1) % p, 7);
    auto v = g->recv(got.data(), n, DType::kF32, (r - 1 + p) % p, 7);
    v->wait();
    s->wait();
    EXPECT_EQ(got[0], static_cast<float>((r - 1 + p) % p));
    EXPECT_EQ(got[n - 1], static_cast<float>((r - 1 + p) % p));
  }
  g->barrier()->wait();
}

// The record of every operation (comm/record.h): one event per collective
// and message, with the group, the kind, the type on the wire and the bytes
// this rank sent, counted message by message where loom sends them.
TEST(Collectives, EveryOperationIsRecordedWithTheBytesItSent) {
  CommOptions opt;
  opt.timeout_s = 120;
  auto world = runtime().world(opt);
  const int p = world->size(), r = world->rank();
  CommRecord& record = *world->record();
  record.take();
  const size_t n = 1024 * static_cast<size_t>(p);  // the ring's chunks are equal
  std::vector<float> x(n, 1.0f);
  world->all_reduce_with("ring", x.data(), x.data(), n, DType::kF32, ReduceOp::kSum)->wait();
  world->all_reduce_with("rhd", x.data(), x.data(), n, DType::kF32, ReduceOp::kSum)->wait();
  std::vector<uint16_t> h = narrow(std::vector<float>(n, 1.0f), DType::kBF16),
                        all(n * static_cast<size_t>(p));
  world->all_reduce(h.data(), h.data(), n, DType::kBF16, ReduceOp::kSum)->wait();
  world->all_gather(h.data(), all.data(), n, DType::kBF16)->wait();
  std::vector<size_t> counts(static_cast<size_t>(p));
  for (int k = 0; k < p; ++k) counts[static_cast<size_t>(k)] = static_cast<size_t>(k + 1);
  const size_t total = static_cast<size_t>(p * (p + 1) / 2);
  std::vector<float> send(total, 1.0f), recv(static_cast<size_t>((r + 1) * p));
  std::vector<size_t> rcounts(static_cast<size_t>(p), static_cast<size_t>(r + 1));
  world->all_to_all(send.data(), counts, recv.data(), rcounts, DType::kF32)->wait();
  std::vector<uint16_t> block(n / static_cast<size_t>(p));
  world->reduce_scatter(h.data(), block.data(), block.size(), DType::kBF16, ReduceOp::kAvg)->wait();
  if (p > 1) {
    std::vector<float> msg(100, 2.0f);
    const int to = (r + 1) % p, from = (r + p - 1) % p;
    WorkPtr s1 = world->send(msg.data(), 100, DType::kF32, to, 5);
    std::vector<float> in(100);
    world->recv(in.data(), 100, DType::kF32, from, 5)->wait();
    s1->wait();
  }
  const std::vector<CommEvent> ev = record.take();
  ASSERT_EQ(ev.size(), p > 1 ? 8u : 6u);
  for (const CommEvent& e : ev) {
    EXPECT_EQ(e.group, "world");
    EXPECT_LE(e.enqueued, e.started + 1e-9);
    EXPECT_LE(e.started, e.ended);
  }
  const double fp = 4.0 * double(n);
  EXPECT_EQ(ev[0].kind, "allreduce");
  EXPECT_EQ(ev[0].algo, "ring");
  EXPECT_TRUE(ev[0].exact);
  EXPECT_EQ(ev[0].sent_bytes, 2.0 * (p - 1) / p * fp);  // counted send by send
  EXPECT_EQ(ev[1].algo, "rhd");
  if ((p & (p - 1)) == 0) {  // no folding: halving and doubling send 2 (p - 1) / p
    EXPECT_EQ(ev[1].sent_bytes, 2.0 * (p - 1) / p * fp);
  }
  // 16-bit data keeps 16 bits on the wire (reduced in f32 where it lands):
  // half an f32 all-reduce's bytes, counted exactly.
  EXPECT_EQ(ev[2].dtype, DType::kBF16);
  EXPECT_EQ(ev[2].wire, DType::kBF16);
  EXPECT_EQ(ev[2].algo, "direct");
  EXPECT_EQ(ev[2].sent_bytes, 2.0 * (p - 1) / p * fp / 2);
  EXPECT_TRUE(ev[2].exact);
  EXPECT_EQ(ev[3].kind, "allgather");
  EXPECT_EQ(ev[3].wire, DType::kBF16);
  EXPECT_EQ(ev[3].sent_bytes, double(p - 1) * 2.0 * double(n));
  EXPECT_EQ(ev[4].kind, "alltoall");
  EXPECT_TRUE(ev[4].exact);
  EXPECT_EQ(ev[4].sent_bytes, 4.0 * double(total - static_cast<size_t>(r + 1)));
  EXPECT_EQ(ev[5].kind, "reducescatter");
  EXPECT_EQ(ev[5].wire, DType::kBF16);
  EXPECT_EQ(ev[5].sent_bytes, double(p - 1) * 2.0 * double(block.size()));
  EXPECT_TRUE(ev[5].exact);
  if (p > 1) {
    // The receive completes first or second; the send is the one that sent.
    double sent = 0, received = 0;
    for (size_t k = 6; k < 8; ++k) (ev[k].kind == "send" ? sent : received) += ev[k].sent_bytes;
    EXPECT_EQ(sent, 400.0);
    EXPECT_EQ(received, 0.0);
  }
  const std::vector<CommTotals> t = totals_by_group(ev);
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].ops, static_cast<int>(ev.size()));
}

// Statistics and counters travel exactly: f64 and i64 reduce as they are,
// bytes gather as they are and do not reduce.
TEST(Collectives, SixtyFourBitAndBytePayloads) {
  auto world = runtime().world(CommOptions{});
  const int p = world->size(), r = world->rank();
  double d[2] = {1e-17 * (r + 1), 1.0 + r};
  world->all_reduce(d, d, 2, DType::kF64, ReduceOp::kSum)->wait();
  EXPECT_DOUBLE_EQ(d[0], 1e-17 * p * (p + 1) / 2);
  EXPECT_EQ(d[1], p + p * (p - 1) / 2.0);
  int64_t big[2] = {(int64_t{1} << 40) + r, -r};
  world->all_reduce(big, big, 2, DType::kI64, ReduceOp::kMax)->wait();
  EXPECT_EQ(big[0], (int64_t{1} << 40) + p - 1);
  EXPECT_EQ(big[1], 0);
  const std::string mine = "rank " + std::to_string(r) + "!";
  std::string all(mine.size() * static_cast<size_t>(p), ' ');
  world->all_gather(mine.data(), all.data(), mine.size(), DType::kU8)->wait();
  EXPECT_EQ(all.substr(0, 7), "rank 0!");
  uint8_t b = 1;
  try {
    world->all_reduce(&b, &b, 1, DType::kU8, ReduceOp::kSum);
    ADD_FAILURE() << "bytes reduced";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bytes (u8) do not reduce"), std::string::npos);
  }
}

TEST(Collectives, GroupsFromTheGridProgressIndependently) {
  auto world = runtime().world(CommOptions{});
  if (world->size() % 2 != 0) GTEST_SKIP() << "needs an even world";
  Grid grid({world->size(), 2, 1, 1});
  auto tp = world->split(grid.all_groups("tp"), "tp");
  auto dp = world->split(grid.all_groups("dp"), "dp");
  EXPECT_EQ(tp->members(), grid.tp_group(world->rank()));
  EXPECT_EQ(dp->members(), grid.dp_group(world->rank()));
  // Even and odd ranks start their tp and dp all-reduces in opposite orders:
  // each group's worker runs its own queue, so neither waits on the other.
  std::vector<float> a(1000, 1.0f), b(1000, 2.0f);
  WorkPtr wa, wb;
  if (world->rank() % 2 == 0) {
    wa = tp->all_reduce(a.data(), a.data(), a.size(), DType::kF32, ReduceOp::kSum);
    wb = dp->all_reduce(b.data(), b.data(), b.size(), DType::kF32, ReduceOp::kSum);
  } else {
    wb = dp->all_reduce(b.data(), b.data(), b.size(), DType::kF32, ReduceOp::kSum);
    wa = tp->all_reduce(a.data(), a.data(), a.size(), DType::kF32, ReduceOp::kSum);
  }
  wa->wait();
  wb->wait();
  EXPECT_EQ(a[0], 2.0f);
  EXPECT_EQ(b[999], 2.0f * static_cast<float>(dp->size()));
}

TEST(Collectives, DebugModeNamesMismatchedCollectives) {
  CommOptions opt;
  opt.debug = true;
  auto g = runtime().world(opt);
  if (g->size() < 2) GTEST_SKIP();
  const int p = g->size(), r = g->rank();
  // Legitimate differences pass: all-to-all totals that differ per rank, and
  // sends and receives that only some ranks make.
  std::vector<size_t> sc(p), rc(p);
  for (int q = 0; q < p; ++q)
    sc[q] = static_cast<size_t>(r + 1), rc[q] = static_cast<size_t>(q + 1);
  std::vector<float> in(static_cast<size_t>((r + 1) * p), 1.0f),
      out(static_cast<size_t>(p * (p + 1) / 2));
  g->all_to_all(in.data(), sc, out.data(), rc, DType::kF32)->wait();
  float token = 1.0f;
  if (r == 0) g->send(&token, 1, DType::kF32, 1, 3)->wait();
  if (r == 1) g->recv(&token, 1, DType::kF32, 0, 3)->wait();
  std::vector<float> x(64, 1.0f), y(64 * p);
  g->all_reduce(x.data(), x.data(), 64, DType::kF32, ReduceOp::kSum)->wait();
  // A real mismatch, at the third collective, is named on both sides.
  WorkPtr w = r == 0 ? g->all_reduce(x.data(), x.data(), 64, DType::kF32, ReduceOp::kSum)
                     : g->all_gather(x.data(), y.data(), 64, DType::kF32);
  try {
    w->wait();
    FAIL() << "no mismatch reported";
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("mismatched collectives at position #3"), std::string::npos) << what;
    EXPECT_NE(what.find(r == 0 ? "called allgather #3 (64 x f32)"
                               : "called allreduce #3 (64 x f32, sum)"),
              std::string::npos)
        << what;
  }
}

}  // namespace
}  // namespace loom
