#include "loom/plan/planner.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>
#include <numeric>
#include <set>
#include <tuple>

#include "loom/comm/algorithms/allreduce.h"
#include "loom/core/error.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/plan/loom_memory.h"

namespace loom::plan {

using json = nlohmann::json;

namespace {

int64_t g_considered = 0;

bool divides(int64_t a, int64_t b) {
  return a > 0 && b % a == 0;
}

std::vector<int> powers_of_two_upto(int n) {
  std::vector<int> v;
  for (int k = 1; k <= n; k *= 2) v.push_back(k);
  return v;
}

std::vector<int> divisors(int64_t n, int64_t upto) {
  std::vector<int> v;
  for (int64_t k = 1; k <= std::min(n, upto); ++k)
    if (n % k == 0) v.push_back(int(k));
  return v;
}

// j[key] under `section` ("model" or "model.moe").
int64_t integer(const json& j, const char* section, const char* key, const std::string& source,
                int64_t fallback = -1) {
  if (!j.contains(key)) {
    LOOM_CHECK_KIND(kConfig, fallback >= 0, "{}: {}.{} is missing", source, section, key);
    return fallback;
  }
  LOOM_CHECK_KIND(kConfig, j[key].is_number_integer() && j[key].get<int64_t>() > 0,
                  "{}: {}.{} must be a whole number > 0, not {}", source, section, key,
                  j[key].dump());
  return j[key].get<int64_t>();
}

// Bytes a value of the activations, parameters and gradients takes.
double bytes_of(const std::string& precision) {
  return precision == "f32" ? 4 : 2;
}

bool moe_layer(const ModelShape& m, int64_t layer) {
  return m.experts > 0 && (layer + 1) % m.moe_every == 0;
}

// A ring all-reduce of `bytes` over n devices on `link` (2 (n-1)/n of the
// data each way, 2 (n-1) steps of latency); a reduce-scatter or an
// all-gather is half of it.
double allreduce_s(double bytes, int n, const Link& link) {
  if (n <= 1 || bytes <= 0) return 0;
  return 2.0 * (n - 1) / n * bytes / link.bandwidth + 2.0 * (n - 1) * link.latency;
}

// Ranks in Megatron's order: tensor fastest, then context, data, pipeline.
// A group of `size` whose members are `stride` apart stays inside a node
// when the blocks of stride x size ranks tile the nodes (or the whole job,
// `gpus`, is one node).
const Link& link_for(const ClusterSpec& c, int64_t gpus, int64_t stride, int64_t size) {
  const int64_t span = stride * size;
  const bool inside =
      span <= c.gpus_per_node && (c.gpus_per_node % span == 0 || gpus <= c.gpus_per_node);
  return inside ? c.node : c.cluster;
}

// Pipelines of up to this many (stage, micro-batch, chunk) forwards are
// simulated.
constexpr int64_t kSimulatedInstructions = 4096;

// Idle time of a pipeline's busiest stage over a step, in stage-times of
// one micro-batch (forward and backward; the backward `ratio` times the
// forward, rounded to eighths; a chunk's 1/v of each), from the simulated
// schedule (cached: a search meets the same few many times; one thread).
double bubble_stage_times(const std::string& schedule, int p, int64_t m, int v, double ratio) {
  static std::map<std::tuple<std::string, int, int64_t, int, int>, double> cache;
  const int r8 = std::max(1, int(std::lround(ratio * 8)));
  const auto key = std::make_tuple(schedule, p, m, v, r8);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  const double r = r8 / 8.0;
  pp::SimCosts costs;
  costs.forward = 1.0 / v;
  costs.backward = r / v;
  costs.backward_input = costs.backward_weight = r / (2.0 * v);
  costs.p2p = 0;
  const pp::SimResult sim =
      pp::simulate(pp::make_schedule(pp::parse_schedule(schedule), p, int(m), v), costs);
  const double busy = *std::max_element(sim.busy.begin(), sim.busy.end());
  return cache[key] = std::max(0.0, sim.makespan - busy) / (1 + r);
}

// The layouts refused, over every reason (all that were counted, when none ran).
int64_t refused_in_all(const std::map<std::string, std::pair<int64_t, std::string>>& rejected) {
  int64_t n = 0;
  for (const auto& [reason, seen] : rejected) n += seen.first;
  return n;
}

}  // namespace

double layer_gemm_s(const ModelShape& m, const ClusterSpec& c, const Layout& l, int64_t layer) {
  const double b = double(l.micro), s = double(m.seq) / l.cp, S = double(m.seq),
               h = double(m.hidden), t = double(l.tp);
  const double peak = l.precision == "f32" ? c.peak_flops_32 : c.peak_flops_16;
  auto gemm_s = [&](double flops, double size) {
    return flops / (peak * c.gemm_max * size / (size + c.gemm_half_flops));
  };
  const double dense = 16 * b * s * h * h / t, attn_proj = 8 * b * s * h * h / t;
  const double attn = 4 * b * s * S * h / t;
  if (moe_layer(m, layer)) {
    // The experts are whole on a rank; it runs the k slots of the rows it
    // routes (moe_rows) through them.
    const double rows = moe_rows(m, l, b * s);
    return gemm_s(attn_proj, 2 * b * s * h * (4 * h / t)) +
           gemm_s(double(m.top_k) * 16 * rows * h * h, 2 * rows * h * 4 * h) +
           gemm_s(attn, 2 * b * s * S * h / t);
  }
  return gemm_s(attn_proj + dense, 2 * b * s * h * (4 * h / t)) +
         gemm_s(attn, 2 * b * s * S * h / t);
}

double ModelShape::params() const {
  const double h = double(hidden);
  double p = double(vocab) * h + double(seq) * h + 2 * h;  // embeddings, ln_f
  for (int64_t l = 0; l < n_layer; ++l) {
    p += 4 * h * h + 4 * h + 4 * h;  // attention, its biases, two LayerNorms
    p += moe_layer(*this, l) ? double(experts) * (8 * h * h + 5 * h) + h * double(experts)
                             : 8 * h * h + 5 * h;
  }
  return p;
}

ModelShape parse_model(const json& j, const std::string& source) {
  LOOM_CHECK_KIND(kConfig, j.is_object(), "{}: a model is a JSON object", source);
  const json& m = j.contains("model") ? j["model"] : j;
  LOOM_CHECK_KIND(kConfig, m.is_object(), "{}: model is a JSON object", source);
  ModelShape s;
  s.n_layer = integer(m, "model", "n_layer", source);
  s.hidden = integer(m, "model", "n_embd", source);
  s.heads = integer(m, "model", "n_head", source);
  s.vocab = integer(m, "model", "vocab_size", source);
  s.seq = integer(m, "model", "seq_len", source);
  LOOM_CHECK_KIND(kConfig, s.hidden % s.heads == 0,
                  "{}: model.n_embd {} is not divisible by model.n_head {}", source, s.hidden,
                  s.heads);
  if (m.contains("moe")) {
    const json& moe = m["moe"];
    LOOM_CHECK_KIND(kConfig, moe.is_object(), "{}: model.moe is a JSON object", source);
    s.experts = integer(moe, "model.moe", "num_experts", source);
    s.top_k = integer(moe, "model.moe", "top_k", source, 2);
    s.moe_every = integer(moe, "model.moe", "every_n_layers", source, 1);
    if (moe.contains("capacity_factor")) {
      LOOM_CHECK_KIND(
          kConfig, moe["capacity_factor"].is_number() && moe["capacity_factor"].get<double>() >= 0,
          "{}: model.moe.capacity_factor must be a number >= 0, not {}", source,
          moe["capacity_factor"].dump());
      s.capacity = moe["capacity_factor"].get<double>();
    }
    s.learned_router = moe.value("router", std::string("learned")) == "learned";
  }
  return s;
}

std::string Layout::describe() const {
  return format(
      "tp={},pp={},dp={},cp={},ep={},v={},micro={},zero={},recompute={},sp={},precision={},"
      "schedule={}",
      tp, pp, dp, cp, ep, v, micro, zero, recompute, sp ? "true" : "false", precision, schedule);
}

bool LayoutConstraint::has(const std::string& key) const {
  return std::find(fixed.begin(), fixed.end(), key) != fixed.end();
}

LayoutConstraint parse_layout(const std::string& text) {
  LayoutConstraint c;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find(',', pos);
    if (end == std::string::npos) end = text.size();
    const std::string item = text.substr(pos, end - pos);
    pos = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    LOOM_CHECK_KIND(kConfig, eq != std::string::npos, "--layout: '{}' is not key=value", item);
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto number = [&]() {
      LOOM_CHECK_KIND(
          kConfig,
          !value.empty() && value.size() <= 9 &&
              value.find_first_not_of("0123456789") == std::string::npos && std::stoll(value) > 0,
          "--layout: {} must be a whole number from 1 to 999999999, not '{}'", key, value);
      return std::stoll(value);
    };
    auto one_of = [&](std::initializer_list<const char*> choices) {
      std::string list;
      for (const char* ch : choices) {
        if (value == ch) return value;
        list += (list.empty() ? "" : ", ") + std::string(ch);
      }
      LOOM_FAIL(kConfig, "--layout: {} must be one of {}, not '{}'", key, list, value);
    };
    Layout& l = c.values;
    if (key == "tp")
      l.tp = int(number());
    else if (key == "pp")
      l.pp = int(number());
    else if (key == "dp")
      l.dp = int(number());
    else if (key == "cp")
      l.cp = int(number());
    else if (key == "ep")
      l.ep = int(number());
    else if (key == "v")
      l.v = int(number());
    else if (key == "micro")
      l.micro = number();
    else if (key == "zero") {
      LOOM_CHECK_KIND(kConfig, value.size() == 1 && value[0] >= '0' && value[0] <= '3',
                      "--layout: zero must be 0, 1, 2 or 3, not '{}'", value);
      l.zero = value[0] - '0';
    } else if (key == "recompute")
      l.recompute = one_of({"none", "selective", "full"});
    else if (key == "sp")
      l.sp = one_of({"true", "false"}) == "true";
    else if (key == "precision")
      l.precision = one_of({"bf16", "fp16", "f32"});
    else if (key == "schedule")
      l.schedule = one_of({"1f1b", "gpipe", "interleaved", "zero_bubble"});
    else
      LOOM_FAIL(kConfig,
                "--layout: unknown key '{}' (tp, pp, dp, cp, ep, v, micro, zero, recompute, sp, "
                "precision, schedule)",
                key);
    LOOM_CHECK_KIND(kConfig, !c.has(key), "--layout: {} given twice", key);
    c.fixed.push_back(key);
  }
  return c;
}

