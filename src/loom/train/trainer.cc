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
#include "loom/train/checkpoint.h"
#include "loom/train/fs.h"
#include "loom/train/generate.h"

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
      // ZeRO shards the flat buffers into equal pieces, one per rank.
      model_(config_.model,
             options_.dp_group && config_.zero.stage >= 1 ? options_.dp_group->size() : 1) {
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
    buckets_ =
        std::make_unique<GradBuckets>(model_.layout(), options_.dp_group,
                                      config_.zero.reduce_bucket_size, config_.zero.overlap_comm);
  }
  if (sharded()) {
    const int64_t shard = model_.buffer_elements() / dp_size_;
    optimizer_ = std::make_unique<AdamW>(model_.layout(), config_.optimizer, dp_rank_ * shard,
                                         (dp_rank_ + 1) * shard);
  } else {
    optimizer_ = std::make_unique<AdamW>(model_.layout(), config_.optimizer);
  }
  if (writer_ && !options_.out_dir.empty() && options_.resume.empty()) {
    std::error_code ec;
    if (fs::exists(options_.out_dir, ec) && !fs::is_empty(options_.out_dir, ec) &&
        !options_.overwrite)
      LOOM_FAIL(kIo,
                "run folder {} already exists and is not empty (choose another --out, or "
                "pass --overwrite)",
                options_.out_dir);
  }
  model_.init(seed);
  if (!options_.init_from.empty()) load_hf_weights(options_.init_from, model_);
  if (!options_.resume.empty()) {
    std::string dir = resolve_checkpoint(options_.resume, checkpoint_root());
    TrainerState st;
    if (sharded()) {
      // The file holds whole moments; keep this rank's shard.
      const size_t n = static_cast<size_t>(model_.buffer_elements());
      std::vector<float> m(n), v(n);
      st = load_checkpoint(dir, model_, m.data(), v.data());
      const int64_t b = optimizer_->shard_begin(), e = optimizer_->shard_end();
      std::copy(m.begin() + b, m.begin() + e, optimizer_->exp_avg());
      std::copy(v.begin() + b, v.begin() + e, optimizer_->exp_avg_sq());
    } else {
      st = load_checkpoint(dir, model_, optimizer_->exp_avg(), optimizer_->exp_avg_sq());
    }
    LOOM_CHECK_KIND(kConfig, st.seed == seed,
                    "{}: saved with train.seed {} but the config has {}; a resumed run must keep "
                    "its seed to see the same data",
                    dir, st.seed, seed);
    step_ = st.step;
  }
  acts_ = model_.make_activations(config_.micro_batch, m.seq_len);
  const size_t bt = static_cast<size_t>(config_.micro_batch * m.seq_len);
  inputs_.resize(bt);
  targets_.resize(bt);
  peak_gflops_ = config_.log.peak_gflops > 0 ? config_.log.peak_gflops : quick_peak_gflops();
  tty_ = !options_.quiet && isatty(STDOUT_FILENO);
}

