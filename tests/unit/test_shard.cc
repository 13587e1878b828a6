// Sharded parameters: every split kind maps a slice's elements to the right
// elements of the whole tensor, initialisation gives each slice exactly its
// elements of the unsharded tensor, and slices assemble into the tensors a
// single-process checkpoint holds.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/checkpoint/checkpoint.h"
#include "loom/io/fs.h"
#include "loom/model/gpt_stage.h"
#include "loom/nn/param_store.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using test::error_of;

// The whole tensor numbered 0, 1, 2, ...: a slice shows which elements it took.
std::vector<float> iota(int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i);
  return v;
}

std::vector<float> slice_of(const Shape& g, const ShardSpec& s) {
  std::vector<float> whole = iota(g.numel());
  std::vector<float> local(static_cast<size_t>(shard_shape(g, s).numel()));
  shard_from_global(g, s, whole.data(), local.data());
  return local;
}

TEST(Shard, RowSplitIsOneContiguousRange) {
  const Shape g{6, 4};
  const ShardSpec s = ShardSpec::split(0, 1, 3);
  EXPECT_EQ(shard_shape(g, s), Shape({2, 4}));
  EXPECT_EQ(slice_of(g, s), (std::vector<float>{8, 9, 10, 11, 12, 13, 14, 15}));
}

TEST(Shard, ColumnSplitTakesColumnsOfEveryRow) {
  const Shape g{2, 6};
  const ShardSpec s = ShardSpec::split(1, 2, 3);
  EXPECT_EQ(shard_shape(g, s), Shape({2, 2}));
  EXPECT_EQ(slice_of(g, s), (std::vector<float>{4, 5, 10, 11}));
}

TEST(Shard, FusedQkvSplitByHeadsTakesAPieceOfEachBlock) {
  // (C=2, 3C=12) with q | k | v of 4 columns each (say 4 heads of 1),
  // split over 2 ranks: rank 1 holds heads 2-3 of q, of k and of v.
  const Shape g{2, 12};
  const ShardSpec s = ShardSpec::heads(1, 1, 2);
  EXPECT_EQ(shard_shape(g, s), Shape({2, 6}));
  EXPECT_EQ(slice_of(g, s), (std::vector<float>{2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23}));
  // The bias (3C) the same way along its only dimension.
  EXPECT_EQ(slice_of(Shape{12}, ShardSpec::heads(0, 0, 2)), (std::vector<float>{0, 1, 4, 5, 8, 9}));
}

TEST(Shard, VocabularyRangeTakesRows) {
  const Shape g{8, 2};
  const ShardSpec s = ShardSpec::vocab(1, 2);
  EXPECT_EQ(shard_shape(g, s), Shape({4, 2}));
  EXPECT_EQ(slice_of(g, s), (std::vector<float>{8, 9, 10, 11, 12, 13, 14, 15}));
}

TEST(Shard, SlicesOfEveryRankAssembleTheWholeTensor) {
  const Shape g{4, 12};
  for (ShardSpec proto : {ShardSpec::split(0, 0, 4), ShardSpec::split(1, 0, 3),
                          ShardSpec::heads(1, 0, 2), ShardSpec::vocab(0, 2)}) {
    std::vector<float> whole(static_cast<size_t>(g.numel()), -1.0f);
    for (int r = 0; r < proto.count; ++r) {
      ShardSpec s = proto;
      s.index = r;
      std::vector<float> local = slice_of(g, s);
      shard_to_global(g, s, local.data(), whole.data());
    }
    EXPECT_EQ(whole, iota(g.numel())) << proto.describe();
  }
}

TEST(Shard, UnevenSplitsAreRefusedWithTheNumbers) {
  EXPECT_HAS(error_of([] {
               shard_shape(Shape{5, 4}, ShardSpec::split(0, 0, 2));
             }),
             "dimension 0 of (5, 4) (5) does not split into 2");
  EXPECT_HAS(error_of([] {
               shard_shape(Shape{4, 9}, ShardSpec::heads(1, 0, 2));
             }),
             "does not split into 6");
}

// Megatron's splits of GPT-2 over `tp` ranks: c_attn by heads, c_fc by
// output columns (column-parallel), both c_proj by input rows
// (row-parallel), wte by vocabulary range; norms and row-parallel biases
// whole.
ShardSpec megatron_split(const std::string& name, int rank, int tp) {
  auto ends = [&](const std::string& suffix) {
    return name.size() >= suffix.size() &&
           name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends("attn.c_attn.weight")) return ShardSpec::heads(1, rank, tp);
  if (ends("attn.c_attn.bias")) return ShardSpec::heads(0, rank, tp);
  if (ends("mlp.c_fc.weight")) return ShardSpec::split(1, rank, tp);
  if (ends("mlp.c_fc.bias")) return ShardSpec::split(0, rank, tp);
  if (ends("c_proj.weight")) return ShardSpec::split(0, rank, tp);
  if (name == "transformer.wte.weight") return ShardSpec::vocab(rank, tp);
  return ShardSpec::whole();
}

GptConfig small() {
  GptConfig c;
  c.n_layer = 2, c.n_embd = 16, c.n_head = 4, c.vocab_size = 200, c.seq_len = 8;  // padded 256
  return c;
}

TEST(Shard, EachRanksSliceInitialisesToItsPartOfTheWholeModel) {
  GptStage<float> whole(small());
  whole.init(42);
  const int tp = 2;
  // Every rank's store: the same parameters, each its slice.
  GptStage<float> assembled(small());
  std::memset(assembled.params(), 0, sizeof(float) * static_cast<size_t>(assembled.num_params()));
  for (int r = 0; r < tp; ++r) {
    ParamLayout layout;
    for (const Unit& u : whole.layout().units()) {
      layout.begin_unit(u.name);
      for (const Param& p : whole.layout().params())
        if (whole.layout().units()[static_cast<size_t>(p.unit)].name == u.name)
          layout.add(p.name, p.shape, p.decay, p.init, megatron_split(p.name, r, tp));
    }
    ParamStore<float> shard;
    shard.build(std::move(layout), StoreOptions{});
    shard.init(42);
    int sharded = 0;
    for (const Param& p : shard.layout().params()) {
      const Param& g = assembled.layout().find(p.name);
      shard_to_global(p.shape, p.shard, shard.param(p), assembled.param(g));
      sharded += p.shard.sharded();
      if (p.shard.sharded()) {
        EXPECT_EQ(p.numel * tp, p.shape.numel()) << p.name;
      }
    }
    EXPECT_EQ(sharded, 1 + 2 * 6);  // wte, and six per block
  }
  // Bitwise the unsharded initialisation, vocabulary padding zero included.
  EXPECT_EQ(std::memcmp(assembled.params(), whole.params(),
                        sizeof(float) * static_cast<size_t>(whole.num_params())),
            0);
  // And a checkpoint of the assembled tensors is the single-process one.
  test::TempDir a, b;
  TrainerState st{1, 0.1, 1.0, 42, ""};
  const std::string da = save_checkpoint(a.path.string(), whole, nullptr, nullptr, st, {}, 0);
  const std::string db = save_checkpoint(b.path.string(), assembled, nullptr, nullptr, st, {}, 0);
  EXPECT_EQ(read_file((fs::path(da) / "model.safetensors").string()),
            read_file((fs::path(db) / "model.safetensors").string()));
}

}  // namespace
}  // namespace loom
