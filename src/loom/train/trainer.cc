#include "loom/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/profile/gemm_peak.h"
#include "loom/checkpoint/checkpoint.h"
#include "loom/io/fs.h"
#include "loom/infer/generate.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string format_duration(double s) {
  int64_t t = static_cast<int64_t>(std::max(0.0, s) + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", long(t / 3600), long(t / 60 % 60));
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", long(t / 60), long(t % 60));
  return buf;
}

// The tokenizer named in meta.json beside a token file, if there is one.
std::unique_ptr<Tokenizer> tokenizer_for(const std::string& token_path) {
  if (token_path.empty()) return nullptr;
  fs::path meta = fs::path(token_path).parent_path() / "meta.json";
  std::error_code ec;
  if (!fs::exists(meta, ec)) return nullptr;
  json j = json::parse(read_file(meta.string()), nullptr, false);
  if (j.is_discarded() || !j.contains("tokenizer") || !j["tokenizer"].is_string()) return nullptr;
  return make_tokenizer(j["tokenizer"].get<std::string>());
}

}  // namespace

Trainer::Trainer(Config config, RunOptions options, ThreadConfig threads)
    : config_(std::move(config)),
      options_(std::move(options)),
      threads_(threads),
      // ZeRO decides which full buffers the model holds and how units pad.
      model_(config_.model,
             ZeroEngine::storage(config_.zero, options_.dp_group ? options_.dp_group->size() : 1)) {
  const GptConfig& m = config_.model;
  const uint64_t seed = config_.train.seed;
  if (config_.data.synthetic) {
    train_data_ = make_synthetic_source(seed, m.vocab_size);
    val_data_ = make_synthetic_source(seed + 1, m.vocab_size);
  } else {
    const Sampling sampling =
        config_.data.sampling == "sequential" ? Sampling::kSequential : Sampling::kRandom;
    const uint64_t per_step = static_cast<uint64_t>(config_.train_batch_size);
    train_data_ = make_token_file_source(config_.data.train, "data.train", seed, m.vocab_size,
                                         m.seq_len, sampling, per_step);
    if (!config_.data.val.empty())
      val_data_ = make_token_file_source(config_.data.val, "data.val", seed, m.vocab_size,
                                         m.seq_len, sampling, per_step);
    tokenizer_ = tokenizer_for(config_.data.train);
  }
  if (config_.train.eval_every > 0 && !val_data_)
    LOOM_FAIL(kConfig, "train.eval_every is {} but there is no validation data (set data.val)",
              config_.train.eval_every);
  LOOM_CHECK_KIND(kConfig, options_.resume.empty() || options_.init_from.empty(),
                  "--resume and --init-from exclude each other");
  if (options_.dp_group) {
    dp_rank_ = options_.dp_group->rank();
    dp_size_ = options_.dp_group->size();
    writer_ = dp_rank_ == 0;
    if (!writer_) options_.quiet = true;
    LOOM_CHECK_KIND(kConfig, config_.data_parallel == dp_size_,
                    "the config's data-parallel size {} differs from the group's {}",
                    config_.data_parallel, dp_size_);
  }
  zero_ = std::make_unique<ZeroEngine>(model_, options_.dp_group, config_.zero, config_.optimizer);
  if (writer_ && !options_.out_dir.empty() && options_.resume.empty()) {
    std::error_code ec;
    if (fs::exists(options_.out_dir, ec) && !fs::is_empty(options_.out_dir, ec) &&
        !options_.overwrite)
      LOOM_FAIL(kIo,
                "run folder {} already exists and is not empty (choose another --out, or "
                "pass --overwrite)",
                options_.out_dir);
  }
  zero_->init_params(seed);
  const bool loading = !options_.init_from.empty() || !options_.resume.empty();
  // Stage 3 loads into full parameters, then keeps this rank's slices.
  if (loading) zero_->gather_full_params();
  if (!options_.init_from.empty()) load_hf_weights(options_.init_from, model_);
  if (!options_.resume.empty()) {
    std::string dir = resolve_checkpoint(options_.resume, checkpoint_root());
    // The file holds whole moments; the engine keeps this rank's slices.
    const size_t n = static_cast<size_t>(model_.num_params());
    std::vector<float> m(n), v(n);
    TrainerState st = load_checkpoint(dir, model_, m.data(), v.data());
    zero_->load_moments(m.data(), v.data());
    LOOM_CHECK_KIND(kConfig, st.seed == seed,
                    "{}: saved with train.seed {} but the config has {}; a resumed run must keep "
                    "its seed to see the same data",
                    dir, st.seed, seed);
    step_ = st.step;
  }
  if (loading) zero_->release_full_params(true);
  acts_ = model_.make_activations(config_.micro_batch, m.seq_len);
  const size_t bt = static_cast<size_t>(config_.micro_batch * m.seq_len);
  inputs_.resize(bt);
  targets_.resize(bt);
  peak_gflops_ = config_.log.peak_gflops > 0 ? config_.log.peak_gflops : quick_peak_gflops();
  tty_ = !options_.quiet && isatty(STDOUT_FILENO);
}

