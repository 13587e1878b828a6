#include "loom/train/checkpointer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>

#include "loom/core/clock.h"
#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/core/range.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

using State = ZeroEngine::State;

constexpr std::pair<State, const char*> kStates[] = {
    {State::kParams, ""}, {State::kExpAvg, "exp_avg."}, {State::kExpAvgSq, "exp_avg_sq."}};

// The checkpoint's name of a compression state tensor of data-parallel
// rank dp and tensor-parallel rank tp (a parameter whole on every tp rank
// is tp 0's); `copy`: of a last stage's wte copy.
std::string compression_tensor(const CompressionState& s, bool copy, int dp, int tp) {
  const std::string name = (copy ? "tied_copy." : "") + s.param->name;
  switch (s.kind) {
    case CompressionState::kError:
      return format("{}.error.dp{}.{}", s.family, dp, name);
    case CompressionState::kServerError:
      return format("{}.server_error.{}", s.family, name);
    case CompressionState::kQ:
      break;
  }
  return format("{}.q.tp{}.{}", s.family, s.param->shard.sharded() ? tp : 0, name);
}

// A rank's file as the all-gather carries it: its size, then its SHA-256 in
// hex, 8 characters to a word.
constexpr size_t kInfoWords = 9;

}  // namespace

struct Checkpointer::Pending {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double paused_s = 0;
  bool async = false;
  TrainerState state;
  json config;
  std::string folder;
  Buffer staging;  // async: the copy being written
  std::vector<PieceOut> pieces;
  std::deque<Param> extra;  // the compression state's Q tensors (pieces point at them)
  std::thread thread;
  std::atomic<bool> done{false};
  std::atomic<bool> stop{false};
  std::exception_ptr error;
  ShardFileInfo info;
};

Checkpointer::Checkpointer(StepEngine& engine, std::string root,
                           std::function<void(const SaveReport&)> on_saved)
    : engine_(engine), root_(std::move(root)), on_saved_(std::move(on_saved)) {}

Checkpointer::~Checkpointer() {
  if (!pending_ || !pending_->thread.joinable()) return;
  pending_->stop = true;  // a run ending on an error does not wait for the whole file
  pending_->thread.join();
}

std::vector<PieceOut> Checkpointer::pieces(std::deque<Param>& extra) const {
  const ParallelContext& ctx = engine_.context();
  const int tp_rank = ctx.tp ? ctx.tp->rank() : 0;
  const int dp_rank = ctx.dp ? ctx.dp->rank() : 0;
  std::vector<PieceOut> out;
  for (int c = 0; c < engine_.num_chunks(); ++c) {
    GptStage<float>& stage = engine_.stage(c);
    ZeroEngine& zero = engine_.zero(c);
    // A last stage's copy of wte is the first stage's tensor.
    const int skip = stage.wte_is_copy() ? stage.wte_unit() : -1;
    for (const auto& [state, prefix] : kStates) {
      const std::vector<ZeroEngine::StateRange> share = zero.share(state);
      for (const Param& p : stage.layout().params()) {
        // A tensor every rank of the tensor-parallel group holds whole is
        // written by its first rank.
        if (p.unit == skip || (!p.shard.sharded() && tp_rank != 0)) continue;
        const ZeroEngine::StateRange& r = share[static_cast<size_t>(p.unit)];
        const auto [lo, hi] = intersect({r.begin, r.end}, {p.offset, p.offset + p.numel});
        if (lo >= hi) continue;
        out.push_back({prefix + p.name, &p, lo - p.offset, hi - p.offset, r.data + (lo - r.begin)});
      }
    }
    // comm.compression and the 1-bit optimizers: each data-parallel rank's
    // error feedback, a tensor of the parameter's shape per rank; the 1-bit
    // server errors, the pieces each rank serves of one tensor; Q, the same
    // on every data-parallel rank, written by the first, one tensor per
    // tensor-parallel slice.
    for (const CompressionState& s : zero.compression_state()) {
      const Param& p = *s.param;
      if (!p.shard.sharded() && tp_rank != 0) continue;  // the same on every tp rank
      const std::string name = compression_tensor(s, p.unit == skip, dp_rank, tp_rank);
      if (s.kind == CompressionState::kError) {
        out.push_back({name, &p, 0, p.numel, s.data});
      } else if (s.kind == CompressionState::kServerError) {
        if (s.begin < s.end) out.push_back({name, &p, s.begin, s.end, s.data});
      } else if (dp_rank == 0) {
        Param& q = extra.emplace_back();
        q.name = name;
        q.shape = q.local = Shape{s.rows, s.cols};
        q.numel = s.rows * s.cols;
        out.push_back({name, &q, 0, q.numel, s.data});
      }
    }
  }
  return out;
}

