#include "loom/train/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <numeric>
#include <sstream>

#include "loom/core/error.h"
#include "loom/parallel/pipeline/partition.h"
#include "loom/parallel/pipeline/schedule.h"
#include "loom/parallel/zero/offload.h"
#include "loom/train/config_keys.h"
#include "loom/train/gemm_choice.h"

namespace loom {

using nlohmann::json;

namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

// Keys allowed directly under `prefix` ("" for the top level, "model." ...).
std::vector<std::string> children(const std::string& prefix) {
  std::vector<std::string> out;
  for (const ConfigKey& k : config_keys()) {
    if (k.path.compare(0, prefix.size(), prefix) != 0) continue;
    std::string rest = k.path.substr(prefix.size());
    std::string child = rest.substr(0, rest.find('.'));
    if (std::find(out.begin(), out.end(), child) == out.end()) out.push_back(child);
  }
  return out;
}

[[noreturn]] void fail(const std::string& source, const std::string& msg) {
  LOOM_FAIL(kConfig, "{}: {}", source, msg);
}

// device, comm.backend and kernels.tf32 against each other and the build.
void check_device_keys(Config& c, const std::string& source) {
#ifndef LOOM_HAVE_CUDA
  if (c.device == "cuda")
    fail(source,
         "device: cuda needs loom built with -DLOOM_CUDA=ON (docs/cuda.md); this build "
         "computes on the CPU alone");
#endif
  if (c.comm.backend == "nccl" && c.device != "cuda")
    fail(source, "comm.backend nccl needs device: cuda (NCCL moves GPU memory; device is " +
                     c.device + ")");
  if (c.kernels.tf32 && c.device != "cuda")
    fail(source, "kernels.tf32 applies to device: cuda; the CPU backend has no TF32");
}

std::string type_name(const json& v) {
  if (v.is_number_integer() || v.is_number_unsigned()) return "an integer";
  if (v.is_number_float()) return "a number";
  return std::string("a ") + v.type_name();
}

// A value as JSON text for a message; bytes that are not UTF-8 shown as
// U+FFFD (dumping them strictly throws).
std::string show(const json& v) {
  return v.dump(-1, ' ', false, json::error_handler_t::replace);
}

bool valid_utf8(const json& v) {
  try {
    (void)v.dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

void check_leaf(const ConfigKey& k, const json& v, const std::string& source) {
  auto expect = [&](const char* what) {
    fail(source, format("{}: expected {}, got {} {}", k.path, what, type_name(v), show(v)));
  };
  auto range = [&](double x) {
    bool low = k.lo_exclusive ? x <= k.lo : x < k.lo;
    if (low || x > k.hi) {
      std::string lo = k.lo_exclusive ? "> " : ">= ";
      fail(source,
           format("{}: {} is out of range (must be {}{}{})", k.path, show(v), lo, json(k.lo).dump(),
                  k.hi < 1e299 ? " and <= " + json(k.hi).dump() : std::string()));
    }
  };
  switch (k.kind) {
    case KeyKind::kInt:
      // A whole float (4.0) counts as an integer, and is range-checked like one.
      if (v.is_number_float() && std::floor(v.get<double>()) != v.get<double>())
        expect("an integer");
      if (!v.is_number()) expect("an integer");
      range(v.get<double>());
      break;
    case KeyKind::kNumber:
      if (!v.is_number()) expect("a number");
      range(v.get<double>());
      break;
    case KeyKind::kBool:
      if (!v.is_boolean()) expect("true or false");
      break;
    case KeyKind::kString:
      if (!v.is_string()) expect("a string");
      // It goes into config.resolved.json, which is UTF-8.
      if (!valid_utf8(v)) fail(source, format("{}: {} is not valid UTF-8", k.path, show(v)));
      if (!k.choices.empty() &&
          std::find(k.choices.begin(), k.choices.end(), v.get<std::string>()) == k.choices.end()) {
        std::string list;
        for (const auto& c : k.choices) list += (list.empty() ? "" : ", ") + c;
        fail(source, format("{}: unknown value {} (expected one of {})", k.path, show(v), list));
      }
      break;
    case KeyKind::kPartition:
      if (v.is_string()) {
        if (v != "uniform" && v != "balanced")
          fail(source, format("{}: unknown value {} (expected uniform, balanced, or a list of "
                              "layer counts per part)",
                              k.path, show(v)));
        break;
      }
      if (!v.is_array() || v.empty()) expect("uniform, balanced, or a list of layer counts");
      for (const json& x : v)
        if (!x.is_number_integer() || x.get<int64_t>() < 1)
          fail(source,
               format("{}: {} is not a layer count (a whole number >= 1)", k.path, show(x)));
      break;
    case KeyKind::kIntList:
      if (!v.is_array() || v.empty()) expect("a non-empty list of integers");
      for (const json& x : v) {
        if (!x.is_number_integer())
          fail(source, format("{}: {} is not an integer", k.path, show(x)));
        range(x.get<double>());
      }
      break;
    case KeyKind::kNumberPair:
      if (!v.is_array() || v.size() != 2 || !v[0].is_number() || !v[1].is_number())
        expect("a list of two numbers");
      for (const json& x : v) {
        double d = x.get<double>();
        if (d < 0 || d >= 1) fail(source, format("{}: {} must be in [0, 1)", k.path, show(x)));
      }
      break;
  }
}

// Checks every key of `obj` (at `prefix`) against the schema, recursively.
void validate(const json& obj, const std::string& prefix, const std::string& source) {
  const std::string where = prefix.empty() ? "the top level" : prefix.substr(0, prefix.size() - 1);
  if (!obj.is_object())
    fail(source, format("{}: expected an object, got {}", where, type_name(obj)));
  std::vector<std::string> allowed = children(prefix);
  for (const auto& [key, value] : obj.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      std::string best;
      size_t best_d = 1000;
      for (const auto& a : allowed)
        if (size_t d = edit_distance(key, a); d < best_d) best_d = d, best = a;
      std::string hint = (best_d <= std::max<size_t>(2, key.size() / 3))
                             ? format(" (did you mean '{}{}'?)", prefix, best)
                             : format(" (keys allowed in {}: see docs/config.md)", where);
      fail(source, format("unknown key '{}{}'{}", prefix, key, hint));
    }
    std::string path = prefix + key;
    if (const ConfigKey* spec = find_config_key(path)) {
      check_leaf(*spec, value, source);
    } else {
      validate(value, path + ".", source);
    }
  }
}

void apply_override(json& root, const std::string& item) {
  size_t eq = item.find('=');
  LOOM_CHECK_KIND(kConfig, eq != std::string::npos && eq > 0,
                  "--set {}: expected key=value, e.g. --set model.n_layer=4", item);
  std::string path = item.substr(0, eq), text = item.substr(eq + 1);
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) value = text;  // a bare word is a string
  json* node = &root;
  std::stringstream ss(path);
  std::string part, walked;
  std::vector<std::string> parts;
  while (std::getline(ss, part, '.')) parts.push_back(part);
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    walked += (walked.empty() ? "" : ".") + parts[i];
    json& next = (*node)[parts[i]];
    if (next.is_null()) next = json::object();
    LOOM_CHECK_KIND(kConfig, next.is_object(), "--set {}: '{}' is not a section", item, walked);
    node = &next;
  }
  (*node)[parts.back()] = value;
}

