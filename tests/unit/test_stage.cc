// Stages and activation stores: a model cut into two stages trains like one,
// several micro-batches can be between forward and backward, and every
// activation-checkpointing policy gives bitwise the same losses, gradients
// and trained weights as keeping everything.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/memory.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/kernels/reference/reference_backend.h"
#include "loom/model/gpt_stage.h"
#include "loom/parallel/tensor/parallel_layers.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "test_util.h"

namespace loom {
namespace {

using test::error_of;

GptConfig tiny(float dropout = 0.1f, int layers = 4) {
  GptConfig c;
  c.n_layer = layers;
  c.n_embd = 32;
  c.n_head = 4;
  c.vocab_size = 100;  // padded to 128
  c.seq_len = 16;
  c.dropout = dropout;
  return c;
}

using test::tokens;

// The gradient of every parameter, by name.
std::map<std::string, std::vector<float>> grads_by_name(const GptStage<float>& s) {
  std::map<std::string, std::vector<float>> g;
  for (const Param& p : s.layout().params()) g[p.name].assign(s.grad(p), s.grad(p) + p.numel);
  return g;
}

TEST(Stage, TwoStagesBackToBackTrainLikeOne) {
  const GptConfig c = tiny(0.1f, 4);
  const int64_t B = 2, T = 16, BT = B * T, C = c.n_embd;
  auto in = tokens(BT, c.vocab_size, 1), tg = tokens(BT, c.vocab_size, 2);
  const StepContext ctx{7, 3, 40, true};

  GptStage<float> one(c);
  one.init(9);
  one.zero_grads();
  auto a1 = one.make_activations(B, T);
  const double loss_one = one.forward(a1, in.data(), nullptr, tg.data(), ctx);
  one.backward(a1, 1.0);

  GptStage<float> first(c, StageSpec{0, 2}), second(c, StageSpec{2, 4});
  EXPECT_TRUE(first.has_embedding() && !first.has_head());
  EXPECT_TRUE(!second.has_embedding() && second.has_head());
  // The last stage holds its own copy of wte, under the same name, in its own unit.
  const Param& copy = second.layout().find("transformer.wte.weight");
  EXPECT_EQ(second.layout().units()[static_cast<size_t>(copy.unit)].name, "lm_head");
  EXPECT_EQ(second.layout().find_or_null("transformer.wpe.weight"), nullptr);
  first.init(9);
  second.init(9);
  first.zero_grads();
  second.zero_grads();
  auto af = first.make_activations(B, T);
  auto as = second.make_activations(B, T);
  first.forward(af, in.data(), nullptr, nullptr, ctx);
  const double loss_two = second.forward(as, nullptr, af.output, tg.data(), ctx);
  std::vector<float> d_mid(static_cast<size_t>(BT * C));
  second.backward(as, 1.0, nullptr, d_mid.data());
  first.backward(af, 1.0, d_mid.data(), nullptr);

  EXPECT_EQ(loss_one, loss_two);
  auto g1 = grads_by_name(one), gf = grads_by_name(first), gs = grads_by_name(second);
  EXPECT_EQ(gf.size() + gs.size(), g1.size() + 1);  // wte on both
  for (const auto& [name, g] : g1) {
    std::vector<float> split;
    if (name == "transformer.wte.weight") {
      // The embedding group's sum: the lookup's gradient plus the head's.
      split = gf.at(name);
      for (size_t i = 0; i < split.size(); ++i) split[i] += gs.at(name)[i];
    } else {
      split = gf.count(name) ? gf.at(name) : gs.at(name);
    }
    ASSERT_EQ(g, split) << name;
  }
}

// Zero-bubble's split backward: B gives the input gradient and writes no
// parameter gradient; W, run after the store has been reused by another
// forward, gives every parameter gradient of an undivided backward bitwise.
TEST(Stage, SplitBackwardGivesTheSameGradientsBitwise) {
  const GptConfig c = tiny(0.1f, 4);
  const int64_t B = 2, T = 16, BT = B * T, C = c.n_embd;
  auto in = tokens(BT, c.vocab_size, 1), tg = tokens(BT, c.vocab_size, 2);
  auto other = tokens(BT, c.vocab_size, 3);
  const StepContext ctx{7, 3, 40, true};
  for (auto policy :
       {CheckpointPolicy::kNone, CheckpointPolicy::kFull, CheckpointPolicy::kSelective}) {
    SCOPED_TRACE(CheckpointPolicy::name(policy));
    using Result = std::pair<std::vector<float>, std::map<std::string, std::vector<float>>>;
    auto run = [&](bool split) -> Result {
      GptStage<float> first(c, StageSpec{0, 2}), second(c, StageSpec{2, 4});
      CheckpointPolicy p;
      p.kind = policy;
      for (GptStage<float>* st : {&first, &second}) {
        st->set_plan(st->plan(p, B, T));
        st->init(9);
        st->zero_grads();
      }
      auto af = first.make_activations(B, T);
      auto as = second.make_activations(B, T);
      first.forward(af, in.data(), nullptr, nullptr, ctx);
      second.forward(as, nullptr, af.output, tg.data(), ctx);
      std::vector<float> d_mid(static_cast<size_t>(BT * C));
      DeferredGrads<float> d1, d2;
      second.backward(as, 1.0, nullptr, d_mid.data(), split ? &d2 : nullptr);
      first.backward(af, 1.0, d_mid.data(), nullptr, split ? &d1 : nullptr);
      if (split) {
        for (const GptStage<float>* st : {&first, &second})
          for (const auto& [name, g] : grads_by_name(*st))
            for (float x : g) EXPECT_EQ(x, 0.0f) << name << " written in B";
        // The stores are free after B: another micro-batch overwrites them.
        first.forward(af, other.data(), nullptr, nullptr, ctx);
        second.forward(as, nullptr, af.output, tg.data(), ctx);
        std::vector<UnitUse> w = first.deferred_unit_schedule(d1);
        EXPECT_FALSE(w.empty());
        if (!w.empty()) {
          EXPECT_EQ(w.back().unit, first.wte_unit());  // the lookup's, last
        }
        for (const UnitUse& u : w) EXPECT_EQ(u.pass, Pass::kBackwardGradsOnly);
        second.apply_deferred(d2);
        first.apply_deferred(d1);
        EXPECT_TRUE(d1.empty() && d2.empty());
      }
      auto g = grads_by_name(first);
      for (auto& [name, v] : grads_by_name(second)) g["second." + name] = v;
      return std::make_pair(d_mid, g);
    };
    const auto whole = run(false), split = run(true);
    EXPECT_EQ(whole.first, split.first) << "input gradient";
    EXPECT_TRUE(whole.second == split.second) << "parameter gradients";
  }
}

// bf16 records keep "twins": ranges read in bf16 alone, rounded into the
// packed slot by forward and read there by backward, never widened. On any
// backend, q|k|v (the attention core's 16-bit forms read them) and GELU's
// input (GELU's); on a backend whose GEMMs read bf16 inputs also the
// linears' inputs that only a GEMM reads (the LayerNorms' outputs, GELU's)
// and the attention core's output, which c_proj reads and the core's
// backward too, rounded into the slot by c_proj and widened for the core (a
// shared twin). Over two micro-batches in one activation store: the losses
// equal bitwise those of f32 records (forward's GEMMs round the same
// values), and the gradients those of a backward that widens the whole
// record (a deferring one: its weight gradients run later from f32 copies
// of their inputs).
void expect_twins_give_widened_gradients(const CpuBackend<float>& be) {
  const GptConfig c = tiny(0.1f, 2);
  const int64_t B = 2, T = 16, BT = B * T;
  const std::vector<int32_t> in[2] = {tokens(BT, c.vocab_size, 1), tokens(BT, c.vocab_size, 3)};
  const std::vector<int32_t> tg[2] = {tokens(BT, c.vocab_size, 2), tokens(BT, c.vocab_size, 4)};
  const bool linears16 = be.reads_inputs16();
  for (auto policy : {CheckpointPolicy::kNone, CheckpointPolicy::kSelective}) {
    SCOPED_TRACE(CheckpointPolicy::name(policy));
    auto run = [&](DType records, bool deferred) {
      GptStage<float> m(c, StageSpec{}, StoreOptions{}, LayerFactory<float>::single_process(), be);
      CheckpointPolicy p;
      p.kind = policy;
      p.records = records;
      m.set_plan(m.plan(p, B, T));
      // The stage keeps the twins the block names (none with f32 records).
      ParamLayout layout;
      layout.begin_unit("h");
      const Block<float> block(layout, c, 0);
      const auto mode = m.recompute_plan().blocks[0];
      EXPECT_EQ(m.record_twin_ranges(0, B, T).size(),
                records == DType::kBF16
                    ? block.twin_ranges(Rows::whole(B, T), mode, linears16).size()
                    : 0u);
      m.init(9);
      m.zero_grads();
      auto a = m.make_activations(B, T);
      std::vector<double> losses;
      for (int mb = 0; mb < 2; ++mb) {
        const StepContext ctx{7, 3, uint64_t(40 + 2 * mb), true};
        losses.push_back(m.forward(a, in[mb].data(), nullptr, tg[mb].data(), ctx));
        DeferredGrads<float> d;
        m.backward(a, 1.0, nullptr, nullptr, deferred ? &d : nullptr);
        if (deferred) m.apply_deferred(d);
      }
      return std::make_pair(losses, grads_by_name(m));
    };
    const auto twins = run(DType::kBF16, false), widened = run(DType::kBF16, true);
    const auto f32 = run(DType::kF32, false);
    EXPECT_EQ(twins.first, f32.first) << "forward reads what f32 records' GEMMs round";
    EXPECT_EQ(twins.first, widened.first);
    EXPECT_TRUE(twins.second == widened.second) << "parameter gradients";
    EXPECT_FALSE(twins.second == f32.second) << "the other ranges were not rounded";
    ParamLayout layout;
    layout.begin_unit("h");
    const Block<float> block(layout, c, 0);
    const auto mode = policy == CheckpointPolicy::kNone ? Recompute::kNone : Recompute::kSelective;
    // Unless selective recomputes the core and GELU: q|k|v and GELU's input;
    // with the linears' twins ln_1's and ln_2's outputs and, unless
    // selective, GELU's output and (shared) the attention core's output.
    const bool none = policy == CheckpointPolicy::kNone;
    const size_t kernels = none ? 2 : 0, linears = none ? 3 : 2;
    EXPECT_EQ(block.twin_ranges(Rows::whole(B, T), mode, linears16).size(),
              kernels + (linears16 ? linears + (none ? 1 : 0) : 0));
    EXPECT_EQ(block.twin_ranges(Rows::whole(B, T), mode, linears16, false).size(),
              kernels + (linears16 ? linears : 0));
  }
}

TEST(Stage, RecordTwinsGiveTheWidenedRecordsGradientsBitwise) {
  if (!cpu::gemm_16_uses_bf16_matmul(DType::kBF16)) GTEST_SKIP() << "no bf16 matmul on this CPU";
  const CpuBackend<float> bf16(cpu::GemmConfig{cpu::GemmBackend::kOneDnn, DType::kBF16});
  ASSERT_TRUE(bf16.reads_inputs16());
  expect_twins_give_widened_gradients(bf16);
}

// With f32 GEMMs (any CPU) the layers' own twins alone: the same bitwise.
TEST(Stage, KernelTwinsOnF32GemmsGiveTheWidenedRecordsGradientsBitwise) {
  const CpuBackend<float> f32;
  ASSERT_FALSE(f32.reads_inputs16());
  ASSERT_TRUE(f32.fuses_record16());
  expect_twins_give_widened_gradients(f32);
}

// A backend whose 16-bit record forms are not fused (the defaults round and
// widen in passes of their own) keeps no twins: packing converts it all.
TEST(Stage, ABackendWithoutFusedRecordFormsKeepsNoTwins) {
  const GptConfig c = tiny(0.0f, 2);
  const ReferenceBackend<float> ref;
  ASSERT_FALSE(ref.fuses_record16() || ref.reads_inputs16());
  GptStage<float> m(c, StageSpec{}, StoreOptions{}, LayerFactory<float>::single_process(), ref);
  CheckpointPolicy p;
  p.records = DType::kBF16;
  m.set_plan(m.plan(p, 2, 16));
  EXPECT_TRUE(m.record_twin_ranges(0, 2, 16).empty());
}

TEST(Stage, MicroBatchesInFlightKeepTheirOwnActivations) {
  const GptConfig c = tiny(0.1f, 2);
  const int64_t B = 2, T = 16, BT = B * T;
  auto in1 = tokens(BT, c.vocab_size, 3), tg1 = tokens(BT, c.vocab_size, 4);
  auto in2 = tokens(BT, c.vocab_size, 5), tg2 = tokens(BT, c.vocab_size, 6);
  const StepContext ctx1{1, 0, 0, true}, ctx2{1, 0, 2, true};
  GptStage<float> m(c);
  m.init(3);
  auto s1 = m.make_activations(B, T), s2 = m.make_activations(B, T);

  // One after the other, each micro-batch's gradients on their own.
  m.zero_grads();
  const double l1 = m.forward(s1, in1.data(), nullptr, tg1.data(), ctx1);
  m.backward(s1, 0.5);
  auto g1 = grads_by_name(m);
  m.zero_grads();
  const double l2 = m.forward(s2, in2.data(), nullptr, tg2.data(), ctx2);
  m.backward(s2, 0.5);
  auto g2 = grads_by_name(m);

  // Both forwards, then the backwards in reverse order: each backward reads
  // its own store, so each gives the same gradients bitwise.
  auto t1 = m.make_activations(B, T), t2 = m.make_activations(B, T);
  EXPECT_EQ(m.forward(t1, in1.data(), nullptr, tg1.data(), ctx1), l1);
  EXPECT_EQ(m.forward(t2, in2.data(), nullptr, tg2.data(), ctx2), l2);
  m.zero_grads();
  m.backward(t2, 0.5);
  EXPECT_EQ(grads_by_name(m), g2);
  m.zero_grads();
  m.backward(t1, 0.5);
  EXPECT_EQ(grads_by_name(m), g1);
}

RecomputePlan plan_for(const GptStage<float>& s, CheckpointPolicy::Kind k, int64_t B, int64_t T,
                       int every_n = 2, int64_t budget = 0) {
  CheckpointPolicy p;
  p.kind = k;
  p.every_n = every_n;
  p.budget_bytes = budget;
  return s.plan(p, B, T);
}

TEST(Stage, EveryRecomputePolicyGivesTheSameLossAndGradientsBitwise) {
  const GptConfig c = tiny(0.1f, 4);
  const int64_t B = 2, T = 16, BT = B * T;
  auto in = tokens(BT, c.vocab_size, 7), tg = tokens(BT, c.vocab_size, 8);
  const StepContext ctx{5, 2, 8, true};
  auto run = [&](CheckpointPolicy::Kind k, int every_n, int64_t budget) {
    GptStage<float> m(c);
    m.set_plan(plan_for(m, k, B, T, every_n, budget));
    m.init(11);
    m.zero_grads();
    auto a = m.make_activations(B, T);
    const double loss = m.forward(a, in.data(), nullptr, tg.data(), ctx);
    m.backward(a, 1.0);
    return std::make_pair(loss, grads_by_name(m));
  };
  const auto ref = run(CheckpointPolicy::kNone, 2, 0);
  GptStage<float> probe(c);
  const int64_t half = static_cast<int64_t>(probe.block_bytes(B, T, Recompute::kNone) * 2 +
                                            probe.block_bytes(B, T, Recompute::kFull) * 2 +
                                            probe.store_bytes(B, T) / 2);
  struct Case {
    CheckpointPolicy::Kind k;
    int every_n;
    int64_t budget;
  };
  for (Case cs : {Case{CheckpointPolicy::kFull, 2, 0}, Case{CheckpointPolicy::kSelective, 2, 0},
                  Case{CheckpointPolicy::kEveryN, 2, 0}, Case{CheckpointPolicy::kEveryN, 3, 0},
                  Case{CheckpointPolicy::kBudget, 2, half}}) {
    const auto got = run(cs.k, cs.every_n, cs.budget);
    EXPECT_EQ(got.first, ref.first) << CheckpointPolicy::name(cs.k);
    EXPECT_TRUE(got.second == ref.second)
        << CheckpointPolicy::name(cs.k) << " every_n " << cs.every_n;
  }
}

TEST(Stage, PlansFollowThePolicy) {
  const GptConfig c = tiny(0.1f, 6);
  GptStage<float> m(c);
  const int64_t B = 2, T = 16;
  auto full = plan_for(m, CheckpointPolicy::kFull, B, T);
  EXPECT_EQ(full.count(Recompute::kFull), 6);
  EXPECT_TRUE(full.head_logits);
  auto sel = plan_for(m, CheckpointPolicy::kSelective, B, T);
  EXPECT_EQ(sel.count(Recompute::kSelective), 6);
  EXPECT_FALSE(sel.head_logits);
  auto every3 = plan_for(m, CheckpointPolicy::kEveryN, B, T, 3);
  EXPECT_EQ(every3.blocks,
            (std::vector<Recompute>{Recompute::kFull, Recompute::kNone, Recompute::kNone,
                                    Recompute::kFull, Recompute::kNone, Recompute::kNone}));
  // A block kept whole costs its record; one recomputed keeps its output.
  const size_t whole = m.block_bytes(B, T, Recompute::kNone);
  const size_t kept = m.block_bytes(B, T, Recompute::kFull);
  EXPECT_EQ(kept, static_cast<size_t>(B * T * c.n_embd) * sizeof(float));
  EXPECT_GT(whole, 15 * kept);
  // Budget: every block recomputed needs the all-full bytes; each whole
  // block adds (whole - kept); the last blocks are the ones kept whole.
  m.set_plan(full);
  const size_t least = m.store_bytes(B, T) + m.room_bytes(B, T);
  auto b0 = plan_for(m, CheckpointPolicy::kBudget, B, T, 2, static_cast<int64_t>(least));
  EXPECT_EQ(b0.count(Recompute::kNone), 0);
  auto b2 = plan_for(m, CheckpointPolicy::kBudget, B, T, 2,
                     static_cast<int64_t>(least + 2 * (whole - kept) + 100));
  EXPECT_EQ(b2.blocks,
            (std::vector<Recompute>{Recompute::kFull, Recompute::kFull, Recompute::kFull,
                                    Recompute::kFull, Recompute::kNone, Recompute::kNone}));
  auto all = plan_for(m, CheckpointPolicy::kBudget, B, T, 2, int64_t{1} << 40);
  EXPECT_EQ(all.count(Recompute::kNone), 6);
  EXPECT_FALSE(all.head_logits);
  // Too small: the numbers in the message.
  const std::string e = error_of([&] { plan_for(m, CheckpointPolicy::kBudget, B, T, 2, 1000); });
  EXPECT_HAS(e, "activation_checkpointing.budget_bytes 1000 is too small");
  EXPECT_HAS(e, "one block's input is " + std::to_string(kept) + " bytes");
  EXPECT_HAS(e, "at least " + std::to_string(least) + " bytes");
}

TEST(Stage, BudgetPlansAStageWithoutTheHead) {
  // A middle stage of one block: with it whole there is no recompute room,
  // so keeping it costs less than recomputing it (its output plus the room);
  // the planner costs every choice and keeps the most whole blocks that fit.
  const GptConfig c = tiny(0.1f, 6);
  GptStage<float> mid(c, StageSpec{2, 3});
  const int64_t B = 2, T = 16;
  auto whole = plan_for(mid, CheckpointPolicy::kNone, B, T);
  const size_t all_whole = mid.store_bytes(B, T, whole) + mid.room_bytes(B, T, whole);
  auto full = plan_for(mid, CheckpointPolicy::kFull, B, T);
  EXPECT_FALSE(full.head_logits);
  EXPECT_LT(all_whole, mid.store_bytes(B, T, full) + mid.room_bytes(B, T, full));
  auto got = plan_for(mid, CheckpointPolicy::kBudget, B, T, 2, static_cast<int64_t>(all_whole));
  EXPECT_EQ(got.count(Recompute::kNone), 1);
}

TEST(Stage, StoresMadeUnderAnotherPlanAreRefused) {
  GptStage<float> m(tiny(0.0f, 2));
  m.init(1);
  auto a = m.make_activations(1, 16);
  m.set_plan(plan_for(m, CheckpointPolicy::kFull, 1, 16));
  std::vector<int32_t> in(16, 1);
  EXPECT_HAS(error_of([&] { m.forward(a, in.data(), nullptr, in.data(), StepContext{}); }),
             "an activation store made under another recompute plan");
}

TEST(Stage, TheActivationsCategoryHoldsTheStoreAndTheRoom) {
  const GptConfig c = tiny(0.1f, 6);
  const int64_t B = 2, T = 16, BT = B * T;
  auto in = tokens(BT, c.vocab_size, 9), tg = tokens(BT, c.vocab_size, 10);
  for (auto k : {CheckpointPolicy::kNone, CheckpointPolicy::kFull, CheckpointPolicy::kSelective}) {
    GptStage<float> m(c);
    m.set_plan(plan_for(m, k, B, T));
    m.init(1);
    const size_t before = memory_tracker().stats().current[int(MemCategory::kActivations)];
    memory_tracker().reset_peaks();
    {
      auto a = m.make_activations(B, T);
      m.forward(a, in.data(), nullptr, tg.data(), StepContext{1, 0, 0, true});
      m.backward(a, 1.0);
    }
    const size_t peak = memory_tracker().stats().peak[int(MemCategory::kActivations)];
    EXPECT_EQ(peak - before, m.store_bytes(B, T) + m.room_bytes(B, T)) << CheckpointPolicy::name(k);
  }
}

// A 16-bit run's record of a block, packed and widened back: what must stay
// f32 comes back bit for bit (the LayerNorm statistics, the attention's
// log-sum-exp, a router's logits, found here from the layouts the layers
// document, not from the ranges they name), everything else as its 16-bit
// rounding; the packed size is the output and those ranges at 4 bytes and
// the rest at 2.
TEST(Stage, SixteenBitRecordsKeepTheExactRangesAndRoundTheRest) {
  const int64_t B = 2, T = 16;
  // Whole micro-batches, and (dense) a sequence-parallel slice of the rows.
  for (const Rows rw : {Rows::whole(B, T), Rows{B, T, 8, 16}})
    for (const bool moe : {false, true}) {
      if (moe && rw.split()) continue;
      const int64_t N = rw.count;
      GptConfig c = tiny(0.0f, 2);
      if (moe) c.moe_experts = 4, c.moe_top_k = 2;
      const int64_t C = c.n_embd, NH = c.n_head, E = c.moe_experts;
      ParamLayout layout;
      layout.begin_unit("h.0");
      const Block<float> block(layout, c, 0);
      for (const Recompute mode : {Recompute::kNone, Recompute::kSelective})
        for (const DType t : {DType::kBF16, DType::kF16}) {
          const std::string what =
              std::string(rw.split() ? "split rows, " : "") + std::string(moe ? "moe" : "mlp") +
              (mode == Recompute::kNone ? " whole " : " selective ") + std::string(dtype_name(t));
          const int64_t n = block.record_elems(rw, mode);
          std::vector<float> whole(static_cast<size_t>(n)), back(whole.size(), -7.0f);
          std::mt19937 gen(3);
          std::normal_distribution<float> dist(0.0f, 3.0f);
          for (float& v : whole) v = dist(gen);
          std::vector<float> room(static_cast<size_t>(block.recompute_elems(rw, mode)));
          Arena<float> rec(whole.data()), rm(room.data());
          const BlockRecord<float> r = block.bind(rec, rm, rw, mode);
          // The exact elements, from the documented layouts.
          std::vector<char> exact(whole.size(), 0);
          auto mark = [&](const float* p, int64_t count) {
            std::fill_n(exact.begin() + (p - whole.data()), count, 1);
          };
          mark(r.ln1_mean, N), mark(r.ln1_rstd, N), mark(r.ln2_mean, N), mark(r.ln2_rstd, N);
          if (mode == Recompute::kNone) mark(r.attn + 4 * B * T * C, B * NH * T);  // qkv, y, lse
          if (moe) mark(r.ffn, N * E);  // the logits first
          const int64_t out0 = r.res3 - whole.data();
          ASSERT_EQ(out0 + N * C, n) << what << ": the output ends the record";
          int64_t exact_n = 0;
          for (char e : exact) exact_n += e;
          EXPECT_EQ(block.packed_elems(rw, mode), N * C + exact_n + (n - N * C - exact_n + 1) / 2)
              << what;

          std::vector<float> slot(static_cast<size_t>(block.packed_elems(rw, mode)));
          block.pack(default_backend<float>(), whole.data(), slot.data(), rw, mode, t);
          block.unpack(default_backend<float>(), slot.data(), back.data(), rw, mode, t);
          int64_t bad = 0, rounded = 0;
          for (int64_t i = 0; i < out0; ++i) {
            const float w = whole[static_cast<size_t>(i)];
            const float want = exact[static_cast<size_t>(i)] ? w
                               : t == DType::kBF16           ? bf16_to_f32(f32_to_bf16(w))
                                                             : f16_to_f32(f32_to_f16(w));
            bad += std::memcmp(&want, &back[static_cast<size_t>(i)], sizeof(float)) != 0;
            rounded += want != w;
          }
          EXPECT_EQ(bad, 0) << what;
          EXPECT_GT(rounded, (out0 - exact_n) * 9 / 10) << what << ": the rest was not rounded";
          // The output is not written back (backward does not read it).
          EXPECT_EQ(back[static_cast<size_t>(out0)], -7.0f) << what;
        }
    }
}

// The tensor-parallel attention lays its record out as the serial one
// does (on one rank the same sizes): its exact range is the same.
TEST(Stage, TensorParallelAttentionNamesTheSameExactRange) {
  const GptConfig c = tiny(0.0f, 2);
  ParamLayout layout;
  layout.begin_unit("h.0");
  const Attention<float> serial(layout, "a", c, 0.02f);
  const tp::ParallelAttention split(layout, "b", c, 0.02f, tp::Group(nullptr));
  for (const bool selective : {false, true})
    for (const Rows rw : {Rows::whole(2, 16), Rows{2, 16, 8, 16}}) {
      const auto want = serial.exact_ranges(rw, selective);
      const auto got = split.exact_ranges(rw, selective);
      ASSERT_EQ(got.size(), want.size()) << selective;
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].offset, want[i].offset);
        EXPECT_EQ(got[i].count, want[i].count);
      }
      EXPECT_EQ(split.record_elems(rw, selective), serial.record_elems(rw, selective));
    }
}