Engine engine_named(const std::string& name) {
  Engine e;
  e.name = name;
  if (name == "loom") return e;
  LOOM_CHECK_KIND(kConfig, name == "megatron-2021",
                  "--engine: '{}' is not an engine the planner models (loom, megatron-2021)", name);
  e.state_bytes_16 = 18;
  e.grad_wire_bytes = 4;
  e.dp_overlap = false;
  e.zero_bubble = false;
  e.gpipe = false;
  e.sequence_parallel = false;
  e.context_parallel = false;
  e.interleave_min_pp = 3;  // Megatron-LM interleaves only past two stages
  e.max_zero = 0;
  e.executor_memory = false;
  e.p2p_overlap = false;
  e.pipeline_tags = 0;
  return e;
}

MemoryBytes model_states(double psi, const std::string& precision, int zero, int dp) {
  MemoryBytes m;
  const double b = bytes_of(precision), k = precision == "f32" ? 8 : 12, d = dp;
  m.params = psi * b / (zero >= 3 ? d : 1);
  m.grads = psi * b / (zero >= 2 ? d : 1);
  m.optimizer = psi * k / (zero >= 1 ? d : 1);
  return m;
}

double step_flops(const ModelShape& m, int64_t batch, bool with_recompute) {
  const double B = double(batch), s = double(m.seq), h = double(m.hidden), V = double(m.vocab);
  double layers = 0;  // forward FLOPs of the blocks, per sequence
  for (int64_t l = 0; l < m.n_layer; ++l) {
    const double mlp = moe_layer(m, l) ? double(m.top_k) * 16 * s * h * h : 16 * s * h * h;
    layers += 8 * s * h * h + 4 * s * s * h + mlp;
  }
  const double head = 2 * s * h * V;
  return B * ((with_recompute ? 4 : 3) * layers + 3 * head);
}