std::vector<float> Trainer::gather_params() {
  const bool gathered = zero_->full_params_gathered();
  zero_->gather_full_params();
  std::vector<float> out(model_.params(), model_.params() + model_.num_params());
  if (!gathered) zero_->release_full_params(false);
  return out;
}

MemStats Trainer::peak_memory_over_ranks() {
  MemStats mem = memory_tracker().stats();
  if (!options_.dp_group) return mem;
  const std::vector<size_t> all =
      all_gather_words(*options_.dp_group, mem.peak.data(), kNumMemCategories);
  for (int r = 0; r < dp_size_; ++r)
    for (int c = 0; c < kNumMemCategories; ++c)
      mem.peak[c] = std::max(mem.peak[c], all[static_cast<size_t>(r * kNumMemCategories + c)]);
  return mem;
}

StepResult Trainer::train_step() {
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  // metrics.jsonl's peaks are the step's own (training and evaluation),
  // not setup's or a checkpoint's temporaries.
  memory_tracker().reset_peaks();
  StepResult r;
  r.step = step_ + 1;
  const int64_t B = config_.micro_batch, Tn = config_.model.seq_len;
  const int64_t accum = config_.grad_accum;
  zero_->zero_grads();
  double loss_sum = 0;
  for (int64_t micro = 0; micro < accum; ++micro) {
    // Global sample index: the step's train_batch_size samples are numbered
    // micro-batch by micro-batch, data-parallel rank within each, so every
    // layout sees the same samples with the same dropout masks.
    const int64_t first = (micro * dp_size_ + dp_rank_) * B;
    StepContext ctx{config_.train.seed, static_cast<uint64_t>(step_), static_cast<uint64_t>(first),
                    true};
    train_data_->fill(ctx.step, ctx.sample0, B, Tn, inputs_.data(), targets_.data());
    auto t0 = clock::now();
    zero_->begin_micro_batch(true, micro == accum - 1);
    loss_sum += model_.forward(acts_, inputs_.data(), targets_.data(), ctx);
    r.t_forward += seconds_since(t0);
    t0 = clock::now();
    model_.backward(acts_, 1.0 / static_cast<double>(accum));
    r.t_backward += seconds_since(t0);
    // Waits for what is left of this micro-batch's gradient reduction.
    zero_->end_micro_batch();
  }
  if (options_.dp_group) {
    // The step's loss over the global batch: the mean of the ranks' means.
    float mean = static_cast<float>(loss_sum);
    options_.dp_group->all_reduce(&mean, &mean, 1, DType::kF32, ReduceOp::kAvg)->wait();
    loss_sum = mean;
  }
  auto t0 = clock::now();
  r.grad_norm = zero_->clip_grad_norm(config_.gradient_clipping);
  r.lr = learning_rate(config_.scheduler, config_.optimizer.lr, step_);
  zero_->step(r.lr, step_ + 1);
  r.t_optimizer = seconds_since(t0);
  const CommStats cs = zero_->take_stats();
  r.t_comm = cs.comm_s;
  r.t_comm_exposed = cs.exposed_s;
  r.comm_bytes = cs.bytes;
  r.loss = loss_sum / static_cast<double>(accum);
  r.t_step = seconds_since(t_start);
  double tokens = static_cast<double>(config_.train_batch_size * Tn);
  r.tokens_per_s = tokens / r.t_step;
  r.mfu = model_.flops_per_token() * r.tokens_per_s / (peak_gflops_ * 1e9);
  ++step_;
  return r;
}

