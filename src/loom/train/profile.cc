#include "loom/train/profile.h"

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <numeric>

#include "loom/comm/process_group.h"
#include "loom/core/error.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/train/config.h"
#include "loom/train/step_engine.h"

namespace loom {

using json = nlohmann::json;

namespace {

constexpr int kProfileTag = 7103;  // rank profiles to the writer

std::string printf_string(const char* fmt, ...) {
  va_list ap, again;
  va_start(ap, fmt);
  va_copy(again, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string out(static_cast<size_t>(std::max(0, n)) + 1, '\0');
  std::vsnprintf(out.data(), out.size(), fmt, again);
  va_end(again);
  out.resize(static_cast<size_t>(std::max(0, n)));
  return out;
}

double mean(const std::vector<double>& v) {
  return v.empty() ? 0 : std::accumulate(v.begin(), v.end(), 0.0) / double(v.size());
}

size_t argmax(const std::vector<double>& v) {
  return static_cast<size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// max / mean - 1 (0 for an empty or all-zero list).
double over_mean(const std::vector<double>& v) {
  const double m = mean(v);
  return m > 0 ? *std::max_element(v.begin(), v.end()) / m - 1 : 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[(v.size() - 1) / 2];
}

std::string list(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

std::string where(const JobProfile& p, size_t r) {
  const RankProfile& k = p.ranks[r];
  std::string s = "rank " + std::to_string(k.rank);
  if (p.shape.pp > 1) s += " (stage " + std::to_string(k.coord.pp) + ")";
  if (!k.host.empty()) s += " on " + k.host;
  return s;
}

double ms(double s) {
  return s * 1e3;
}

double mb(double b) {
  return b / 1e6;
}

// "stage 1" without virtual stages, else "part 3 (stage 1)".
std::string part_name(const JobShape& s, int part) {
  if (s.virtual_stages <= 1) return "stage " + std::to_string(part);
  return "part " + std::to_string(part) + " (stage " + std::to_string(part % s.pp) + ")";
}

// Which blocks change parts between two cuts, in words.
std::string moves(const JobShape& s, const std::vector<int>& from, const std::vector<int>& to) {
  std::string out;
  int a = 0, b = 0;
  for (size_t k = 0; k + 1 < from.size(); ++k) {
    a += from[k], b += to[k];  // the boundary after part k
    if (a == b) continue;
    const int lo = std::min(a, b), hi = std::max(a, b);
    const std::string blocks = hi - lo == 1
                                   ? "h." + std::to_string(lo)
                                   : "h." + std::to_string(lo) + "-h." + std::to_string(hi - 1);
    const int src = b < a ? static_cast<int>(k) : static_cast<int>(k) + 1;
    const int dst = b < a ? static_cast<int>(k) + 1 : static_cast<int>(k);
    out += (out.empty() ? "" : ", ") + blocks + " from " + part_name(s, src) + " to " +
           part_name(s, dst);
  }
  return out;
}

// The measured pieces as the partitioner's costs (seconds per step, the
// mean over the ranks holding each piece); false when the profile does not
// cover every block.
bool measured_costs(const JobProfile& p, pp::ModelCosts& costs) {
  std::map<std::string, std::pair<double, int>> sum;
  int n_layer = 0;
  for (const RankProfile& r : p.ranks)
    for (const ChunkProfile& c : r.chunks) {
      n_layer = std::max(n_layer, c.last);
      for (const PieceProfile& q : c.pieces) {
        auto& [s, n] = sum[q.name];
        s += q.seconds(), ++n;
      }
    }
  auto at = [&](const std::string& name) {
    auto it = sum.find(name);
    return it == sum.end() ? 0.0 : it->second.first / it->second.second;
  };
  costs.embedding.seconds = at("embeddings");
  costs.head.seconds = at("ln_f") + at("lm_head");
  costs.blocks.assign(static_cast<size_t>(n_layer), {});
  for (int i = 0; i < n_layer; ++i) {
    if (!sum.count("h." + std::to_string(i))) return false;
    costs.blocks[static_cast<size_t>(i)].seconds = at("h." + std::to_string(i));
  }
  return n_layer > 0;
}

// Pipelined: the cut the measured layer times favour, when it beats the
// run's by more than 2%.
std::string partition_suggestion(const JobProfile& p) {
  const JobShape& s = p.shape;
  pp::ModelCosts costs;
  const int parts = s.pp * s.virtual_stages;
  if (!measured_costs(p, costs) || static_cast<int>(s.partition.size()) != parts) return "";
  const std::vector<double> in_flight(static_cast<size_t>(parts), 1.0);
  auto slowest = [&](const std::vector<int>& counts) {
    double m = 0;
    for (const pp::PartCost& c : pp::part_costs(costs, counts, in_flight))
      m = std::max(m, c.seconds);
    return m;
  };
  const std::vector<int> best = pp::balanced_partition(costs, parts, in_flight, 0);
  const double now = slowest(s.partition), then = slowest(best);
  if (best == s.partition || then > 0.98 * now) return "";
  return printf_string(
      "parallel.partition %s (%s): the slowest part %.1f -> %.1f ms a step, predicted from "
      "the measured layer times (`parallel.partition: balanced` measures them at start)",
      list(best).c_str(), moves(s, s.partition, best).c_str(), ms(now), ms(then));
}

// Pipelined with a large bubble: more micro-batches of the same global
// batch.
std::string bubble_suggestion(const JobProfile& p, double bubble) {
  const JobShape& s = p.shape;
  if (s.pp <= 1 || s.schedule == "zero_bubble" || bubble <= 0.2) return "";
  const int64_t m = s.micro_batches, b = s.micro_batch, pm1 = s.pp - 1;
  const int64_t v = std::max(1, s.virtual_stages);
  auto theory = [&](int64_t mb) { return double(pm1) / double(v * mb + pm1); };
  const int64_t need = (9 * pm1 + v - 1) / v;  // (p - 1) / (v m + p - 1) <= 10%
  if (m >= need) return "";
  int64_t k = b;
  for (int64_t d = 1; d <= b; ++d)
    if (b % d == 0 && m * d >= need) {
      k = d;
      break;
    }
  // Past what the micro-batch size can give, the global batch grows.
  const bool grows = m * k < need;
  const int64_t micro_batches = grows ? need : m * k;
  std::string text =
      printf_string("the bubble is %.0f%% of the step: gradient_accumulation_steps %ld",
                    100 * bubble, long(micro_batches));
  if (k > 1) text += printf_string(" with train_micro_batch_size_per_gpu %ld", long(b / k));
  text += printf_string(" (theory %.0f%% -> %.0f%%", 100 * theory(m), 100 * theory(micro_batches));
  text += grows ? printf_string("; the global batch grows %.1fx)",
                                double(micro_batches * (b / k)) / double(m * b))
                : ", the same global batch)";
  return text + ", or parallel.schedule zero_bubble";
}

Finding compute_finding(const JobProfile& p) {
  const JobShape& s = p.shape;
  std::vector<double> busy;
  for (const RankProfile& r : p.ranks) busy.push_back(r.compute_s());
  Finding f;
  f.kind = "compute";
  const size_t top = argmax(busy);
  f.rank = p.ranks[top].rank;
  f.imbalance = over_mean(busy);
  f.detail = printf_string("%s computes %.1f ms a step, the mean rank %.1f ms",
                           where(p, top).c_str(), ms(busy[top]), ms(mean(busy)));
  std::vector<std::string> tips;
  double stage_imbalance = 0;
  if (s.pp > 1) {
    std::vector<double> stage(static_cast<size_t>(s.pp), 0.0), count(stage.size(), 0.0);
    for (size_t r = 0; r < p.ranks.size(); ++r) {
      stage[static_cast<size_t>(p.ranks[r].coord.pp)] += busy[r];
      count[static_cast<size_t>(p.ranks[r].coord.pp)] += 1;
    }
    std::string per;
    for (size_t k = 0; k < stage.size(); ++k) {
      stage[k] /= std::max(1.0, count[k]);
      per += printf_string("%s%.1f", k ? ", " : "", ms(stage[k]));
    }
    stage_imbalance = over_mean(stage);
    f.detail += printf_string("; per stage %s ms (%.0f%% over the mean)", per.c_str(),
                              100 * stage_imbalance);
    if (stage_imbalance > kComputeImbalance) {
      const std::string cut = partition_suggestion(p);
      tips.push_back(cut.empty() ? "no contiguous cut of the measured layer times does better "
                                   "(the embeddings or the head outweigh a block)"
                                 : cut);
    }
    double bubble = 0;
    for (const RankProfile& r : p.ranks) bubble += r.bubble_fraction / double(p.ranks.size());
    const std::string more = bubble_suggestion(p, bubble);
    if (!more.empty()) tips.push_back(more);
  }
  // Peers: ranks of the same stage do the same work.
  double worst = 1;
  size_t slow = 0, peers = 0;
  for (int st = 0; st < s.pp; ++st) {
    std::vector<double> v;
    std::vector<size_t> who;
    for (size_t r = 0; r < p.ranks.size(); ++r)
      if (p.ranks[r].coord.pp == st) v.push_back(busy[r]), who.push_back(r);
    if (v.size() < 2) continue;
    const double med = median(v);
    for (size_t i = 0; i < v.size(); ++i)
      if (med > 0 && v[i] / med > worst) worst = v[i] / med, slow = who[i], peers = v.size() - 1;
  }
  if (worst > 1 + kComputeImbalance) {
    f.detail += printf_string("; %s computes %.2fx the median of its %zu peers",
                              where(p, slow).c_str(), worst, peers);
    tips.push_back(printf_string(
        "%s is slower on the same work: a slower or busier host (run `loom bench gemm` there, "
        "or leave it out of the hostfile)",
        where(p, slow).c_str()));
  }
  if (f.imbalance > kComputeImbalance || stage_imbalance > kComputeImbalance)
    for (const std::string& t : tips) f.suggestion += (f.suggestion.empty() ? "" : "; ") + t;
  else if (!tips.empty())
    f.suggestion = tips.back();
  return f;
}

Finding memory_finding(const JobProfile& p) {
  const JobShape& s = p.shape;
  std::vector<double> total;
  for (const RankProfile& r : p.ranks) total.push_back(r.mem_total());
  Finding f;
  f.kind = "memory";
  const size_t top = argmax(total);
  f.rank = p.ranks[top].rank;
  f.imbalance = over_mean(total);
  // The category the largest rank is furthest above the mean in.
  int cat = 0;
  double excess = -1, cat_mean = 0;
  for (int c = 0; c < kNumMemCategories; ++c) {
    double m = 0;
    for (const RankProfile& r : p.ranks) m += r.mem_peak[static_cast<size_t>(c)];
    m /= double(p.ranks.size());
    const double e = p.ranks[top].mem_peak[static_cast<size_t>(c)] - m;
    if (e > excess) excess = e, cat = c, cat_mean = m;
  }
  const std::string name(mem_category_name(static_cast<MemCategory>(cat)));
  f.detail = printf_string(
      "%s peaks at %.1f MB, the mean rank %.1f MB; most above the mean in %s (%.1f MB, mean %.1f "
      "MB)",
      where(p, top).c_str(), mb(total[top]), mb(mean(total)), name.c_str(),
      mb(p.ranks[top].mem_peak[static_cast<size_t>(cat)]), mb(cat_mean));
  if (f.imbalance <= kMemoryImbalance) return f;
  const MemCategory c = static_cast<MemCategory>(cat);
  const int stage = p.ranks[top].coord.pp;
  if (c == MemCategory::kActivations) {
    f.suggestion = printf_string(
        "activation_checkpointing {\"policy\": \"budget\", \"budget_bytes\": %.0f}: the ranks "
        "above the mean's activations recompute, the others keep everything",
        cat_mean >= 1e6 ? std::floor(cat_mean / 1e6) * 1e6 : std::max(1.0, std::round(cat_mean)));
  } else if ((c == MemCategory::kParams || c == MemCategory::kGrads ||
              c == MemCategory::kOptimizer) &&
             s.pp > 1 && s.virtual_stages == 1 && static_cast<int>(s.partition.size()) == s.pp &&
             s.partition[static_cast<size_t>(stage)] > 1) {
    // One block off the heavy stage, to its lighter neighbour.
    auto stage_total = [&](int st) {
      double m = 0;
      for (size_t r = 0; r < p.ranks.size(); ++r)
        if (p.ranks[r].coord.pp == st) m = std::max(m, total[r]);
      return m;
    };
    int to = stage == 0 ? 1 : stage == s.pp - 1 ? stage - 1 : -1;
    if (to < 0) to = stage_total(stage - 1) <= stage_total(stage + 1) ? stage - 1 : stage + 1;
    std::vector<int> cut = s.partition;
    --cut[static_cast<size_t>(stage)];
    ++cut[static_cast<size_t>(to)];
    f.suggestion =
        printf_string("parallel.partition %s (%s) moves a block's %s off %s", list(cut).c_str(),
                      moves(s, s.partition, cut).c_str(), name.c_str(), where(p, top).c_str());
  } else if ((c == MemCategory::kParams || c == MemCategory::kGrads ||
              c == MemCategory::kOptimizer) &&
             s.dp > 1 && s.zero_stage < 3) {
    const int need = c == MemCategory::kOptimizer ? 1 : c == MemCategory::kGrads ? 2 : 3;
    f.suggestion =
        printf_string("zero_optimization.stage %d shards the %s over the %d data-parallel ranks",
                      std::max(need, s.zero_stage + 1), name.c_str(), s.dp);
  } else if (c == MemCategory::kComm) {
    f.suggestion =
        "a smaller zero_optimization.reduce_bucket_size (and stage3_prefetch_bucket_size) "
        "bounds the communication buffers";
  } else if (c == MemCategory::kWorkspace) {
    f.suggestion =
        "the kernels' scratch grows with the micro-batch: a smaller "
        "train_micro_batch_size_per_gpu with more gradient_accumulation_steps";
  }
  return f;
}

Finding comm_finding(const JobProfile& p) {
  const JobShape& s = p.shape;
  std::vector<double> sent, exposed;
  for (const RankProfile& r : p.ranks) sent.push_back(r.comm_bytes), exposed.push_back(r.exposed_s);
  Finding f;
  f.kind = "communication";
  const size_t top = argmax(sent), late = argmax(exposed);
  f.rank = p.ranks[top].rank;
  f.imbalance = over_mean(sent);
  // What a group is: a grid group's name, or "world" resolved by the
  // shape (the grid dimension that is the whole job); messages are the
  // pipeline's whatever their group.
  auto role = [&](const CommProfile& c) -> std::string {
    if (c.group == "cp") return "cp";  // the context ring's messages and collectives
    if (c.kind == "send" || c.kind == "recv") return "pp";
    if (c.kind == "alltoall") return "ep";
    if (c.group != "world") return c.group;
    const int world = s.tp * s.pp * s.dp * s.cp;
    return s.tp == world ? "tp" : s.pp == world ? "pp" : "dp";
  };
  // The role carrying most of a rank's bytes (or time).
  auto main_group = [&](size_t r, bool by_time) {
    std::map<std::string, double> g;
    for (const CommProfile& c : p.ranks[r].comm) g[role(c)] += by_time ? c.seconds : c.bytes;
    std::string best;
    double most = -1;
    for (const auto& [name, v] : g)
      if (v > most) most = v, best = name;
    return best;
  };
  const RankProfile& L = p.ranks[late];
  const double share = L.step_s > 0 ? L.exposed_s / L.step_s : 0;
  f.detail = printf_string("%s sends %.2f MB a step, the mean rank %.2f MB", where(p, top).c_str(),
                           mb(sent[top]), mb(mean(sent)));
  if (!p.ranks[top].comm.empty()) f.detail += ", most on " + main_group(top, false);
  f.detail += printf_string("; %s waits %.1f ms of its %.1f ms step on communication (%.0f%%)",
                            where(p, late).c_str(), ms(L.exposed_s), ms(L.step_s), 100 * share);
  if (share > 0.2) {
    const std::string g = main_group(late, true);
    if (g == "dp" || g == "ep_dp")
      f.suggestion = !s.overlap_comm
                         ? "zero_optimization.overlap_comm true starts the reductions during "
                           "backward"
                         : "the data-parallel reduction is exposed: comm.compression "
                           "(\"fp16\", \"powersgd\") or optimizer OneBitAdam sends less";
    else if (g == "tp")
      f.suggestion =
          "tensor parallelism's collectives are exposed: keep parallel.tensor within a host "
          "(comm.placement topology), or a smaller parallel.tensor";
    else if (g == "pp")
      f.suggestion =
          "waiting on the pipeline's messages: more micro-batches per step "
          "(gradient_accumulation_steps) or a balanced parallel.partition";
    else if (g == "cp")
      f.suggestion =
          "the context-parallel keys and values are exposed: parallel.context_comm p2p overlaps "
          "them with the attention; keep parallel.context within a host, or a smaller one";
    else if (g == "ep")
      f.suggestion =
          "the MoE all-to-alls are exposed: keep parallel.expert within a host, or a smaller "
          "model.moe.capacity_factor";
    else
      f.suggestion = "group " + g + " waits most";
  } else if (f.imbalance > kCommImbalance) {
    f.suggestion = printf_string(
        "no change needed: the ranks' groups differ by design and the waiting is %.0f%% of the "
        "step",
        100 * share);
  }
  return f;
}

}  // namespace

double RankProfile::compute_s() const {
  double s = 0;
  for (const ChunkProfile& c : chunks)
    for (const PieceProfile& p : c.pieces) s += p.seconds();
  return s;
}

double RankProfile::mem_total() const {
  return std::accumulate(mem_peak.begin(), mem_peak.end(), 0.0);
}

double piece_forward_flops(const GptConfig& m, const std::string& name) {
  const double C = m.n_embd, T = m.seq_len;
  if (name == "embeddings" || name == "ln_f") return 0;
  if (name == "lm_head") return 2.0 * C * m.vocab_size;
  LOOM_CHECK(name.rfind("h.", 0) == 0, "piece '{}' is not a model piece", name);
  LOOM_CHECK(name.size() > 2 && name.find_first_not_of("0123456789", 2) == std::string::npos,
             "piece '{}' is not a model piece", name);
  const int layer = std::stoi(name.substr(2));
  const double attention = 2.0 * 4 * C * C + 4.0 * T * C;
  if (!m.moe_layer(layer)) return attention + 2.0 * 8 * C * C;
  return attention + 2.0 * m.moe_top_k * 8 * C * C + 2.0 * C * m.moe_experts;
}

std::vector<Finding> imbalance_report(const JobProfile& p) {
  if (p.ranks.empty()) return {};
  return {compute_finding(p), memory_finding(p), comm_finding(p)};
}

json to_json(const std::vector<Finding>& f) {
  json out = json::array();
  for (const Finding& x : f)
    out.push_back({{"kind", x.kind},
                   {"imbalance", x.imbalance},
                   {"rank", x.rank},
                   {"detail", x.detail},
                   {"suggestion", x.suggestion}});
  return out;
}

json to_json(const JobProfile& p) {
  const JobShape& s = p.shape;
  json shape = {{"tp", s.tp},
                {"pp", s.pp},
                {"dp", s.dp},
                {"cp", s.cp},
                {"ep", s.ep},
                {"virtual_stages", s.virtual_stages},
                {"micro_batch", s.micro_batch},
                {"micro_batches", s.micro_batches},
                {"seq_len", s.seq_len},
                {"schedule", s.schedule},
                {"zero_stage", s.zero_stage},
                {"overlap_comm", s.overlap_comm},
                {"recompute", s.recompute},
                {"partition", s.partition},
                {"steps", s.steps}};
  json ranks = json::array();
  for (const RankProfile& r : p.ranks) {
    json chunks = json::array();
    for (const ChunkProfile& c : r.chunks) {
      json pieces = json::array();
      for (const PieceProfile& q : c.pieces)
        pieces.push_back({{"name", q.name},
                          {"params", q.params},
                          {"flops", q.flops},
                          {"forward_s", q.forward},
                          {"backward_s", q.backward},
                          {"recompute_s", q.recompute},
                          {"record_bytes", q.record_bytes},
                          {"bytes", q.bytes},
                          {"comm_bytes", q.comm_bytes}});
      chunks.push_back({{"first", c.first}, {"last", c.last}, {"pieces", pieces}});
    }
    json comm = json::array();
    for (const CommProfile& c : r.comm)
      comm.push_back({{"group", c.group},
                      {"kind", c.kind},
                      {"ops", c.ops},
                      {"bytes", c.bytes},
                      {"seconds", c.seconds}});
    json mem = json::object();
    for (int c = 0; c < kNumMemCategories; ++c)
      mem[std::string(mem_category_name(static_cast<MemCategory>(c)))] =
          r.mem_peak[static_cast<size_t>(c)];
    ranks.push_back({{"rank", r.rank},
                     {"coord",
                      {{"tp", r.coord.tp},
                       {"cp", r.coord.cp},
                       {"dp", r.coord.dp},
                       {"pp", r.coord.pp},
                       {"ep", r.coord.ep}}},
                     {"host", r.host},
                     {"chunks", chunks},
                     {"comm", comm},
                     {"step_s", r.step_s},
                     {"compute_s", r.compute_s()},
                     {"optimizer_s", r.optimizer_s},
                     {"comm_s", r.comm_s},
                     {"exposed_s", r.exposed_s},
                     {"bubble_s", r.bubble_s},
                     {"bubble_fraction", r.bubble_fraction},
                     {"comm_bytes", r.comm_bytes},
                     {"mem_peak_bytes", mem}});
  }
  return {{"shape", shape}, {"ranks", ranks}};
}

JobProfile job_profile_from_json(const json& j) {
  JobProfile p;
  const json& s = j.at("shape");
  p.shape.tp = s.at("tp");
  p.shape.pp = s.at("pp");
  p.shape.dp = s.at("dp");
  p.shape.ep = s.at("ep");
  p.shape.cp = s.value("cp", 1);
  p.shape.virtual_stages = s.at("virtual_stages");
  p.shape.micro_batch = s.at("micro_batch");
  p.shape.micro_batches = s.at("micro_batches");
  p.shape.seq_len = s.at("seq_len");
  p.shape.schedule = s.at("schedule");
  p.shape.zero_stage = s.at("zero_stage");
  p.shape.overlap_comm = s.at("overlap_comm");
  p.shape.recompute = s.at("recompute");
  p.shape.partition = s.at("partition").get<std::vector<int>>();
  p.shape.steps = s.at("steps");
  for (const json& r : j.at("ranks")) {
    RankProfile k;
    k.rank = r.at("rank");
    const json& c = r.at("coord");
    k.coord.tp = c.at("tp"), k.coord.dp = c.at("dp"), k.coord.pp = c.at("pp");
    k.coord.ep = c.at("ep");
    k.coord.cp = c.value("cp", 0);
    k.host = r.at("host");
    for (const json& ch : r.at("chunks")) {
      ChunkProfile cp{ch.at("first"), ch.at("last"), {}};
      for (const json& q : ch.at("pieces"))
        cp.pieces.push_back({q.at("name"), q.at("params"), q.at("flops"), q.at("forward_s"),
                             q.at("backward_s"), q.at("recompute_s"), q.value("record_bytes", 0.0),
                             q.value("bytes", 0.0), q.value("comm_bytes", 0.0)});
      k.chunks.push_back(std::move(cp));
    }
    for (const json& q : r.at("comm"))
      k.comm.push_back({q.at("group"), q.at("kind"), q.at("ops"), q.at("bytes"), q.at("seconds")});
    k.step_s = r.at("step_s");
    k.optimizer_s = r.at("optimizer_s");
    k.comm_s = r.at("comm_s");
    k.exposed_s = r.at("exposed_s");
    k.bubble_s = r.at("bubble_s");
    k.bubble_fraction = r.at("bubble_fraction");
    k.comm_bytes = r.at("comm_bytes");
    for (int m = 0; m < kNumMemCategories; ++m)
      k.mem_peak[static_cast<size_t>(m)] =
          r.at("mem_peak_bytes")
              .at(std::string(mem_category_name(static_cast<MemCategory>(m))))
              .get<double>();
    p.ranks.push_back(std::move(k));
  }
  return p;
}

std::string profile_table(const JobProfile& p) {
  std::string out = printf_string("%-6s %-14s %10s %12s %10s %10s %10s %6s %9s %9s %7s %9s\n",
                                  "stage", "module", "params", "GFLOP", "fwd ms", "bwd ms",
                                  "recomp ms", "step%", "GFLOP/s", "act MB", "GB/s", "comm MB");
  for (int st = 0; st < p.shape.pp; ++st) {
    // The first rank of the stage stands for it.
    const RankProfile* r = nullptr;
    for (const RankProfile& k : p.ranks)
      if (k.coord.pp == st) {
        r = &k;
        break;
      }
    if (r == nullptr) continue;
    PieceProfile total{"total"};
    auto row = [&](const PieceProfile& q) {
      const double t = q.seconds();
      out += printf_string(
          "%-6d %-14s %10ld %12.3f %10.2f %10.2f %10.2f %5.1f%% %9.1f %9.2f %7.1f %9.3f\n", st,
          q.name.c_str(), long(q.params), q.flops / 1e9, ms(q.forward), ms(q.backward),
          ms(q.recompute), r->step_s > 0 ? 100 * t / r->step_s : 0.0,
          t > 0 ? q.flops / t / 1e9 : 0.0, mb(q.record_bytes), t > 0 ? q.bytes / t / 1e9 : 0.0,
          mb(q.comm_bytes));
    };
    for (const ChunkProfile& c : r->chunks)
      for (const PieceProfile& q : c.pieces) {
        row(q);
        total.params += q.params, total.flops += q.flops;
        total.record_bytes += q.record_bytes, total.bytes += q.bytes;
        total.comm_bytes += q.comm_bytes;
        total.forward += q.forward, total.backward += q.backward, total.recompute += q.recompute;
      }
    row(total);
  }
  out += printf_string(
      "per step, mean over %ld profiled steps, on each stage's first rank; GFLOP: model FLOPs of "
      "forward and backward on that rank; GFLOP/s: those over forward + backward + recompute "
      "time; step%%: of the step's wall time; act MB: what it keeps from forward to backward a "
      "micro-batch; GB/s: a model of its traffic (that record written and read, the f32 "
      "parameters read twice, their gradients read and written, each micro-batch) over its "
      "time; comm MB: what the collectives issued while it ran sent, from the record\n",
      long(p.shape.steps));
  return out;
}

std::string imbalance_text(const JobProfile& p, const std::vector<Finding>& f) {
  std::string out =
      printf_string("load imbalance over %zu rank%s (the largest rank over the mean):\n",
                    p.ranks.size(), p.ranks.size() == 1 ? "" : "s");
  for (const Finding& x : f) {
    out +=
        printf_string("  %-13s %5.1f%%  %s\n", x.kind.c_str(), 100 * x.imbalance, x.detail.c_str());
    if (!x.suggestion.empty()) out += "                 -> " + x.suggestion + "\n";
  }
  return out;
}

std::string profile_text(const JobProfile& p, const std::vector<Finding>& f) {
  std::string out = profile_table(p) + "\n";
  const bool cp = p.shape.cp > 1;
  out += printf_string("%-5s %-12s %-14s %10s %10s %10s %10s %9s %10s\n", "rank", "host",
                       cp ? "pp tp cp dp ep" : "pp tp dp ep", "step ms", "compute ms", "optim ms",
                       "comm ms", "exposed", "sent MB");
  for (const RankProfile& r : p.ranks)
    out += printf_string(
        "%-5d %-12s %-14s %10.2f %10.2f %10.2f %10.2f %9.2f %10.3f\n", r.rank, r.host.c_str(),
        (cp ? printf_string("%d %d %d %d %d", r.coord.pp, r.coord.tp, r.coord.cp, r.coord.dp,
                            r.coord.ep)
            : printf_string("%d %d %d %d", r.coord.pp, r.coord.tp, r.coord.dp, r.coord.ep))
            .c_str(),
        ms(r.step_s), ms(r.compute_s()), ms(r.optimizer_s), ms(r.comm_s), ms(r.exposed_s),
        mb(r.comm_bytes));
  out += "\npeak memory per rank, MB:\n";
  out += printf_string("%-5s", "rank");
  for (int c = 0; c < kNumMemCategories; ++c)
    out +=
        printf_string(" %11s", std::string(mem_category_name(static_cast<MemCategory>(c))).c_str());
  out += printf_string(" %11s\n", "total");
  for (const RankProfile& r : p.ranks) {
    out += printf_string("%-5d", r.rank);
    for (double b : r.mem_peak) out += printf_string(" %11.2f", mb(b));
    out += printf_string(" %11.2f\n", mb(r.mem_total()));
  }
  out += "\ncollectives per rank and step:\n";
  out += printf_string("%-5s %-8s %-14s %8s %12s %10s\n", "rank", "group", "kind", "ops", "MB sent",
                       "ms");
  for (const RankProfile& r : p.ranks)
    for (const CommProfile& c : r.comm)
      out += printf_string("%-5d %-8s %-14s %8.1f %12.3f %10.2f\n", r.rank, c.group.c_str(),
                           c.kind.c_str(), c.ops, mb(c.bytes), ms(c.seconds));
  return out + "\n" + imbalance_text(p, f);
}

json step_imbalance(const std::vector<double>& compute, const std::vector<double>& mem,
                    const std::vector<double>& sent) {
  json j = json::object();
  auto one = [&](const char* key, const std::vector<double>& v) {
    if (v.empty()) return;
    j[key] = over_mean(v);
    j[std::string(key) + "_rank"] = argmax(v);
  };
  one("compute", compute);
  one("memory", mem);
  one("comm", sent);
  return j;
}

RunProfiler::RunProfiler(const Config& config, int64_t total_steps, StepEngine& engine)
    : config_(config), total_(total_steps) {
  for (int c = 0; c < engine.num_chunks(); ++c) engine.stage(c).record_spans(true);
}

void RunProfiler::skip(StepEngine& engine) {
  for (int c = 0; c < engine.num_chunks(); ++c) engine.stage(c).take_piece_seconds();
}

void RunProfiler::add(StepEngine& engine, const StepResult& r, const MemStats& mine) {
  // The first step warms up (allocations, the GEMM library's first calls).
  if (!warmed_ && total_ > 1) {
    warmed_ = true;
    skip(engine);
    return;
  }
  // Every piece's spans this step, sorted, to find the one an event's
  // enqueue time falls in: {start, end, chunk, piece}.
  struct Span {
    double start, end;
    size_t chunk, piece;
  };
  std::vector<Span> spans;
  for (int c = 0; c < engine.num_chunks(); ++c) {
    GptStage<float>& st = engine.stage(c);
    const auto pieces = st.take_piece_seconds();
    if (mine_.chunks.size() <= static_cast<size_t>(c)) {
      ChunkProfile cp{st.first(), st.last(), {}};
      const std::vector<size_t> kept =
          st.piece_record_bytes(config_.micro_batch, config_.local_seq_len());
      for (size_t k = 0; k < pieces.size(); ++k) {
        PieceProfile q{pieces[k].name, pieces[k].params};
        q.record_bytes = k < kept.size() ? double(kept[k]) : 0;
        cp.pieces.push_back(q);
      }
      mine_.chunks.push_back(std::move(cp));
    }
    auto& mine = mine_.chunks[static_cast<size_t>(c)].pieces;
    LOOM_CHECK(pieces.size() == mine.size(), "chunk {}: {} pieces, {} profiled", c, pieces.size(),
               mine.size());
    for (size_t k = 0; k < pieces.size(); ++k) {
      mine[k].forward += pieces[k].forward;
      mine[k].backward += pieces[k].backward;
      mine[k].recompute += pieces[k].recompute;
      for (const auto& [start, end] : pieces[k].spans)
        spans.push_back({start, end, static_cast<size_t>(c), k});
    }
  }
  // The step's collectives issued inside one of a piece's passes (spans
  // of one process do not overlap).
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.start < b.start; });
  for (const CommEvent& e : r.comm_events) {
    auto it = std::upper_bound(spans.begin(), spans.end(), e.enqueued,
                               [](double t, const Span& s) { return t < s.start; });
    if (it == spans.begin()) continue;
    --it;
    if (e.enqueued < it->end) mine_.chunks[it->chunk].pieces[it->piece].comm_bytes += e.sent_bytes;
  }
  for (const CommEvent& e : r.comm_events) {
    auto it = std::find_if(mine_.comm.begin(), mine_.comm.end(), [&](const CommProfile& c) {
      return c.group == e.group && c.kind == e.kind;
    });
    if (it == mine_.comm.end()) it = mine_.comm.insert(mine_.comm.end(), {e.group, e.kind});
    it->ops += 1, it->bytes += e.sent_bytes, it->seconds += e.ended - e.started;
  }
  mine_.step_s += r.t_step;
  mine_.optimizer_s += r.t_optimizer;
  mine_.comm_s += r.t_comm;
  mine_.exposed_s += r.t_comm_exposed;
  mine_.bubble_s += r.t_bubble;
  mine_.bubble_fraction += r.bubble_fraction;
  mine_.comm_bytes += r.comm_bytes;
  for (int c = 0; c < kNumMemCategories; ++c)
    mine_.mem_peak[static_cast<size_t>(c)] =
        std::max(mine_.mem_peak[static_cast<size_t>(c)], double(mine.peak[static_cast<size_t>(c)]));
  ++steps_;
}

JobProfile RunProfiler::gather(const ParallelContext& ctx, bool writer) const {
  // This rank's figures per step.
  RankProfile r = mine_;
  const double n = std::max<int64_t>(1, steps_);
  const Config& c = config_;
  const int tp = std::max(1, ctx.grid.shape().tp);
  // This rank's tokens: its share of each sequence under context parallelism.
  const double tokens = double(c.micro_batch) * double(c.grad_accum) * double(c.local_seq_len());
  for (ChunkProfile& ch : r.chunks)
    for (PieceProfile& q : ch.pieces) {
      q.forward /= n, q.backward /= n, q.recompute /= n, q.comm_bytes /= n;
      q.flops = 3.0 * piece_forward_flops(c.model, q.name) * tokens / tp;
      q.bytes = double(c.grad_accum) * (2 * q.record_bytes + 4.0 * 4 * double(q.params));
    }
  for (CommProfile& q : r.comm) q.ops /= n, q.bytes /= n, q.seconds /= n;
  for (double* x : {&r.step_s, &r.optimizer_s, &r.comm_s, &r.exposed_s, &r.bubble_s,
                    &r.bubble_fraction, &r.comm_bytes})
    *x /= n;
  r.rank = ctx.rank;
  r.coord = ctx.coord();
  const int launch = ctx.order.empty() ? 0 : ctx.order[static_cast<size_t>(ctx.rank)];
  if (static_cast<size_t>(launch) < ctx.topology.host_of.size())
    r.host =
        ctx.topology.names[static_cast<size_t>(ctx.topology.host_of[static_cast<size_t>(launch)])];

  JobProfile p;
  p.shape.tp = ctx.grid.shape().tp;
  p.shape.pp = ctx.grid.shape().pp;
  p.shape.dp = ctx.grid.shape().dp();
  p.shape.ep = ctx.grid.shape().ep;
  p.shape.cp = ctx.grid.shape().cp;
  p.shape.virtual_stages = c.parallel.pipeline > 1 ? c.parallel.virtual_stages : 1;
  p.shape.micro_batch = c.micro_batch;
  p.shape.micro_batches = c.grad_accum;
  p.shape.seq_len = c.model.seq_len;
  p.shape.schedule = c.parallel.pipeline > 1 ? c.parallel.schedule : "";
  p.shape.zero_stage = c.zero.stage;
  p.shape.overlap_comm = c.zero.overlap_comm;
  p.shape.recompute = CheckpointPolicy::name(c.checkpointing.policy.kind);
  p.shape.steps = steps_;
  JobProfile one;
  one.shape = p.shape;
  one.ranks.push_back(r);
  const std::string text = to_json(one).dump();
  std::vector<std::string> texts;
  if (ctx.world) {
    const uint64_t bytes = text.size();
    const std::vector<uint64_t> sizes = all_gather_words(*ctx.world, &bytes, 1);
    if (writer) {
      for (int k = 0; k < ctx.world->size(); ++k) {
        if (k == ctx.world->rank()) {
          texts.push_back(text);
          continue;
        }
        std::string s(sizes[static_cast<size_t>(k)], '\0');
        ctx.world->recv(s.data(), s.size(), DType::kU8, k, kProfileTag)->wait();
        texts.push_back(std::move(s));
      }
    } else {
      ctx.world->send(text.data(), text.size(), DType::kU8, 0, kProfileTag)->wait();
    }
  } else {
    texts.push_back(text);
  }
  if (!writer) return {};
  for (const std::string& t : texts) {
    JobProfile k = job_profile_from_json(json::parse(t));
    p.ranks.push_back(std::move(k.ranks.at(0)));
  }
  if (p.shape.pp > 1) {
    // The cut, part by part in model order, from every rank's chunks.
    std::map<int, int> parts;
    for (const RankProfile& k : p.ranks)
      for (const ChunkProfile& ch : k.chunks) parts[ch.first] = ch.last - ch.first;
    for (const auto& [first, count] : parts) p.shape.partition.push_back(count);
  }
  return p;
}

}  // namespace loom