std::string invalid_reason(const ModelShape& m, int64_t batch, const Layout& l,
                           const Engine& engine) {
  if (!engine.zero_bubble && l.schedule == "zero_bubble")
    return format("the {} engine has no zero-bubble schedule", engine.name);
  if (!engine.gpipe && l.schedule == "gpipe")
    return format("the {} engine has no GPipe schedule", engine.name);
  if (!engine.sequence_parallel && l.sp)
    return format("the {} engine has no sequence parallelism", engine.name);
  if (!engine.sequence_parallel_moe && l.sp && m.experts > 0)
    return format("the {} engine runs no expert layers under sequence parallelism", engine.name);
  if (!engine.context_parallel && l.cp > 1)
    return format("the {} engine has no context parallelism", engine.name);
  if (l.zero > engine.max_zero)
    return format("the {} engine has ZeRO up to stage {}", engine.name, engine.max_zero);
  if (!divides(l.tp, m.heads)) return format("tp {} does not divide {} heads", l.tp, m.heads);
  if (!divides(int64_t(l.pp) * l.v, m.n_layer))
    return format("pp x v = {} does not divide {} layers", int64_t(l.pp) * l.v, m.n_layer);
  // loom's causal balance: each sequence in 2 x cp chunks, and with the
  // sequence split over tp too, each rank's pair in tp pieces.
  if (l.cp > 1 && !divides(2 * l.cp, m.seq))
    return format("seq_len {} does not divide into 2 x cp = {} chunks", m.seq, 2 * l.cp);
  if (l.cp > 1 && l.sp && !divides(int64_t(l.cp) * std::lcm(2, l.tp), m.seq))
    return format("seq_len {} does not divide into cp x lcm(2, tp) = {} pieces", m.seq,
                  int64_t(l.cp) * std::lcm(2, l.tp));
  if (!divides(int64_t(l.dp) * l.micro, batch))
    return format("dp x micro = {} does not divide the batch {}", int64_t(l.dp) * l.micro, batch);
  if (l.ep > 1 && !(m.experts > 0 && divides(l.ep, m.experts) && divides(l.ep, l.dp * l.cp)))
    return format("ep {} must divide the experts ({}) and dp x cp ({})", l.ep, m.experts,
                  l.dp * l.cp);
  if (l.sp && l.tp == 1) return "sequence parallelism needs tp > 1";
  if (l.pp == 1 && l.schedule != "1f1b") return "a schedule needs pp > 1";
  if ((l.v > 1) != (l.schedule == "interleaved"))
    return "v > 1 is the interleaved schedule's, and it needs v > 1";
  if (l.schedule == "interleaved" && l.pp < engine.interleave_min_pp)
    return format("the {} engine interleaves from pp {}", engine.name, engine.interleave_min_pp);
  const int64_t micro_batches = batch / (int64_t(l.dp) * l.micro);
  if (engine.pipeline_tags > 0 && l.pp > 1 && 2 * micro_batches * l.v >= engine.pipeline_tags)
    return format("{} micro-batches x {} chunks exceed the pipeline's message tags", micro_batches,
                  l.v);
  if (l.schedule == "interleaved" && micro_batches % l.pp != 0)
    return format("interleaving needs the micro-batches ({}) a multiple of pp", micro_batches);
  return "";
}