// A stage whose records are 16-bit: forward is unchanged (it reads f32
// values; packing comes after), backward reads the rounded records, so the
// gradients stay within bf16's rounding of the f32 records' gradients and
// differ from them; the store shrinks by what packing saves, the room holds
// one f32 record to compute and widen in, and the activations category
// holds both. A block recomputed in full packs nothing.
TEST(Stage, SixteenBitRecordsTrainCloseToF32RecordsInLessMemory) {
  const GptConfig c = tiny(0.1f, 4);
  const int64_t B = 2, T = 16, BT = B * T;
  auto in = tokens(BT, c.vocab_size, 7), tg = tokens(BT, c.vocab_size, 8);
  const StepContext ctx{5, 2, 8, true};
  struct Out {
    double loss;
    std::map<std::string, std::vector<float>> grads;
    size_t store, room, peak;
  };
  auto run = [&](CheckpointPolicy::Kind k, DType records) {
    GptStage<float> m(c);
    CheckpointPolicy p;
    p.kind = k;
    p.records = records;
    m.set_plan(m.plan(p, B, T));
    m.init(11);
    m.zero_grads();
    const size_t before = memory_tracker().stats().current[int(MemCategory::kActivations)];
    memory_tracker().reset_peaks();
    Out o;
    {
      auto a = m.make_activations(B, T);
      o.loss = m.forward(a, in.data(), nullptr, tg.data(), ctx);
      m.backward(a, 1.0);
    }
    o.grads = grads_by_name(m);
    o.store = m.store_bytes(B, T), o.room = m.room_bytes(B, T);
    o.peak = memory_tracker().stats().peak[int(MemCategory::kActivations)] - before;
    return o;
  };
  GptStage<float> probe(c);
  const Rows rw = Rows::whole(B, T);
  for (auto k : {CheckpointPolicy::kNone, CheckpointPolicy::kSelective, CheckpointPolicy::kEveryN,
                 CheckpointPolicy::kFull}) {
    const char* name = CheckpointPolicy::name(k);
    const Out f32 = run(k, DType::kF32), half = run(k, DType::kBF16);
    EXPECT_EQ(half.loss, f32.loss) << name;
    EXPECT_EQ(half.peak, half.store + half.room) << name;
    double worst = 0, scale = 0;
    for (const auto& [param, g] : f32.grads)
      for (size_t i = 0; i < g.size(); ++i) {
        worst = std::max(worst, double(std::abs(half.grads.at(param)[i] - g[i])));
        scale = std::max(scale, double(std::abs(g[i])));
      }
    // What packing saves: each packed block's record less its packed size.
    RecomputePlan plan = plan_for(probe, k, B, T);
    size_t saved = 0;
    for (size_t i = 0; i < plan.blocks.size(); ++i) {
      if (plan.blocks[i] == Recompute::kFull) continue;
      ParamLayout layout;
      layout.begin_unit("h");
      const Block<float> b(layout, c, static_cast<int>(i));
      saved += size_t(b.record_elems(rw, plan.blocks[i]) - b.packed_elems(rw, plan.blocks[i])) * 4;
    }
    EXPECT_EQ(half.store, f32.store - saved) << name;
    if (k == CheckpointPolicy::kFull) {
      EXPECT_TRUE(half.grads == f32.grads) << "full recomputation keeps only f32 outputs";
      EXPECT_EQ(saved, 0u);
      continue;
    }
    EXPECT_GT(saved, f32.store / 3) << name;
    EXPECT_GT(worst, 0.0) << name << ": the gradients did not read 16-bit records";
    EXPECT_LT(worst, 2e-2 * scale) << name;
    std::printf(
        "[ records ] %s: bf16 store %.1f KB of f32's %.1f KB (+ room %.1f KB); largest "
        "gradient difference %.1e of the largest gradient\n",
        name, half.store / 1e3, f32.store / 1e3, half.room / 1e3, worst / scale);
  }
}