// Line and column (1-based) of byte offset `pos` in `text`.
std::pair<size_t, size_t> line_column(const std::string& text, size_t pos) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos && i < text.size(); ++i) {
    if (text[i] == '\n') {
      line++;
      col = 1;
    } else {
      col++;
    }
  }
  return {line, col};
}

// The value at a dotted path ("model.n_layer"), or null when it is absent.
const json* lookup(const json& j, const char* path) {
  const json* node = &j;
  std::stringstream ss(path);
  std::string part;
  while (std::getline(ss, part, '.')) {
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
  }
  return node;
}

template <typename T>
T get_or(const json& j, const char* path, T fallback) {
  const json* v = lookup(j, path);
  return v ? v->get<T>() : fallback;
}

bool has(const json& j, const char* path) {
  return lookup(j, path) != nullptr;
}

// The 2 x cp chunks of every sequence, and what each way of reaching the
// other chunks' keys and values needs.
void resolve_context(const Config& c, const std::string& source) {
  const ParallelConfig& p = c.parallel;
  const GptConfig& m = c.model;
  const int64_t cp = p.context, T = m.seq_len;
  // With the sequence split over the tensor group too, each chunk pair
  // splits into tensor equal pieces.
  const int64_t tp = p.sequence_parallel ? p.tensor : 1;
  const int64_t step = p.sequence_parallel ? cp * std::lcm(int64_t{2}, tp) : 2 * cp;
  if (T % step != 0) {
    const int64_t below = T / step * step, above = below + step;
    fail(source,
         p.sequence_parallel
             ? format("model.seq_len {} does not divide into parallel.context {} x lcm(2, "
                      "parallel.tensor {}) = {} (2 x context chunks, each rank's pair split over "
                      "the tensor group); nearest valid seq_len: {}",
                      T, cp, tp, step,
                      below > 0 ? format("{} or {}", below, above) : format("{}", above))
             : format("model.seq_len {} does not divide into 2 x parallel.context {} = {} chunks; "
                      "nearest valid seq_len: {}",
                      T, cp, step,
                      below > 0 ? format("{} or {}", below, above) : format("{}", above)));
  }
  if (p.context_comm == "a2a") {
    const int64_t heads = m.n_head / p.tensor;  // this rank's, tensor-divisibility checked above
    if (heads % cp != 0) {
      std::string valid;
      for (int64_t d = 1; d <= heads; ++d)
        if (heads % d == 0) valid += (valid.empty() ? "" : ", ") + std::to_string(d);
      fail(source, format("parallel.context_comm a2a gives each rank n_head / parallel.tensor / "
                          "parallel.context heads, but model.n_head {} / tensor {} = {} heads "
                          "do not divide by parallel.context {}; valid context sizes for a2a: "
                          "{} (or context_comm p2p / all_gather, which split no heads)",
                          m.n_head, p.tensor, heads, cp, valid));
    }
  }
}