Estimate estimate(const ModelShape& m, const ClusterSpec& c, int64_t batch, const Layout& l,
                  const Engine& engine) {
  const std::string reason = invalid_reason(m, batch, l, engine);
  LOOM_CHECK_KIND(kConfig, reason.empty(), "{}: {}", l.describe(), reason);
  const int64_t micro_batches = batch / (int64_t(l.dp) * l.micro);

  Estimate e;
  e.layout = l;
  const double b = double(l.micro), s = double(m.seq) / l.cp, S = double(m.seq),
               h = double(m.hidden), a = double(m.heads), V = double(m.vocab), t = double(l.tp);
  const double act = bytes_of(l.precision);
  const double peak = l.precision == "f32" ? c.peak_flops_32 : c.peak_flops_16;
  const int64_t layers = m.n_layer / l.pp;  // per stage
  auto eff = [&](double flops) { return c.gemm_max * flops / (flops + c.gemm_half_flops); };
  auto gemm_s = [&](double flops, double size) { return flops / (peak * eff(size)); };

  // Parameters of the most loaded stage, this device's slice: its blocks,
  // and the embeddings (first stage) or the head's copy and ln_f (last).
  // Experts apart: dense parameters are replicated over the dp x cp ranks
  // of a stage, an expert over dp / ep of them.
  double psi_blocks = 0, psi_experts = 0, moe_layers = 0;
  for (int64_t k = 0; k < layers; ++k) {
    const bool moe = moe_layer(m, k);
    moe_layers += moe;
    psi_blocks += (4 * h * h) / t + 8 * h;
    if (moe) {
      psi_experts += double(m.experts) / l.ep * (8 * h * h + 5 * h);  // experts are whole
      psi_blocks += h * double(m.experts);                            // the router
    } else {
      psi_blocks += 8 * h * h / t + 5 * h;
    }
  }
  const double psi_first = psi_blocks + V * h / t + S * h;
  const double psi_last = psi_blocks + (l.pp > 1 ? V * h / t : 0) + 2 * h;
  const double psi_dense = std::max(psi_first, psi_last), psi = psi_dense + psi_experts;
  const int dense_dp = l.dp * l.cp, expert_dp = l.dp * l.cp / l.ep;

  // Model states (the ZeRO paper's formulas over the data-parallel ranks).
  const double p_bytes = act, g_bytes = act;
  const MemoryBytes dense_states = model_states(psi_dense, l.precision, l.zero, dense_dp);
  const MemoryBytes expert_states = model_states(psi_experts, l.precision, l.zero, expert_dp);
  e.mem.params = dense_states.params + expert_states.params;
  e.mem.grads = dense_states.grads + expert_states.grads;
  e.mem.optimizer = dense_states.optimizer + expert_states.optimizer;
  // Parameters a device keeps state for (its share from stage `at`).
  auto share = [&](int at) {
    return l.zero >= at ? psi_dense / dense_dp + psi_experts / expert_dp : psi;
  };
  if (l.precision != "f32" && engine.state_bytes_16 != 16) {
    // The engine keeps more state a parameter: fp32 gradients (4) and
    // the masters and moments (12) beside the fp16 parameters (2).
    e.mem.grads += share(2) * (engine.state_bytes_16 - 16);
  }
  if (l.zero >= 2) e.mem.comm = 2 * 1e6 * 4;  // the reduce-scatter buckets (1e6 elements)
  if (l.zero >= 3)
    e.mem.comm += 2 * 1e6 * act + 2 * ((psi_blocks + psi_experts) / double(layers)) * act;

  // Activations per layer and micro-batch (Korthikanti et al., 16-bit).
  const double sbh = s * b * h;
  const double attn_core = 5 * a * s * b * S / t;  // the score matrices
  const double kept_none = l.sp ? 34 * sbh / t + attn_core : sbh * (10 + 24 / t) + attn_core;
  double per_layer = l.recompute == "none"        ? kept_none
                     : l.recompute == "selective" ? kept_none - attn_core
                                                  : 2 * sbh / (l.sp ? t : 1);
  per_layer *= act / 2;
  const double moe_share = layers > 0 ? moe_layers / double(layers) : 0;
  per_layer *= 1 + moe_share * 0.5 * double(std::max<int64_t>(0, m.top_k - 1));
  // Micro-batches the first stage holds at its peak.
  const double m_b = double(micro_batches), p = l.pp;
  double in_flight = l.schedule == "gpipe" ? m_b : std::min(p, m_b);
  if (l.schedule == "interleaved") in_flight = std::min(m_b, p * (1 + (p - 1) / (p * l.v)));
  e.mem.activations = per_layer * double(layers) * in_flight;
  if (l.recompute == "full") e.mem.activations += kept_none * act / 2;  // the layer rebuilt
  // The logits in f32 and their gradient, one micro-batch at a time.
  e.mem.workspace = 2 * 4 * b * s * V / t;
  if (engine.executor_memory) {
    // loom's own records, rooms, scratch and buffers (loom_memory.h).
    const LoomMemory lm = loom_memory(m, l, micro_batches);
    e.mem.activations = lm.activations;
    e.mem.workspace = lm.workspace;
    e.mem.comm = lm.comm;
  }
  e.fits = e.mem.total() <= c.memory_bytes - c.reserved_bytes;

  // Time of one micro-batch through one stage.
  const double attn = 4 * b * s * S * h / t;
  double f_layer = 0, record = 0;
  for (int64_t k = 0; k < layers; ++k) {
    f_layer += layer_gemm_s(m, c, l, k);
    if (engine.executor_memory) record += loom_block_record_bytes(m, l, k);
  }
  f_layer /= double(std::max<int64_t>(1, layers));
  record /= double(std::max<int64_t>(1, layers));
  // The memory-bound rest of a layer: Korthikanti's activations read and
  // written once; for loom, its own f32 record at the elementwise rate
  // --calibrate measured (once forward, twice backward), and in 16-bit runs
  // the record's packing and unpacking and the 16-bit parameters widened
  // for each micro-batch's forward and backward.
  double elem = 2 * kept_none * (act / 2) / c.memory_bandwidth;  // read and write once
  const double ebw = c.elementwise_bandwidth > 0 ? c.elementwise_bandwidth : c.memory_bandwidth;
  if (engine.executor_memory) {
    elem = record / ebw;
    if (l.precision != "f32")
      elem += (l.recompute == "full" ? 0 : record / ebw) +
              (psi_blocks + psi_experts) / double(layers) * 6 / c.memory_bandwidth;
  }
  const double fwd = f_layer + elem, bwd = 2 * f_layer + 2 * elem;
  const double rec =
      l.recompute == "full" ? fwd
      : l.recompute == "selective"
          ? gemm_s(attn, 2 * b * s * S * h / t) +
                (engine.executor_memory ? 4 * (b * s * h / t + b * s * 4 * h / t) / ebw
                                        : 2 * attn_core * (act / 2) / c.memory_bandwidth)
          : 0;
  // Tensor parallelism: two all-reduces (or all-gather + reduce-scatter)
  // of the layer's activations forward, two backward, two more to recompute.
  const Link& tp_link = link_for(c, l.gpus(), 1, l.tp);
  const double tp_one = allreduce_s(b * s * h * act, l.tp, tp_link);
  const double tp_layer = tp_one * (4 + (l.recompute == "full" ? 2 : 0));
  // Context parallelism: K and V passed around the ring beside attention.
  const Link& cp_link = link_for(c, l.gpus(), l.tp, l.cp);
  const double kv =
      l.cp > 1 ? (l.cp - 1) * (2 * b * s * h / t * act / cp_link.bandwidth + cp_link.latency) : 0;
  const double cp_exposed = 3 * std::max(0.0, kv - gemm_s(attn, 2 * b * s * S * h / t));
  // Expert parallelism: dispatch and combine forward, and backward.
  // Expert groups are consecutive dp x cp indices (cp fastest): stride tp.
  const Link& ep_link = link_for(c, l.gpus(), l.tp, l.ep);
  const double a2a =
      l.ep > 1 ? 4 * (b * s * h * double(m.top_k) * act * (l.ep - 1) / l.ep / ep_link.bandwidth +
                      (l.ep - 1) * ep_link.latency)
               : 0;
  const double layer_s = fwd + bwd + rec;
  const double comm_layer = tp_layer + cp_exposed + moe_share * a2a;
  const double head = gemm_s(2 * b * s * h * V / t, 2 * b * s * h * V / t) * 3 +
                      3 * 4 * b * s * V / t / c.memory_bandwidth;
  const double stage_mb = double(layers) * (layer_s + comm_layer) + head;
  e.tp_comm_s = m_b * double(layers) * comm_layer;
  e.compute_s = m_b * stage_mb;
  // The bubble: the schedule the executor runs, simulated in units of a
  // stage's forward of one micro-batch (its backward, with recomputation,
  // (bwd + rec) / fwd of them; zero-bubble's B and W half of that each).
  // Schedules too long to simulate at interactive speed (a search of a
  // large cluster meets thousands of micro-batches on tens of stages) take
  // the closed form: (p - 1) / v stage-times, a third of 1F1B's for
  // zero-bubble, which the simulation gives for long schedules too.
  if (l.pp > 1 && int64_t(l.pp) * micro_batches * l.v <= kSimulatedInstructions) {
    const double ratio = (bwd + rec) / std::max(1e-30, fwd);
    e.bubble_s = bubble_stage_times(l.schedule, l.pp, micro_batches, l.v, ratio) * stage_mb;
  } else {
    e.bubble_s = (l.schedule == "zero_bubble" ? (p - 1) / 3 : (p - 1) / l.v) * stage_mb;
  }
  // Point to point: each micro-batch's activation and gradient on every
  // boundary of the critical path (scattered over the tensor ranks).
  if (l.pp > 1) {
    // Every boundary is on the critical path: one between nodes sets the pace.
    const Link& pp_link = link_for(c, l.gpus(), int64_t(l.tp) * l.cp * l.dp, l.pp);
    const double msg = b * s * h * act / t / pp_link.bandwidth + pp_link.latency;
    const double v = l.schedule == "interleaved" ? l.v : 1;
    if (engine.p2p_overlap) {
      // The first activation and the last gradient cross every boundary
      // with nothing to hide behind; in between, each boundary carries one
      // message a micro-batch (and chunk) each way, hidden while the link
      // keeps up with the stage's compute. A link that does not sets the
      // pace: its messages, and one fill.
      const double fill = (p * v - 1) * msg;  // every boundary of every chunk, once
      e.p2p_s = std::max(2 * fill, fill + std::max(0.0, m_b * v * msg - m_b * stage_mb));
    } else {
      e.p2p_s = 2 * msg * (m_b + (p - 1)) * v;
    }
  }
  // Data parallelism, dense parameters over the dp x cp ranks, experts
  // over dp x cp / ep: stages 0-1 all-reduce the gradients beside the last
  // micro-batch's backward, stages 2-3 reduce-scatter them beside every
  // micro-batch's; stages 1-2 all-gather the updated parameters after the
  // step; stage 3 gathers parameters ahead of each use, forward and
  // backward, hidden behind the compute it precedes.
  const Link& dense_link = link_for(c, l.gpus(), l.tp, dense_dp);
  const Link& expert_link = link_for(c, l.gpus(), int64_t(l.tp) * l.ep, expert_dp);
  const double wire = engine.grad_wire_bytes > 0 ? engine.grad_wire_bytes : g_bytes;
  auto over_dp = [&](double bytes_a_param) {  // a ring all-reduce of the stage's parameters
    return allreduce_s(psi_dense * bytes_a_param, dense_dp, dense_link) +
           allreduce_s(psi_experts * bytes_a_param, expert_dp, expert_link);
  };
  const double backward = double(layers) * bwd;
  auto exposed = [&](double comm_s) {
    return engine.dp_overlap ? std::max(0.0, comm_s - backward) : comm_s;
  };
  const double gather = over_dp(p_bytes) / 2;
  if (l.zero <= 1)
    e.dp_exposed_s = exposed(over_dp(wire));
  else
    e.dp_exposed_s = m_b * exposed(over_dp(wire) / 2);
  if (l.zero == 1 || l.zero == 2) e.dp_exposed_s += gather;
  if (l.zero >= 3) e.dp_exposed_s += m_b * 2 * std::max(0.0, gather - stage_mb / 2);
  // The optimizer reads and writes its share of 16 bytes a parameter.
  e.optimizer_s = 2 * 16 * share(1) / c.memory_bandwidth;
  e.step_s = e.compute_s + e.bubble_s + e.p2p_s + e.dp_exposed_s + e.optimizer_s;
  e.tokens_per_s = double(batch) * double(m.seq) / e.step_s;
  const double n = l.gpus();
  e.tflops_per_gpu = step_flops(m, batch, false) / e.step_s / n / 1e12;
  e.hw_tflops_per_gpu = step_flops(m, batch, l.recompute == "full") / e.step_s / n / 1e12;
  return e;
}

