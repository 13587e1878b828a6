#include "loom/report/report.h"

#include <algorithm>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <map>
#include <set>

#include "loom/core/error.h"
#include "loom/io/fs.h"
#include "loom/report/assets.h"

namespace loom {

namespace fs = std::filesystem;
using nlohmann::json;

Series downsample_minmax(const std::vector<double>& x, const std::vector<double>& y,
                         size_t buckets) {
  LOOM_CHECK(x.size() == y.size(), "downsample_minmax: {} x values, {} y values", x.size(),
             y.size());
  const size_t n = x.size();
  if (buckets == 0 || n <= 2 * buckets) return {x, y};
  Series out;
  size_t last_kept = n;
  auto keep = [&](size_t i) {
    if (i == n || i == last_kept) return;
    out.x.push_back(x[i]), out.y.push_back(y[i]);
    last_kept = i;
  };
  // Per bucket its least and greatest finite values and its first value
  // that is not finite (a NaN loss is a spike too), in step order.
  for (size_t b = 0; b < buckets; ++b) {
    const size_t begin = b * n / buckets, end = (b + 1) * n / buckets;
    size_t lo = n, hi = n, bad = n;
    for (size_t i = begin; i < end; ++i) {
      if (!std::isfinite(y[i])) {
        if (bad == n) bad = i;
        continue;
      }
      if (lo == n || y[i] < y[lo]) lo = i;
      if (hi == n || y[i] > y[hi]) hi = i;
    }
    size_t k[3] = {lo, hi, bad};
    std::sort(k, k + 3);
    for (size_t i : k) keep(i);
  }
  keep(n - 1);
  return out;
}

namespace {

std::string run_name(const std::string& dir) {
  fs::path p = fs::path(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  const std::string name = p.filename().string();
  return name.empty() || name == "." ? fs::absolute(p).filename().string() : name;
}

// A value at a JSON pointer, or `fallback` when the path is absent.
template <typename T>
T at(const json& j, const char* pointer, T fallback) {
  const json::json_pointer ptr(pointer);
  if (!j.contains(ptr) || j.at(ptr).is_null()) return fallback;
  try {
    return j.at(ptr).get<T>();
  } catch (const json::exception&) {
    return fallback;
  }
}

std::string model_summary(const json& c) {
  std::string s = format("{} layers, n_embd {}, {} heads, vocab {}, seq {}",
                         at<int64_t>(c, "/model/n_layer", 0), at<int64_t>(c, "/model/n_embd", 0),
                         at<int64_t>(c, "/model/n_head", 0), at<int64_t>(c, "/model/vocab_size", 0),
                         at<int64_t>(c, "/model/seq_len", 0));
  const int64_t experts = at<int64_t>(c, "/model/moe/num_experts", 0);
  if (experts > 0)
    s += format(", MoE {} experts top-{} every {} layers", experts,
                at<int64_t>(c, "/model/moe/top_k", 1),
                at<int64_t>(c, "/model/moe/every_n_layers", 1));
  return s;
}

std::string precision(const json& c) {
  std::string s = "f32";
  if (at<bool>(c, "/bf16/enabled", false)) s = "bf16 (f32 master weights)";
  if (at<bool>(c, "/fp16/enabled", false))
    s = at<double>(c, "/fp16/loss_scale", 0) > 0 ? "fp16, static loss scale"
                                                 : "fp16, dynamic loss scale";
  const std::string inputs = at<std::string>(c, "/kernels/gemm_inputs", "");
  if (!inputs.empty()) s += ", GEMM inputs " + inputs;
  return s;
}

// The layout panel's rows: what the run was, as pairs of label and value.
json layout_rows(const RunRecord& r) {
  const json& c = r.config;
  const json& info = r.info;
  const json& last = r.steps.back();
  json rows = json::array();
  auto row = [&](const std::string& k, const std::string& v) { rows.push_back({k, v}); };
  const int tp = at<int>(c, "/parallel/tensor", 1), pp = at<int>(c, "/parallel/pipeline", 1),
            ep = at<int>(c, "/parallel/expert", 1);
  const int world = at<int>(info, "/world", at<int>(c, "/parallel/data", 1) * tp * pp);
  row("model", model_summary(c));
  row("ranks",
      format("{}: data {} x tensor {}{} x pipeline {}, expert {}", world,
             at<int>(c, "/parallel/data", std::max(1, world / std::max(1, tp * pp))), tp,
             at<bool>(c, "/parallel/sequence_parallel", false) ? " (sequence parallel)" : "", pp,
             ep));
  row("ZeRO stage", std::to_string(at<int>(c, "/zero_optimization/stage", 0)));
  row("precision", precision(c));
  row("batch",
      format("{} sequences (micro-batch {} x accumulation {}), {} tokens per step",
             at<int64_t>(c, "/train_batch_size", 0),
             at<int64_t>(c, "/train_micro_batch_size_per_gpu", 0),
             at<int64_t>(c, "/gradient_accumulation_steps", 0),
             at<int64_t>(c, "/train_batch_size", 0) * at<int64_t>(c, "/model/seq_len", 0)));
  row("optimizer", format("{}, lr {}", at<std::string>(c, "/optimizer/type", "?"),
                          at<double>(c, "/optimizer/params/lr", 0)));
  if (pp > 1) {
    std::string sched = at<std::string>(c, "/parallel/schedule", "?");
    const int v = at<int>(c, "/parallel/virtual_stages", 1);
    if (v > 1) sched += format(", {} chunks per stage", v);
    row("schedule", sched);
    std::string parts = at<std::string>(c, "/parallel/partition", "uniform");
    if (info.contains("partition") && info["partition"].is_array()) {
      parts += ": blocks";
      int first = 0;
      for (const json& n : info["partition"]) {
        const int k = n.get<int>();
        parts += format(" [{}, {})", first, first + k);
        first += k;
      }
    }
    row("partition", parts);
  }
  std::string ckpt = at<std::string>(c, "/activation_checkpointing/policy", "none");
  if (ckpt == "every_n")
    ckpt += format(" ({})", at<int>(c, "/activation_checkpointing/every_n", 1));
  if (ckpt == "budget")
    ckpt += format(" ({} bytes)", at<int64_t>(c, "/activation_checkpointing/budget_bytes", 0));
  row("activation checkpointing", ckpt);
  const std::string comp = at<std::string>(c, "/comm/compression/type", "none");
  if (comp != "none") row("gradient compression", comp);
  row("GEMM",
      format("{}, {} ({} GFLOP/s peak per rank)", at<std::string>(last, "/gemm_backend", "?"),
             at<std::string>(last, "/gemm_path", "?"),
             std::llround(at<double>(last, "/peak_gflops", 0))));
  if (!info.empty()) {
    row("CPU", format("{} ({}), {} threads per rank", at<std::string>(info, "/cpu", "?"),
                      at<std::string>(info, "/isa", "?"), at<int>(info, "/threads", 1)));
    if (info.contains("hosts")) row("hosts", at<std::string>(info, "/hosts", ""));
    row("loom", at<std::string>(info, "/loom_version", "?") + ", started " +
                    at<std::string>(info, "/started", "?"));
  }
  return rows;
}

json series_json(const Series& s) {
  return {{"x", s.x}, {"y", s.y}};
}

// The per-step scalar series the charts draw, by name.
json step_series(const RunRecord& r, size_t buckets) {
  const size_t n = r.steps.size();
  std::vector<double> steps(n);
  for (size_t i = 0; i < n; ++i) steps[i] = r.steps[i]["step"].get<double>();
  std::map<std::string, std::vector<double>> ys;
  std::map<std::string, std::vector<bool>> present;  // the step has the field
  auto put = [&](const std::string& name, size_t i, double v) {
    std::vector<double>& y = ys[name];
    if (y.empty()) y.assign(n, NAN), present[name].assign(n, false);
    y[i] = v;
    present[name][i] = true;
  };
  const char* scalars[] = {"loss",         "lr",  "grad_norm",  "loss_scale",
                           "tokens_per_s", "mfu", "comm_bytes", "bubble_fraction"};
  std::set<int> moe_layers;
  for (size_t i = 0; i < n; ++i) {
    const json& s = r.steps[i];
    // A value written as null was not finite (a NaN loss, an overflowed
    // norm): a point the page marks.
    for (const char* k : scalars)
      if (s.contains(k) && (s[k].is_number() || s[k].is_null()))
        put(k, i, s[k].is_number() ? s[k].get<double>() : NAN);
    if (s.contains("time") && s["time"].is_object()) {
      const json& t = s["time"];
      for (const char* k : {"step", "forward", "backward", "recompute", "optimizer", "comm_exposed",
                            "bubble", "all_to_all"})
        if (t.contains(k) && t[k].is_number()) put(std::string("time.") + k, i, t[k].get<double>());
      if (t.contains("comm") && t.contains("comm_exposed"))
        put("time.comm_hidden", i,
            std::max(0.0, t["comm"].get<double>() - t["comm_exposed"].get<double>()));
    }
    if (s.contains("mem") && s["mem"].is_object())
      for (const auto& [k, v] : s["mem"].items())
        if (v.is_number()) put("mem." + k, i, v.get<double>());
    if (s.contains("moe") && s["moe"].is_array())
      for (const json& l : s["moe"]) {
        const int layer = l.value("layer", 0);
        moe_layers.insert(layer);
        put(format("moe.{}.imbalance", layer), i, l.value("imbalance", 0.0));
        put(format("moe.{}.dropped", layer), i, l.value("dropped", 0.0));
      }
  }
  json out = json::object();
  for (const auto& [name, y] : ys) {
    // A field a step lacks is a gap, not a point.
    std::vector<double> xs, vs;
    const std::vector<bool>& has = present[name];
    for (size_t i = 0; i < n; ++i)
      if (has[i]) xs.push_back(steps[i]), vs.push_back(y[i]);
    const Series kept = downsample_minmax(xs, vs, buckets);
    out[name] = series_json(kept);
    out[name]["points"] = xs.size();  // before downsampling
  }
  return out;
}

// Steps whose update was skipped: where skipped_steps rose.
json skipped_steps(const RunRecord& r, size_t buckets) {
  std::vector<double> x, y;
  int64_t before = 0;
  for (const json& s : r.steps) {
    const int64_t k = s.value("skipped_steps", int64_t{0});
    if (k > before) x.push_back(s["step"].get<double>()), y.push_back(s.value("loss_scale", 1.0));
    before = k;
  }
  // Markers, not a curve: beyond the budget keep the first ones.
  const size_t cap = 4 * std::max<size_t>(buckets, 1);
  const size_t total = x.size();
  if (x.size() > cap) x.resize(cap), y.resize(cap);
  json j = series_json({x, y});
  j["total"] = total;
  return j;
}

// Per MoE layer: the share of assignments each expert took, as the mean
// over columns of consecutive steps (at most `columns`).
json moe_load(const RunRecord& r, size_t columns) {
  std::map<int, std::vector<std::pair<double, std::vector<double>>>> per_layer;
  for (const json& s : r.steps) {
    if (!s.contains("moe") || !s["moe"].is_array()) continue;
    for (const json& l : s["moe"])
      if (l.contains("load") && l["load"].is_array())
        per_layer[l.value("layer", 0)].push_back(
            {s["step"].get<double>(), l["load"].get<std::vector<double>>()});
  }
  json out = json::array();
  for (const auto& [layer, rows] : per_layer) {
    const size_t n = rows.size(), cols = std::min(n, std::max<size_t>(columns, 1));
    const size_t experts = rows.front().second.size();
    json first = json::array(), last = json::array(), load = json::array();
    for (size_t c = 0; c < cols; ++c) {
      const size_t begin = c * n / cols, end = (c + 1) * n / cols;
      std::vector<double> mean(experts, 0.0);
      for (size_t i = begin; i < end; ++i)
        for (size_t e = 0; e < experts && e < rows[i].second.size(); ++e)
          mean[e] += rows[i].second[e] / double(end - begin);
      first.push_back(rows[begin].first), last.push_back(rows[end - 1].first);
      load.push_back(mean);
    }
    out.push_back(
        {{"layer", layer}, {"experts", experts}, {"first", first}, {"last", last}, {"load", load}});
  }
  return out;
}

// profile.json (log.profile) as the page shows it: the per-layer table of
// each stage's first rank (stage, piece, parameters, GFLOP, forward,
// backward and recompute ms, share of the step, GFLOP/s), a row per rank
// (rank, host, stage, step, compute and exposed communication ms, MB sent,
// peak MB) and the imbalance findings; null without a profile.
json profile_rows(const json& p) {
  if (!p.is_object()) return nullptr;
  json layers = json::array(), ranks = json::array();
  std::set<int> stages;
  for (const json& r : p.value("ranks", json::array())) {
    const int stage = r["coord"].value("pp", 0);
    const double step = r.value("step_s", 0.0);
    double peak = 0;
    const json mem = r.value("mem_peak_bytes", json::object());
    for (const auto& [k, v] : mem.items())
      if (v.is_number()) peak += v.get<double>();
    ranks.push_back({r.value("rank", 0), r.value("host", ""), stage, 1e3 * step,
                     1e3 * r.value("compute_s", 0.0), 1e3 * r.value("exposed_s", 0.0),
                     r.value("comm_bytes", 0.0) / 1e6, peak / 1e6});
    if (!stages.insert(stage).second) continue;  // the stage's first rank stands for it
    for (const json& c : r.value("chunks", json::array()))
      for (const json& q : c.value("pieces", json::array())) {
        const double f = q.value("forward_s", 0.0), b = q.value("backward_s", 0.0),
                     rc = q.value("recompute_s", 0.0), flops = q.value("flops", 0.0);
        layers.push_back({stage, q.value("name", ""), q.value("params", 0), flops / 1e9, 1e3 * f,
                          1e3 * b, 1e3 * rc, step > 0 ? (f + b + rc) / step : 0.0,
                          f + b + rc > 0 ? flops / (f + b + rc) / 1e9 : 0.0});
      }
  }
  return {{"layers", layers},
          {"ranks", ranks},
          {"steps", p["shape"].value("steps", 0)},
          {"imbalance", p.value("imbalance", json::array())}};
}

// The timeline of trace.json, a row per rank: the pipeline's instructions
// where the run was pipelined, its compute otherwise; [step, start ms,
// duration ms, name, category] per slice.
json trace_rows(const json& trace) {
  if (!trace.is_object() || !trace.contains("traceEvents")) return nullptr;
  std::map<std::pair<int, int>, std::string> thread_names;
  std::map<int, std::string> process_names;
  for (const json& e : trace["traceEvents"]) {
    if (e.value("ph", "") != "M") continue;
    const int pid = e.value("pid", 0), tid = e.value("tid", 0);
    const std::string name = e.contains("args") ? e["args"].value("name", "") : "";
    if (e.value("name", "") == "process_name") process_names[pid] = name;
    if (e.value("name", "") == "thread_name") thread_names[{pid, tid}] = name;
  }
  // Per rank, the schedule's row when it has one.
  std::map<int, int> row_tid;
  for (const auto& [key, name] : thread_names) {
    if (name == "pipeline schedule") row_tid[key.first] = key.second;
    if (name == "compute" && !row_tid.count(key.first)) row_tid[key.first] = key.second;
  }
  std::map<int, json> events;
  std::set<int64_t> steps;
  for (const json& e : trace["traceEvents"]) {
    if (e.value("ph", "") != "X") continue;
    const int pid = e.value("pid", 0);
    auto it = row_tid.find(pid);
    if (it == row_tid.end() || e.value("tid", -1) != it->second) continue;
    const int64_t step = e.contains("args") ? e["args"].value("step", int64_t{0}) : 0;
    steps.insert(step);
    events[pid].push_back({step, e.value("ts", 0.0) / 1e3, e.value("dur", 0.0) / 1e3,
                           e.value("name", ""), e.value("cat", "")});
  }
  json ranks = json::array();
  for (const auto& [pid, tid] : row_tid)
    ranks.push_back(
        {{"name", process_names.count(pid) ? process_names[pid] : format("rank {}", pid)},
         {"row", thread_names[{pid, tid}]},
         {"events", events.count(pid) ? events[pid] : json::array()}});
  if (ranks.empty()) return nullptr;
  return {{"steps", steps}, {"ranks", ranks}};
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

}  // namespace

namespace {

// metrics.jsonl's step records into r.steps; what cannot be read, noted.
void read_metrics(const std::string& text, RunRecord& r) {
  size_t line_no = 0, pos = 0;
  int64_t last_step = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const bool unterminated = end == std::string::npos;
    if (unterminated) end = text.size();
    const std::string line = text.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    const bool record = j.is_object() && j.contains("step") && j["step"].is_number_integer();
    if (!record) {
      r.damage.push_back(
          unterminated ? format("metrics.jsonl line {} is incomplete (being written, or the run "
                                "stopped while writing it): skipped",
                                line_no)
                       : format("metrics.jsonl line {} is not a step record: skipped", line_no));
      continue;
    }
    const int64_t step = j["step"].get<int64_t>();
    if (step <= last_step) {
      r.damage.push_back(format("metrics.jsonl line {} holds step {} after step {}: skipped",
                                line_no, step, last_step));
      continue;
    }
    last_step = step;
    r.steps.push_back(std::move(j));
  }
}

// trace.json and profile.json, when present and of this run.
template <typename Stale>
void read_optional(const fs::path& root, const Stale& stale, RunRecord& r) {
  std::error_code ec;
  if (fs::exists(root / "trace.json", ec) && stale("trace.json")) {
    r.damage.push_back("trace.json is older than run.json (an earlier run's): no timeline");
  } else if (fs::exists(root / "trace.json", ec)) {
    r.trace = json::parse(read_file((root / "trace.json").string()), nullptr, false);
    if (r.trace.is_discarded()) {
      r.trace = nullptr;
      r.damage.push_back("trace.json is not JSON: no timeline");
    }
  }
  if (fs::exists(root / "profile.json", ec) && stale("profile.json")) {
    r.damage.push_back("profile.json is older than run.json (an earlier run's): no profile");
  } else if (fs::exists(root / "profile.json", ec)) {
    r.profile = json::parse(read_file((root / "profile.json").string()), nullptr, false);
    if (!r.profile.is_object() || !r.profile.contains("ranks") || !r.profile.contains("shape")) {
      r.profile = nullptr;
      r.damage.push_back("profile.json is not a profile: no profile panels");
    }
  }
}

}  // namespace

RunRecord read_run(const std::string& dir, uint64_t metrics_bytes) {
  std::error_code ec;
  LOOM_CHECK_KIND(kData, fs::exists(dir, ec), "{} does not exist", dir);
  LOOM_CHECK_KIND(kData, fs::is_directory(dir, ec),
                  "{} is not a run folder: it is a file (give the folder loom train wrote, "
                  "--out DIR)",
                  dir);
  const fs::path root(dir);
  for (const char* f : {"metrics.jsonl", "config.resolved.json"})
    LOOM_CHECK_KIND(kData, fs::exists(root / f, ec),
                    "{} is not a run folder: it has no {} (loom train writes metrics.jsonl and "
                    "config.resolved.json into its --out folder)",
                    dir, f);
  RunRecord r;
  r.dir = dir;
  r.name = run_name(dir);
  r.config = read_json_file((root / "config.resolved.json").string());
  r.info = json::object();
  if (fs::exists(root / "run.json", ec)) {
    json info = json::parse(read_file((root / "run.json").string()), nullptr, false);
    if (info.is_object())
      r.info = std::move(info);
    else
      r.damage.push_back("run.json is not JSON: the layout panel lacks the CPU and loom version");
  }
  std::string text = read_file((root / "metrics.jsonl").string());
  if (metrics_bytes > 0 && metrics_bytes < text.size()) text.resize(metrics_bytes);
  // An output older than run.json (rewritten at every start) is left from
  // an earlier run in the folder.
  auto stale = [&](const char* f) {
    if (!fs::exists(root / "run.json", ec)) return false;
    const auto t = fs::last_write_time(root / f, ec);
    const auto start = fs::last_write_time(root / "run.json", ec);
    return !ec && t < start;
  };
  read_metrics(text, r);
  LOOM_CHECK_KIND(kData, !r.steps.empty(), "{} has no steps yet: {}", dir,
                  r.damage.empty()
                      ? "metrics.jsonl is empty"
                      : "no line of metrics.jsonl is a step record (" + r.damage.front() + ")");
  read_optional(root, stale, r);
  return r;
}

json report_data(const std::vector<RunRecord>& runs, const ReportOptions& o) {
  LOOM_CHECK(!runs.empty(), "report_data: no runs");
  json notes = json::array();
  // Labels: the folder names, or the folders where two names are alike.
  std::map<std::string, int> seen;
  for (const RunRecord& r : runs) ++seen[r.name];
  std::set<std::string> models;
  for (const RunRecord& r : runs) models.insert(model_summary(r.config));
  if (models.size() > 1) {
    std::string s = "the runs train different models:";
    for (const RunRecord& r : runs) s += format(" {}: {};", r.name, model_summary(r.config));
    s.pop_back();
    notes.push_back(s);
  }
  json out = json::array();
  for (const RunRecord& r : runs) {
    json j;
    j["name"] = seen[r.name] > 1 ? r.dir : r.name;
    j["dir"] = r.dir;
    j["model"] = model_summary(r.config);
    j["total_steps"] = at<int64_t>(r.config, "/train/steps", 0);
    j["last_step"] = r.steps.back()["step"];
    j["records"] = r.steps.size();
    j["tokens_per_step"] =
        at<int64_t>(r.config, "/train_batch_size", 0) * at<int64_t>(r.config, "/model/seq_len", 0);
    j["damage"] = r.damage;
    j["layout"] = layout_rows(r);
    j["series"] = step_series(r, o.buckets);
    std::vector<double> vx, vy;
    for (const json& s : r.steps)
      if (s.contains("val_loss") && s["val_loss"].is_number())
        vx.push_back(s["step"].get<double>()), vy.push_back(s["val_loss"].get<double>());
    j["val"] = series_json(downsample_minmax(vx, vy, o.buckets));
    j["skips"] = skipped_steps(r, o.buckets);
    j["moe_load"] = moe_load(r, std::min<size_t>(o.buckets, 400));
    j["trace"] = trace_rows(r.trace);
    j["profile"] = profile_rows(r.profile);
    out.push_back(std::move(j));
    for (const std::string& d : r.damage) notes.push_back(format("{}: {}", r.name, d));
  }
  return {{"generated", utc_now()}, {"generated_epoch", static_cast<int64_t>(std::time(nullptr))},
          {"live", o.live},         {"refresh_s", o.refresh_s},
          {"stopped", o.stopped},   {"buckets", o.buckets},
          {"notes", notes},         {"runs", out}};
}

std::string report_html(const json& data) {
  // Inside <script>, "</script" or "<!--" in a string would end or derail
  // the element: every '<' of the data goes as its JSON escape.
  std::string payload;
  // (Text that is not UTF-8, a folder's name, is replaced, not an error.)
  for (char ch : data.dump(-1, ' ', false, json::error_handler_t::replace)) {
    if (ch == '<')
      payload += "\\u003c";
    else
      payload += ch;
  }
  std::string title = "loom report";
  for (const json& r : data["runs"]) title += " " + r["name"].get<std::string>();
  std::string safe_title;
  for (char ch : title)
    safe_title += ch == '<' ? std::string("&lt;") : ch == '&' ? "&amp;" : std::string(1, ch);
  std::string html;
  html += "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n";
  html += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
  html += "<title>" + safe_title + "</title>\n<style>\n";
  html += report_assets::kUplotCss;
  html += "\n";
  html += report_assets::kReportCss;
  html += "\n</style></head>\n<body>\n<div id=\"app\"></div>\n";
  html += "<script id=\"loom-data\" type=\"application/json\">" + payload + "</script>\n<script>\n";
  html += report_assets::kUplotJs;
  html += "\n</script>\n<script>\n";
  html += report_assets::kReportJs;
  html += "\n</script>\n</body></html>\n";
  return html;
}

ReportSummary write_report(const ReportOptions& o) {
  LOOM_CHECK_KIND(kConfig, !o.runs.empty(), "loom report: no run folder given");
  LOOM_CHECK_KIND(kConfig, !o.out.empty(), "loom report: no output file (--out)");
  std::vector<RunRecord> runs;
  for (const std::string& dir : o.runs) runs.push_back(read_run(dir, o.metrics_bytes));
  const json data = report_data(runs, o);
  const std::string html = report_html(data);
  const fs::path out(o.out);
  if (out.has_parent_path()) fs::create_directories(out.parent_path());
  write_file_atomic(o.out, html);
  ReportSummary s;
  s.runs = runs.size();
  for (const RunRecord& r : runs) s.steps += r.steps.size();
  s.bytes = html.size();
  for (const json& n : data["notes"]) s.notes.push_back(n.get<std::string>());
  return s;
}

}  // namespace loom
