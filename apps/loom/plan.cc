// loom plan: the layouts of a model on a cluster, predicted memory and step
// time, best tokens/s first.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "loom/comm/mpi/mpi_process_group.h"
#include "loom/core/error.h"
#include "loom/core/threads.h"
#include "loom/io/fs.h"
#include "loom/kernels/cpu/cpu_backend.h"
#include "loom/plan/loom_memory.h"
#include "loom/plan/planner.h"
#include "loom/profile/calibrate.h"
#include "loom/profile/gemm_peak.h"
#include "loom/train/gemm_choice.h"
#include "loom/train/pipeline_setup.h"

namespace loom::app {

namespace {

struct PlanArgs {
  std::string model, cluster, layout, engine = "loom", calibrate;
  int gpus = 0, top = 10;
  int64_t batch = 0;
  bool json = false;
};

void print_table(const std::vector<plan::Estimate>& best) {
  std::printf("%-4s %-3s %-3s %-4s %-2s %-2s %-2s %-5s %-4s %-9s %-2s %-11s %9s %10s %8s %8s\n",
              "rank", "tp", "pp", "dp", "cp", "ep", "v", "micro", "zero", "recompute", "sp",
              "schedule", "step s", "tokens/s", "TFLOP/s", "mem GB");
  int k = 0;
  for (const plan::Estimate& e : best) {
    const plan::Layout& l = e.layout;
    std::printf(
        "%-4d %-3d %-3d %-4d %-2d %-2d %-2d %-5ld %-4d %-9s %-2s %-11s %9.3f %10.0f %8.1f %8.1f\n",
        ++k, l.tp, l.pp, l.dp, l.cp, l.ep, l.v, long(l.micro), l.zero, l.recompute.c_str(),
        l.sp ? "y" : "n", l.schedule.c_str(), e.step_s, e.tokens_per_s, e.tflops_per_gpu,
        e.mem.total() / 1e9);
  }
}

constexpr int kPingTag = 7201;

// Rank 0 and `peer` pass messages of `bytes` back and forth: seconds one
// way, the median of five rounds of `iters` (every rank calls; only the two
// take part).
double one_way_s(ProcessGroup& world, int peer, size_t bytes, int iters) {
  if (peer < 0) return 0;
  const int me = world.rank();
  std::vector<uint8_t> buf(bytes);
  std::vector<double> rounds;
  for (int round = 0; round < 6; ++round) {
    world.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters && (me == 0 || me == peer); ++i) {
      if (me == 0) {
        world.send(buf.data(), bytes, DType::kU8, peer, kPingTag)->wait();
        world.recv(buf.data(), bytes, DType::kU8, peer, kPingTag)->wait();
      } else {
        world.recv(buf.data(), bytes, DType::kU8, 0, kPingTag)->wait();
        world.send(buf.data(), bytes, DType::kU8, 0, kPingTag)->wait();
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (round > 0) rounds.push_back(s / (2.0 * iters));  // the first warms up
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

// Rank 0 and `peer` send each other `bytes` at once (as a ring step or a
// pipeline's activations and gradients do): seconds per exchange, the
// median of five rounds of `iters`.
double exchange_s(ProcessGroup& world, int peer, size_t bytes, int iters) {
  if (peer < 0) return 0;
  const int me = world.rank();
  std::vector<uint8_t> out(bytes), in(bytes);
  std::vector<double> rounds;
  for (int round = 0; round < 6; ++round) {
    world.barrier()->wait();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters && (me == 0 || me == peer); ++i) {
      const int other = me == 0 ? peer : 0;
      WorkPtr r = world.recv(in.data(), bytes, DType::kU8, other, kPingTag);
      WorkPtr s = world.send(out.data(), bytes, DType::kU8, other, kPingTag);
      s->wait();
      r->wait();
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (round > 0) rounds.push_back(s / iters);
  }
  std::sort(rounds.begin(), rounds.end());
  return rounds[rounds.size() / 2];
}

// A link between rank 0 and `peer`: latency from 8-byte messages passed
// back and forth; bandwidth from 16 MB ones sent both ways at once (less
// the latency), what collectives and pipelines see with both directions
// busy (a shaped or shared link can give much less than one way alone,
// which `one_way_GBps` keeps).
nlohmann::json measure_link(ProcessGroup& world, int peer) {
  const double lat = one_way_s(world, peer, 8, 200);
  const size_t big = size_t{16} << 20;
  const double one_way = one_way_s(world, peer, big, 4);
  const double both = exchange_s(world, peer, big, 4);
  if (peer < 0) return nullptr;
  return {{"bandwidth_GBps", double(big) / std::max(1e-9, both - lat) / 1e9},
          {"latency_us", lat * 1e6},
          {"one_way_GBps", double(big) / std::max(1e-9, one_way - lat) / 1e9}};
}

void calibrate(const PlanArgs& a) {
  MpiRuntime rt(nullptr, nullptr);
  // The others wait while rank 0 measures: as long as a large model's
  // block takes, not the training timeout.
  CommOptions options;
  options.timeout_s = 4 * 3600;
  auto world = rt.world(options);
  const ThreadConfig threads = configure_threads(rt.node_size());
  int64_t seq = 0, hidden = 0, vocab = 0, micro = 1;
  plan::ModelShape m;
  if (!a.model.empty()) {
    const nlohmann::json mj = nlohmann::json::parse(read_file(a.model), nullptr, false);
    LOOM_CHECK_KIND(kConfig, !mj.is_discarded(), "{}: not JSON", a.model);
    m = plan::parse_model(mj, a.model);
    seq = m.seq, hidden = m.hidden, vocab = m.vocab;
    if (mj.contains("train_micro_batch_size_per_gpu") &&
        mj["train_micro_batch_size_per_gpu"].is_number_integer())
      micro = std::max<int64_t>(1, mj["train_micro_batch_size_per_gpu"].get<int64_t>());
  }
  // Rank 0 measures the host while the others wait (they would share its cores).
  HostCalibration h;
  double block_s = 0, elementwise_gbps = 0;
  world->barrier()->wait();
  if (world->rank() == 0) try {
      h = calibrate_host(threads.threads, rt.node_size(), calibration_shapes(seq, hidden, vocab));
      if (!a.model.empty()) {
        // One dense block's forward and backward at the model's shape and
        // micro-batch, in one process: what its GEMMs do not explain is
        // loom's non-GEMM work, charged by the block's f32 record bytes.
        // Three blocks: the middle one's stage has neither the embedding
        // nor the head.
        GptConfig g;
        g.n_layer = 3;
        g.n_embd = int(m.hidden), g.n_head = int(m.heads), g.vocab_size = int(m.vocab);
        g.seq_len = int(m.seq);
        // The GEMM backend a run takes by default (kernels.gemm auto).
        const CpuBackend<float> backend(cpu::GemmConfig{configure_gemm("auto").backend});
        block_s = measure_model_costs(g, micro, m.seq, 5, DType::kF32, backend).blocks[1].seconds;
        plan::ClusterSpec here;
        here.peak_flops_32 = here.peak_flops_16 = h.peak_gflops_32 * 1e9;
        here.gemm_max = h.gemm_max;
        here.gemm_half_flops = h.gemm_half_gflop * 1e9;
        plan::ModelShape dense = m;
        dense.experts = 0;
        plan::Layout one;
        one.micro = micro;
        one.precision = "f32";
        const double gemm = 3 * plan::layer_gemm_s(dense, here, one, 0);
        const double bytes = 3 * plan::loom_block_record_bytes(dense, one, 0);
        if (block_s > 1.05 * gemm) {
          elementwise_gbps = bytes / (block_s - gemm) / 1e9;
        } else {
          std::fprintf(stderr,
                       "loom: plan --calibrate: the block ran in %.4f s, within 5%% of its GEMMs' "
                       "%.4f s as predicted from the sgemm points: its non-GEMM rate is not "
                       "measurable; the memory bandwidth stands in for it\n",
                       block_s, gemm);
        }
      }
    } catch (const std::exception& e) {
      // The others would wait in the barrier: end the job with the reason.
      if (world->size() == 1) throw;
      rt.abort(e.what());
    }
  world->barrier()->wait();
  const Topology& topo = rt.topology();
  int same = -1, other = -1;
  for (int r = 1; r < world->size(); ++r) {
    const bool here = topo.host_of[static_cast<size_t>(r)] == topo.host_of[0];
    if (here && same < 0) same = r;
    if (!here && other < 0) other = r;
  }
  nlohmann::json node = measure_link(*world, same), cluster = measure_link(*world, other);
  if (world->rank() != 0) return;
  nlohmann::json measured = {{"node_link", !node.is_null()}, {"cluster_link", !cluster.is_null()}};
  // Without a second rank on the host, the link is a copy through memory;
  // without a second host, the cluster link is the host's.
  if (node.is_null()) node = {{"bandwidth_GBps", h.memory_bandwidth_gbps / 2}, {"latency_us", 1}};
  if (cluster.is_null()) cluster = node;
  nlohmann::json points = nlohmann::json::array();
  for (const GemmPoint& p : h.points)
    points.push_back({{"m", p.m}, {"n", p.n}, {"k", p.k}, {"gflops", p.gflops}});
  measured["threads"] = threads.threads;
  measured["bf16_matmul_tflops"] = h.peak_gflops_16 / 1e3;
  if (block_s > 0)
    measured["block"] = {
        {"micro_batch", micro}, {"seconds", block_s}, {"elementwise_GBps", elementwise_gbps}};
  measured["sgemm"] = points;
  const nlohmann::json out = {
      {"name", "calibrated"},
      {"description",
       format("measured by loom plan --calibrate: {} ({}), a device is one rank of {} threads, {} "
              "ranks on a host, {} hosts",
              cpu_model(), cpu_isa(), threads.threads, rt.node_size(), topo.hosts())},
      {"gpus_per_node", rt.node_size()},
      {"gpu",
       {{"name", cpu_model()},
        {"memory_bytes", h.memory_bytes},
        {"reserved_bytes", 0.1 * h.memory_bytes},
        // A 16-bit run's GEMMs take the sgemm unless kernels.gemm_inputs is 16bit.
        {"peak_tflops_16bit", h.peak_gflops_32 / 1e3},
        {"peak_tflops_32bit", h.peak_gflops_32 / 1e3},
        {"memory_bandwidth_GBps", h.memory_bandwidth_gbps},
        {"elementwise_GBps", elementwise_gbps > 0 ? elementwise_gbps : h.memory_bandwidth_gbps},
        {"gemm_efficiency", {{"max", h.gemm_max}, {"half_at_gflop", h.gemm_half_gflop}}}}},
      {"links", {{"node", node}, {"cluster", cluster}}},
      {"measured", measured}};
  plan::parse_cluster(out, a.calibrate);  // what it wrote, the planner reads
  write_file_atomic(a.calibrate, out.dump(2) + "\n");
  std::printf(
      "loom: plan --calibrate %s: %s; sgemm peak %.0f GFLOP/s (bf16 matmul %.0f), efficiency "
      "%.2f x F / (F + %.3g GFLOP), memory %.1f GB/s, elementwise %.1f GB/s%s; node link %.2f "
      "GB/s, %.1f us%s; cluster link %.2f GB/s, %.1f us%s\n",
      a.calibrate.c_str(), cpu_model().c_str(), h.peak_gflops_32, h.peak_gflops_16, h.gemm_max,
      h.gemm_half_gflop, h.memory_bandwidth_gbps, out["gpu"]["elementwise_GBps"].get<double>(),
      block_s > 0
          ? format(" (a block of {} in {} ms)", a.model, std::round(block_s * 1e4) / 10).c_str()
          : " (no --model: memory's)",
      node["bandwidth_GBps"].get<double>(), node["latency_us"].get<double>(),
      measured["node_link"] ? "" : " (one rank: not measured)",
      cluster["bandwidth_GBps"].get<double>(), cluster["latency_us"].get<double>(),
      measured["cluster_link"] ? "" : " (one host: the node link's)");
}

}  // namespace

void add_plan_command(CLI::App& app) {
  auto a = std::make_shared<PlanArgs>();
  CLI::App* cmd = app.add_subcommand(
      "plan",
      "Predict memory per device and step time of every layout of a model on a cluster, and "
      "rank those that fit by tokens/s (docs/plan.md)");
  cmd->add_option("--model", a->model, "A loom config, or its model section alone");
  cmd->add_option("--cluster", a->cluster, "A cluster file (configs/clusters/)");
  cmd->add_option("--gpus", a->gpus, "Devices in the job")->check(CLI::PositiveNumber);
  cmd->add_option("--global-batch", a->batch, "Sequences per optimizer step")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--calibrate", a->calibrate,
                  "Measure this host (and, under mpirun, the links between its ranks and hosts) "
                  "and write a cluster file here; --model adds its GEMM shapes");
  cmd->add_option("--top", a->top, "Layouts shown (default 10)")->check(CLI::PositiveNumber);
  cmd->add_option("--layout", a->layout,
                  "Keys to fix, the rest searched: tp=8,pp=35,dp=1,cp=1,ep=1,v=3,micro=1,zero=1,"
                  "recompute=selective,sp=true,precision=bf16,schedule=interleaved");
  cmd->add_option("--engine", a->engine,
                  "What runs the layouts: loom (default), or megatron-2021 (the engine of "
                  "Megatron-LM's published 2021 runs, for comparing with them)");
  cmd->add_flag("--json", a->json, "One JSON object per layout, a line each");
  cmd->callback([a] {
    if (!a->calibrate.empty()) {
      calibrate(*a);
      return;
    }
    for (auto [value, flag] :
         {std::pair{!a->model.empty(), "--model"}, std::pair{!a->cluster.empty(), "--cluster"},
          std::pair{a->gpus > 0, "--gpus"}, std::pair{a->batch > 0, "--global-batch"}})
      LOOM_CHECK_KIND(kConfig, value, "loom plan: {} is required (or --calibrate FILE)", flag);
    const nlohmann::json mj = nlohmann::json::parse(read_file(a->model), nullptr, false);
    LOOM_CHECK_KIND(kConfig, !mj.is_discarded(), "{}: not JSON", a->model);
    const plan::ModelShape m = plan::parse_model(mj, a->model);
    const plan::ClusterSpec c = plan::read_cluster(a->cluster);
    plan::PlanOptions o;
    o.gpus = a->gpus;
    o.batch = a->batch;
    o.top = a->top;
    o.constraint = plan::parse_layout(a->layout);
    o.engine = plan::engine_named(a->engine);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<plan::Estimate> best = plan::search(m, c, o);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (a->json) {
      for (const plan::Estimate& e : best) std::printf("%s\n", plan::to_json(e).dump().c_str());
      return;
    }
    std::printf(
        "loom: plan %s (%.2fB parameters, %ld layers, n_embd %ld, seq %ld) on %d x %s "
        "(%s), global batch %ld\n",
        a->model.c_str(), m.params() / 1e9, long(m.n_layer), long(m.hidden), long(m.seq), a->gpus,
        c.device.c_str(), c.name.c_str(), long(a->batch));
    print_table(best);
    std::printf("loom: %ld layouts estimated in %.2f s; the best %zu that fit shown\n",
                long(plan::layouts_considered()), seconds, best.size());
  });
}

}  // namespace loom::app
