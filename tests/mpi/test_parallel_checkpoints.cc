// Checkpoints of every parallel layout under mpirun: experts, tensor- and
// pipeline-parallel models loaded at other sizes bitwise, sharded ZeRO
// saves within their memory bound, and a skipped non-finite step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness.h"
#include "loom/checkpoint/sharded.h"
#include "loom/core/memory.h"
#include "loom/io/fs.h"
#include "loom/nn/param.h"
#include "loom/parallel/expert/all_to_all.h"
#include "loom/parallel/tensor/linear.h"
#include "loom/train/config.h"
#include "loom/train/trainer.h"
#include "loom/train/whole_model.h"
#include "mpi_main.h"

namespace loom {
namespace {

using test::runtime;
using namespace test;

// The all-to-all dispatcher alone: every rank's rows for each expert (some
// blocks empty) arrive at the expert's rank, expert by expert and within an
// expert rank by rank; combine brings each row back to its place. Row
// values name (rank, expert, row, column), so any misplaced row shows.
TEST(ExpertParallel, DispatchSendsEveryRowToItsExpertAndCombineBringsItBack) {
  auto world = runtime().world(CommOptions{});
  const int P = world->size(), me = world->rank(), L = 2, E = P * L;
  const int64_t C = 3;
  if (P == 1) GTEST_SKIP() << "needs 2 ranks";
  ep::AllToAllDispatcher d(world);
  auto count = [&](int r, int e) { return int64_t{(r * 5 + e * 3) % 4}; };  // 0 to 3 rows
  auto value = [](int r, int e, int64_t i, int64_t c) {
    return static_cast<float>(r * 1000 + e * 100 + i * 10 + c);
  };
  std::vector<int64_t> mine(static_cast<size_t>(E));
  std::vector<float> rows;
  for (int e = 0; e < E; ++e) {
    mine[static_cast<size_t>(e)] = count(me, e);
    for (int64_t i = 0; i < count(me, e); ++i)
      for (int64_t c = 0; c < C; ++c) rows.push_back(value(me, e, i, c));
  }
  const ExpertPlan p = d.plan(mine, E);
  std::vector<float> want;
  for (int le = 0; le < L; ++le) {
    const int e = me * L + le;
    int64_t n = 0;
    for (int s = 0; s < P; ++s)
      for (int64_t i = 0; i < count(s, e); ++i, ++n)
        for (int64_t c = 0; c < C; ++c) want.push_back(value(s, e, i, c));
    EXPECT_EQ(p.offsets[static_cast<size_t>(le) + 1] - p.offsets[static_cast<size_t>(le)], n)
        << "local expert " << le;
  }
  std::vector<float> got(static_cast<size_t>(p.rows() * C), -1.0f);
  d.dispatch(p, rows.data(), C, got.data());
  EXPECT_EQ(got, want);
  for (float& x : got) x += 0.5f;  // what the experts did
  std::vector<float> back(rows.size(), -1.0f);
  d.combine(p, got.data(), C, back.data());
  for (float& x : rows) x += 0.5f;
  EXPECT_EQ(back, rows);
  const ep::AllToAllStats st = d.take_stats();
  EXPECT_EQ(st.calls, 2);
  world->barrier()->wait();
}

// Under expert parallelism each rank writes the experts it holds under
// their global names (transformer.h.1.mlp.experts.3.c_fc.weight), so a
// checkpoint loads bitwise in one process and at any other expert-parallel
// size (and at another ZeRO stage), a resumed run continues bitwise, and the
// whole format (gathered from the expert ranks) loads alike.
TEST(ExpertParallel, CheckpointsHoldEveryExpertAndLoadAtAnyEpBitwise) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-ep-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  auto make = [&](int ep, int stage, int steps, const std::string& resume, const std::string& dir,
                  bool one_process, std::vector<std::string> extra = {}) {
    std::vector<std::string> o = {"model.moe.num_experts=4",
                                  "model.moe.every_n_layers=2",
                                  "parallel.expert=" + std::to_string(ep),
                                  "zero_optimization.stage=" + std::to_string(stage),
                                  "train.steps=" + std::to_string(steps),
                                  "checkpoint.every=3",
                                  "checkpoint.dir=" + root + "/" + dir};
    o.insert(o.end(), extra.begin(), extra.end());
    Config c = parse_config(kBase, "harness", o, one_process ? 1 : n);
    RunOptions opt;
    opt.quiet = true;
    opt.resume = resume;
    if (!one_process) opt.parallel = make_parallel_context(world, GridShape{n, 1, 1, ep});
    return std::make_unique<Trainer>(std::move(c), opt, ThreadConfig{});
  };
  const std::string step = "/step-00000003";
  // A: ep n at ZeRO-2, 3 steps, saved.
  auto a = make(n, 2, 3, "", "a", false);
  a->run();
  const auto sa = whole_state(*a);
  ASSERT_TRUE(sa.count("transformer.h.1.mlp.experts.3.c_fc.weight"));
  if (world->rank() == 0) {
    const std::string manifest = read_file(root + "/a" + step + "/manifest.json");
    for (int e = 0; e < 4; ++e)
      EXPECT_NE(
          manifest.find("\"transformer.h.3.mlp.experts." + std::to_string(e) + ".c_proj.weight\""),
          std::string::npos)
          << "expert " << e << " in the manifest";
  }
  // B: one process from it (every rank alone), then saved by rank 0.
  auto b = make(1, 0, 3, root + "/a" + step, "b", true);
  EXPECT_TRUE(whole_state(*b) == sa) << "ep " << n << " -> one process";
  if (world->rank() == 0) b->save(0.0);
  world->barrier()->wait();
  // C: ep n at ZeRO-3 from the one-process checkpoint.
  auto c = make(n, 3, 3, root + "/b" + step, "c", false);
  EXPECT_TRUE(whole_state(*c) == sa) << "one process -> ep " << n << ", zero-3";
  if (n == 4) {
    // D: ep 2 (x dp 2) at ZeRO-1 from A's ep-4 checkpoint.
    auto d = make(2, 1, 3, root + "/a" + step, "d", false);
    EXPECT_TRUE(whole_state(*d) == sa) << "ep 4 -> ep 2 x dp 2";
  }
  // E: A resumed for 3 more steps continues as F, never stopped.
  auto e = make(n, 2, 6, root + "/a" + step, "e", false);
  auto f = make(n, 2, 6, "", "f", false);
  const std::vector<StepResult> rf = f->run();
  const std::vector<StepResult> re = e->run();
  ASSERT_EQ(re.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(re[k].loss, rf[k + 3].loss) << "step " << k + 4;
  EXPECT_TRUE(whole_state(*e) == whole_state(*f)) << "resumed run's final state";
  // G: the whole format, its experts gathered from their ranks.
  auto g = make(n, 2, 3, "", "g", false, {"checkpoint.format=whole"});
  g->run();
  auto h = make(1, 0, 3, root + "/g" + step, "h", true);
  EXPECT_TRUE(whole_state(*h) == whole_state(*g)) << "whole format, ep " << n << " -> one process";
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf(
        "[ ep checkpoints ] world %d: ep %d -> 1 -> ep %d (zero-3)%s bitwise; resume "
        "bitwise; whole format\n",
        n, n, n, n == 4 ? ", ep 4 -> ep 2 x dp 2" : "");
  }
}

// A checkpoint saved under any tensor-parallel size loads under any other
// (its pieces reassembled into the new slices): parameters and AdamW
// moments come back bitwise. tp N -> one process -> tp N, and at 4 ranks tp 4 -> tp 2 -> tp 4.
TEST(TensorParallel, CheckpointsLoadUnderAnyTensorParallelSizeBitwise) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-tp-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  struct Local {
    std::vector<float> params, m, v;
  };
  auto make = [&](int tp, const std::string& resume, const std::string& dir, bool one_process) {
    Config c = parse_config(kBase, "harness",
                            {"parallel.tensor=" + std::to_string(tp), "train.steps=3",
                             "checkpoint.every=3", "checkpoint.dir=" + root + "/" + dir},
                            one_process ? 1 : n);
    RunOptions o;
    o.quiet = true;
    o.resume = resume;
    if (!one_process) o.parallel = make_parallel_context(world, GridShape{n, tp});
    return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
  };
  auto local = [](Trainer& t) {
    Local l;
    l.params = t.gather_params();
    t.zero().gather_moments(l.m, l.v);
    return l;
  };
  const std::string step = "/step-00000003";
  // A: trained at tp n, saved.
  auto a = make(n, "", "a", false);
  a->run();
  const Local la = local(*a);
  const auto whole_a = whole_params(*a);
  // B: every rank loads it in one process; rank 0 saves it again from there.
  auto b = make(1, root + "/a" + step, "b", true);
  EXPECT_TRUE(whole_params(*b) == whole_a) << "tp " << n << " -> one process";
  if (world->rank() == 0) b->save(0.0);
  world->barrier()->wait();
  // C: tp n from the one-process checkpoint: the same slices and moments as A.
  auto c = make(n, root + "/b" + step, "c", false);
  const Local lc = local(*c);
  EXPECT_TRUE(lc.params == la.params) << "one process -> tp " << n;
  EXPECT_TRUE(lc.m == la.m && lc.v == la.v) << "moments, one process -> tp " << n;
  if (n == 4) {
    // D: tp 2 (x dp 2) from A's tp-4 checkpoint, saved; E: tp 4 from that.
    auto d = make(2, root + "/a" + step, "d", false);
    EXPECT_TRUE(whole_params(*d) == whole_a) << "tp 4 -> tp 2";
    d->save(0.0);
    auto e = make(4, root + "/d" + step, "e", false);
    const Local le = local(*e);
    EXPECT_TRUE(le.params == la.params) << "tp 2 -> tp 4";
    EXPECT_TRUE(le.m == la.m && le.v == la.v) << "moments, tp 2 -> tp 4";
  }
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf("[ tp checkpoints ] world %d: tp %d -> 1 -> %d%s bitwise\n", n, n, n,
                n == 4 ? ", 4 -> 2 -> 4" : "");
  }
}