std::vector<Estimate> search(const ModelShape& m, const ClusterSpec& c, const PlanOptions& o) {
  LOOM_CHECK_KIND(kConfig, o.gpus > 0, "--gpus must be > 0");
  LOOM_CHECK_KIND(kConfig, o.batch > 0, "--global-batch must be > 0");
  const LayoutConstraint& k = o.constraint;
  const Layout& f = k.values;
  auto pick = [&](const char* key, std::vector<int> all, int fixed) {
    return k.has(key) ? std::vector<int>{fixed} : all;
  };
  auto pick_s = [&](const char* key, std::vector<std::string> all, const std::string& fixed) {
    return k.has(key) ? std::vector<std::string>{fixed} : all;
  };
  const std::vector<int> tps = pick("tp", powers_of_two_upto(c.gpus_per_node), f.tp);
  const std::vector<int> pps = pick("pp", divisors(m.n_layer, o.gpus), f.pp);
  const std::vector<int> cps =
      pick("cp",
           o.engine.context_parallel && m.seq >= 16384 ? std::vector<int>{1, 2, 4, 8}
                                                       : std::vector<int>{1},
           f.cp);
  const std::vector<int> eps =
      pick("ep", m.experts > 0 ? powers_of_two_upto(int(m.experts)) : std::vector<int>{1}, f.ep);
  const std::vector<int> vs = pick("v", {1, 2, 3, 4, 6, 8}, f.v);
  const std::vector<int> micros = pick("micro", {1, 2, 4, 8, 16}, int(f.micro));
  // What the engine lacks is not searched (but refused when --layout asks).
  std::vector<int> zero_stages;
  for (int z = 0; z <= o.engine.max_zero; ++z) zero_stages.push_back(z);
  const std::vector<int> zeros = pick("zero", zero_stages, f.zero);
  const auto recs = pick_s("recompute", {"none", "selective", "full"}, f.recompute);
  const auto precs = pick_s("precision", {"bf16"}, f.precision);
  const std::vector<int> sps =
      k.has("sp") ? std::vector<int>{f.sp ? 1 : 0}
      : o.engine.sequence_parallel && (m.experts == 0 || o.engine.sequence_parallel_moe)
          ? std::vector<int>{0, 1}
          : std::vector<int>{0};
  const auto scheds =
      pick_s("schedule",
             o.engine.zero_bubble ? std::vector<std::string>{"1f1b", "interleaved", "zero_bubble"}
                                  : std::vector<std::string>{"1f1b", "interleaved"},
             f.schedule);

  std::vector<Estimate> fit, over;
  int divisible = 0;
  // Why the layouts that could not run could not (the first one's text
  // under each reason's leading words), for the error when none can.
  std::map<std::string, std::pair<int64_t, std::string>> rejected;
  std::string odd;  // the first combination that is no layout
  g_considered = 0;
  for (int tp : tps)
    for (int pp : pps)
      for (int cp : cps) {
        if (o.gpus % (int64_t(tp) * pp * cp) != 0) continue;
        const int dp = o.gpus / (tp * pp * cp);
        if (k.has("dp") && dp != f.dp) continue;
        ++divisible;
        for (int ep : eps)
          for (int v : vs)
            for (int micro : micros)
              for (int zero : zeros)
                for (const std::string& rec : recs)
                  for (const std::string& prec : precs)
                    for (int sp : sps)
                      for (const std::string& sched : scheds) {
                        const Layout l{tp,    pp,   dp,  cp,      ep,   v,
                                       micro, zero, rec, sp != 0, prec, sched};
                        const std::string why = invalid_reason(m, o.batch, l, o.engine);
                        // Combinations of searched values no layout has are
                        // not counted; what --layout fixed is, if nothing else is.
                        if ((v > 1) != (sched == "interleaved") || (pp == 1 && sched != "1f1b") ||
                            (sp && tp == 1)) {
                          if (odd.empty()) odd = l.describe() + ": " + why;
                          continue;
                        }
                        if (!why.empty()) {
                          std::string kind = why;  // the reason without its numbers
                          kind.erase(std::remove_if(kind.begin(), kind.end(), ::isdigit),
                                     kind.end());
                          auto& [count, example] = rejected[kind];
                          if (count++ == 0) example = l.describe() + ": " + why;
                          continue;
                        }
                        ++g_considered;
                        Estimate e = estimate(m, c, o.batch, l, o.engine);
                        (e.fits ? fit : over).push_back(std::move(e));
                      }
      }
  LOOM_CHECK_KIND(kConfig, divisible > 0,
                  "no layout of {} GPUs: tp x pp x cp must divide it (tp a power of two up to "
                  "{} per node, pp a divisor of the {} layers){}",
                  o.gpus, c.gpus_per_node, m.n_layer,
                  k.fixed.empty() ? "" : ", with --layout's sizes");
  if (fit.empty()) {
    if (over.empty()) {
      LOOM_CHECK_KIND(kConfig, !rejected.empty(), "no layout of {} GPUs{}: {}", o.gpus,
                      k.fixed.empty() ? "" : " with --layout's sizes", odd);
      const auto most = std::max_element(
          rejected.begin(), rejected.end(),
          [](const auto& x, const auto& y) { return x.second.first < y.second.first; });
      LOOM_FAIL(kConfig,
                "no layout of {} GPUs runs the model ({} layers, {} heads) and the batch {}{} "
                "on the {} engine: of the {} layouts that divide the GPUs, {} are refused for this "
                "reason, e.g. {}",
                o.gpus, m.n_layer, m.heads, o.batch,
                k.fixed.empty() ? "" : " with --layout's sizes", o.engine.name,
                refused_in_all(rejected), most->second.first, most->second.second);
    }
    const auto best = std::min_element(
        over.begin(), over.end(),
        [](const Estimate& x, const Estimate& y) { return x.mem.total() < y.mem.total(); });
    LOOM_FAIL(kConfig,
              "the model fits on no layout of {} x {}: the smallest ({}) needs {} GB a device, "
              "{} GB more than the {} GB there is",
              o.gpus, c.device.empty() ? c.name : c.device, best->layout.describe(),
              std::round(best->mem.total() / 1e8) / 10,
              std::round((best->mem.total() - (c.memory_bytes - c.reserved_bytes)) / 1e8) / 10,
              std::round((c.memory_bytes - c.reserved_bytes) / 1e8) / 10);
  }
  std::sort(fit.begin(), fit.end(),
            [](const Estimate& x, const Estimate& y) { return x.tokens_per_s > y.tokens_per_s; });
  if (o.top > 0 && static_cast<int>(fit.size()) > o.top) fit.resize(static_cast<size_t>(o.top));
  return fit;
}