StepResult Trainer::train_step() {
  using clock = std::chrono::steady_clock;
  const auto t_start = clock::now();
  StepResult r;
  r.step = step_ + 1;
  const int64_t B = config_.micro_batch, Tn = config_.model.seq_len;
  const int64_t accum = config_.grad_accum;
  model_.zero_grads();
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
    loss_sum += model_.forward(acts_, inputs_.data(), targets_.data(), ctx);
    r.t_forward += seconds_since(t0);
    t0 = clock::now();
    // Gradients are reduced once, during the last micro-batch's backward.
    const bool reduce = buckets_ && micro == accum - 1;
    if (reduce) buckets_->begin(model_.grads());
    model_.backward(acts_, 1.0 / static_cast<double>(accum),
                    reduce ? [this](int64_t from) { buckets_->ready_from(from); }
                           : std::function<void(int64_t)>());
    r.t_backward += seconds_since(t0);
    if (reduce) {
      BucketStats st = buckets_->finish();
      r.t_comm = st.comm_s;
      r.t_comm_exposed = st.exposed_s;
      r.comm_bytes = st.bytes;
    }
  }
  if (options_.dp_group) {
    // The step's loss over the global batch: the mean of the ranks' means.
    float mean = static_cast<float>(loss_sum);
    options_.dp_group->all_reduce(&mean, &mean, 1, DType::kF32, ReduceOp::kAvg)->wait();
    loss_sum = mean;
  }
  auto t0 = clock::now();
  r.grad_norm = clip_grad_norm(model_.grads(), model_.num_params(), config_.gradient_clipping);
  r.lr = learning_rate(config_.scheduler, config_.optimizer.lr, step_);
  optimizer_->step(model_.params(), model_.grads(), r.lr, step_ + 1);
  r.t_optimizer = seconds_since(t0);
  if (sharded()) {
    // ZeRO stage 1: each rank updated its shard; gather the whole parameters.
    const auto t1 = clock::now();
    const int64_t shard = model_.buffer_elements() / dp_size_;
    WorkPtr w = options_.dp_group->all_gather(model_.params() + dp_rank_ * shard, model_.params(),
                                              static_cast<size_t>(shard), DType::kF32);
    w->wait();
    const double waited = seconds_since(t1);
    r.t_comm += w->seconds();
    r.t_comm_exposed += waited;
    r.comm_bytes += double(dp_size_ - 1) / dp_size_ * double(model_.buffer_elements()) * 4.0;
  }
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
  // A fixed set of validation batches (step 0, samples from i * B), shared
  // out round-robin over the data-parallel ranks.
  float sum_count[2] = {0, 0};
  for (int64_t i = dp_rank_; i < config_.train.eval_steps; i += dp_size_) {
    StepContext ctx{config_.train.seed, 0, static_cast<uint64_t>(i * B), false};
    val_data_->fill(0, ctx.sample0, B, Tn, inputs_.data(), targets_.data());
    sum_count[0] += static_cast<float>(model_.forward(acts_, inputs_.data(), targets_.data(), ctx));
    sum_count[1] += 1;
  }
  if (options_.dp_group)
    options_.dp_group->all_reduce(sum_count, sum_count, 2, DType::kF32, ReduceOp::kSum)->wait();
  return sum_count[0] / sum_count[1];
}

std::string Trainer::sample(const std::string& prompt, int64_t n, double temperature, int64_t top_k,
                            uint64_t seed) {
  LOOM_CHECK_KIND(kUnsupported, tokenizer_ != nullptr,
                  "sampling needs the data's tokenizer (meta.json beside data.train)");
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
  std::vector<float> m, v;
  const float* exp_avg = optimizer_->exp_avg();
  const float* exp_avg_sq = optimizer_->exp_avg_sq();
  if (sharded()) {
    const size_t n = static_cast<size_t>(model_.buffer_elements()), shard = n / dp_size_;
    m.resize(n), v.resize(n);
    options_.dp_group->all_gather(optimizer_->exp_avg(), m.data(), shard, DType::kF32)->wait();
    options_.dp_group->all_gather(optimizer_->exp_avg_sq(), v.data(), shard, DType::kF32)->wait();
    exp_avg = m.data(), exp_avg_sq = v.data();
  }
  if (!writer_) return;
  TrainerState st{step_, lr, 1.0, config_.train.seed, tokenizer_ ? tokenizer_->name() : ""};
  std::string dir = save_checkpoint(checkpoint_root(), model_, exp_avg, exp_avg_sq, st,
                                    config_.resolved, config_.checkpoint.keep_last);
  if (!options_.quiet && !tty_) std::printf("loom: checkpoint %s\n", dir.c_str());
}

void Trainer::write_metrics(const StepResult& r) {
  if (!metrics_.is_open()) return;
  MemStats mem = memory_tracker().stats();
  json m = json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    m[std::string(mem_category_name(static_cast<MemCategory>(c)))] = mem.peak[c];
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
    if (buckets_)
      std::printf("loom: data parallel over %d ranks: %ld gradient buckets, overlap %s\n", dp_size_,
                  long(buckets_->num_buckets()), config_.zero.overlap_comm ? "on" : "off");
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
    write_metrics(r);
    results.push_back(r);
    show_progress(r, seconds_since(t0), static_cast<int64_t>(results.size()));
    if (checkpoints && (r.step % every == 0 || r.step == total)) save(r.lr);
  }
  if (!options_.quiet) print_summary(results, seconds_since(t0));
  return results;
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
