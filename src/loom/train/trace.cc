#include "loom/train/trace.h"

#include "loom/core/error.h"
#include "loom/io/fs.h"

namespace loom {

using nlohmann::json;

namespace {

constexpr int kComputeTid = 0, kScheduleTid = 1, kFirstCommTid = 2;
constexpr int kTraceTag = 7102;  // rank traces to the writer

const char* pass_name(Pass p) {
  switch (p) {
    case Pass::kForward:
      return "forward";
    case Pass::kRecompute:
      return "recompute";
    case Pass::kBackward:
      return "backward";
    case Pass::kBackwardGradsOnly:
      return "weight gradients";
    case Pass::kBackwardInput:
      return "input gradients";
  }
  return "?";
}

}  // namespace

RunTrace::RunTrace(double origin, int64_t steps_kept) : origin_(origin), kept_(steps_kept) {}

void RunTrace::begin_step(int64_t step) {
  step_ = step;
}

void RunTrace::add(int tid, std::string name, std::string cat, double start, double end,
                   json args) {
  args["step"] = step_;
  events_.push_back({{"name", std::move(name)},
                     {"cat", std::move(cat)},
                     {"ph", "X"},
                     {"ts", (start - origin_) * 1e6},
                     {"dur", (end - start) * 1e6},
                     {"tid", tid},
                     {"args", std::move(args)}});
}

void RunTrace::observe(GptStage<float>& stage) {
  const size_t stage_id = open_.size();
  open_.emplace_back(stage.layout().units().size(), -1.0);
  const ParamLayout* layout = &stage.layout();
  stage.store().set_observer([this, stage_id, layout](int u, Pass pass, bool begin) {
    if (!keeping()) return;
    double& t0 = open_[stage_id][static_cast<size_t>(u)];
    if (begin) {
      t0 = comm_clock();
      return;
    }
    if (t0 < 0) return;
    add(kComputeTid, format("{} {}", pass_name(pass), layout->units()[static_cast<size_t>(u)].name),
        "compute", t0, comm_clock(), json::object());
    t0 = -1;
  });
}

int RunTrace::tid_of(const std::string& group) {
  for (size_t k = 0; k < groups_.size(); ++k)
    if (groups_[k] == group) return kFirstCommTid + static_cast<int>(k);
  groups_.push_back(group);
  return kFirstCommTid + static_cast<int>(groups_.size()) - 1;
}

void RunTrace::add_comm(const std::vector<CommEvent>& events) {
  if (!keeping()) return;
  for (const CommEvent& e : events) {
    json args = {{"bytes_sent", e.sent_bytes},
                 {"bytes_exact", e.exact},
                 {"count", e.count},
                 {"dtype", std::string(dtype_name(e.dtype))},
                 {"wire", std::string(dtype_name(e.wire))},
                 {"queued_ms", (e.started - e.enqueued) * 1e3}};
    if (!e.algo.empty()) args["algorithm"] = e.algo;
    if (e.peer >= 0) args["peer"] = e.peer;
    add(tid_of(e.group), e.algo.empty() ? e.kind : e.kind + " (" + e.algo + ")", "comm", e.started,
        e.ended, std::move(args));
  }
}

void RunTrace::add_schedule(const std::vector<pp::TraceSlice>& slices) {
  if (!keeping()) return;
  // The executor's slices are seconds from the same origin.
  for (const pp::TraceSlice& s : slices) {
    json args = json::object();
    if (s.instr.micro >= 0) args["micro_batch"] = s.instr.micro, args["chunk"] = s.instr.chunk;
    add(kScheduleTid, s.instr.describe(), pp::op_name(s.instr.op), origin_ + s.start,
        origin_ + s.end, std::move(args));
  }
}

void RunTrace::write(const ParallelContext& ctx, bool writer, const std::string& path) const {
  // Each rank's events with its row names, as bytes, to the writer.
  json mine = {{"events", events_}, {"groups", groups_}};
  const std::string text = mine.dump();
  std::vector<std::string> ranks;
  if (ctx.world) {
    const uint64_t n = text.size();
    const std::vector<uint64_t> sizes = all_gather_words(*ctx.world, &n, 1);
    if (writer) {
      for (int r = 0; r < ctx.world->size(); ++r) {
        if (r == ctx.world->rank()) {
          ranks.push_back(text);
          continue;
        }
        std::string s(sizes[static_cast<size_t>(r)], '\0');
        if (!s.empty()) ctx.world->recv(s.data(), s.size(), DType::kU8, r, kTraceTag)->wait();
        ranks.push_back(std::move(s));
      }
    } else if (!text.empty()) {
      ctx.world->send(text.data(), text.size(), DType::kU8, 0, kTraceTag)->wait();
    }
  } else {
    ranks.push_back(text);
  }
  if (!writer || path.empty()) return;
  json out = json::array();
  for (size_t r = 0; r < ranks.size(); ++r) {
    const json j = json::parse(ranks[r]);
    const GridCoord c = ctx.grid.coord(static_cast<int>(r));
    const int pid = static_cast<int>(r);
    auto meta = [&](const char* name, int tid, json args) {
      out.push_back({{"name", name}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", args}});
    };
    meta("process_name", 0,
         {{"name", format("rank {}: stage {} (tp {}, dp {}, ep {})", r, c.pp, c.tp, c.dp, c.ep)}});
    meta("process_sort_index", 0, {{"sort_index", pid}});
    meta("thread_name", kComputeTid, {{"name", "compute"}});
    bool schedule = false;
    for (const json& e : j["events"]) schedule = schedule || e["tid"] == kScheduleTid;
    if (schedule) meta("thread_name", kScheduleTid, {{"name", "pipeline schedule"}});
    const json& groups = j["groups"];
    for (size_t k = 0; k < groups.size(); ++k)
      meta("thread_name", kFirstCommTid + static_cast<int>(k),
           {{"name", "comm: " + groups[k].get<std::string>()}});
    for (json e : j["events"]) {
      e["pid"] = pid;
      out.push_back(std::move(e));
    }
  }
  const json trace = {{"traceEvents", out}, {"displayTimeUnit", "ms"}};
  write_file_atomic(path, trace.dump() + "\n");
}

}  // namespace loom