int64_t layouts_considered() {
  return g_considered;
}

json to_json(const Estimate& e) {
  const Layout& l = e.layout;
  return {{"layout",
           {{"tp", l.tp},
            {"pp", l.pp},
            {"dp", l.dp},
            {"cp", l.cp},
            {"ep", l.ep},
            {"v", l.v},
            {"micro", l.micro},
            {"zero", l.zero},
            {"recompute", l.recompute},
            {"sp", l.sp},
            {"precision", l.precision},
            {"schedule", l.schedule}}},
          {"step_time_s", e.step_s},
          {"tokens_per_s", e.tokens_per_s},
          {"tflops_per_gpu", e.tflops_per_gpu},
          {"hw_tflops_per_gpu", e.hw_tflops_per_gpu},
          {"fits", e.fits},
          {"mem_bytes",
           {{"params", e.mem.params},
            {"grads", e.mem.grads},
            {"optimizer", e.mem.optimizer},
            {"activations", e.mem.activations},
            {"comm", e.mem.comm},
            {"workspace", e.mem.workspace},
            {"total", e.mem.total()}}},
          {"time_s",
           {{"compute", e.compute_s},
            {"tp_cp_ep_comm", e.tp_comm_s},
            {"bubble", e.bubble_s},
            {"p2p", e.p2p_s},
            {"dp_exposed", e.dp_exposed_s},
            {"optimizer", e.optimizer_s}}}};
}

}  // namespace loom::plan