void Checkpointer::save(const TrainerState& state, const json& config) {
  finish();  // one save at a time
  const ParallelContext& ctx = engine_.context();
  const Config& cfg = engine_.config();
  auto p = std::make_unique<Pending>();
  p->state = state;
  p->config = config;
  p->folder = checkpoint_staging_folder(root_, state.step);
  p->pieces = pieces(p->extra);
  p->async = cfg.checkpoint.async;
  if (ctx.writer()) begin_checkpoint(root_, state.step);
  if (ctx.world) ctx.world->barrier()->wait();  // the folder exists

  const int rank = ctx.rank;
  const int64_t step = state.step;
  // (Test crash points name the launch rank, as LOOM_TEST_THROW does.)
  const int fault_rank = ctx.launch_rank;
  auto write = [folder = p->folder, rank, fault_rank, step](const std::vector<PieceOut>& pieces,
                                                            const std::atomic<bool>* stop) {
    return write_shard_file(
        folder, rank, pieces, [&] { checkpoint_fault_point("partial", step, fault_rank); }, stop);
  };
  if (!cfg.checkpoint.async) {
    p->info = write(p->pieces, nullptr);
    for (int c = 0; c < engine_.num_chunks(); ++c) engine_.zero(c).release_offloaded();
    p->done = true;
    pending_ = std::move(p);
    complete();  // the report counts the whole save as paused
    // When save returns on any rank, the checkpoint is complete on disk.
    if (ctx.world) ctx.world->barrier()->wait();
    return;
  }
  // Async: the state as it is now, copied, written while training goes on.
  size_t elements = 0;
  for (const PieceOut& pc : p->pieces) elements += static_cast<size_t>(pc.end - pc.begin);
  p->staging = Buffer(elements * sizeof(float), MemCategory::kWorkspace);
  float* at = p->staging.as<float>();
  for (PieceOut& pc : p->pieces) {
    const size_t n = static_cast<size_t>(pc.end - pc.begin);
    std::memcpy(at, pc.data, n * sizeof(float));
    pc.data = at;
    at += n;
  }
  for (int c = 0; c < engine_.num_chunks(); ++c) engine_.zero(c).release_offloaded();
  Pending* raw = p.get();
  p->thread = std::thread([raw, write] {
    try {
      raw->info = write(raw->pieces, &raw->stop);
    } catch (...) {
      raw->error = std::current_exception();
    }
    raw->done = true;
  });
  p->paused_s = seconds_since(p->start);
  pending_ = std::move(p);
}

void Checkpointer::poll() {
  if (!pending_) return;
  if (pending_->done && pending_->error) finish();  // rethrows here, on this rank
  float busy = pending_->done ? 0.0f : 1.0f;
  const ParallelContext& ctx = engine_.context();
  if (ctx.world) ctx.world->all_reduce(&busy, &busy, 1, DType::kF32, ReduceOp::kMax)->wait();
  if (busy == 0.0f) finish();
}

void Checkpointer::finish() {
  if (!pending_) return;
  const auto t0 = std::chrono::steady_clock::now();
  if (pending_->thread.joinable()) pending_->thread.join();
  pending_->paused_s += seconds_since(t0);
  if (pending_->error) {
    std::exception_ptr e = pending_->error;
    pending_.reset();
    std::rethrow_exception(e);
  }
  complete();
}

void Checkpointer::complete() {
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<Pending> p = std::move(pending_);
  const ParallelContext& ctx = engine_.context();
  const int world = ctx.world ? ctx.world->size() : 1;
  // Every rank's file size and hash to the writer.
  uint64_t mine[kInfoWords] = {p->info.bytes};
  LOOM_CHECK(p->info.sha256.size() == 64, "shard file hash of {} characters",
             p->info.sha256.size());
  std::memcpy(mine + 1, p->info.sha256.data(), 64);
  const std::vector<uint64_t> all = ctx.world ? all_gather_words(*ctx.world, mine, kInfoWords)
                                              : std::vector<uint64_t>(mine, mine + kInfoWords);
  if (!ctx.writer()) return;
  const Config& cfg = engine_.config();
  json manifest = {{"format", "loom checkpoint v2"},
                   {"layout",
                    {{"world", world},
                     {"data", ctx.replicas()},
                     {"context", ctx.cp_size()},
                     {"tensor", cfg.parallel.tensor},
                     {"pipeline", cfg.parallel.pipeline},
                     {"expert", cfg.parallel.expert},
                     {"virtual_stages", cfg.parallel.virtual_stages},
                     {"zero_stage", cfg.zero.stage}}},
                   {"files", json::object()}};
  for (int r = 0; r < world; ++r) {
    const uint64_t* w = all.data() + static_cast<size_t>(r) * kInfoWords;
    manifest["files"][shard_file_name(r)] = {
        {"bytes", w[0]}, {"sha256", std::string(reinterpret_cast<const char*>(w + 1), 64)}};
  }
  manifest["tensors"] = index_shard_files(p->folder, world);
  SaveReport report;
  for (int r = 0; r < world; ++r) report.bytes += all[static_cast<size_t>(r) * kInfoWords];
  report.dir =
      finish_checkpoint(root_, p->state, p->config, std::move(manifest), cfg.checkpoint.keep_last);
  report.seconds = seconds_since(p->start);
  // Async: the training thread also waited for this completion (the other
  // ranks wait for it at their next collective).
  report.paused_s = p->async ? p->paused_s + seconds_since(t0) : report.seconds;
  report.async = p->async;
  if (on_saved_) on_saved_(report);
}