// Context parallelism changes nothing in the parameters: a checkpoint saved
// at cp N (ZeRO-2, its state sharded over dp x cp) loads at cp 1 (dp N) and
// at another cp with parameters and AdamW moments bitwise, and training on
// from it matches the run that never stopped (reduction order apart).
TEST(ContextParallel, CheckpointsResumeAtAnotherContextSize) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-cp-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  auto make = [&](int cp, int steps, const std::string& resume, const std::string& dir) {
    Config c = parse_config(kBase, "harness",
                            {"parallel.context=" + std::to_string(cp), "zero_optimization.stage=2",
                             "train.steps=" + std::to_string(steps), "checkpoint.every=3",
                             "checkpoint.dir=" + root + "/" + dir},
                            n);
    RunOptions o;
    o.quiet = true;
    o.resume = resume;
    o.parallel = make_parallel_context(world, GridShape{n, 1, 1, 1, cp});
    return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
  };
  const std::string step = "/step-00000003";
  // A: cp n for 6 steps, saving after 3.
  auto a = make(n, 6, "", "a");
  const std::vector<StepResult> full = a->run();
  const auto end_a = whole_state(*a);
  // The state at step 3, loaded at cp n again.
  auto a3 = make(n, 6, root + "/a" + step, "a3");
  const auto at3 = whole_state(*a3);
  std::vector<int> others = {1};
  if (n == 4) others.push_back(2);
  for (int cp : others) {
    const std::string name = "cp " + std::to_string(n) + " -> cp " + std::to_string(cp);
    auto b = make(cp, 6, root + "/a" + step, "b" + std::to_string(cp));
    EXPECT_TRUE(whole_state(*b) == at3) << name << ": the loaded state differs";
    const std::vector<StepResult> rest = b->run();
    ASSERT_EQ(rest.size(), 3u) << name;
    for (size_t k = 0; k < rest.size(); ++k)
      EXPECT_LE(std::abs(rest[k].loss - full[k + 3].loss), 1e-5 * full[k + 3].loss)
          << name << ", step " << k + 4;
    double worst = 0;
    const auto end_b = whole_state(*b);
    for (const auto& [key, want] : end_a)
      for (size_t i = 0; i < want.size(); ++i)
        worst = std::max(worst, double(std::abs(end_b.at(key)[i] - want[i])));
    EXPECT_LE(worst, 1e-4) << name << ": the state after 3 more steps";
  }
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf("[ cp checkpoints ] world %d: cp %d -> 1%s bitwise on load, on within 1e-4\n", n,
                n, n == 4 ? ", cp 4 -> cp 2 x dp 2" : "");
  }
}