double Trainer::evaluate() {
  LOOM_CHECK(val_data_ != nullptr, "evaluate() without validation data");
  const int64_t B = config_.micro_batch, Tn = config_.model.seq_len;
  // The validation set is train.eval_steps global batches (step 0, samples
  // 0 .. eval_steps x train_batch_size), each split over micro-batches and
  // ranks as a training batch is, so every layout evaluates the same samples,
  // and every rank runs the same number of forwards (at ZeRO stage 3 a
  // forward is collective: it gathers each unit).
  float sum_count[2] = {0, 0};
  for (int64_t s = 0; s < config_.train.eval_steps; ++s) {
    for (int64_t micro = 0; micro < config_.grad_accum; ++micro) {
      const int64_t first = s * config_.train_batch_size + (micro * dp_size_ + dp_rank_) * B;
      StepContext ctx{config_.train.seed, 0, static_cast<uint64_t>(first), false};
      val_data_->fill(0, ctx.sample0, B, Tn, inputs_.data(), targets_.data());
      zero_->begin_micro_batch(false, false);
      sum_count[0] +=
          static_cast<float>(model_.forward(acts_, inputs_.data(), targets_.data(), ctx));
      zero_->end_micro_batch();
      sum_count[1] += 1;
    }
  }
  if (options_.dp_group)
    options_.dp_group->all_reduce(sum_count, sum_count, 2, DType::kF32, ReduceOp::kSum)->wait();
  return sum_count[0] / sum_count[1];
}

std::string Trainer::sample(const std::string& prompt, int64_t n, double temperature, int64_t top_k,
                            uint64_t seed) {
  LOOM_CHECK_KIND(kUnsupported, tokenizer_ != nullptr,
                  "sampling needs the data's tokenizer (meta.json beside data.train)");
  LOOM_CHECK(model_.params() != nullptr,
             "sampling at ZeRO stage 3 needs the full parameters: gather them on every rank "
             "first (ZeroEngine::gather_full_params)");
  std::vector<uint32_t> ids = tokenizer_->encode(prompt.empty() ? "\n" : prompt);
  return tokenizer_->decode(generate(model_, ids, SampleOptions{n, temperature, top_k, seed}));
}

std::string Trainer::checkpoint_root() const {
  if (!config_.checkpoint.dir.empty()) return config_.checkpoint.dir;
  return options_.out_dir.empty() ? std::string()
                                  : (fs::path(options_.out_dir) / "checkpoints").string();
}

void Trainer::open_run_folder() {
  fs::create_directories(options_.out_dir);
  write_file_atomic((fs::path(options_.out_dir) / "config.resolved.json").string(),
                    config_.resolved.dump(2) + "\n");
  std::string path = (fs::path(options_.out_dir) / "metrics.jsonl").string();
  // A resumed run keeps the metrics of the steps its checkpoint covers and
  // drops any written after it by the interrupted run.
  std::string kept;
  std::error_code ec;
  if (step_ > 0 && fs::exists(path, ec)) {
    std::istringstream lines(read_file(path));
    for (std::string line; std::getline(lines, line);) {
      json j = json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.value("step", int64_t{0}) <= step_) kept += line + "\n";
    }
  }
  write_file_atomic(path, kept);
  metrics_.open(path, std::ios::app);
  LOOM_CHECK_KIND(kIo, metrics_.good(), "{}: cannot open for writing", path);
}