TEST(Stage, TheUnitScheduleRecomputesBeforeBackward) {
  GptStage<float> m(tiny(0.0f, 2));
  CheckpointPolicy p;
  p.kind = CheckpointPolicy::kFull;
  m.set_plan(m.plan(p, 1, 16));
  std::vector<std::pair<int, Pass>> got;
  for (const UnitUse& u : m.unit_schedule(true)) got.emplace_back(u.unit, u.pass);
  const Pass F = Pass::kForward, R = Pass::kRecompute, Bk = Pass::kBackward;
  // Units: 0 embeddings, 1-2 the blocks, 3 ln_f; the tied head reads unit 0.
  EXPECT_EQ(got, (std::vector<std::pair<int, Pass>>{{0, F},
                                                    {1, F},
                                                    {2, F},
                                                    {3, F},
                                                    {0, F},
                                                    {0, Bk},
                                                    {3, Bk},
                                                    {2, R},
                                                    {2, Bk},
                                                    {1, R},
                                                    {1, Bk},
                                                    {0, Pass::kBackwardGradsOnly}}));
}

Config tiny_run(const std::string& policy, int stage) {
  std::string text = R"({
    "train_batch_size": 8, "gradient_accumulation_steps": 2,
    "gradient_clipping": 0.5,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}},
    "model": {"n_layer": 4, "n_embd": 32, "n_head": 4, "vocab_size": 64, "seq_len": 16, "dropout": 0.1},
    "data": {"synthetic": true},
    "train": {"steps": 10, "seed": 11},
    "log": {"peak_gflops": 100}
  })";
  return parse_config(text, "test",
                      {"activation_checkpointing.policy=" + policy,
                       "zero_optimization.stage=" + std::to_string(stage)});
}