void resolve_parallel(Config& c, const json& j, int world_size, const std::string& source) {
  const ParallelConfig& p = c.parallel;
  if (p.tensor > world_size)
    fail(source,
         format("parallel.tensor {} is larger than the job's {} rank(s)", p.tensor, world_size));
  const int64_t model = int64_t{p.tensor} * p.pipeline * p.context;
  if (world_size % model != 0)
    fail(source, p.context > 1
                     ? format("the job's {} rank(s) do not divide into parallel.tensor {} x "
                              "parallel.context {} x parallel.pipeline {}",
                              world_size, p.tensor, p.context, p.pipeline)
                     : format("the job's {} rank(s) do not divide into parallel.tensor {} x "
                              "parallel.pipeline {}",
                              world_size, p.tensor, p.pipeline));
  const int tp = p.tensor;
  GptConfig& m = c.model;
  if (tp > 1) {
    // Each rank holds whole heads, an equal share of the MLP's hidden
    // features and an equal vocabulary range.
    if (m.n_head % tp != 0)
      fail(source, format("model.n_head {} is not divisible by parallel.tensor {} (each rank "
                          "holds whole heads)",
                          m.n_head, tp));
    if ((4 * int64_t{m.n_embd}) % tp != 0)
      fail(source, format("4 x model.n_embd = {} is not divisible by parallel.tensor {}",
                          4 * int64_t{m.n_embd}, tp));
    m.vocab_multiple = 128 * tp;
  }
  c.data_parallel = get_or<int64_t>(j, "parallel.data", world_size / model);
  if (c.data_parallel * model != world_size)
    fail(source,
         p.context > 1
             ? format("parallel.data is {} but the job has {} rank(s) (= tensor {} x context {} x "
                      "pipeline {} x data {})",
                      c.data_parallel, world_size, p.tensor, p.context, p.pipeline,
                      world_size / model)
             : format("parallel.data is {} but the job has {} rank(s) (= tensor {} x pipeline "
                      "{} x data {})",
                      c.data_parallel, world_size, p.tensor, p.pipeline, world_size / model));
  if (p.context > 1) resolve_context(c, source);
  // Expert parallelism splits each MoE layer's experts over groups of
  // data-parallel (x context-parallel) ranks.
  if (p.expert > 1) {
    if (m.moe_experts == 0)
      fail(source, format("parallel.expert is {} but the model has no mixture-of-experts layers "
                          "(model.moe.num_experts)",
                          p.expert));
    if ((c.data_parallel * p.context) % p.expert != 0)
      fail(source,
           p.context > 1
               ? format("parallel.expert {} does not divide the data-parallel x context-parallel "
                        "size {} x {} = {} (expert groups are carved out of those ranks)",
                        p.expert, c.data_parallel, p.context, c.data_parallel * p.context)
               : format("parallel.expert {} does not divide the data-parallel size {} (expert "
                        "groups are carved out of the data-parallel ranks)",
                        p.expert, c.data_parallel));
    if (m.moe_experts % p.expert != 0)
      fail(source, format("model.moe.num_experts {} is not divisible by parallel.expert {} (each "
                          "rank holds num_experts / expert of them)",
                          m.moe_experts, p.expert));
  }
}