void Trainer::save(double lr) {
  // Moments as the whole layout: a shard per rank is gathered first (by every
  // rank, since the gather is collective); rank 0 writes.
  // At stage 3 the parameters are gathered too.
  std::vector<float> m, v;
  zero_->gather_moments(m, v);
  zero_->gather_full_params();
  std::string dir;
  if (writer_) {
    TrainerState st{step_, lr, 1.0, config_.train.seed, tokenizer_ ? tokenizer_->name() : ""};
    dir = save_checkpoint(checkpoint_root(), model_, m.data(), v.data(), st, config_.resolved,
                          config_.checkpoint.keep_last);
  }
  zero_->release_full_params(false);
  if (!writer_) return;
  if (!options_.quiet && !tty_) std::printf("loom: checkpoint %s\n", dir.c_str());
}

void Trainer::write_metrics(const StepResult& r) {
  if (!metrics_.is_open()) return;
  json m = json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    m[std::string(mem_category_name(static_cast<MemCategory>(c)))] = r.mem.peak[c];
  json j = {{"step", r.step},
            {"loss", r.loss},
            {"lr", r.lr},
            {"grad_norm", r.grad_norm},
            {"loss_scale", 1.0},
            {"tokens_per_s", r.tokens_per_s},
            {"mfu", r.mfu},
            {"mem", m},
            {"time",
             {{"step", r.t_step},
              {"forward", r.t_forward},
              {"backward", r.t_backward},
              {"optimizer", r.t_optimizer},
              {"comm", r.t_comm},
              {"comm_exposed", r.t_comm_exposed},
              {"bubble", 0.0}}}};
  if (r.val_loss) j["val_loss"] = *r.val_loss;
  j["comm_bytes"] = r.comm_bytes;
  metrics_ << j.dump() << "\n";
  metrics_.flush();
}

void Trainer::show_progress(const StepResult& r, double elapsed, int64_t done) {
  if (options_.quiet) return;
  const int64_t total = config_.train.steps;
  double eta = elapsed / static_cast<double>(done) * static_cast<double>(total - r.step);
  std::string val = r.val_loss ? format(" | val {}", std::round(*r.val_loss * 1e4) / 1e4) : "";
  if (tty_) {
    const int width = 24;
    int filled = static_cast<int>(width * r.step / total);
    std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
    std::printf("\r[%s] step %ld/%ld | loss %.4f%s | %.0f tok/s | ETA %s   ", bar.c_str(),
                long(r.step), long(total), r.loss, val.c_str(), r.tokens_per_s,
                format_duration(eta).c_str());
    if (r.step == total) std::printf("\n");
    std::fflush(stdout);
  } else if (r.step % config_.log.every == 0 || r.step == total || r.val_loss) {
    std::printf("step %ld/%ld loss %.4f%s lr %.3g grad_norm %.3f tok/s %.0f mfu %.3f eta %s\n",
                long(r.step), long(total), r.loss, val.c_str(), r.lr, r.grad_norm, r.tokens_per_s,
                r.mfu, format_duration(eta).c_str());
    std::fflush(stdout);
  }
}