TEST(Trainer, CheckpointingPoliciesTrainBitwiseLikeNoneAtEveryZeroStage) {
  RunOptions quiet;
  quiet.quiet = true;
  for (int stage : {0, 1, 2, 3}) {
    auto train = [&](const std::string& policy) {
      Config c = tiny_run(policy, stage);
      if (policy == "every_n") c.checkpointing.policy.every_n = 3;
      Trainer t(std::move(c), quiet, ThreadConfig{});
      std::vector<double> losses;
      for (const auto& r : t.run()) losses.push_back(r.loss);
      return std::make_pair(losses, t.gather_params());
    };
    const auto ref = train("none");
    for (const char* policy : {"full", "selective", "every_n"}) {
      const auto got = train(policy);
      EXPECT_EQ(got.first, ref.first) << policy << " at stage " << stage;
      EXPECT_TRUE(got.second == ref.second) << policy << " at stage " << stage;
    }
  }
}

TEST(Config, ActivationCheckpointingKeysAreChecked) {
  auto parse = [](const std::vector<std::string>& o) {
    return error_of([&] {
      parse_config(R"({"train_batch_size": 4, "data": {"synthetic": true}})", "f.json", o);
    });
  };
  EXPECT_HAS(parse({"activation_checkpointing.policy=some"}),
             "activation_checkpointing.policy: unknown value \"some\" (expected one of none, full, "
             "selective, every_n, budget)");
  EXPECT_HAS(parse({"activation_checkpointing.policy=budget"}),
             "activation_checkpointing.policy is budget but activation_checkpointing.budget_bytes "
             "is not set");
  EXPECT_HAS(parse({"activation_checkpointing.budget_bytes=1000"}),
             "budget_bytes is set but the policy is none");
  EXPECT_HAS(parse({"activation_checkpointing.polcy=full"}),
             "did you mean 'activation_checkpointing.policy'");
  // DeepSpeed's keys are accepted.
  Config c = parse_config(
      R"({"train_batch_size": 4, "data": {"synthetic": true},
          "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": false,
            "contiguous_memory_optimization": true, "number_checkpoints": 4,
            "synchronize_checkpoint_boundary": false, "profile": true, "policy": "full"}})",
      "f.json", {});
  EXPECT_EQ(c.checkpointing.policy.kind, CheckpointPolicy::kFull);
  EXPECT_TRUE(c.checkpointing.deepspeed_keys);
  EXPECT_EQ(c.resolved["activation_checkpointing"]["policy"], "full");
  // Records follow the run's precision unless told f32.
  auto records = [](const std::vector<std::string>& o) {
    return parse_config(R"({"train_batch_size": 4, "data": {"synthetic": true}})", "f.json", o)
        .checkpointing.policy.records;
  };
  EXPECT_EQ(records({}), DType::kF32);
  EXPECT_EQ(records({"bf16.enabled=true"}), DType::kBF16);
  EXPECT_EQ(records({"fp16.enabled=true"}), DType::kF16);
  EXPECT_EQ(records({"bf16.enabled=true", "activation_checkpointing.activation_dtype=f32"}),
            DType::kF32);
  EXPECT_EQ(records({"activation_checkpointing.activation_dtype=auto"}), DType::kF32);
  EXPECT_HAS(parse({"activation_checkpointing.activation_dtype=bf16"}),
             "activation_checkpointing.activation_dtype");
}

