#include "loom/train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <future>
#include <iostream>
#include <sstream>
#include <tuple>

#include "loom/checkpoint/checkpoint.h"
#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/fault.h"
#include "loom/core/rng.h"
#include "loom/infer/generate.h"
#include "loom/io/fs.h"
#include "loom/optim/lr_schedule.h"
#include "loom/profile/gemm_peak.h"
#include "loom/report/report.h"
#include "loom/train/device.h"
#include "loom/train/whole_model.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kAssembleTag = 7101;   // checkpoint assembly's point-to-point messages
constexpr int64_t kTraceSteps = 20;  // steps a trace keeps (the first ones)

// The tokenizer named in meta.json beside a token file, if there is one.
std::unique_ptr<Tokenizer> tokenizer_for(const std::string& token_path) {
  if (token_path.empty()) return nullptr;
  fs::path meta = fs::path(token_path).parent_path() / "meta.json";
  std::error_code ec;
  if (!fs::exists(meta, ec)) return nullptr;
  // Written by prepare-data; damaged, it is an error that names it.
  const json j = read_json_file(meta.string());
  LOOM_CHECK_KIND(kData, j.is_object() && j.contains("tokenizer") && j["tokenizer"].is_string(),
                  "{}: field 'tokenizer' is missing or not a string", meta.string());
  return make_tokenizer(j["tokenizer"].get<std::string>());
}

}  // namespace

Trainer::Trainer(Config config, RunOptions options, ThreadConfig threads)
    : config_(std::move(config)), options_(std::move(options)), threads_(threads) {
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
  writer_ = options_.parallel.writer();
  if (!writer_) options_.quiet = true;
  if (writer_ && !options_.out_dir.empty() && options_.resume.empty()) {
    std::error_code ec;
    if (fs::exists(options_.out_dir, ec) && !fs::is_empty(options_.out_dir, ec) &&
        !options_.overwrite)
      LOOM_FAIL(kIo,
                "run folder {} already exists and is not empty (choose another --out, or "
                "pass --overwrite)",
                options_.out_dir);
  }
  gemm_ = configure_gemm(config_.kernels.gemm);
  const bool cuda = config_.device == "cuda";
  if (cuda) {
    RunBackend rb = make_cuda_run_backend(config_, options_.parallel);
    backend_ = std::move(rb.backend);
    gemm_inputs_ = rb.gemm_inputs;
    gemm_backend_name_ = rb.gemm_backend;
    gemm_.describe = rb.describe;
    gemm_.warning.clear();
    gemm_path_name_ = std::string("cublaslt ") + (gemm_inputs_ != DType::kF32
                                                      ? std::string(dtype_name(gemm_inputs_))
                                                  : config_.kernels.tf32 ? "tf32"
                                                                         : "f32");
    // The grid's groups over NCCL (comm.backend nccl, the default on cuda).
    options_.parallel = with_nccl_groups(std::move(options_.parallel), config_);
  } else {
    gemm_inputs_ = config_.kernels.gemm16 ? config_.precision : DType::kF32;
    backend_ = std::make_unique<CpuBackend<float>>(cpu::GemmConfig{gemm_.backend, gemm_inputs_});
    gemm_backend_name_ = cpu::gemm_backend_name(gemm_.backend);
  }
  check_gemm_inputs_agree();
  engine_ = std::make_unique<StepEngine>(config_, options_.parallel, *backend_);
  if (config_.log.trace) {
    trace_ = std::make_unique<RunTrace>(engine_->time_origin(), kTraceSteps);
    for (int c = 0; c < engine_->num_chunks(); ++c) trace_->observe(engine_->stage(c));
  }
  load_initial_state(seed);
  if (config_.log.profile)
    profiler_ = std::make_unique<RunProfiler>(config_, config_.train.steps - step_, *engine_);
  // Per rank, of the path the GEMMs take (bf16 inputs through oneDNN's
  // bf16 matmul have its peak, not the sgemm's); MFU divides the job's
  // FLOP/s by it times the ranks. Under mpirun rank 0 measures while the
  // others wait (ranks measuring at once would compete for the cores) and
  // every rank takes its figure.
  gemm_path_ = gemm_path_for(gemm_inputs_);
  if (!cuda) gemm_path_name_ = loom::gemm_path_name(gemm_path_);
  peak_gflops_ = config_.log.peak_gflops;
  if (peak_gflops_ <= 0 && cuda) {
    // Each rank's own GPU, measured by the backend's own GEMM path.
    peak_gflops_ = measure_gemm_gflops(*backend_);
  } else if (peak_gflops_ <= 0) {
    const auto& world = options_.parallel.world;
    if (world) world->barrier()->wait();
    float peak = 0;
    if (!world || world->rank() == 0)
      peak = static_cast<float>(
          machine_peak_gflops(threads_.threads, gemm_path_, options_.remeasure_peak).gflops);
    if (world) world->broadcast(&peak, 1, DType::kF32, 0)->wait();
    peak_gflops_ = peak;
  }
  // The job's peak counts the cores its ranks really have: the per-rank
  // peak, measured with this rank's threads (at most the cores), per core,
  // times the cores the host's ranks can keep busy, per host. Ranks sharing
  // a host's cores (4 ranks of 1 thread on 2 cores) share its peak.
  const int ranks = options_.parallel.world ? options_.parallel.world->size() : 1;
  job_peak_gflops_ =
      cuda ? peak_gflops_ * ranks : loom::job_peak_gflops(peak_gflops_, threads_, ranks);
  progress_ = std::make_unique<Progress>(config_.train.steps, config_.log.every, options_.quiet,
                                         !options_.quiet && isatty(STDOUT_FILENO));
}