// Checkpoints of a pipelined run (each stage writes its own tensors) load
// in one process and at another pipeline size with parameters and AdamW moments
// bitwise, and a pipelined run resumed from one continues bitwise as if
// never stopped.
TEST(Pipeline, CheckpointsLoadAnywhereAndResumeBitwise) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-pp-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  using State = std::map<std::string, std::vector<float>>;
  auto state = [](Trainer& t) { return whole_state(t); };
  auto make = [&](int pp, int steps, const std::string& resume, const std::string& dir,
                  bool one_process) {
    const int world_size = one_process ? 1 : n;
    Config c =
        parse_config(kBase, "harness",
                     {"parallel.pipeline=" + std::to_string(pp), "gradient_accumulation_steps=4",
                      "train.steps=" + std::to_string(steps), "checkpoint.every=3",
                      "checkpoint.dir=" + root + "/" + dir},
                     world_size);
    RunOptions o;
    o.quiet = true;
    o.resume = resume;
    if (!one_process) o.parallel = make_parallel_context(world, GridShape{n, 1, pp});
    return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
  };
  const std::string step = "/step-00000003";
  // A: pp n, 3 steps, saved.
  auto a = make(n, 3, "", "a", false);
  a->run();
  const State sa = state(*a);
  // B: one process loads it (every rank); rank 0 saves it again from there.
  auto b = make(1, 3, root + "/a" + step, "b", true);
  EXPECT_TRUE(state(*b) == sa) << "pp " << n << " -> one process";
  if (world->rank() == 0) b->save(0.0);
  world->barrier()->wait();
  // C: pp n from the one-process checkpoint.
  auto c = make(n, 3, root + "/b" + step, "c", false);
  EXPECT_TRUE(state(*c) == sa) << "one process -> pp " << n;
  if (n == 4) {
    // D: pp 2 x dp 2 from A's pp-4 checkpoint, saved; E: pp 4 from that.
    auto d = make(2, 3, root + "/a" + step, "d", false);
    EXPECT_TRUE(state(*d) == sa) << "pp 4 -> pp 2 x dp 2";
    d->save(0.0);
    auto e = make(4, 3, root + "/d" + step, "e", false);
    EXPECT_TRUE(state(*e) == sa) << "pp 2 -> pp 4";
  }
  // F: 6 steps straight; G: A's checkpoint resumed for steps 4-6.
  auto f = make(n, 6, "", "f", false);
  const std::vector<StepResult> rf = f->run();
  auto g = make(n, 6, root + "/a" + step, "g", false);
  const std::vector<StepResult> rg = g->run();
  ASSERT_EQ(rg.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(rg[k].loss, rf[k + 3].loss) << "step " << k + 4;
  EXPECT_TRUE(state(*g) == state(*f)) << "resumed run's final state";
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf("[ pp checkpoints ] world %d: pp %d -> 1 -> %d%s bitwise; resume bitwise\n", n, n,
                n, n == 4 ? ", 4 -> 2 x dp 2 -> 4" : "");
  }
}