std::vector<StepResult> Trainer::run() {
  if (writer_ && !options_.out_dir.empty()) open_run_folder();
  const GptConfig& m = config_.model;
  if (!options_.quiet) {
    std::printf("loom: %s\n", describe(threads_).c_str());
    if (!threads_.warning.empty()) std::printf("loom: warning: %s\n", threads_.warning.c_str());
    std::printf(
        "loom: model GPT-2 n_layer %d n_embd %d n_head %d vocab %d (padded %d) seq_len %d: "
        "%.2fM parameters\n",
        m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.padded_vocab(), m.seq_len,
        double(model_.num_params()) / 1e6);
    std::printf(
        "loom: data %s; batch %ld = micro-batch %ld x accumulation %ld x data-parallel "
        "%d\n",
        train_data_->describe().c_str(), long(config_.train_batch_size), long(config_.micro_batch),
        long(config_.grad_accum), dp_size_);
    describe_zero();
    std::fflush(stdout);
  }
  std::vector<StepResult> results;
  const auto t0 = std::chrono::steady_clock::now();
  if (step_ > 0 && !options_.quiet)
    std::printf("loom: resumed from %s at step %ld\n", options_.resume.c_str(), long(step_));
  const int64_t total = config_.train.steps, every = config_.checkpoint.every;
  const bool checkpoints = (writer_ || sharded()) && every > 0 && !checkpoint_root().empty();
  while (step_ < total) {
    StepResult r = train_step();
    const int64_t eval = config_.train.eval_every;
    if (eval > 0 && (r.step % eval == 0 || r.step == total)) r.val_loss = evaluate();
    r.mem = peak_memory_over_ranks();
    write_metrics(r);
    results.push_back(r);
    show_progress(r, seconds_since(t0), static_cast<int64_t>(results.size()));
    if (checkpoints && (r.step % every == 0 || r.step == total)) save(r.lr);
  }
  // The closing sample decodes on rank 0 from full parameters; at stage 3
  // every rank takes part in gathering them.
  const bool sampling = config_.train.sample_tokens > 0 && tokenizer_ && !results.empty();
  if (sampling) zero_->gather_full_params();
  if (!options_.quiet) print_summary(results, seconds_since(t0));
  if (sampling) zero_->release_full_params(false);
  return results;
}

void Trainer::describe_zero() const {
  const ZeroConfig& z = config_.zero;
  if (options_.dp_group || z.stage > 0) {
    std::printf("loom: data parallel over %d ranks, ZeRO stage %d (%s), shard %.2fM elements",
                dp_size_, z.stage,
                z.stage == 0   ? "replicated"
                : z.stage == 1 ? "optimizer state sharded"
                : z.stage == 2 ? "optimizer state and gradients sharded"
                               : "optimizer state, gradients and parameters sharded",
                double(zero_->shard_elements()) / 1e6);
    if (z.stage <= 1 && options_.dp_group)
      std::printf(", gradient buckets of %ld elements, overlap %s", long(z.reduce_bucket_size),
                  z.overlap_comm ? "on" : "off");
    if (z.stage == 3)
      std::printf(", prefetch %ld elements, units of <= %ld elements stay gathered",
                  long(z.prefetch_bucket_size), long(z.persistence_threshold));
    std::printf("\n");
  }
  if (z.offload_device == "cpu")
    std::printf(
        "loom: offload_optimizer.device cpu: this build computes on the CPU, so the optimizer "
        "state is in host memory already (the same as none)\n");
  if (z.offload_device == "nvme")
    std::printf(
        "loom: offload_optimizer.device nvme: AdamW moments (%.1f MB per rank) in a "
        "memory-mapped file under %s, paged in and out unit by unit\n",
        double(zero_->shard_elements()) * 8.0 / 1e6, z.nvme_path.c_str());
  if (z.offload_device == "nvme" && is_tmpfs(z.nvme_path))
    std::printf(
        "loom: warning: %s is on tmpfs, which is memory: the offloaded optimizer state "
        "stays in RAM there\n",
        z.nvme_path.c_str());
  if (z.offload_device != "none" && (z.pin_memory || z.buffer_count != 4))
    std::printf(
        "loom: offload_optimizer.pin_memory and buffer_count have no effect in this build\n");
}

void Trainer::print_summary(const std::vector<StepResult>& results, double elapsed) {
  if (results.empty()) return;
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
              100.0 * results.back().mfu, peak_gflops_);
  if (!options_.out_dir.empty())
    std::printf("loom: run folder %s (metrics.jsonl, config.resolved.json)\n",
                options_.out_dir.c_str());
  const TrainConfig& t = config_.train;
  if (t.sample_tokens > 0 && tokenizer_) {
    std::string text =
        sample(t.sample_prompt, t.sample_tokens, t.sample_temperature, t.sample_top_k, t.seed);
    std::printf("\n--- sample (%ld tokens, temperature %.2f) ---\n%s%s\n---\n",
                long(t.sample_tokens), t.sample_temperature, t.sample_prompt.c_str(), text.c_str());
  }
  std::fflush(stdout);
}

}  // namespace loom
