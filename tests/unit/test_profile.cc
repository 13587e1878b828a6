// log.profile: the stage's per-piece timing, the FLOP count per piece
// against the MFU numerator, and the load-imbalance report on made-up
// profiles (each finding's rank, figure and suggestion).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "loom/model/gpt_stage.h"
#include "loom/model/recompute.h"
#include "loom/train/profile.h"
#include "test_util.h"

namespace loom {
namespace {

GptConfig tiny(int layers = 4) {
  GptConfig c;
  c.n_layer = layers;
  c.n_embd = 32;
  c.n_head = 4;
  c.vocab_size = 100;
  c.seq_len = 16;
  return c;
}

TEST(Profile, StageTimesEveryPieceInEveryPass) {
  const GptConfig c = tiny(3);
  const int64_t B = 2, T = 16;
  auto in = test::tokens(B * T, c.vocab_size, 1), tg = test::tokens(B * T, c.vocab_size, 2);
  GptStage<float> s(c);
  s.init(1);
  CheckpointPolicy full;
  full.kind = CheckpointPolicy::kFull;
  s.set_plan(s.plan(full, B, T));
  auto a = s.make_activations(B, T);
  s.zero_grads();
  s.forward(a, in.data(), nullptr, tg.data(), StepContext{1, 0, 0, true});
  s.backward(a, 1.0);
  const auto pieces = s.take_piece_seconds();
  ASSERT_EQ(pieces.size(), 6u);
  const std::vector<std::string> names = {"embeddings", "h.0", "h.1", "h.2", "ln_f", "lm_head"};
  int64_t params = 0;
  for (size_t k = 0; k < pieces.size(); ++k) {
    EXPECT_EQ(pieces[k].name, names[k]);
    EXPECT_GT(pieces[k].forward, 0) << names[k];
    EXPECT_GT(pieces[k].backward, 0) << names[k];
    // Full checkpointing recomputes every block (and the head's logits).
    if (names[k][0] == 'h') {
      EXPECT_GT(pieces[k].recompute, 0) << names[k];
    }
    if (names[k] == "embeddings" || names[k] == "ln_f") {
      EXPECT_EQ(pieces[k].recompute, 0);
    }
    params += pieces[k].params;
  }
  EXPECT_EQ(pieces[5].params, 0);  // the tied head holds nothing of its own
  EXPECT_EQ(params, s.num_params());
  // What each piece keeps adds up to the stage's store, here and on a
  // later stage (no embeddings, an untied copy of the head's matrix).
  size_t kept = 0;
  for (size_t b : s.piece_record_bytes(B, T)) kept += b;
  EXPECT_EQ(kept, s.store_bytes(B, T));
  GptStage<float> last(c, StageSpec{1, 3});
  const auto later = last.piece_record_bytes(B, T);
  ASSERT_EQ(later.size(), 4u);  // h.1, h.2, ln_f, lm_head
  kept = 0;
  for (size_t b : later) kept += b;
  EXPECT_EQ(kept, last.store_bytes(B, T));
  EXPECT_GT(last.take_piece_seconds()[3].params, 0);  // the head's own copy of wte
  // Taken: the next take starts from zero.
  for (const auto& p : s.take_piece_seconds())
    EXPECT_EQ(p.forward + p.backward + p.recompute, 0) << p.name;
}

TEST(Profile, PieceFlopsAddUpToTheMfuNumerator) {
  GptConfig c = tiny(4);
  c.n_embd = 192, c.seq_len = 128, c.vocab_size = 256;
  for (const int experts : {0, 4}) {
    c.moe_experts = experts;
    c.moe_top_k = 2;
    c.moe_every = 2;
    GptStage<float> s(c);
    double sum = piece_forward_flops(c, "embeddings") + piece_forward_flops(c, "ln_f") +
                 piece_forward_flops(c, "lm_head");
    for (int l = 0; l < c.n_layer; ++l) sum += piece_forward_flops(c, "h." + std::to_string(l));
    // The numerator also counts the position table and the vectors (biases,
    // LayerNorms) as 6 FLOPs a parameter: within a few percent here.
    EXPECT_NEAR(3 * sum / s.flops_per_token(), 1.0, 0.03) << experts << " experts";
    EXPECT_LT(3 * sum, s.flops_per_token());
  }
  EXPECT_NE(test::error_of([&] { piece_forward_flops(c, "wpe"); }).find("'wpe'"),
            std::string::npos);
}

// A pipeline of `counts` blocks per stage, each block `block_ms` on its
// stage's rank, with the embeddings and head as given.
JobProfile pipeline(const std::vector<int>& counts, double block_ms, double emb_ms = 1,
                    double head_ms = 2) {
  JobProfile p;
  p.shape.pp = static_cast<int>(counts.size());
  p.shape.partition = counts;
  p.shape.schedule = "1f1b";
  p.shape.micro_batches = 8;
  p.shape.micro_batch = 4;
  p.shape.steps = 5;
  int first = 0;
  for (int st = 0; st < p.shape.pp; ++st) {
    RankProfile r;
    r.rank = st;
    r.coord.pp = st;
    r.host = "h" + std::to_string(st);
    ChunkProfile c{first, first + counts[static_cast<size_t>(st)], {}};
    if (st == 0) c.pieces.push_back({"embeddings", 10, 0, emb_ms / 1e3});
    for (int b = c.first; b < c.last; ++b)
      c.pieces.push_back({"h." + std::to_string(b), 100, 1e9, block_ms / 3e3, 2 * block_ms / 3e3});
    if (st == p.shape.pp - 1) {
      c.pieces.push_back({"ln_f", 1, 0, head_ms / 4e3});
      c.pieces.push_back({"lm_head", 0, 1e8, head_ms * 3 / 4e3});
    }
    first = c.last;
    r.chunks.push_back(c);
    r.step_s = 0.1;
    r.mem_peak = {1e6, 1e6, 2e6, 10e6, 0, 1e6};
    p.ranks.push_back(r);
  }
  return p;
}

TEST(Profile, AnUnbalancedPipelineGetsTheCutThatBalancesIt) {
  // Stage 0: 1 + 10 ms, stage 1: 3 x 10 + 2 ms.
  const JobProfile p = pipeline({1, 3}, 10);
  const std::vector<Finding> f = imbalance_report(p);
  ASSERT_EQ(f.size(), 3u);
  EXPECT_EQ(f[0].kind, "compute");
  EXPECT_EQ(f[0].rank, 1);
  EXPECT_NEAR(f[0].imbalance, 32.0 / 21.5 - 1, 1e-9);
  EXPECT_NE(f[0].detail.find("per stage 11.0, 32.0 ms"), std::string::npos) << f[0].detail;
  EXPECT_NE(f[0].suggestion.find("parallel.partition [2, 2] (h.1 from stage 1 to stage 0): "
                                 "the slowest part 32.0 -> 22.0 ms a step"),
            std::string::npos)
      << f[0].suggestion;
  // The balanced cut has nothing to suggest.
  const std::vector<Finding> g = imbalance_report(pipeline({2, 2}, 10));
  EXPECT_LT(g[0].imbalance, kComputeImbalance);
  EXPECT_EQ(g[0].suggestion, "");
  // Several blocks move at once, named as a range.
  const JobProfile q = pipeline({1, 7}, 10);
  EXPECT_NE(imbalance_report(q)[0].suggestion.find("(h.1-h.3 from stage 1 to stage 0)"),
            std::string::npos)
      << imbalance_report(q)[0].suggestion;
}

TEST(Profile, ALargeBubbleGetsMoreMicroBatchesOfTheSameBatch) {
  JobProfile p = pipeline({2, 2, 2, 2}, 10);
  p.shape.micro_batches = 4;
  p.shape.micro_batch = 8;
  for (RankProfile& r : p.ranks) r.bubble_fraction = 0.4;
  const Finding f = imbalance_report(p)[0];
  // (p - 1) / (m + p - 1) <= 10% needs m >= 27: 4 x 8 = 32 micro-batches of 1.
  EXPECT_NE(f.suggestion.find("the bubble is 40% of the step: gradient_accumulation_steps 32 with "
                              "train_micro_batch_size_per_gpu 1 (theory 43% -> 9%, the same "
                              "global batch)"),
            std::string::npos)
      << f.suggestion;
  // Micro-batches of one: only a larger global batch gets there.
  p.shape.micro_batch = 1;
  const std::string grow = imbalance_report(p)[0].suggestion;
  EXPECT_NE(grow.find("gradient_accumulation_steps 27 (theory 43% -> 10%; the global batch grows "
                      "6.8x), or parallel.schedule zero_bubble"),
            std::string::npos)
      << grow;
  p.shape.schedule = "zero_bubble";
  EXPECT_EQ(imbalance_report(p)[0].suggestion.find("bubble"), std::string::npos);
}

TEST(Profile, LongSuggestionsAreWhole) {
  // 32 parts, each boundary moved: a suggestion far past any fixed buffer.
  std::vector<int> counts(32, 1);
  counts[31] = 33;
  const JobProfile p = pipeline(counts, 10);
  const std::string s = imbalance_report(p)[0].suggestion;
  EXPECT_NE(s.find("predicted from the measured layer times"), std::string::npos) << s;
  EXPECT_GT(s.size(), 600u);
}

TEST(Profile, ASlowPeerIsNamedWithItsHost) {
  JobProfile p = pipeline({4}, 10);
  p.shape.dp = 4;
  for (int r = 1; r < 4; ++r) {
    RankProfile k = p.ranks[0];
    k.rank = r;
    k.coord.dp = r;
    k.host = "h" + std::to_string(r);
    p.ranks.push_back(k);
  }
  for (PieceProfile& q : p.ranks[2].chunks[0].pieces) q.forward *= 1.6, q.backward *= 1.6;
  const Finding f = imbalance_report(p)[0];
  EXPECT_EQ(f.rank, 2);
  EXPECT_NE(f.detail.find("rank 2 on h2 computes 1.60x the median of its 3 peers"),
            std::string::npos)
      << f.detail;
  EXPECT_NE(f.suggestion.find("rank 2 on h2 is slower on the same work"), std::string::npos)
      << f.suggestion;
}

TEST(Profile, MemoryImbalanceNamesTheCategoryAndAChange) {
  // 1F1B's first stage holds more micro-batches' activations.
  JobProfile p = pipeline({2, 2}, 10);
  p.ranks[0].mem_peak[static_cast<size_t>(MemCategory::kActivations)] = 30e6;
  Finding f = imbalance_report(p)[1];
  EXPECT_EQ(f.kind, "memory");
  EXPECT_EQ(f.rank, 0);
  EXPECT_NE(f.detail.find("most above the mean in activations (30.0 MB, mean 20.0 MB)"),
            std::string::npos)
      << f.detail;
  EXPECT_NE(f.suggestion.find("\"policy\": \"budget\", \"budget_bytes\": 20000000"),
            std::string::npos)
      << f.suggestion;
  // Parameter state on a stage of three blocks: one moves to its neighbour.
  p = pipeline({3, 1}, 10);
  p.ranks[0].mem_peak[static_cast<size_t>(MemCategory::kOptimizer)] = 30e6;
  f = imbalance_report(p)[1];
  EXPECT_NE(f.suggestion.find("parallel.partition [2, 2] (h.2 from stage 0 to stage 1)"),
            std::string::npos)
      << f.suggestion;
  // Without a pipeline, replicated moments: the ZeRO stage that shards them.
  p = pipeline({4}, 10);
  p.shape.dp = 2;
  p.ranks.push_back(p.ranks[0]);
  p.ranks[1].rank = 1;
  p.ranks[1].mem_peak[static_cast<size_t>(MemCategory::kOptimizer)] = 30e6;
  f = imbalance_report(p)[1];
  EXPECT_EQ(f.rank, 1);
  EXPECT_NE(f.suggestion.find("zero_optimization.stage 1 shards the optimizer over the 2"),
            std::string::npos)
      << f.suggestion;
}

TEST(Profile, ExposedCommunicationIsNamedByWhatWaits) {
  JobProfile p = pipeline({4}, 10);
  p.shape.dp = 2;
  p.shape.overlap_comm = false;
  p.ranks.push_back(p.ranks[0]);
  p.ranks[1].rank = 1;
  for (RankProfile& r : p.ranks) {
    r.comm = {{"world", "allreduce", 3, 8e6, 0.04}};
    r.comm_bytes = 8e6;
    r.exposed_s = 0.04;
  }
  Finding f = imbalance_report(p)[2];
  EXPECT_EQ(f.kind, "communication");
  EXPECT_NE(f.detail.find("most on dp"), std::string::npos) << f.detail;  // world = dp here
  EXPECT_NE(f.detail.find("waits 40.0 ms of its 100.0 ms step on communication (40%)"),
            std::string::npos)
      << f.detail;
  EXPECT_NE(f.suggestion.find("zero_optimization.overlap_comm true"), std::string::npos);
  p.shape.overlap_comm = true;
  EXPECT_NE(imbalance_report(p)[2].suggestion.find("comm.compression"), std::string::npos);
  // A pipeline's messages: more micro-batches.
  JobProfile q = pipeline({2, 2}, 10);
  for (RankProfile& r : q.ranks) {
    r.comm = {{"world", "send", 16, 1e6, 0.01}, {"world", "recv", 16, 0, 0.03}};
    r.comm_bytes = 1e6;
    r.exposed_s = 0.03;
  }
  EXPECT_NE(imbalance_report(q)[2].suggestion.find("gradient_accumulation_steps"),
            std::string::npos)
      << imbalance_report(q)[2].suggestion;
  // The context ring's messages are the cp group's, not the pipeline's.
  for (RankProfile& r : q.ranks)
    r.comm = {{"cp", "send", 16, 1e6, 0.01}, {"cp", "recv", 16, 0, 0.03}};
  EXPECT_NE(imbalance_report(q)[2].suggestion.find("parallel.context_comm p2p"), std::string::npos)
      << imbalance_report(q)[2].suggestion;
}

TEST(Profile, JsonRoundTrips) {
  JobProfile p = pipeline({1, 3}, 10);
  p.ranks[1].comm = {{"pp", "send", 2, 3, 4}};
  p.ranks[1].bubble_fraction = 0.25;
  const JobProfile q = job_profile_from_json(to_json(p));
  EXPECT_EQ(to_json(q), to_json(p));
  EXPECT_EQ(q.ranks[1].chunks[0].pieces[1].name, "h.2");
  EXPECT_EQ(q.shape.partition, (std::vector<int>{1, 3}));
  // cp: written and read back; a file from before it reads as cp 1.
  p.shape.cp = 2, p.ranks[1].coord.cp = 1;
  nlohmann::json j = to_json(p);
  EXPECT_EQ(job_profile_from_json(j).ranks[1].coord.cp, 1);
  EXPECT_NE(profile_text(p, {}).find("pp tp cp dp ep"), std::string::npos);
  j["shape"].erase("cp");
  for (auto& r : j["ranks"]) r["coord"].erase("cp");
  EXPECT_EQ(job_profile_from_json(j).shape.cp, 1);
  EXPECT_EQ(job_profile_from_json(j).ranks[1].coord.cp, 0);
  p.shape.cp = 1, p.ranks[1].coord.cp = 0;
  // The text names every piece and the report.
  const std::string text = profile_text(p, imbalance_report(p));
  for (const char* s : {"embeddings", "h.3", "lm_head", "load imbalance over 2 ranks",
                        "peak memory per rank", "collectives per rank and step"})
    EXPECT_NE(text.find(s), std::string::npos) << s;
}

TEST(Profile, StepImbalanceNamesTheLargestRank) {
  const auto j = step_imbalance({1, 1, 2}, {5, 5, 5}, {0, 3, 0});
  EXPECT_DOUBLE_EQ(j["compute"].get<double>(), 2.0 / (4.0 / 3) - 1);
  EXPECT_EQ(j["compute_rank"], 2);
  EXPECT_DOUBLE_EQ(j["memory"].get<double>(), 0);
  EXPECT_EQ(j["comm_rank"], 1);
}

}  // namespace
}  // namespace loom