// /proc/self/status's `key` in bytes.
size_t status_bytes(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::stoull(line.substr(std::strlen(key) + 1)) * 1024;
  return 0;
}
// Whether the resident set measures loom's memory: not under AddressSanitizer,
// whose shadow memory and quarantine of freed blocks move it by megabytes.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kRssMeaningful = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kRssMeaningful = false;
#else
constexpr bool kRssMeaningful = true;
#endif
#else
constexpr bool kRssMeaningful = true;
#endif

// Starts a new peak resident set (VmHWM) at the current size; false where
// the kernel does not offer it.
bool reset_peak_rss() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return f.good();
}

// Sharded checkpoints at every ZeRO stage: each rank writes its own shard,
// and a save or a resume at stage 3 holds no more than the model state plus
// one unit's buffers (the tracked peak and the resident set's high-water
// mark both); the checkpoint loads bitwise at stages 0, 1 and 2, in one
// process, and from a one-process save back at stage 3; async saves write
// the same bytes as synchronous ones; a resumed run continues bitwise.
TEST(ShardedCheckpoint, EveryZeroStageSavesAndResumesWithinStatePlusOneUnit) {
  const int n = runtime().world_size();
  const std::string root =
      (std::filesystem::temp_directory_path() / "loom-test-zero-checkpoints").string();
  auto world = runtime().world(CommOptions{});
  if (world->rank() == 0) std::filesystem::remove_all(root);
  world->barrier()->wait();
  using State = std::map<std::string, std::vector<float>>;
  // A model large enough for memory to show: units of ~3 MB.
  auto make = [&](int stage, int steps, const std::string& resume, const std::string& dir,
                  bool one_process, std::vector<std::string> extra = {}) {
    std::vector<std::string> o = {
        "model.n_embd=256", "model.n_layer=2", "zero_optimization.stage=" + std::to_string(stage),
        "train.steps=" + std::to_string(steps), "checkpoint.dir=" + root + "/" + dir};
    o.insert(o.end(), extra.begin(), extra.end());
    Config c = parse_config(kBase, "harness", o, one_process ? 1 : n);
    RunOptions opt;
    opt.quiet = true;
    opt.resume = resume;
    if (!one_process) opt.parallel = make_parallel_context(world, GridShape{n});
    return std::make_unique<Trainer>(std::move(c), opt, ThreadConfig{});
  };
  auto unit_bytes = [](Trainer& t) {
    int64_t most = 0;
    for (const Unit& u : t.model().layout().units()) most = std::max(most, u.size());
    return static_cast<size_t>(most) * sizeof(float);
  };
  auto total = [](const std::array<size_t, kNumMemCategories>& a) {
    size_t s = 0;
    for (size_t x : a) s += x;
    return s;
  };
  const bool rss = reset_peak_rss() && kRssMeaningful;
  constexpr size_t kSlack = 2 << 20;  // allocator and file-system noise
  const std::string step = "/step-00000003";

  // A: stage 3 on n ranks, 3 steps, saved; the save measured.
  auto a = make(3, 3, "", "a", false);
  a->run();
  const size_t unit = unit_bytes(*a);
  memory_tracker().reset_peaks();
  reset_peak_rss();
  const size_t rss_before = status_bytes("VmRSS:");
  a->save(0.0);
  const size_t save_rss = status_bytes("VmHWM:") - rss_before;
  const MemStats ms = memory_tracker().stats();
  EXPECT_LE(total(ms.peak) - total(ms.current), unit) << "tracked peak during save";
  if (rss) {
    EXPECT_LE(save_rss, unit + kSlack) << "resident set growth during save";
  }
  const State sa = whole_state(*a);
  for (int r = 0; r < n; ++r)
    EXPECT_TRUE(std::filesystem::exists(root + "/a" + step + "/" + shard_file_name(r)));

  // B: stage 3 resumed on n ranks: the load measured, the state bitwise.
  memory_tracker().reset_peaks();
  reset_peak_rss();
  auto b = make(3, 6, root + "/a" + step, "b", false);
  const MemStats mb = memory_tracker().stats();
  const size_t load_rss = status_bytes("VmHWM:") - status_bytes("VmRSS:");
  EXPECT_LE(total(mb.peak) - total(mb.current), unit) << "tracked peak above state at resume";
  if (rss) {
    EXPECT_LE(load_rss, unit + kSlack) << "resident set above state at resume";
  }
  EXPECT_TRUE(whole_state(*b) == sa) << "stage 3 -> stage 3";
  // ... and continues as a run never stopped.
  auto f = make(3, 6, "", "f", false);
  const std::vector<StepResult> rf = f->run();
  const std::vector<StepResult> rb = b->run();
  ASSERT_EQ(rb.size(), 3u);
  for (size_t k = 0; k < 3; ++k) EXPECT_EQ(rb[k].loss, rf[k + 3].loss) << "step " << k + 4;
  EXPECT_TRUE(whole_state(*b) == whole_state(*f)) << "resumed run's final state";

  // Other stages and one process load it bitwise.
  for (int stage : {0, 1, 2}) {
    auto c = make(stage, 3, root + "/a" + step, "c", false);
    EXPECT_TRUE(whole_state(*c) == sa) << "stage 3 -> stage " << stage;
  }
  auto one = make(0, 3, root + "/a" + step, "one", true);
  EXPECT_TRUE(whole_state(*one) == sa) << "stage 3 on " << n << " ranks -> one process";
  if (world->rank() == 0) one->save(0.0);
  world->barrier()->wait();
  auto back = make(3, 3, root + "/one" + step, "back", false);
  EXPECT_TRUE(whole_state(*back) == sa) << "one process -> stage 3";

  // Async saves (every step, overlapping the next) write the same files.
  auto sync = make(2, 4, "", "sync", false, {"checkpoint.every=2"});
  sync->run();
  auto async = make(2, 4, "", "async", false, {"checkpoint.every=2", "checkpoint.async=true"});
  async->run();
  if (world->rank() == 0) {
    for (const char* s : {"/step-00000002/", "/step-00000004/"})
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(read_file(root + "/sync" + s + shard_file_name(r)),
                  read_file(root + "/async" + s + shard_file_name(r)))
            << s << shard_file_name(r);
      }
  }
  world->barrier()->wait();
  if (world->rank() == 0) {
    std::filesystem::remove_all(root);
    std::printf(
        "[ sharded checkpoints ] world %d, stage 3: save +%.2f MB resident, resume +%.2f MB "
        "above state (largest unit %.2f MB%s); stages 0-2, one process, back: bitwise; async = "
        "sync\n",
        n, save_rss / 1e6, load_rss / 1e6, unit / 1e6, rss ? "" : ", resident set not measured");
  }
}

