#include "loom/train/metrics.h"

#include "loom/train/profile.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

std::string format_duration(double s) {
  int64_t t = static_cast<int64_t>(std::max(0.0, s) + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(t / 3600), long(t / 60 % 60));
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", long(t / 60), long(t % 60));
  return buf;
}

void MetricsLog::open(const std::string& path, int64_t keep_through) {
  std::string kept;
  std::error_code ec;
  if (keep_through > 0 && fs::exists(path, ec)) {
    std::istringstream lines(read_file(path));
    for (std::string line; std::getline(lines, line);) {
      json j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= keep_through) kept += line + "\n";
    }
  }
  write_file_atomic(path, kept);
  out_.open(path, std::ios::app);
  LOOM_CHECK_KIND(kIo, out_.good(), "{}: cannot open for writing", path);
}

void MetricsLog::write(const StepResult& r) {
  if (!out_.is_open()) return;
  json m = json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    m[std::string(mem_category_name(static_cast<MemCategory>(c)))] = r.mem.peak[c];
  json j = {{"step", r.step},
            {"loss", r.loss},
            {"lr", r.lr},
            {"grad_norm", r.grad_norm},
            {"loss_scale", r.loss_scale},
            {"skipped_steps", r.skipped_steps},
            {"tokens_per_s", r.tokens_per_s},
            {"mfu", r.mfu},
            {"mem", m},
            {"time",
             {{"step", r.t_step},
              {"forward", r.t_forward},
              {"backward", r.t_backward},
              {"recompute", r.t_recompute},
              {"optimizer", r.t_optimizer},
              {"comm", r.t_comm},
              {"comm_exposed", r.t_comm_exposed},
              {"all_to_all", r.t_all_to_all},
              {"bubble", r.t_bubble},
              {"p2p_wait", r.t_p2p_wait}}}};
  j["bubble_fraction"] = r.bubble_fraction;
  if (r.context)
    j["context"] = {{"comm", r.t_context_comm},
                    {"exposed", r.t_context_exposed},
                    {"sent_bytes", r.context_sent_bytes},
                    {"attention", r.context_attention}};
  if (r.val_loss) j["val_loss"] = *r.val_loss;
  j["comm_bytes"] = r.comm_bytes;
  if (!r.compression.empty() && r.compression != "none")
    j["compression"] = {
        {"type", r.compression},
        {"phase", r.local_step   ? "local"
                  : r.compressed ? "compressed"
                                 : "warmup"},
        {"sent_bytes", r.compressed_bytes},
        // A local step sends nothing: no ratio.
        {"ratio", r.compressed_bytes > 0 ? json(r.uncompressed_bytes / r.compressed_bytes)
                  : r.local_step         ? json(nullptr)
                                         : json(1.0)},
        {"error_norm", r.error_norm}};
  if (!r.comm_groups.empty()) {
    json groups = json::object();
    for (const CommTotals& g : r.comm_groups)
      groups[g.group] = {{"ops", g.ops}, {"bytes", g.sent_bytes}, {"seconds", g.seconds}};
    j["comm_groups"] = groups;
  }
  if (!r.rank_compute.empty())
    j["ranks"] = {{"compute", r.rank_compute}, {"wait", r.rank_wait}, {"score", r.rank_score}};
  if (!r.rank_mem.empty()) j["imbalance"] = step_imbalance(r.rank_compute, r.rank_mem, r.rank_sent);
  if (r.restart > 0)
    j["restart"] = {{"count", r.restart}, {"cause", r.restart_cause}, {"world", r.world}};
  j["gemm_backend"] = r.gemm_backend;
  j["gemm_path"] = r.gemm_path;
  j["peak_gflops"] = r.peak_gflops;
  if (!r.moe.empty()) {
    json moe = json::array();
    for (const MoeLayerStats& l : r.moe)
      moe.push_back({{"layer", l.layer},
                     {"imbalance", l.imbalance},
                     {"cv", l.cv},
                     {"dropped", l.dropped},
                     {"aux_loss", l.aux},
                     {"z_loss", l.z},
                     {"load", l.load}});
    j["moe"] = moe;
  }
  out_ << j.dump() << "\n";
  out_.flush();
}

void Progress::show(const StepResult& r, double elapsed, int64_t done) const {
  if (quiet_) return;
  double eta = elapsed / static_cast<double>(done) * static_cast<double>(total_ - r.step);
  std::string val = r.val_loss ? format(" | val {}", std::round(*r.val_loss * 1e4) / 1e4) : "";
  if (tty_) {
    const int width = 24;
    int filled = static_cast<int>(width * r.step / total_);
    std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
    std::printf("\r[%s] step %ld/%ld | loss %.4f%s | %.0f tok/s | ETA %s   ", bar.c_str(),
                long(r.step), long(total_), r.loss, val.c_str(), r.tokens_per_s,
                format_duration(eta).c_str());
    if (r.step == total_) std::printf("\n");
    std::fflush(stdout);
  } else if (r.step % every_ == 0 || r.step == total_ || r.val_loss) {
    std::printf("step %ld/%ld loss %.4f%s lr %.3g grad_norm %.3f tok/s %.0f mfu %.3f eta %s\n",
                long(r.step), long(total_), r.loss, val.c_str(), r.lr, r.grad_norm, r.tokens_per_s,
                r.mfu, format_duration(eta).c_str());
    std::fflush(stdout);
  }
}

void Progress::summary(const std::vector<StepResult>& results, double elapsed, double peak_gflops,
                       const std::string& out_dir) const {
  if (results.empty() || quiet_) return;
  std::vector<double> tps;
  for (const auto& r : results) tps.push_back(r.tokens_per_s);
  std::sort(tps.begin(), tps.end());
  std::optional<double> val;
  for (const auto& r : results)
    if (r.val_loss) val = r.val_loss;
  std::printf("\nloom: done in %s: loss %.4f -> %.4f", format_duration(elapsed).c_str(),
              results.front().loss, results.back().loss);
  if (val) std::printf(" (val %.4f)", *val);
  std::printf(", median %.0f tokens/s, MFU %.1f%% of %.0f GFLOP/s\n", tps[tps.size() / 2],
              100.0 * results.back().mfu, peak_gflops);
  if (!results.back().moe.empty()) {
    const MoeLayerStats* worst = &results.back().moe.front();
    for (const MoeLayerStats& l : results.back().moe)
      if (l.imbalance > worst->imbalance) worst = &l;
    std::printf(
        "loom: mixture of experts at the last step: worst load imbalance %.2f (block %d: "
        "busiest expert over the mean; cv %.2f, %.1f%% dropped)\n",
        worst->imbalance, worst->layer, worst->cv, 100.0 * worst->dropped);
  }
  if (results.back().skipped_steps > 0) {
    const bool fp16 = results.back().fp16;
    std::printf("loom: %ld steps skipped for %s\n", long(results.back().skipped_steps),
                fp16 ? "fp16 overflows (dynamic loss scaling)"
                     : "non-finite gradients (train.on_nonfinite skip)");
  }
  if (!out_dir.empty()) {
    std::error_code ec;
    const bool trace = std::filesystem::exists(std::filesystem::path(out_dir) / "trace.json", ec);
    std::printf("loom: run folder %s (metrics.jsonl, config.resolved.json%s)\n", out_dir.c_str(),
                trace ? ", trace.json" : "");
  }
  std::fflush(stdout);
}

}  // namespace loom