void Checkpointer::load(StepEngine& engine, const CheckpointReader& reader, bool moments) {
  for (int c = 0; c < engine.num_chunks(); ++c) {
    GptStage<float>& stage = engine.stage(c);
    ZeroEngine& zero = engine.zero(c);
    for (const auto& [state, prefix] : kStates) {
      if (state != State::kParams && !moments) continue;
      const std::vector<ZeroEngine::StateRange> held = zero.held(state);
      for (const Param& p : stage.layout().params()) {
        // A 16-bit run continues from its f32 masters; 16-bit weights would
        // lose what the masters keep (--init-from takes them as a start).
        if (moments && state == State::kParams && zero.dtype() != DType::kF32)
          LOOM_CHECK_KIND(kData, reader.stored_dtype(prefix + p.name) == DType::kF32,
                          "{}: '{}' is stored in {}, not f32: a {} run resumes from f32 master "
                          "weights, which this checkpoint does not hold (start from its "
                          "weights with --init-from instead)",
                          reader.where(), p.name, dtype_name(reader.stored_dtype(prefix + p.name)),
                          dtype_name(zero.dtype()));
        const ZeroEngine::StateRange& r = held[static_cast<size_t>(p.unit)];
        const auto [lo, hi] = intersect({r.begin, r.end}, {p.offset, p.offset + p.numel});
        if (lo < hi)
          reader.read(prefix + p.name, p, lo - p.offset, hi - p.offset, r.data + (lo - r.begin));
      }
    }
    // 16-bit runs loaded the masters; their parameters are them rounded.
    zero.sync_params();
    zero.release_offloaded();
    if (moments) load_compression(engine, c, reader);
  }
}

void Checkpointer::load_compression(StepEngine& engine, int chunk, const CheckpointReader& reader) {
  const ParallelContext& ctx = engine.context();
  const int tp_rank = ctx.tp ? ctx.tp->rank() : 0;
  const int dp_rank = ctx.dp ? ctx.dp->rank() : 0;
  GptStage<float>& stage = engine.stage(chunk);
  const int skip = stage.wte_is_copy() ? stage.wte_unit() : -1;
  for (const CompressionState& s : engine.zero(chunk).compression_state()) {
    const Param& p = *s.param;
    const bool copy = p.unit == skip;
    if (s.kind == CompressionState::kServerError) {
      // The pieces this rank serves now, from whatever ranks served them.
      const std::string name = compression_tensor(s, copy, 0, tp_rank);
      if (s.begin < s.end && reader.has(name)) reader.read(name, p, s.begin, s.end, s.data);
      continue;
    }
    if (s.kind == CompressionState::kQ) {
      // Saved at this slicing: continue from it; else the fresh Q stays.
      Param q;
      q.name = compression_tensor(s, copy, 0, tp_rank);
      q.shape = q.local = Shape{s.rows, s.cols};
      q.numel = s.rows * s.cols;
      if (reader.has(q.name) && Shape(reader.shape(q.name)) == q.shape)
        reader.read(q.name, q, 0, q.numel, s.data);
      continue;
    }
    // The error feedback of the saving data-parallel ranks: this rank's own
    // at the same data-parallel size; else every new rank takes their mean,
    // so that the mean error (what the group has yet to deliver) carries on.
    int saved = 0;
    while (reader.has(compression_tensor(s, copy, saved, 0))) ++saved;
    if (saved == 0) continue;  // saved without it: starts from zero
    if (saved == ctx.dp_size()) {
      reader.read(compression_tensor(s, copy, dp_rank, 0), p, 0, p.numel, s.data);
      continue;
    }
    std::vector<float> one(static_cast<size_t>(p.numel));
    std::fill(s.data, s.data + p.numel, 0.0f);
    for (int d = 0; d < saved; ++d) {
      reader.read(compression_tensor(s, copy, d, 0), p, 0, p.numel, one.data());
      for (int64_t i = 0; i < p.numel; ++i) s.data[i] += one[static_cast<size_t>(i)];
    }
    const float inv = 1.0f / static_cast<float>(saved);
    for (int64_t i = 0; i < p.numel; ++i) s.data[i] *= inv;
  }
}

}  // namespace loom