TEST(Config, TensorParallelSizesAreChecked) {
  auto parse = [](const std::vector<std::string>& o, int world) {
    return parse_config(R"({"train_batch_size": 8, "data": {"synthetic": true},
        "model": {"n_layer": 2, "n_embd": 48, "n_head": 6, "vocab_size": 300, "seq_len": 16}})",
                        "f.json", o, world);
  };
  auto error = [&](const std::vector<std::string>& o, int world) {
    return error_of([&] { parse(o, world); });
  };
  EXPECT_HAS(error({"parallel.tensor=4"}, 4),
             "model.n_head 6 is not divisible by parallel.tensor 4 (each rank holds whole heads)");
  EXPECT_HAS(error({"parallel.tensor=8"}, 4),
             "parallel.tensor 8 is larger than the job's 4 rank(s)");
  EXPECT_HAS(error({"parallel.tensor=3"}, 4),
             "the job's 4 rank(s) do not divide into parallel.tensor 3 x parallel.pipeline 1");
  EXPECT_HAS(error({"parallel.tensor=2", "parallel.data=4"}, 4),
             "parallel.data is 4 but the job has 4 rank(s) (= tensor 2 x pipeline 1 x data 2)");
  EXPECT_HAS(error({"parallel.sequence_parallel=true"}, 1),
             "parallel.sequence_parallel splits the sequence across the tensor-parallel group; it "
             "needs parallel.tensor > 1");
  EXPECT_HAS(error({"parallel.tensor=2", "parallel.sequence_parallel=true", "train_batch_size=1",
                    "model.seq_len=15"},
                   2),
             "parallel.sequence_parallel: a micro-batch of 1 x 15 = 15 tokens does not split into "
             "parallel.tensor 2 pieces");
  // tp 2 of 4 ranks: data-parallel 2, the vocabulary padded to a multiple of 256.
  Config c = parse({"parallel.tensor=2"}, 4);
  EXPECT_EQ(c.data_parallel, 2);
  EXPECT_EQ(c.model.padded_vocab(), 512);
  EXPECT_EQ(c.micro_batch, 4);
  EXPECT_EQ(parse({}, 1).model.padded_vocab(), 384);
}

}  // namespace
}  // namespace loom