// A step whose gradients hold a NaN (LOOM_TEST_NONFINITE puts one into a
// parameter's reduced gradient where a rank holds it) is skipped on every
// rank at once with train.on_nonfinite skip: parameters and moments stay as
// they were, the schedule does not advance, and every layout then trains
// like one process doing the same.
// In every precision: f32 and bf16 skip the step (train.on_nonfinite:
// skip), fp16 skips it as an overflow and halves the loss scale (hysteresis
// 1); every rank agrees, and the state is left as it was.
TEST(NonFinite, ASkippedStepIsSkippedEverywhereAndTrainsLikeOneProcess) {
  const int n = runtime().world_size();
  auto world = runtime().world(CommOptions{});
  ::setenv("LOOM_TEST_NONFINITE", "3:transformer.h.1.mlp.c_fc.weight", 1);
  for (const std::string precision : {"f32", "bf16", "fp16"}) {
    std::vector<std::string> base = {"train.steps=6", "train.on_nonfinite=skip",
                                     "gradient_accumulation_steps=4"};
    // (Activation records in f32: the 16-bit layouts' tight bounds; the
    // skip does not depend on them.)
    if (precision != "f32")
      base.insert(base.end(),
                  {precision + ".enabled=true", "activation_checkpointing.activation_dtype=f32"});
    if (precision == "fp16") base.push_back("fp16.hysteresis=1");
    // 16-bit: the tolerances of the 16-bit layouts above.
    const double loss_tol = precision == "f32" ? 1e-5 : 2e-5;
    const double param_tol = precision == "f32" ? 1e-4 : 2e-3;
    auto make = [&](std::vector<std::string> extra, bool one_process, GridShape shape) {
      extra.insert(extra.end(), base.begin(), base.end());
      Config c = parse_config(kBase, "harness", extra, one_process ? 1 : n);
      RunOptions o;
      o.quiet = true;
      if (!one_process) o.parallel = make_parallel_context(world, shape);
      return std::make_unique<Trainer>(std::move(c), o, ThreadConfig{});
    };
    // One process, step by step: the skipped step leaves the state as it was.
    auto ref = make({}, true, GridShape{});
    std::vector<StepResult> want;
    want.push_back(ref->train_step());
    want.push_back(ref->train_step());
    const auto before = whole_state(*ref);
    want.push_back(ref->train_step());
    EXPECT_EQ(want.back().skipped_steps, 1) << precision;
    EXPECT_TRUE(whole_state(*ref) == before) << precision << ": the skipped step changed the state";
    for (int k = 0; k < 3; ++k) want.push_back(ref->train_step());
    EXPECT_EQ(want.back().skipped_steps, 1) << precision;
    if (precision == "fp16") {
      EXPECT_EQ(want[2].loss_scale, 65536.0);
      EXPECT_EQ(want[3].loss_scale, 32768.0) << "the overflow halves the scale";
    }
    const auto want_params = whole_params(*ref);
    struct L {
      std::string name;
      std::vector<std::string> set;
      GridShape shape;
    };
    for (const L& l : {L{"dp, zero-2", {"zero_optimization.stage=2"}, GridShape{n}},
                       L{"tp", {"parallel.tensor=" + std::to_string(n)}, GridShape{n, n}},
                       L{"pp", {"parallel.pipeline=" + std::to_string(n)}, GridShape{n, 1, n}}}) {
      auto t = make(l.set, false, l.shape);
      const std::vector<StepResult> got = t->run();
      ASSERT_EQ(got.size(), want.size()) << l.name;
      for (size_t k = 0; k < got.size(); ++k) {
        EXPECT_EQ(got[k].skipped_steps, k >= 2 ? 1 : 0)
            << precision << ", " << l.name << " step " << k + 1;
        EXPECT_EQ(got[k].loss_scale, want[k].loss_scale) << precision << ", " << l.name;
        EXPECT_LE(std::abs(got[k].loss - want[k].loss), loss_tol * std::abs(want[k].loss))
            << precision << ", " << l.name << " step " << k + 1;
      }
      const auto params = whole_params(*t);
      double worst = 0;
      for (const auto& [name, w] : want_params)
        for (size_t i = 0; i < w.size(); ++i)
          worst = std::max(worst, double(std::abs(params.at(name)[i] - w[i])));
      EXPECT_LE(worst, param_tol) << precision << ", " << l.name;
    }
    if (world->rank() == 0)
      std::printf(
          "[ non-finite ] world %d, %s: step 3 skipped on every rank under dp zero-2, tp %d, "
          "pp %d, as in one process\n",
          n, precision.c_str(), n, n);
  }
  ::unsetenv("LOOM_TEST_NONFINITE");
}

}  // namespace
}  // namespace loom