// After the batch: the micro-batches per step are the pipeline's.
void resolve_pipeline(Config& c, const std::string& source) {
  const ParallelConfig& p = c.parallel;
  const pp::ScheduleKind kind = pp::parse_schedule(p.schedule);
  if (p.virtual_stages > 1 && kind != pp::ScheduleKind::kInterleaved)
    fail(source, format("parallel.virtual_stages {} needs parallel.schedule interleaved (it is {})",
                        p.virtual_stages, p.schedule));
  if (p.virtual_stages > 1 && p.pipeline == 1)
    fail(source, format("parallel.virtual_stages {} interleaves chunks over pipeline stages; it "
                        "needs parallel.pipeline > 1",
                        p.virtual_stages));
  const int parts = p.pipeline * p.virtual_stages;
  try {
    if (p.virtual_stages > 1 && c.model.n_layer % parts != 0)
      LOOM_FAIL(kConfig,
                "model.n_layer {} does not divide into parallel.pipeline {} x "
                "parallel.virtual_stages {} = {} equal chunks",
                c.model.n_layer, p.pipeline, p.virtual_stages, parts);
    pp::check_schedule(kind, p.pipeline, static_cast<int>(c.grad_accum), p.virtual_stages);
    if (p.partition == "list")
      pp::check_partition(p.partition_counts, c.model.n_layer, parts);
    else
      pp::uniform_partition(c.model.n_layer, parts);
  } catch (const Error& e) {
    fail(source, e.what());
  }
}

void resolve_checkpointing(Config& c, const json& j, const std::string& source) {
  CheckpointingConfig& a = c.checkpointing;
  if (a.policy.kind == CheckpointPolicy::kBudget &&
      !has(j, "activation_checkpointing.budget_bytes"))
    fail(source,
         "activation_checkpointing.policy is budget but activation_checkpointing."
         "budget_bytes is not set (activation bytes per rank)");
  if (a.policy.kind != CheckpointPolicy::kBudget && has(j, "activation_checkpointing.budget_bytes"))
    fail(source, format("activation_checkpointing.budget_bytes is set but the policy is {} "
                        "(set activation_checkpointing.policy to budget)",
                        CheckpointPolicy::name(a.policy.kind)));
  if (a.policy.kind != CheckpointPolicy::kEveryN && has(j, "activation_checkpointing.every_n"))
    fail(source, format("activation_checkpointing.every_n is set but the policy is {} (set "
                        "activation_checkpointing.policy to every_n)",
                        CheckpointPolicy::name(a.policy.kind)));
  // A 16-bit run keeps the records in its type unless told f32.
  a.policy.records = a.activation_dtype == "f32" ? DType::kF32 : c.precision;
  for (const char* k :
       {"partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
        "number_checkpoints", "synchronize_checkpoint_boundary", "profile"})
    a.deepspeed_keys =
        a.deepspeed_keys || has(j, (std::string("activation_checkpointing.") + k).c_str());
}

