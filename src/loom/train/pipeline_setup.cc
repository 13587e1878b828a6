#include "loom/train/pipeline_setup.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/model/gpt_stage.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/train/step_engine.h"

namespace loom {

namespace {

// Median seconds of forward + backward of `stage` over one micro-batch.
double time_stage(GptStage<float>& stage, int64_t B, int64_t Tn, int reps) {
  const GptConfig& c = stage.config();
  const size_t BT = static_cast<size_t>(B * Tn), BTC = BT * static_cast<size_t>(c.n_embd);
  std::vector<int32_t> tokens(BT), targets(BT);
  for (size_t i = 0; i < BT; ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919) % static_cast<size_t>(c.vocab_size));
    targets[i] = static_cast<int32_t>((i * 104729 + 1) % static_cast<size_t>(c.vocab_size));
  }
  std::vector<float> input(BTC, 0.01f), d_output(BTC, 1e-3f), d_input(BTC);
  StageActivations<float> a = stage.make_activations(B, Tn);
  const StepContext ctx{1, 0, 0, true};
  std::vector<double> t;
  for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
    const auto t0 = std::chrono::steady_clock::now();
    stage.forward(a, tokens.data(), stage.has_embedding() ? nullptr : input.data(),
                  stage.has_head() ? targets.data() : nullptr, ctx);
    stage.backward(a, 1.0, stage.has_head() ? nullptr : d_output.data(),
                   stage.has_embedding() ? nullptr : d_input.data());
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (r > 0) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

pp::ModelCosts measure_model_costs(const GptConfig& model, int64_t B, int64_t Tn, int reps,
                                   DType records, const Backend<float>& backend) {
  LOOM_CHECK_KIND(kConfig, model.n_layer >= 2, "measuring layer costs needs 2 layers or more");
  // Three one-block stages: with the embedding, alone, with the head; the
  // differences are the embedding's and the head's.
  // Measured on the dense model; a mixture-of-experts block, when the model
  // has them, measured alone on a model whose every block is one.
  GptConfig dense = model;
  dense.moe_experts = 0;
  auto measure = [&](const GptConfig& cfg, int first) {
    GptStage<float> s(cfg, StageSpec{first, first + 1}, StoreOptions{},
                      LayerFactory<float>::single_process(), backend);
    s.init(1);
    CheckpointPolicy keep;
    keep.records = records;
    s.set_plan(s.plan(keep, B, Tn));
    return pp::LayerCost{time_stage(s, B, Tn, reps), static_cast<double>(s.store_bytes(B, Tn)),
                         static_cast<double>(s.num_params()) * 4 * sizeof(float),
                         static_cast<double>(s.room_bytes(B, Tn))};
  };
  const pp::LayerCost with_emb = measure(dense, 0), block = measure(dense, 1),
                      with_head = measure(dense, model.n_layer - 1);
  pp::LayerCost moe_block = block;
  if (model.moe_experts > 0) {
    GptConfig all_moe = model;
    all_moe.moe_every = 1;
    moe_block = measure(all_moe, 1);
  }
  auto minus = [](const pp::LayerCost& a, const pp::LayerCost& b) {
    return pp::LayerCost{
        std::max(0.0, a.seconds - b.seconds), std::max(0.0, a.act_bytes - b.act_bytes),
        std::max(0.0, a.state_bytes - b.state_bytes), std::max(0.0, a.room_bytes - b.room_bytes)};
  };
  pp::ModelCosts c;
  c.embedding = minus(with_emb, block);
  c.head = minus(with_head, block);
  for (int l = 0; l < model.n_layer; ++l)
    c.blocks.push_back(model.moe_layer(l) ? moe_block : block);
  return c;
}

PartitionReport resolve_partition(const Config& config, const ParallelContext& ctx,
                                  const Backend<float>& backend, const pp::SimResult* sim) {
  const ParallelConfig& p = config.parallel;
  const pp::ScheduleKind kind = pp::parse_schedule(p.schedule);
  const int v = kind == pp::ScheduleKind::kInterleaved ? p.virtual_stages : 1;
  const int parts = p.pipeline * v, n = config.model.n_layer;
  PartitionReport r;
  if (p.pipeline == 1) {
    r.counts = {n};
    return r;
  }
  // Micro-batches whose activations each part holds at its peak.
  LOOM_CHECK(sim != nullptr, "a pipeline's partition needs its schedule simulated");
  std::vector<double> in_flight;
  for (int k = 0; k < parts; ++k)
    in_flight.push_back(sim->peak_in_flight[static_cast<size_t>(k % p.pipeline)] / double(v));
  if (p.partition == "list") {
    pp::check_partition(p.partition_counts, n, parts);
    r.counts = p.partition_counts;
  } else if (p.partition == "uniform") {
    r.counts = pp::uniform_partition(n, parts);
  }
  if (p.partition != "balanced") return r;
  // Measured on one rank (ranks timing at once would share the cores) and
  // broadcast, so every rank cuts the model the same way.
  std::vector<float> counts(static_cast<size_t>(parts), 0);
  std::exception_ptr failed;
  if (ctx.rank == 0) {
    try {
      const pp::ModelCosts costs =
          measure_model_costs(config.model, config.micro_batch, config.local_seq_len(), 3,
                              config.checkpointing.policy.records, backend);
      r.counts = pp::balanced_partition(costs, parts, in_flight,
                                        static_cast<double>(p.stage_memory_bytes));
      const std::vector<int> uniform = pp::uniform_partition(n, parts);
      r.table = "balanced partition (measured per micro-batch on this machine):\n" +
                pp::partition_table(r.counts, pp::part_costs(costs, r.counts, in_flight)) +
                "uniform would be:\n" +
                pp::partition_table(uniform, pp::part_costs(costs, uniform, in_flight));
      for (int k = 0; k < parts; ++k)
        counts[static_cast<size_t>(k)] = static_cast<float>(r.counts[static_cast<size_t>(k)]);
    } catch (...) {
      // The others learn it from the broadcast rather than waiting for it.
      failed = std::current_exception();
      counts[0] = -1;
    }
  }
  if (ctx.world) ctx.world->broadcast(counts.data(), counts.size(), DType::kF32, 0)->wait();
  if (failed) std::rethrow_exception(failed);
  LOOM_CHECK_KIND(kConfig, counts[0] >= 0,
                  "parallel.partition balanced failed on rank 0 (its message says why)");
  r.counts.assign(counts.begin(), counts.end());
  return r;
}

}  // namespace loom