void Trainer::load_initial_state(uint64_t seed) {
  for (int c = 0; c < engine_->num_chunks(); ++c) engine_->zero(c).init_params(seed);
  if (!options_.init_from.empty()) {
    // Each rank reads the parameters it holds (its slices and stages; at
    // ZeRO stage 3 its shard) of the whole tensors in the file.
    check_hf_weights(options_.init_from, config_.model);
    Checkpointer::load(*engine_, CheckpointReader::of_file(options_.init_from), false);
  }
  if (options_.resume.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const std::string dir = resolve_checkpoint(options_.resume, checkpoint_root());
  // The ranks share the hashing: each reads its part of the files whole,
  // and after that only the pieces of the state it holds.
  const ParallelContext& ctx = options_.parallel;
  verify_checkpoint(dir, ctx.rank, ctx.world ? ctx.world->size() : 1);
  const TrainerState st = read_trainer_state(dir);
  // The model's shape, key by key (a tensor's shape alone would miss n_head,
  // or a vocabulary the padding hides).
  const GptConfig saved = read_checkpoint_model(dir);
  const GptConfig& m = config_.model;
  for (auto [key, a, b] : {std::tuple{"model.n_layer", saved.n_layer, m.n_layer},
                           std::tuple{"model.n_embd", saved.n_embd, m.n_embd},
                           std::tuple{"model.n_head", saved.n_head, m.n_head},
                           std::tuple{"model.vocab_size", saved.vocab_size, m.vocab_size},
                           std::tuple{"model.seq_len", saved.seq_len, m.seq_len},
                           std::tuple{"model.moe.num_experts", saved.moe_experts, m.moe_experts},
                           std::tuple{"model.moe.top_k", saved.moe_top_k, m.moe_top_k},
                           std::tuple{"model.moe.every_n_layers", saved.moe_every, m.moe_every}})
    LOOM_CHECK_KIND(kConfig, a == b, "{}: saved with {} {} but the config has {}", dir, key, a, b);
  const char* routers[] = {"learned", "hash", "tag"};
  LOOM_CHECK_KIND(kConfig,
                  saved.moe_router == m.moe_router && saved.moe_tag_tokens == m.moe_tag_tokens,
                  "{}: saved with model.moe.router {}{} but the config has {}{}", dir,
                  routers[saved.moe_router], saved.moe_router == 2 ? " (its tag_tokens)" : "",
                  routers[m.moe_router], m.moe_router == 2 ? " (its tag_tokens)" : "");
  LOOM_CHECK_KIND(kConfig, st.seed == seed,
                  "{}: saved with train.seed {} but the config has {}; a resumed run must "
                  "keep its seed to see the same data",
                  dir, st.seed, seed);
  Checkpointer::load(*engine_, CheckpointReader(dir), true);
  step_ = st.step;
  for (int c = 0; c < engine_->num_chunks(); ++c)
    engine_->zero(c).resume_steps(st.step, st.step - st.skipped_steps);
  engine_->set_skipped_steps(st.skipped_steps);
  // An fp16 run continues with its scaler's state; one resumed from an f32
  // or bf16 checkpoint, or with a static fp16.loss_scale now, starts afresh.
  if (LossScaler* s = engine_->loss_scaler();
      s && st.scaler_iteration >= 0 && config_.loss_scaling.loss_scale == 0)
    s->restore(st.loss_scale, st.scaler_iteration, st.scaler_last_overflow, st.scaler_hysteresis);
  resume_s_ = seconds_since(t0);
}

StepResult Trainer::train_step() {
  const auto t_start = std::chrono::steady_clock::now();
  // metrics.jsonl's peaks are the step's own (training and evaluation),
  // not setup's or a checkpoint's temporaries.
  memory_tracker().reset_peaks();
  StepResult r;
  r.step = step_ + 1;
  set_fault_step(step_);
  fault_delay();
  // A skipped step does not advance the schedule (as DeepSpeed's scheduler
  // is not stepped on an overflow); its data is consumed.
  r.lr = learning_rate(config_.scheduler, config_.optimizer.lr, step_ - engine_->skipped_steps());
  // The step's communication: what the record holds from now on (between
  // steps, evaluation's and checkpoints' are not the step's).
  CommRecord* record = options_.parallel.world ? options_.parallel.world->record() : nullptr;
  if (record) record->take();
  if (trace_) trace_->begin_step(r.step);
  if (profiler_) profiler_->skip(*engine_);  // evaluation's forwards are not the step's
  const StepStats s = engine_->step(*train_data_, step_, r.lr);
  const MemStats mem_mine = memory_tracker().stats();
  if (config_.comm.debug) engine_->check_replicas();
  r.loss = s.loss;
  r.grad_norm = s.grad_norm;
  r.skipped_steps = engine_->skipped_steps();
  r.loss_scale = s.loss_scale;
  r.fp16 = engine_->loss_scaler() != nullptr;
  r.moe = s.moe;
  if (s.skipped && writer_ && !options_.quiet) {
    if (progress_->tty()) std::printf("\r\033[K");
    const LossScaler* scaler = engine_->loss_scaler();
    std::printf(
        "loom: step %ld skipped: %s%s (%ld skipped so far)%s\n", long(step_ + 1),
        scaler ? "fp16 overflow" : "non-finite gradient",
        s.nonfinite.empty() ? "" : (" first in '" + s.nonfinite + "'").c_str(),
        long(r.skipped_steps),
        scaler ? format("; loss scale {} -> {}", s.loss_scale, scaler->scale()).c_str() : "");
    std::fflush(stdout);
  }
  r.t_forward = s.t_forward;
  r.t_backward = s.t_backward;
  r.t_recompute = s.t_recompute;
  r.t_optimizer = s.t_optimizer;
  r.t_comm = s.comm.comm_s;
  r.t_comm_exposed = s.comm.exposed_s;
  r.t_all_to_all = s.t_all_to_all;
  if (options_.parallel.cp_size() > 1) {
    // Every rank's attention time (a step's one small all-gather).
    r.context = true;
    r.t_context_comm = s.t_context_comm;
    r.t_context_exposed = s.t_context_exposed;
    r.context_sent_bytes = s.context_sent_bytes;
    r.context_attention = all_gather_words(*options_.parallel.world, &s.t_context_attention, 1);
  }
  r.compression =
      config_.optimizer.one_bit() ? config_.optimizer.type : config_.zero.compression.type;
  r.compressed = s.compression.compressed;
  r.local_step = s.compression.local;
  r.compressed_bytes = s.compression.sent_bytes;
  r.uncompressed_bytes = s.compression.plain_bytes;
  r.error_norm = std::sqrt(s.compression.error_sum_squares);
  if (r.compressed && !compression_logged_ && writer_ && !options_.quiet) {
    if (progress_->tty()) std::printf("\r\033[K");
    std::printf("loom: step %ld: %s compresses from here on%s\n", long(r.step),
                r.compression.c_str(),
                config_.optimizer.type == "OneBitAdam"    ? " (variance frozen)"
                : config_.optimizer.type == "ZeroOneAdam" ? " (but at its variance steps)"
                                                          : "");
    std::fflush(stdout);
  }
  compression_logged_ = compression_logged_ || r.compressed;
  r.t_bubble = s.t_bubble;
  r.bubble_fraction = s.bubble_fraction;
  r.t_p2p_wait = s.t_p2p_wait;
  r.t_step = seconds_since(t_start);
  const double tokens = double(config_.train_batch_size) * double(config_.model.seq_len);
  r.tokens_per_s = tokens / r.t_step;
  r.mfu = engine_->flops_per_token() * r.tokens_per_s / (job_peak_gflops_ * 1e9);
  r.gemm_backend = gemm_backend_name_;
  r.gemm_path = gemm_path_name_;
  r.peak_gflops = peak_gflops_;
  // A model-FLOP utilisation above 1 means the denominator is not the peak
  // of the path the GEMMs take: said once, with what to do.
  if (r.mfu > 1 && !mfu_warned_ && writer_ && !options_.quiet) {
    mfu_warned_ = true;
    std::printf(
        "loom: warning: step %ld: MFU %.2f above 1: %.0f GFLOP/s per rank is below what "
        "this run's GEMMs (%s) reach; %s\n",
        long(step_ + 1), r.mfu, peak_gflops_, r.gemm_path.c_str(),
        config_.log.peak_gflops > 0 ? "raise log.peak_gflops to the path's peak (loom bench gemm)"
        : gemm_path_ == GemmPath::kBf16Matmul
            ? "the cached peak may be stale: `loom bench gemm --dtype bf16` measures it again"
            : "the cached peak may be stale: `loom bench gemm` measures it again");
  }
  gather_rank_times(r);
  if (record) {
    r.comm_events = record->take();
    for (const CommEvent& e : r.comm_events) r.comm_bytes += e.sent_bytes;
    r.comm_groups = totals_by_group(r.comm_events);
    if (trace_) trace_->add_comm(r.comm_events);
    if (record->dropped() > comm_dropped_ && writer_ && comm_dropped_ == 0)
      std::printf(
          "loom: warning: the communication record overflowed in step %ld (%lu events "
          "lost): comm_bytes undercounts\n",
          long(r.step), static_cast<unsigned long>(record->dropped()));
    comm_dropped_ = record->dropped();
  }
  if (trace_) {
    trace_->add_schedule(engine_->trace());
    trace_->begin_step(0);  // evaluation and checkpoints between steps are not traced
  }
  if (profiler_) {
    profiler_->add(*engine_, r, mem_mine);
    // After the step's record was taken: the step's own bytes, complete.
    if (options_.parallel.world) {
      const int n = options_.parallel.world->size();
      double total = 0;
      for (size_t b : mem_mine.peak) total += double(b);
      const double mine[2] = {total, r.comm_bytes};
      std::vector<double> all(2 * static_cast<size_t>(n));
      options_.parallel.world->all_gather(mine, all.data(), 2, DType::kF64)->wait();
      for (int g = 0; g < n; ++g) {
        r.rank_mem.push_back(all[2 * static_cast<size_t>(g)]);
        r.rank_sent.push_back(all[2 * static_cast<size_t>(g) + 1]);
      }
    }
  }
  ++step_;
  return r;
}

void Trainer::gather_rank_times(StepResult& r) {
  const ParallelContext& ctx = options_.parallel;
  if (!ctx.world) return;
  const int n = ctx.world->size();
  const float mine[2] = {static_cast<float>(std::max(0.0, r.t_step - r.t_comm_exposed)),
                         static_cast<float>(r.t_comm_exposed)};
  std::vector<float> all(2 * static_cast<size_t>(n));
  ctx.world->all_gather(mine, all.data(), 2, DType::kF32)->wait();
  for (int g = 0; g < n; ++g) {
    r.rank_compute.push_back(all[2 * static_cast<size_t>(g)]);
    r.rank_wait.push_back(all[2 * static_cast<size_t>(g) + 1]);
  }
  if (!stragglers_) {
    // Peers: the ranks of the same pipeline stage.
    std::vector<int> stage(static_cast<size_t>(n));
    for (int g = 0; g < n; ++g) stage[static_cast<size_t>(g)] = ctx.grid.coord(g).pp;
    stragglers_ = std::make_unique<StragglerDetector>(n, std::move(stage));
  }
  r.rank_score = stragglers_->add(r.rank_compute);
  const std::vector<int> slow = stragglers_->slow();
  if (slow == slow_ranks_) return;
  if (writer_ && !options_.quiet) {
    if (progress_->tty()) std::printf("\r\033[K");
    auto where = [&](int g) {
      const int launch = ctx.order[static_cast<size_t>(g)];
      return format(
          "rank {} on {}", launch,
          ctx.topology
              .names[static_cast<size_t>(ctx.topology.host_of[static_cast<size_t>(launch)])]);
    };
    for (int g : slow)
      if (std::find(slow_ranks_.begin(), slow_ranks_.end(), g) == slow_ranks_.end())
        std::printf(
            "loom: warning: step %ld: straggler: %s computes for %.3f s a step, %.2fx the median "
            "peer over the last %d steps (score %.2f < %.2f)\n",
            long(r.step), where(g).c_str(), r.rank_compute[static_cast<size_t>(g)],
            1.0 / r.rank_score[static_cast<size_t>(g)], stragglers_->window(),
            r.rank_score[static_cast<size_t>(g)], stragglers_->threshold());
    for (int g : slow_ranks_)
      if (std::find(slow.begin(), slow.end(), g) == slow.end())
        std::printf("loom: step %ld: %s is no longer a straggler (score %.2f)\n", long(r.step),
                    where(g).c_str(), r.rank_score[static_cast<size_t>(g)]);
    std::fflush(stdout);
  }
  slow_ranks_ = slow;
}

double Trainer::evaluate() {
  LOOM_CHECK(val_data_ != nullptr, "evaluate() without validation data");
  return engine_->evaluate(*val_data_, config_.train.eval_steps);
}

std::string Trainer::sample(const std::string& prompt, int64_t n, double temperature, int64_t top_k,
                            uint64_t seed) {
  LOOM_CHECK_KIND(kUnsupported, tokenizer_ != nullptr,
                  "sampling needs the data's tokenizer (meta.json beside data.train)");
  LOOM_CHECK(model().params() != nullptr,
             "sampling at ZeRO stage 3 needs the full parameters: gather them on every rank "
             "first (ZeroEngine::gather_full_params)");
  std::vector<uint32_t> ids = tokenizer_->encode(prompt.empty() ? "\n" : prompt);
  return tokenizer_->decode(generate(model(), ids, SampleOptions{n, temperature, top_k, seed}));
}

std::string Trainer::checkpoint_root() const {
  if (!config_.checkpoint.dir.empty()) return config_.checkpoint.dir;
  return options_.out_dir.empty() ? std::string()
                                  : (fs::path(options_.out_dir) / "checkpoints").string();
}

ReportOptions Trainer::report_options(bool live, double step_seconds) const {
  ReportOptions o;
  o.runs = {options_.out_dir};
  o.out = (fs::path(options_.out_dir) / "report.html").string();
  o.live = live;
  // Reload about when the next rewrite lands, not more than once a second.
  o.refresh_s = std::max(1.0, std::round(step_seconds * double(config_.log.report_every)));
  return o;
}

namespace {
// The page is a view of the run: a failure to write it stops nothing.
void write_report_or_warn(const ReportOptions& o) {
  try {
    write_report(o);
  } catch (const std::exception& e) {
    std::printf("loom: warning: report.html not written: %s\n", e.what());
    std::fflush(stdout);
  }
}
}  // namespace

void Trainer::write_live_report(double step_seconds) {
  // One rewrite at a time, beside training, and at most a tenth of the time
  // goes to them: the next starts 9 x the last one's duration after it.
  if (report_job_.valid()) {
    if (report_job_.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return;
    report_job_.get();
  }
  const auto now = std::chrono::steady_clock::now();
  if (now < report_next_) return;
  ReportOptions o = report_options(true, step_seconds);
  // What the metrics log has flushed: the page never sees half a line.
  std::error_code ec;
  o.metrics_bytes = fs::file_size(fs::path(options_.out_dir) / "metrics.jsonl", ec);
  if (ec || o.metrics_bytes == 0) return;
  report_job_ = std::async(std::launch::async, [this, o] {
    const auto t0 = std::chrono::steady_clock::now();
    write_report_or_warn(o);
    const auto t1 = std::chrono::steady_clock::now();
    report_next_ = t1 + 9 * (t1 - t0);
  });
}

void Trainer::write_final_report(const std::string& stopped) {
  if (report_job_.valid()) report_job_.get();
  ReportOptions o = report_options(false, 0);
  o.stopped = stopped;
  write_report_or_warn(o);
}

void Trainer::open_run_folder() {
  fs::create_directories(options_.out_dir);
  write_file_atomic((fs::path(options_.out_dir) / "config.resolved.json").string(),
                    config_.resolved.dump(2) + "\n");
  // run.json: what the config does not say (the report's layout panel).
  nlohmann::json info = {{"loom_version", LOOM_VERSION},
                         {"cpu", cpu_model()},
                         {"isa", cpu_isa()},
                         {"threads", threads_.threads},
                         {"world", options_.parallel.world ? options_.parallel.world->size() : 1},
                         {"partition", engine_->partition().counts}};
  if (!options_.parallel.placement.empty()) info["hosts"] = options_.parallel.placement;
  const std::time_t now = std::time(nullptr);
  char started[32];
  std::strftime(started, sizeof started, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  info["started"] = started;
  write_file_atomic((fs::path(options_.out_dir) / "run.json").string(), info.dump(2) + "\n");
  // A resumed run keeps the metrics of the steps its checkpoint covers and
  // drops any written after it by the interrupted run.
  metrics_.open((fs::path(options_.out_dir) / "metrics.jsonl").string(), step_);
}

void Trainer::save(double lr) {
  // Only tensor-parallel rank 0's copy of a replicated parameter is saved:
  // the copies must be one tensor.
  engine_->check_replicas();
  if (config_.checkpoint.format == "whole") {
    const auto t0 = std::chrono::steady_clock::now();
    const bool spread = engine_->pipelined() || config_.parallel.expert > 1;
    const std::string dir = spread ? save_pipelined(lr) : save_whole(lr);
    if (!writer_ || options_.quiet) return;
    size_t bytes = 0;
    for (const auto& f : fs::directory_iterator(dir)) bytes += f.file_size();
    if (progress_->tty()) std::printf("\r\033[K");
    std::printf("loom: checkpoint %s: %.1f MB, whole, from world rank 0 in %.3f s\n", dir.c_str(),
                bytes / 1e6, seconds_since(t0));
    std::fflush(stdout);
    return;
  }
  if (!checkpointer_)
    checkpointer_ =
        std::make_unique<Checkpointer>(*engine_, checkpoint_root(), [this](const SaveReport& r) {
          if (options_.quiet) return;
          const int ranks = options_.parallel.world ? options_.parallel.world->size() : 1;
          // On a terminal, over the progress bar (redrawn at the next step).
          if (progress_->tty()) std::printf("\r\033[K");
          std::printf("loom: checkpoint %s: %.1f MB from %d rank%s in %.3f s", r.dir.c_str(),
                      r.bytes / 1e6, ranks, ranks > 1 ? "s" : "", r.seconds);
          if (r.async) std::printf(" in the background (training paused %.3f s)", r.paused_s);
          std::printf("\n");
          std::fflush(stdout);
        });
  const TrainerState st = trainer_state(lr);
  checkpointer_->save(st, config_.resolved);
}

TrainerState Trainer::trainer_state(double lr) const {
  TrainerState st{step_,
                  lr,
                  1.0,
                  config_.train.seed,
                  tokenizer_ ? tokenizer_->name() : "",
                  engine_->skipped_steps()};
  if (const LossScaler* s = engine_->loss_scaler()) {
    st.loss_scale = s->scale();
    st.scaler_iteration = s->iteration();
    st.scaler_last_overflow = s->last_overflow();
    st.scaler_hysteresis = s->hysteresis_left();
  }
  return st;
}

void Trainer::finish_save() {
  if (checkpointer_) checkpointer_->finish();
}

std::string Trainer::save_whole(double lr) {
  // Moments laid out like the stage's parameters: a ZeRO shard per rank is
  // gathered first (by every rank, since the gather is collective); at stage
  // 3 the parameters are gathered too. Then the ranks of data-parallel index
  // 0 assemble each tensor split over their tensor-parallel group, one at a
  // time, and world rank 0 writes it.
  ZeroEngine& zero = engine_->zero();
  std::vector<float> m, v;
  zero.gather_moments(m, v);
  zero.gather_full_params();
  const ParallelContext& ctx = options_.parallel;
  // Tensor-parallel rank 0 receives the other ranks' slices one at a time
  // and places each; it holds the whole tensor and one slice, the others
  // only their own slices.
  AssembleFn assemble = [&ctx](const Param& p, const float* slice, float* whole) {
    ProcessGroup& tp = *ctx.tp;
    const size_t n = static_cast<size_t>(p.numel);
    if (tp.rank() != 0) {
      tp.send(slice, n, DType::kF32, 0, kAssembleTag)->wait();
      return;
    }
    std::vector<float> other(n);
    for (int r = 0; r < tp.size(); ++r) {
      ShardSpec s = p.shard;
      s.index = r;
      if (r > 0) tp.recv(other.data(), n, DType::kF32, r, kAssembleTag)->wait();
      shard_to_global(p.shape, s, r == 0 ? slice : other.data(), whole);
    }
  };
  std::string dir;
  if (ctx.dp_rank() == 0) {
    const TrainerState st = trainer_state(lr);
    dir = save_checkpoint(checkpoint_root(), model(), m.data(), v.data(), st, config_.resolved,
                          config_.checkpoint.keep_last, ctx.tp ? assemble : AssembleFn{}, writer_);
  }
  zero.release_full_params(false);
  // When save returns on any rank, the checkpoint is complete on disk.
  if (ctx.world) ctx.world->barrier()->wait();
  return dir;
}

std::string Trainer::save_pipelined(double lr) {
  // The stages (and the expert-parallel ranks) hold different parts of the
  // model: the writer stages the whole model (parameters and moments, one
  // process's layout) tensor by tensor from their owners, then writes it as
  // a one-process run would. Every rank of the replica takes part in each
  // tensor's gather.
  WholeModel whole(*engine_, true);
  const ParamLayout& layout = whole.layout();
  std::unique_ptr<GptStage<float>> staging;
  std::vector<float> m, v, scratch;
  const bool writes = writer_;
  if (writes) {
    staging =
        std::make_unique<GptStage<float>>(config_.model, StageSpec{}, StoreOptions{1, true, false},
                                          LayerFactory<float>::single_process(), *backend_);
    m.assign(static_cast<size_t>(layout.total()), 0.0f);
    v.assign(m.size(), 0.0f);
  }
  const ParallelContext& ctx = options_.parallel;
  for (const Param& p : layout.params()) {
    // Only the first replica's ranks gather (with expert parallelism, the
    // first expert-parallel group); the others hold the same values.
    if (ctx.coord().ep_dp != 0) break;
    scratch.resize(static_cast<size_t>(p.shape.numel()));
    whole.get(p, WholeModel::kParam, writes ? staging->param(p) : scratch.data());
    whole.get(p, WholeModel::kExpAvg, writes ? m.data() + p.offset : scratch.data());
    whole.get(p, WholeModel::kExpAvgSq, writes ? v.data() + p.offset : scratch.data());
  }
  std::string dir;
  if (writes) {
    const TrainerState st = trainer_state(lr);
    dir = save_checkpoint(checkpoint_root(), *staging, m.data(), v.data(), st, config_.resolved,
                          config_.checkpoint.keep_last);
  }
  // When save returns on any rank, the checkpoint is complete on disk.
  if (ctx.world) ctx.world->barrier()->wait();
  return dir;
}

std::vector<StepResult> Trainer::run() {
  const bool page = writer_ && config_.log.report_every > 0 && !options_.out_dir.empty();
  try {
    return run_steps();
  } catch (const std::exception& e) {
    // The last page says how the run ended, and stops reloading.
    if (page && fs::exists(fs::path(options_.out_dir) / "metrics.jsonl"))
      write_final_report(
          format("the run stopped at step {} of {}: {}", step_ + 1, config_.train.steps, e.what()));
    throw;
  }
}

std::vector<StepResult> Trainer::run_steps() {
  if (writer_ && !options_.out_dir.empty()) open_run_folder();
  if (!options_.quiet) describe_run();
  std::vector<StepResult> results;
  const auto t0 = std::chrono::steady_clock::now();
  if (options_.restart > 0 && !options_.quiet)
    std::printf("loom: restart %d (loom launch): %s\n", options_.restart,
                options_.restart_cause.c_str());
  if (step_ > 0 && !options_.quiet)
    std::printf("loom: resumed from %s at step %ld (verified and read in %.3f s)\n",
                options_.resume.c_str(), long(step_), resume_s_);
  const int64_t total = config_.train.steps, every = config_.checkpoint.every;
  // Every rank takes part in a save.
  const bool checkpoints = every > 0 && !checkpoint_root().empty();
  while (step_ < total) {
    StepResult r = train_step();
    r.comm_events = {};  // summed into the step's figures; a long run keeps only those
    if (results.empty() && options_.restart > 0) {
      r.restart = options_.restart;
      r.restart_cause = options_.restart_cause;
      r.world = options_.parallel.world ? options_.parallel.world->size() : 1;
    }
    const int64_t eval = config_.train.eval_every;
    if (eval > 0 && (r.step % eval == 0 || r.step == total)) r.val_loss = evaluate();
    r.mem = engine_->peak_memory_over_ranks();
    metrics_.write(r);
    results.push_back(r);
    const int64_t report = config_.log.report_every;
    if (writer_ && report > 0 && !options_.out_dir.empty() && r.step % report == 0 &&
        r.step < total)
      write_live_report(seconds_since(t0) / double(results.size()));
    progress_->show(r, seconds_since(t0), static_cast<int64_t>(results.size()));
    if (checkpointer_) checkpointer_->poll();
    if (checkpoints && (r.step % every == 0 || r.step == total)) save(r.lr);
  }
  finish_save();
  if (trace_)
    trace_->write(
        options_.parallel, writer_,
        options_.out_dir.empty() ? "" : (fs::path(options_.out_dir) / "trace.json").string());
  if (profiler_) write_profile();
  // The final page, with the timeline.
  if (writer_ && config_.log.report_every > 0 && !options_.out_dir.empty() && !results.empty())
    write_final_report("");
  // The closing sample decodes on rank 0 from full parameters; at stage 3
  // every rank takes part in gathering them.
  const TrainConfig& t = config_.train;
  // (Decoding reads the single-process layers and every expert; under
  // tensor, pipeline or expert parallelism `loom generate` samples from a
  // checkpoint instead.)
  const bool split = options_.parallel.tp || engine_->pipelined() || config_.parallel.expert > 1;
  const bool sampling = t.sample_tokens > 0 && tokenizer_ && !results.empty() && !split;
  if (t.sample_tokens > 0 && split && !options_.quiet)
    std::printf(
        "loom: no closing sample under tensor, pipeline or expert parallelism (loom generate "
        "--checkpoint samples from a checkpoint)\n");
  if (sampling) engine_->zero().gather_full_params();
  progress_->summary(results, seconds_since(t0), job_peak_gflops_, options_.out_dir);
  if (sampling && !options_.quiet) {
    std::string text =
        sample(t.sample_prompt, t.sample_tokens, t.sample_temperature, t.sample_top_k, t.seed);
    std::printf("\n--- sample (%ld tokens, temperature %.2f) ---\n%s%s\n---\n",
                long(t.sample_tokens), t.sample_temperature, t.sample_prompt.c_str(), text.c_str());
    std::fflush(stdout);
  }
  if (sampling) engine_->zero().release_full_params(false);
  return results;
}

void Trainer::write_profile() {
  const JobProfile p = profiler_->gather(options_.parallel, writer_);
  if (!writer_) return;
  if (p.shape.steps == 0) {
    if (!options_.quiet)
      std::printf("loom: profile (log.profile): no step after the first to profile\n");
    return;
  }
  const std::vector<Finding> findings = imbalance_report(p);
  if (!options_.out_dir.empty()) {
    nlohmann::json j = to_json(p);
    j["imbalance"] = to_json(findings);
    write_file_atomic((fs::path(options_.out_dir) / "profile.json").string(), j.dump(1) + "\n");
    write_file_atomic((fs::path(options_.out_dir) / "profile.txt").string(),
                      profile_text(p, findings));
  }
  if (options_.quiet) return;
  if (progress_->tty()) std::printf("\r\033[K");
  std::printf(
      "loom: profile (log.profile)%s:\n%s%s",
      options_.out_dir.empty()
          ? ""
          : (" in " + (fs::path(options_.out_dir) / "profile.txt").string() + " and profile.json")
                .c_str(),
      profile_table(p).c_str(), imbalance_text(p, findings).c_str());
  std::fflush(stdout);
}

// kernels.gemm_inputs auto is a rule of each rank's CPU: ranks on unlike
// CPUs would round their GEMM inputs differently and the replicas drift
// apart, so the job stops, naming the first rank that differs from rank 0.
void Trainer::check_gemm_inputs_agree() const {
  const auto& world = options_.parallel.world;
  if (!world || world->size() == 1) return;
  const int64_t mine = config_.kernels.gemm16 ? 1 : 0;
  std::vector<int64_t> all(static_cast<size_t>(world->size()));
  world->all_gather(&mine, all.data(), 1, DType::kI64)->wait();
  for (size_t r = 1; r < all.size(); ++r)
    LOOM_CHECK_KIND(kConfig, all[r] == all[0],
                    "kernels.gemm_inputs {}: rank {} chose {} GEMM inputs and rank 0 {} (their "
                    "CPUs differ: {}); set kernels.gemm_inputs to f32 or 16bit for the job",
                    config_.kernels.gemm_inputs, r, all[r] ? "16-bit" : "f32",
                    all[0] ? "16-bit" : "f32",
                    world->rank() == static_cast<int>(r) || world->rank() == 0
                        ? config_.kernels.gemm_inputs_why
                        : std::string("see ranks 0 and ") + std::to_string(r));
}

void Trainer::describe_run() const {
  const GptConfig& m = config_.model;
  std::printf("loom: %s\n", describe(threads_).c_str());
  if (!threads_.warning.empty()) std::printf("loom: warning: %s\n", threads_.warning.c_str());
  std::printf(
      "loom: model GPT-2 n_layer %d n_embd %d n_head %d vocab %d (padded %d) seq_len %d: "
      "%.2fM parameters\n",
      m.n_layer, m.n_embd, m.n_head, m.vocab_size, m.padded_vocab(), m.seq_len,
      engine_->stage().model_params() / 1e6);
  if (m.moe_experts > 0) {
    std::string blocks;
    for (int i = 0; i < m.n_layer; ++i)
      if (m.moe_layer(i)) blocks += (blocks.empty() ? "" : ", ") + std::to_string(i);
    const double active = engine_->stage().active_params();
    const char* routers[] = {"learned", "hash", "tag"};
    const int ep = config_.parallel.expert;
    std::printf(
        "loom: mixture of experts in blocks %s: %d experts, top-%d, %s router, capacity factor "
        "%g%s, aux_loss_coef %g, z_loss_coef %g; %.2fM parameters active per token",
        blocks.c_str(), m.moe_experts, m.moe_top_k, routers[m.moe_router], m.moe_capacity_factor,
        m.moe_capacity_factor > 0 ? "" : " (no dropping)", m.moe_aux_loss_coef, m.moe_z_loss_coef,
        active / 1e6);
    if (ep > 1)
      std::printf("; experts split over %d expert-parallel ranks, %d each", ep, m.moe_experts / ep);
    if (const int tp = config_.parallel.tensor; tp > 1)
      std::printf(config_.micro_batch % tp == 0
                      ? "; each of %d tensor-parallel ranks routes its share of the sequences"
                      : "; every one of %d tensor-parallel ranks routes all sequences (a "
                        "micro-batch does not split over them)",
                  tp);
    std::printf("\n");
  }
  std::printf(
      "loom: GEMM %s: %.0f GFLOP/s %s\n", gemm_.describe.c_str(), peak_gflops_,
      config_.log.peak_gflops > 0 ? "(log.peak_gflops)"
      : config_.device == "cuda"
          ? "per rank (a 4096^3 GEMM on this rank's GPU by the run's own path, measured "
            "at start; the MFU denominator)"
      : gemm_path_ == GemmPath::kBf16Matmul
          ? "per rank (the 2048^3 bf16 matmul, the path this run's GEMMs take, "
            "measured once per machine and cached, raised by loom bench; the MFU denominator)"
          : "per rank (the best 2048^3 sgemm of any backend, measured "
            "once per machine and cached, raised by loom bench; the MFU denominator)");
  if (!gemm_.warning.empty()) std::printf("loom: warning: %s\n", gemm_.warning.c_str());
  if (const DType in = gemm_inputs_; in != DType::kF32)
    std::printf(
        "loom: GEMM inputs rounded to %s, products accumulated in f32 (%s); "
        "kernels.gemm_inputs %s: %s\n",
        std::string(dtype_name(in)).c_str(),
        config_.device == "cuda" ? "cuBLASLt" : cpu::gemm_16_path(in),
        config_.kernels.gemm_inputs.c_str(), config_.kernels.gemm_inputs_why.c_str());
  else if (config_.precision != DType::kF32)
    std::printf("loom: GEMM inputs f32 in a %s run; kernels.gemm_inputs %s: %s\n",
                std::string(dtype_name(config_.precision)).c_str(),
                config_.kernels.gemm_inputs.c_str(), config_.kernels.gemm_inputs_why.c_str());
  if (config_.device == "cuda")
    std::printf("loom: device cuda: %s; groups over %s\n", gemm_.describe.c_str(),
                !options_.parallel.world ? "none (one process)"
                : uses_nccl(config_)     ? "NCCL"
                                         : "MPI");
  std::printf("loom: grid %s\n", options_.parallel.grid.describe().c_str());
  if (!options_.parallel.placement.empty())
    std::printf("loom: hosts %s\n", options_.parallel.placement.c_str());
  for (const std::string& w : options_.parallel.warnings)
    std::printf("loom: warning: %s\n", w.c_str());
  if (config_.parallel.tensor > 1)
    std::printf(
        "loom: tensor parallel over %d ranks: each holds %d of %d heads, %d of %d MLP features and "
        "%d of %d vocabulary rows (vocabulary padded to a multiple of 128 x %d)\n",
        config_.parallel.tensor, m.n_head / config_.parallel.tensor, m.n_head,
        4 * m.n_embd / config_.parallel.tensor, 4 * m.n_embd,
        m.padded_vocab() / config_.parallel.tensor, m.padded_vocab(), config_.parallel.tensor);
  if (const ParallelConfig& p = config_.parallel; p.context > 1) {
    const int64_t Tc = m.seq_len / (2 * p.context);
    std::printf(
        "loom: context parallel over %d ranks: each sequence of %d tokens in %d chunks of %ld, "
        "rank r holding %s; keys and values by %s%s\n",
        p.context, m.seq_len, 2 * p.context, long(Tc),
        p.context_balance ? "chunks r and 2 x cp - 1 - r (equal causal work)"
                          : "chunks 2r and 2r + 1 (one contiguous piece)",
        p.context_comm == "p2p"          ? "a ring overlapped with the attention"
        : p.context_comm == "all_gather" ? "an all-gather before the attention"
                                         : "all-to-all to whole sequences of a share of the heads",
        m.moe_experts > 0 ? "; MoE layers route whole sequences (router inputs gathered)" : "");
  }
  if (engine_->pipelined()) {
    const ParallelConfig& p = config_.parallel;
    const pp::ScheduleKind kind = pp::parse_schedule(p.schedule);
    const int v = kind == pp::ScheduleKind::kInterleaved ? p.virtual_stages : 1;
    std::string parts;
    int first = 0;
    for (int c : engine_->partition().counts) {
      parts += format("{}[{}, {})", parts.empty() ? "" : " ", first, first + c);
      first += c;
    }
    std::printf(
        "loom: pipeline %s over %d stages%s, %ld micro-batches per step; blocks per part %s "
        "(partition %s); bubble in theory %.1f%%\n",
        p.schedule.c_str(), p.pipeline, v > 1 ? format(" x {} chunks", v).c_str() : "",
        long(config_.grad_accum), parts.c_str(), p.partition.c_str(),
        100 * pp::theoretical_bubble(kind, p.pipeline, static_cast<int>(config_.grad_accum), v));
    if (!engine_->partition().table.empty())
      std::printf("loom: %s", engine_->partition().table.c_str());
  }
  std::printf("loom: data %s; batch %ld = micro-batch %ld x accumulation %ld x data-parallel %ld\n",
              train_data_->describe().c_str(), long(config_.train_batch_size),
              long(config_.micro_batch), long(config_.grad_accum), long(config_.data_parallel));
  describe_zero();
  describe_checkpointing();
  std::fflush(stdout);
}

void Trainer::describe_checkpointing() const {
  const CheckpointingConfig& a = config_.checkpointing;
  const GptStage<float>& s = engine_->stage();
  const int64_t B = config_.micro_batch, Tn = config_.local_seq_len();
  if (a.policy.kind != CheckpointPolicy::kNone || a.policy.records != DType::kF32)
    std::printf(
        "loom: activation checkpointing %s: %s; activations %.1f MB per micro-batch + %.1f MB "
        "recompute room (a block keeps %.1f MB whole, %.1f MB recomputed in full)\n",
        CheckpointPolicy::name(a.policy.kind), s.recompute_plan().describe().c_str(),
        double(s.store_bytes(B, Tn)) / 1e6, double(s.room_bytes(B, Tn)) / 1e6,
        double(s.block_bytes(B, Tn, Recompute::kNone, a.policy.records)) / 1e6,
        double(s.block_bytes(B, Tn, Recompute::kFull)) / 1e6);
  if (!a.deepspeed_keys) return;
  if (a.policy.kind == CheckpointPolicy::kNone)
    std::printf(
        "loom: activation_checkpointing: DeepSpeed's keys are set but nothing is recomputed; "
        "activation_checkpointing.policy chooses (full, selective, every_n, budget)\n");
  if (a.partition_activations)
    std::printf("loom: activation_checkpointing.partition_activations: %s\n",
                config_.parallel.sequence_parallel
                    ? "with sequence parallelism a recomputed block's kept input is already this "
                      "rank's slice of the sequence"
                    : "no effect in this build (a recomputed block's kept input is whole on every "
                      "tensor-parallel rank; parallel.sequence_parallel splits it)");
  if (a.cpu_checkpointing)
    std::printf(
        "loom: activation_checkpointing.cpu_checkpointing: this build computes on the CPU, so "
        "kept activations are in host memory already\n");
  if (a.contiguous_memory_optimization || a.number_checkpoints > 0)
    std::printf(
        "loom: activation_checkpointing.contiguous_memory_optimization / number_checkpoints: "
        "loom always keeps a micro-batch's activations in one buffer, sized from the model\n");
  if (a.synchronize_checkpoint_boundary)
    std::printf(
        "loom: activation_checkpointing.synchronize_checkpoint_boundary: no effect on the CPU "
        "(there is no device stream to synchronise)\n");
  if (a.profile)
    std::printf(
        "loom: activation_checkpointing.profile: recompute time is always in metrics.jsonl "
        "(time.recompute)\n");
}

void Trainer::describe_compression() const {
  const CompressionConfig& cc = config_.zero.compression;
  const OptimizerConfig& o = config_.optimizer;
  const bool dp = options_.parallel.dp != nullptr;
  if (o.zero_one())
    std::printf(
        "loom: ZeroOneAdam: the variance updated from uncompressed gradients at exponentially "
        "spaced steps (%ld at each interval, then the interval doubles) until step %ld, each "
        "rank's momentum averaged by a 1-bit compressed all-reduce per unit at every other "
        "step%s\n",
        long(o.var_update_scaler), long(o.var_freeze_step),
        dp ? "" : " (one process: nothing to compress)");
  if (o.type == "OneBitAdam") {
    std::printf(
        "loom: %s: AdamW for the first %ld optimizer steps, then each rank's momentum averaged "
        "by a 1-bit compressed all-reduce per unit (error feedback on both sides), the variance "
        "frozen%s\n",
        o.type.c_str(), long(o.freeze_step), dp ? "" : " (one process: nothing to compress)");
    if (o.freeze_step >= config_.train.steps)
      std::printf(
          "loom: warning: optimizer.params.freeze_step %ld >= train.steps %ld: compression never "
          "starts\n",
          long(o.freeze_step), long(config_.train.steps));
  }
  if (!cc.any()) return;
  if (cc.type == "powersgd")
    std::printf(
        "loom: comm.compression powersgd: rank %d, from step %ld (before: uncompressed), error "
        "feedback %s, warm start %s, matrices compressed when %.3g x smaller%s\n",
        cc.rank, long(cc.start_iter) + 1, cc.error_feedback ? "on" : "off",
        cc.warm_start ? "on" : "off", cc.min_compression_rate,
        dp ? "" : " (one process: nothing to compress)");
  else
    std::printf("loom: comm.compression %s: f32 gradients reduced in %s, half the bytes%s\n",
                cc.type.c_str(), cc.type.c_str(), dp ? "" : " (one process: nothing to compress)");
  if (cc.type == "powersgd" && cc.start_iter >= config_.train.steps)
    std::printf(
        "loom: warning: comm.compression.start_iter %ld >= train.steps %ld: compression never "
        "starts\n",
        long(cc.start_iter), long(config_.train.steps));
}

void Trainer::describe_zero() const {
  const ZeroConfig& z = config_.zero;
  if (options_.parallel.dp || z.stage > 0) {
    std::printf("loom: data parallel over %d ranks%s, ZeRO stage %d (%s), shard %.2fM elements",
                options_.parallel.dp_size(),
                options_.parallel.cp_size() > 1
                    ? format(" (data {} x context {})", options_.parallel.replicas(),
                             options_.parallel.cp_size())
                          .c_str()
                    : "",
                z.stage,
                z.stage == 0   ? "replicated"
                : z.stage == 1 ? "optimizer state sharded"
                : z.stage == 2 ? "optimizer state and gradients sharded"
                               : "optimizer state, gradients and parameters sharded",
                double(engine_->zero().shard_elements()) / 1e6);
    if (z.stage <= 1 && options_.parallel.dp)
      std::printf(", gradient buckets of %ld elements, overlap %s", long(z.reduce_bucket_size),
                  z.overlap_comm ? "on" : "off");
    if (z.stage == 3)
      std::printf(", prefetch %ld elements, units of <= %ld elements stay gathered",
                  long(z.prefetch_bucket_size), long(z.persistence_threshold));
    std::printf("\n");
  }
  describe_compression();
  if (z.offload_device == "cpu")
    std::printf(
        "loom: offload_optimizer.device cpu: this build computes on the CPU, so the optimizer "
        "state is in host memory already (the same as none)\n");
  if (z.offload_device == "nvme")
    std::printf(
        "loom: offload_optimizer.device nvme: AdamW moments%s (%.1f MB per rank) in a "
        "memory-mapped file under %s, paged in and out unit by unit\n",
        z.dtype != DType::kF32 ? " and f32 masters" : "",
        double(engine_->zero().shard_elements()) * (z.dtype != DType::kF32 ? 12.0 : 8.0) / 1e6,
        z.nvme_path.c_str());
  if (z.offload_device == "nvme" && is_tmpfs(z.nvme_path))
    std::printf(
        "loom: warning: %s is on tmpfs, which is memory: the offloaded optimizer state "
        "stays in RAM there\n",
        z.nvme_path.c_str());
  if (z.offload_device != "none" && (z.pin_memory || z.buffer_count != 4))
    std::printf(
        "loom: offload_optimizer.pin_memory and buffer_count have no effect in this build\n");
  if (z.dtype != DType::kF32) {
    const LossScaleConfig& ls = config_.loss_scaling;
    std::printf(
        "loom: precision %s: parameters and gradients in 16 bits (gradients reduced in 16 bits), "
        "f32 master weights and moments in the optimizer; layers compute in f32 on each unit's "
        "parameters widened while in use\n",
        z.dtype == DType::kBF16 ? "bf16" : "fp16");
    if (z.dtype == DType::kF16) {
      if (ls.loss_scale > 0)
        std::printf("loom: fp16 static loss scale %g: an overflow skips the step\n", ls.loss_scale);
      else
        std::printf(
            "loom: fp16 dynamic loss scale from 2^%d: an overflow skips the step; %d overflows "
            "halve it (down to %g); %ld clean steps double it\n",
            ls.initial_scale_power, ls.hysteresis, ls.min_loss_scale, long(ls.loss_scale_window));
    }
  }
}

}  // namespace loom