// a x b, or a config error naming `what` when the product leaves int64
// (each key alone is checked only against kMaxInt).
int64_t mul(const std::string& source, int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out))
    fail(source,
         format("{} = {} x {} overflows a 64-bit count; use smaller batch sizes", what, a, b));
  return out;
}

void resolve_batch(Config& c, const json& j, const std::string& source) {
  const int64_t dp = c.data_parallel;
  const char* kId = "micro x accumulation x data-parallel";
  bool has_tbs = has(j, "train_batch_size"), has_mb = has(j, "train_micro_batch_size_per_gpu"),
       has_ga = has(j, "gradient_accumulation_steps");
  int64_t tbs = get_or<int64_t>(j, "train_batch_size", 0);
  int64_t mb = get_or<int64_t>(j, "train_micro_batch_size_per_gpu", 0);
  int64_t ga = get_or<int64_t>(j, "gradient_accumulation_steps", 0);
  // DeepSpeed's rule: any two determine the third; one alone takes the
  // others from accumulation 1.
  if (has_tbs && has_mb && has_ga) {
    const int64_t product = mul(source, mul(source, mb, ga, kId), dp, kId);
    if (tbs != product)
      fail(source, format("batch identity broken: train_batch_size {} != "
                          "train_micro_batch_size_per_gpu {} x gradient_accumulation_steps {} x "
                          "data-parallel size {} (= {})",
                          tbs, mb, ga, dp, product));
  } else if (has_tbs && has_mb) {
    const int64_t mb_dp = mul(source, mb, dp, kId);
    if (tbs % mb_dp != 0)
      fail(source, format("train_batch_size {} is not divisible by "
                          "train_micro_batch_size_per_gpu {} x data-parallel size {} (= {})",
                          tbs, mb, dp, mb_dp));
    ga = tbs / mb_dp;
  } else if (has_tbs && has_ga) {
    const int64_t ga_dp = mul(source, ga, dp, kId);
    if (tbs % ga_dp != 0)
      fail(source, format("train_batch_size {} is not divisible by gradient_accumulation_steps "
                          "{} x data-parallel size {} (= {})",
                          tbs, ga, dp, ga_dp));
    mb = tbs / ga_dp;
  } else if (has_mb && has_ga) {
    tbs = mul(source, mul(source, mb, ga, kId), dp, kId);
  } else if (has_tbs) {
    if (tbs % dp != 0)
      fail(source,
           format("train_batch_size {} is not divisible by the data-parallel size {}", tbs, dp));
    ga = 1, mb = tbs / dp;
  } else if (has_mb) {
    ga = 1, tbs = mul(source, mb, dp, kId);
  } else {
    fail(source, "no batch size: set train_batch_size or train_micro_batch_size_per_gpu");
  }
  c.train_batch_size = tbs, c.micro_batch = mb, c.grad_accum = ga;
  // Token counts (per micro-batch, per step) are products too.
  mul(source, tbs, c.model.seq_len, "tokens per step: train_batch_size x model.seq_len");
}

}  // namespace

Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides, int world_size) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    auto [line, col] = line_column(text, e.byte == 0 ? 0 : e.byte - 1);
    std::string what = e.what();
    size_t colon = what.find(": ", what.find("parse error"));
    fail(source, format("invalid JSON at line {}, column {}: {}", line, col,
                        colon == std::string::npos ? what : what.substr(colon + 2)));
  } catch (const json::exception& e) {
    // A number beyond a double (out_of_range), found by fuzzing.
    fail(source, format("invalid JSON: {}", e.what()));
  }
  // Overrides walk the sections: the top level must be one (fuzzing found
  // `1` with --set reaching a type error).
  if (!j.is_object())
    fail(source, format("the top level: expected an object, got {}", type_name(j)));
  for (const std::string& o : overrides) apply_override(j, o);
  validate(j, "", source);

  // Every key the table lands: its value, or its default.
  Config c;
  for (const ConfigKey& k : config_keys()) {
    if (!k.land) continue;
    if (const json* v = lookup(j, k.path.c_str()))
      k.land(c, *v);
    else if (!k.fallback.is_null())
      k.land(c, k.fallback);
  }
  // The rules that span keys.
  GptConfig& m = c.model;
  if (m.n_embd % m.n_head != 0)
    fail(source, format("model.n_embd {} is not divisible by model.n_head {}", m.n_embd, m.n_head));
  if (has(j, "model.moe")) {
    if (!has(j, "model.moe.num_experts"))
      fail(source, "model.moe needs num_experts (the experts of each mixture-of-experts layer)");
    m.moe_top_k = get_or<int>(j, "model.moe.top_k", std::min(2, m.moe_experts));
    const std::string router = find_config_key("model.moe.router")->value(c).get<std::string>();
    if (m.moe_router != 0) {
      // A fixed router has no probabilities to balance or to keep small.
      for (const char* key :
           {"model.moe.aux_loss_coef", "model.moe.z_loss_coef", "model.moe.bias_update_rate"})
        if (has(j, key))
          fail(source, format("{} is set but model.moe.router is {}, which has no router "
                              "probabilities (its choice is fixed by the token ids)",
                              key, router));
      if (m.moe_bias_balancing)
        fail(source, format("model.moe.balancing is bias but model.moe.router is {}; bias "
                            "balancing steers the learned router",
                            router));
    }
    if (router == "tag") {
      if (!has(j, "model.moe.tag_tokens"))
        fail(source,
             "model.moe.router is tag but model.moe.tag_tokens is not set (the token "
             "ids that mark each tag, tag i routing to expert i)");
      for (const json& x : *lookup(j, "model.moe.tag_tokens")) {
        const int64_t id = x.get<int64_t>();
        if (id >= m.vocab_size)
          fail(source, format("model.moe.tag_tokens: {} is outside the vocabulary of {}", id,
                              m.vocab_size));
        if (std::find(m.moe_tag_tokens.begin(), m.moe_tag_tokens.end(), id) !=
            m.moe_tag_tokens.end())
          fail(source, format("model.moe.tag_tokens: {} is listed twice (each token marks one "
                              "tag)",
                              id));
        m.moe_tag_tokens.push_back(static_cast<int32_t>(id));
      }
    } else if (has(j, "model.moe.tag_tokens")) {
      fail(source, format("model.moe.tag_tokens is set but model.moe.router is {} (set it to tag)",
                          router));
    }
    // Bias balancing replaces the auxiliary loss unless one is asked for too.
    m.moe_aux_loss_coef = get_or<double>(j, "model.moe.aux_loss_coef",
                                         m.moe_bias_balancing || m.moe_router != 0 ? 0.0 : 0.01);
    if (!m.moe_bias_balancing && has(j, "model.moe.bias_update_rate"))
      fail(source,
           "model.moe.bias_update_rate is set but model.moe.balancing is aux_loss (set "
           "it to bias)");
    if (m.moe_top_k > m.moe_experts)
      fail(source, format("model.moe.top_k {} is larger than model.moe.num_experts {}", m.moe_top_k,
                          m.moe_experts));
    if (m.moe_every > m.n_layer)
      fail(source, format("model.moe.every_n_layers {} is more than model.n_layer {}: no block "
                          "would be a mixture of experts",
                          m.moe_every, m.n_layer));
  }
  const LossScaleConfig& ls = c.loss_scaling;
  const double initial =
      ls.loss_scale > 0 ? ls.loss_scale : std::ldexp(1.0, ls.initial_scale_power);
  if (ls.min_loss_scale > initial)
    fail(source, format("fp16.min_loss_scale {} is above the initial scale {} ({}); the scale "
                        "could never start",
                        ls.min_loss_scale, initial,
                        ls.loss_scale > 0 ? "fp16.loss_scale" : "2^fp16.initial_scale_power"));
  const bool fp16 = get_or<bool>(j, "fp16.enabled", false);
  const bool bf16 = get_or<bool>(j, "bf16.enabled", false);
  if (fp16 && bf16) fail(source, "fp16.enabled and bf16.enabled are both true; choose one");
  c.precision = fp16 ? DType::kF16 : bf16 ? DType::kBF16 : DType::kF32;

  resolve_parallel(c, j, world_size, source);
  resolve_batch(c, j, source);
  if (c.parallel.sequence_parallel) {
    if (c.parallel.tensor == 1)
      fail(source,
           "parallel.sequence_parallel splits the sequence across the tensor-parallel "
           "group; it needs parallel.tensor > 1");
    // A context-parallel rank's share of the sequence is what splits.
    const int64_t local = c.model.seq_len / c.parallel.context;
    const int64_t tokens = c.micro_batch * local;
    if (tokens % c.parallel.tensor != 0)
      fail(source, format("parallel.sequence_parallel: a micro-batch of {} x {} = {} tokens does "
                          "not split into parallel.tensor {} pieces",
                          c.micro_batch, local, tokens, c.parallel.tensor));
    if (c.model.moe_experts > 0)
      LOOM_FAIL(kUnsupported,
                "{}: parallel.sequence_parallel with mixture-of-experts layers is not supported "
                "yet (a MoE layer routes whole sequences); set it to false",
                source);
  }
  resolve_pipeline(c, source);
  resolve_checkpointing(c, j, source);

  SchedulerConfig& s = c.scheduler;
  if (s.type.empty() && has(j, "scheduler.params"))
    fail(source, "scheduler.params given without scheduler.type");
  // Defaults taken from other keys.
  s.warmup_max_lr = get_or<double>(j, "scheduler.params.warmup_max_lr", c.optimizer.lr);
  s.total_num_steps = get_or<int64_t>(j, "scheduler.params.total_num_steps", c.train.steps);
  if (s.type != "WarmupLR" && !s.type.empty() && s.total_num_steps <= s.warmup_num_steps)
    fail(source, format("scheduler.params.total_num_steps {} must exceed warmup_num_steps {}",
                        s.total_num_steps, s.warmup_num_steps));

  const DataConfig& d = c.data;
  if (!d.synthetic && d.train.empty())
    fail(source, "data.train: no token file given (set data.train, or data.synthetic: true)");

  ZeroConfig& z = c.zero;
  z.dtype = c.precision;
  if (z.offload_device != "none" && z.stage == 0)
    fail(source, format("zero_optimization.offload_optimizer.device {} needs stage 1, 2 or 3 "
                        "(stage is 0)",
                        z.offload_device));
  CompressionConfig& cc = z.compression;
  cc.seed = c.train.seed;
  if ((cc.type == "fp16" || cc.type == "bf16") && c.precision != DType::kF32)
    fail(source, format("comm.compression.type {}: the gradients of a {} run are already 16-bit "
                        "and cross the wire in 16 bits",
                        cc.type, dtype_name(c.precision)));
  if (c.optimizer.one_bit()) {
    if (z.stage >= 2)
      fail(source, format("optimizer.type {} needs zero_optimization.stage 0 or 1 (stage is {}): "
                          "in its compressed phase nothing is reduced and every rank's momentum "
                          "is formed from its own whole gradients, which stages 2-3 do not keep "
                          "(they reduce-scatter every micro-batch's)",
                          c.optimizer.type, z.stage));
    const OptimizerConfig& o = c.optimizer;
    // 0/1 Adam's local steps begin after step var_freeze_step + local_step_scaler.
    const bool local_steps = o.zero_one() && o.local_step_clipper > 1 &&
                             c.train.steps > o.var_freeze_step + o.local_step_scaler;
    if (local_steps && z.stage == 1)
      fail(source, format("optimizer.type ZeroOneAdam with zero_optimization.stage 1: train.steps "
                          "{} reaches the local steps (after step var_freeze_step {} + "
                          "local_step_scaler {}), in which each rank updates all of its own "
                          "parameters, which stage 1 shards; use stage 0, or raise "
                          "var_freeze_step or local_step_scaler",
                          c.train.steps, o.var_freeze_step, o.local_step_scaler));
    if (local_steps && c.parallel.context > 1)
      fail(source,
           format("optimizer.type ZeroOneAdam with parallel.context {}: train.steps {} "
                  "reaches the local steps (after step var_freeze_step {} + "
                  "local_step_scaler {}), in which the ranks of a sequence's context "
                  "group would hold different parameters; raise var_freeze_step or "
                  "local_step_scaler",
                  c.parallel.context, c.train.steps, o.var_freeze_step, o.local_step_scaler));
    if (z.offload_device == "nvme")
      fail(source, format("optimizer.type {} with zero_optimization.offload_optimizer.device "
                          "nvme: the 1-bit update reads and writes the moments in memory, not "
                          "unit by unit from the file",
                          c.optimizer.type));
    if (c.parallel.expert > 1)
      fail(source, format("optimizer.type {} with parallel.expert {}: expert units reduce over "
                          "their own groups, which 1-bit compression does not cover",
                          c.optimizer.type, c.parallel.expert));
    if (cc.any())
      fail(source, format("optimizer.type {} with comm.compression.type {}: the optimizer "
                          "compresses what it communicates itself; set comm.compression.type "
                          "none",
                          c.optimizer.type, cc.type));
    if (c.checkpoint.format == "whole")
      fail(source, format("optimizer.type {} with checkpoint.format whole: the errors of its "
                          "compression are every rank's own, which only sharded checkpoints "
                          "hold",
                          c.optimizer.type));
  }
  if (cc.type == "powersgd" && c.parallel.expert > 1)
    fail(source, format("comm.compression.type powersgd with parallel.expert {}: expert units "
                        "reduce over their own groups, whose error feedback and Q PowerSGD does "
                        "not keep",
                        c.parallel.expert));
  if (cc.type == "powersgd" && c.precision == DType::kF16)
    fail(source,
         "comm.compression.type powersgd with fp16.enabled: the dynamic loss scale "
         "changes the gradients' units between steps, which the carried error does not "
         "follow; train in bf16 or f32");
  if ((cc.type == "fp16" || cc.type == "bf16") && z.stage <= 1 && c.comm.allreduce != "mpi" &&
      c.comm.allreduce != "auto")
    fail(source, format("comm.compression.type {} with comm.allreduce {}: that algorithm reduces "
                        "f32, so 16-bit gradients would cross the wire widened; use mpi or auto",
                        cc.type, c.comm.allreduce));
  if (cc.type == "powersgd" && c.checkpoint.format == "whole")
    fail(source,
         "comm.compression.type powersgd with checkpoint.format whole: PowerSGD's error "
         "feedback is every rank's own, which only sharded checkpoints hold");
  // Checked here, before anything is allocated: the files are made later.
  if (z.offload_device == "nvme")
    check_writable_dir(z.nvme_path, source + ": zero_optimization.offload_optimizer.nvme_path");
  if (c.checkpoint.async && c.checkpoint.format == "whole")
    fail(source, "checkpoint.async writes sharded checkpoints; checkpoint.format is whole");
  try {
    const GemmInputsChoice g = resolve_gemm_inputs(c.kernels.gemm_inputs, c.precision, c.device);
    c.kernels.gemm16 = g.sixteen;
    c.kernels.gemm_inputs_why = g.why;
  } catch (const Error& e) {
    fail(source, e.what());
  }
  c.zero.weights16 = c.kernels.gemm16;
  check_device_keys(c, source);
  c.resolved = resolved_config(c);
  return c;
}

CommOptions comm_options_from(const std::vector<std::string>& overrides) {
  json j = json::object();
  for (const std::string& o : overrides) {
    LOOM_CHECK_KIND(kConfig, o.rfind("comm.", 0) == 0,
                    "--set {}: only comm.* keys apply here (comm.timeout_s, comm.allreduce, ...)",
                    o);
    apply_override(j, o);
  }
  validate(j, "", "--set");
  Config c;
  for (const ConfigKey& k : config_keys()) {
    if (!k.land || k.path.rfind("comm.", 0) != 0) continue;
    const json* v = lookup(j, k.path.c_str());
    k.land(c, v ? *v : k.fallback);
  }
  return c.comm;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides,
                   int world_size) {
  std::ifstream in(path, std::ios::binary);
  LOOM_CHECK_KIND(kConfig, in.good(), "{}: cannot open config file", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_config(ss.str(), path, overrides, world_size);
}

}  // namespace loom
