#include "loom/train/config_keys.h"

#include "loom/train/config.h"
#include "loom/train/config_keys_detail.h"

namespace loom {

using nlohmann::json;

namespace config_table {

std::vector<ConfigKey> run_keys() {
  return {
      key("train_batch_size", KeyKind::kInt)
          .range(1, kMaxInt)
          .resolved([](const Config& c) { return json(c.train_batch_size); })
          .doc("int >= 1", "inferred", "sequences per optimizer step, all ranks"),
      key("train_micro_batch_size_per_gpu", KeyKind::kInt)
          .range(1, kMaxInt)
          .resolved([](const Config& c) { return json(c.micro_batch); })
          .doc("int >= 1", "inferred", "sequences per forward/backward on one rank"),
      key("gradient_accumulation_steps", KeyKind::kInt)
          .range(1, kMaxInt)
          .resolved([](const Config& c) { return json(c.grad_accum); })
          .doc("int >= 1", "inferred", "micro-batches per optimizer step"),
      key("gradient_clipping", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.gradient_clipping, double))
          .doc("number >= 0", "0 (off)", "clip the global gradient L2 norm to this"),
      key("optimizer.type", KeyKind::kString)
          .one_of({"AdamW", "Adam", "OneBitAdam", "ZeroOneAdam"})
          .or_else("AdamW")
          .lands(LOOM_FIELD(c.optimizer.type, std::string))
          .doc("`AdamW` \\| `Adam` \\| `OneBitAdam` \\| `ZeroOneAdam`", "`AdamW`",
               "`AdamW` and `Adam` are AdamW (decoupled weight decay), as DeepSpeed's `Adam` is "
               "by default; `OneBitAdam`: AdamW until `freeze_step`, then the momentum averaged "
               "by a 1-bit compressed all-reduce with the variance frozen; `ZeroOneAdam`: the "
               "variance updated at exponentially spaced steps, the momentum 1-bit compressed at "
               "the others ([comm.md](comm.md#1-bit-adam-and-01-adam))"),
      key("optimizer.params.lr", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(3e-4)
          .lands(LOOM_FIELD(c.optimizer.lr, double))
          .doc("number >= 0", "3e-4", "learning rate (the base of `WarmupCosineLR`)"),
      key("optimizer.params.betas", KeyKind::kNumberPair)
          .range(0, 1)
          .or_else(json::array({0.9, 0.999}))
          .lands(
              [](Config& c, const json& v) {
                c.optimizer.beta1 = v[0].get<double>();
                c.optimizer.beta2 = v[1].get<double>();
              },
              [](const Config& c) {
                return json::array({c.optimizer.beta1, c.optimizer.beta2});
              })
          .doc("[b1, b2] in [0, 1)", "[0.9, 0.999]", ""),
      key("optimizer.params.eps", KeyKind::kNumber)
          .range(0, 1e300)
          .above()
          .or_else(1e-8)
          .lands(LOOM_FIELD(c.optimizer.eps, double))
          .doc("number > 0", "1e-8", ""),
      key("optimizer.params.weight_decay", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.optimizer.weight_decay, double))
          .doc("number >= 0", "0",
               "applied to matrices and embeddings only, not to biases or LayerNorm parameters"),
      key("optimizer.params.freeze_step", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(100000)
          .lands(LOOM_FIELD(c.optimizer.freeze_step, int64_t))
          .when([](const Config& c) { return c.optimizer.type == "OneBitAdam"; })
          .doc("int >= 1", "100000",
               "`OneBitAdam`: optimizer steps of plain AdamW before compression (DeepSpeed "
               "advises 15-25% of training; at least one, to have a variance to freeze)"),
      key("optimizer.params.var_freeze_step", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(100000)
          .lands(LOOM_FIELD(c.optimizer.var_freeze_step, int64_t))
          .when([](const Config& c) { return c.optimizer.zero_one(); })
          .doc("int >= 1", "100000", "`ZeroOneAdam`: the last step that may update the variance"),
      key("optimizer.params.var_update_scaler", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(16)
          .lands(LOOM_FIELD(c.optimizer.var_update_scaler, int64_t))
          .when([](const Config& c) { return c.optimizer.zero_one(); })
          .doc("int >= 1", "16",
               "`ZeroOneAdam`: variance updates at each interval before the interval doubles"),
      key("optimizer.params.local_step_scaler", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(32678)
          .lands(LOOM_FIELD(c.optimizer.local_step_scaler, int64_t))
          .when([](const Config& c) { return c.optimizer.zero_one(); })
          .doc("int >= 1", "32678",
               "`ZeroOneAdam`: frozen steps at each local-step interval before it doubles (1, "
               "2, 4, ... steps between synchronisations)"),
      key("optimizer.params.local_step_clipper", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(16)
          .lands(LOOM_FIELD(c.optimizer.local_step_clipper, int64_t))
          .when([](const Config& c) { return c.optimizer.zero_one(); })
          .doc("int >= 1", "16", "`ZeroOneAdam`: the largest local-step interval"),
      key("optimizer.params.comm_backend_name", KeyKind::kString)
          .one_of({"mpi"})
          .or_else("mpi")
          .lands([](Config&, const json&) {}, [](const Config&) { return json("mpi"); })
          .when([](const Config& c) { return c.optimizer.one_bit(); })
          .doc("`mpi`", "`mpi`",
               "`OneBitAdam`: the transport of its collectives; this build's is MPI"),
      key("optimizer.params.cuda_aware", KeyKind::kBool)
          .or_else(false)
          .lands([](Config&, const json&) {}, [](const Config&) { return json(false); })
          .when([](const Config& c) { return c.optimizer.one_bit(); })
          .doc("bool", "false",
               "`OneBitAdam`: accepted and ignored: this build keeps every buffer in host memory"),
      key("scheduler.type", KeyKind::kString)
          .one_of({"WarmupLR", "WarmupDecayLR", "WarmupCosineLR"})
          .or_else("")
          .lands(LOOM_FIELD(c.scheduler.type, std::string))
          .when(scheduled)
          .doc("`WarmupLR` \\| `WarmupDecayLR` \\| `WarmupCosineLR`", "none (constant lr)",
               "DeepSpeed's schedulers"),
      key("scheduler.params.warmup_min_lr", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.scheduler.warmup_min_lr, double))
          .when(
              [](const Config& c) { return scheduled(c) && c.scheduler.type != "WarmupCosineLR"; })
          .doc("number >= 0", "0", "`WarmupLR`, `WarmupDecayLR`"),
      key("scheduler.params.warmup_max_lr", KeyKind::kNumber)
          .range(0, 1e300)
          .resolved([](const Config& c) { return json(c.scheduler.warmup_max_lr); })
          .when(
              [](const Config& c) { return scheduled(c) && c.scheduler.type != "WarmupCosineLR"; })
          .doc("number >= 0", "`optimizer.params.lr`", "`WarmupLR`, `WarmupDecayLR`"),
      key("scheduler.params.warmup_num_steps", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(1000)
          .lands(LOOM_FIELD(c.scheduler.warmup_num_steps, int64_t))
          .when(scheduled)
          .doc("int >= 0", "1000", "(at least 2 is used, as DeepSpeed does)"),
      key("scheduler.params.warmup_type", KeyKind::kString)
          .one_of({"log", "linear"})
          .or_else("log")
          .lands(LOOM_FIELD(c.scheduler.warmup_type, std::string))
          .when(scheduled)
          .doc("`log` \\| `linear`", "`log`", ""),
      key("scheduler.params.total_num_steps", KeyKind::kInt)
          .range(1, kMaxInt)
          .resolved([](const Config& c) { return json(c.scheduler.total_num_steps); })
          .when([](const Config& c) { return scheduled(c) && c.scheduler.type != "WarmupLR"; })
          .doc("int >= 1", "`train.steps`", "`WarmupDecayLR`, `WarmupCosineLR`"),
      key("scheduler.params.warmup_min_ratio", KeyKind::kNumber)
          .range(0, 1)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.scheduler.warmup_min_ratio, double))
          .when([](const Config& c) { return c.scheduler.type == "WarmupCosineLR"; })
          .doc("number in [0, 1]", "0", "`WarmupCosineLR`"),
      key("scheduler.params.cos_min_ratio", KeyKind::kNumber)
          .range(0, 1)
          .or_else(1e-4)
          .lands(LOOM_FIELD(c.scheduler.cos_min_ratio, double))
          .when([](const Config& c) { return c.scheduler.type == "WarmupCosineLR"; })
          .doc("number in [0, 1]", "1e-4", "`WarmupCosineLR`"),
      key("zero_optimization.stage", KeyKind::kInt)
          .range(0, 3)
          .or_else(0)
          .lands(LOOM_FIELD(c.zero.stage, int))
          .doc("int 0-3", "0",
               "0: replicated; 1: optimizer state sharded; 2: also gradients; 3: also parameters "
               "([parallel.md](parallel.md))"),
      key("zero_optimization.reduce_bucket_size", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(1000000)
          .lands(LOOM_FIELD(c.zero.reduce_bucket_size, int64_t))
          .doc("int >= 1", "1e6",
               "stages 0-1: elements per gradient all-reduce bucket; stages 2-3: the most gradient "
               "elements being reduce-scattered at once (the latest unit's reduction always runs "
               "beside the next unit's backward)"),
      key("zero_optimization.overlap_comm", KeyKind::kBool)
          .or_else(true)
          .lands(LOOM_FIELD(c.zero.overlap_comm, bool))
          .doc("bool", "true",
               "start each reduction during backward (stages 2-3: `false` waits for each unit's "
               "reduce-scatter at once)"),
      key("zero_optimization.stage3_prefetch_bucket_size", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(1000000)
          .lands(LOOM_FIELD(c.zero.prefetch_bucket_size, int64_t))
          .doc("int >= 0", "1e6",
               "stage 3: parameter elements gathered ahead of use along the unit schedule (at "
               "least the next unit; 0: gather on use)"),
      key("zero_optimization.stage3_param_persistence_threshold", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(100000)
          .lands(LOOM_FIELD(c.zero.persistence_threshold, int64_t))
          .doc("int >= 0", "1e5",
               "stage 3: units of at most this many elements stay gathered between uses "
               "(re-gathered after each optimizer step)"),
      key("zero_optimization.offload_optimizer.device", KeyKind::kString)
          .one_of({"none", "cpu", "nvme"})
          .or_else("none")
          .lands(LOOM_FIELD(c.zero.offload_device, std::string))
          .doc("`none` \\| `cpu` \\| `nvme`", "`none`",
               "stages 1-3. `cpu`: the same as `none` in this CPU build (a log line says so); "
               "`nvme`: AdamW moments in a memory-mapped file per rank under `nvme_path`, paged in "
               "and out unit by unit"),
      key("zero_optimization.offload_optimizer.nvme_path", KeyKind::kString)
          .or_else("")
          .lands(LOOM_FIELD(c.zero.nvme_path, std::string))
          .doc("string", "none",
               "an existing folder this process can create files in (checked before anything is "
               "allocated); the files are unlinked once mapped, so nothing is left behind"),
      key("zero_optimization.offload_optimizer.pin_memory", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.zero.pin_memory, bool))
          .doc("bool", "false",
               "accepted for DeepSpeed configs; no effect in this build (a log line says so)"),
      key("zero_optimization.offload_optimizer.buffer_count", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(4)
          .lands(LOOM_FIELD(c.zero.buffer_count, int64_t))
          .doc("int >= 1", "4",
               "accepted for DeepSpeed configs; no effect in this build (a log line says so)"),
      key("comm.allreduce", KeyKind::kString)
          .one_of({"mpi", "ring", "rhd", "hierarchical", "auto"})
          .or_else("mpi")
          .lands(LOOM_FIELD(c.comm.allreduce, std::string))
          .doc("`mpi` \\| `ring` \\| `rhd` \\| `hierarchical` \\| `auto`", "`mpi`",
               "all-reduce algorithm ([comm.md](comm.md))"),
      key("comm.timeout_s", KeyKind::kNumber)
          .range(0, 1e300)
          .above()
          .or_else(600.0)
          .lands(LOOM_FIELD(c.comm.timeout_s, double))
          .doc("number > 0", "600", "deadline of every collective; then a report and the job ends"),
      key("comm.ranks_per_node", KeyKind::kInt)
          .range(0, 1 << 20)
          .or_else(0)
          .lands(LOOM_FIELD(c.comm.ranks_per_node, int))
          .doc("int >= 0", "0 (the hosts MPI reports)",
               "override: emulate nodes of this many consecutive ranks of each group inside the "
               "real hosts (the hierarchical all-reduce); refused when nodes of that many "
               "consecutive grid ranks would span hosts "
               "([hosts.md](hosts.md#topology-from-the-job))"),
      key("comm.backend", KeyKind::kString)
          .one_of({"auto", "mpi", "nccl"})
          .or_else("auto")
          .lands(LOOM_FIELD(c.comm.backend, std::string))
          .doc("`auto` \\| `mpi` \\| `nccl`", "`auto`",
               "what the grid's groups communicate over: `mpi`, or `nccl` (one GPU per rank, "
               "needs `device: cuda`; the groups bootstrapped over MPI, whose world group stays "
               "for control messages); `auto`: `nccl` with `device: cuda`, else `mpi` "
               "([cuda.md](cuda.md))"),
      key("comm.placement", KeyKind::kString)
          .one_of({"topology", "launcher"})
          .or_else("topology")
          .lands(LOOM_FIELD(c.comm.placement, std::string))
          .doc("`topology` \\| `launcher`", "`topology`",
               "`topology`: ranks placed on the grid host by host, so tensor- and expert-parallel "
               "groups stay inside a host whatever order the launcher dealt them in; `launcher`: "
               "the launcher's order ([hosts.md](hosts.md#topology-from-the-job))"),
      key("comm.debug", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.comm.debug, bool))
          .doc("bool", "false",
               "check that ranks call matching collectives, and that parameters replicated over a "
               "tensor-parallel group stay bitwise equal after every step (always checked at "
               "checkpoints)"),
      key("comm.payloads", KeyKind::kString)
          .one_of({"auto", "f32"})
          .or_else("auto")
          .lands(LOOM_FIELD(c.comm.payloads, std::string))
          .doc("`auto` \\| `f32`", "`auto`",
               "`auto`: in a bf16 run the activations and activation gradients that cross ranks "
               "(tensor-parallel regions, pipeline messages, expert all-to-all) travel in bf16, "
               "half the bytes (fp16 runs keep f32: loss-scaled gradients can outgrow fp16's "
               "range where the layers' f32 does not); `f32`: always f32 "
               "([precision](precision.md#what-16-bit-runs-send))"),
      key("comm.compression.type", KeyKind::kString)
          .one_of({"none", "fp16", "bf16", "powersgd"})
          .or_else("none")
          .lands(LOOM_FIELD(c.zero.compression.type, std::string))
          .doc("`none` \\| `fp16` \\| `bf16` \\| `powersgd`", "`none`",
               "compress the data-parallel gradient reduction, for any optimizer: `fp16`/`bf16` "
               "send f32 gradients in 16 bits (divided by the group size first); `powersgd` "
               "sends rank-r factors of each matrix with error feedback (every ZeRO stage) "
               "([comm.md](comm.md#gradient-compression))"),
      key("comm.compression.rank", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(1)
          .lands(LOOM_FIELD(c.zero.compression.rank, int))
          .when([](const Config& c) { return c.zero.compression.type == "powersgd"; })
          .doc("int >= 1", "1", "`powersgd`: the approximation's rank"),
      key("comm.compression.start_iter", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(10)
          .lands(LOOM_FIELD(c.zero.compression.start_iter, int64_t))
          .when([](const Config& c) { return c.zero.compression.type == "powersgd"; })
          .doc("int >= 0", "10", "`powersgd`: steps reduced uncompressed first"),
      key("comm.compression.min_compression_rate", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(2.0)
          .lands(LOOM_FIELD(c.zero.compression.min_compression_rate, double))
          .when([](const Config& c) { return c.zero.compression.type == "powersgd"; })
          .doc("number >= 0", "2",
               "`powersgd`: a matrix is compressed when rows x cols exceeds (rows + cols) x rank "
               "by this factor; the others, and vectors, are averaged uncompressed"),
      key("comm.compression.error_feedback", KeyKind::kBool)
          .or_else(true)
          .lands(LOOM_FIELD(c.zero.compression.error_feedback, bool))
          .when([](const Config& c) { return c.zero.compression.type == "powersgd"; })
          .doc("bool", "true",
               "`powersgd`: carry each matrix's approximation error to the next step"),
      key("comm.compression.warm_start", KeyKind::kBool)
          .or_else(true)
          .lands(LOOM_FIELD(c.zero.compression.warm_start, bool))
          .when([](const Config& c) { return c.zero.compression.type == "powersgd"; })
          .doc("bool", "true", "`powersgd`: start each step's Q from the last step's"),
      key("device", KeyKind::kString)
          .one_of({"cpu", "cuda"})
          .or_else("cpu")
          .lands(LOOM_FIELD(c.device, std::string))
          .doc("`cpu` \\| `cuda`", "`cpu`",
               "where the run computes: the CPU backend, or one NVIDIA GPU per rank (a build with "
               "`-DLOOM_CUDA=ON`; the GPU is the local rank's; [cuda.md](cuda.md))"),
      key("kernels.tf32", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.kernels.tf32, bool))
          .doc("bool", "false",
               "`device: cuda`: f32 GEMMs (attention's included) may round their inputs to "
               "TF32 on the tensor cores (10-bit mantissas, f32 accumulation)"),
      key("kernels.gemm_inputs", KeyKind::kString)
          .one_of({"auto", "f32", "16bit"})
          .or_else("auto")
          .lands(LOOM_FIELD(c.kernels.gemm_inputs, std::string))
          .doc("`auto` \\| `f32` \\| `16bit`", "`auto`",
               "in a bf16/fp16 run, `16bit` rounds every GEMM's operands to the run's 16-bit type "
               "(products accumulated in f32; [precision](precision.md#16-bit-gemms)); `auto`: "
               "16-bit on a GPU and for bf16 on CPUs with AMX or an AMD CPU's AVX512-BF16, f32 "
               "elsewhere (the log says "
               "which and why); `16bit` needs `bf16.enabled` or `fp16.enabled`, and for bf16 a "
               "CPU with a bf16 matmul"),
      key("fp16.enabled", KeyKind::kBool)
          .or_else(false)
          .resolved([](const Config& c) { return json(c.precision == DType::kF16); })
          .doc("bool", "false",
               "16-bit training ([precision](precision.md)): parameters and gradients in bf16 or "
               "fp16, f32 master weights and moments in the optimizer; both `true` is an error"),
      key("bf16.enabled", KeyKind::kBool)
          .or_else(false)
          .resolved([](const Config& c) { return json(c.precision == DType::kBF16); })
          .doc("bool", "false",
               "16-bit training ([precision](precision.md)): parameters and gradients in bf16 or "
               "fp16, f32 master weights and moments in the optimizer; both `true` is an error"),
      key("fp16.loss_scale", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.loss_scaling.loss_scale, double))
          .doc("number >= 0", "0",
               "fp16's loss scaling (DeepSpeed's keys and defaults; read, and recorded in "
               "`config.resolved.json`, in f32 and bf16 runs too); 0 is dynamic, > 0 a static "
               "scale; negative is an error"),
      key("fp16.initial_scale_power", KeyKind::kInt)
          .range(0, 64)
          .or_else(16)
          .lands(LOOM_FIELD(c.loss_scaling.initial_scale_power, int))
          .doc("int in [0, 64]", "16", "dynamic scaling starts at 2^this"),
      key("fp16.loss_scale_window", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(1000)
          .lands(LOOM_FIELD(c.loss_scaling.loss_scale_window, int64_t))
          .doc("int >= 1", "1000", "clean steps after which the scale doubles"),
      key("fp16.hysteresis", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(2)
          .lands(LOOM_FIELD(c.loss_scaling.hysteresis, int))
          .doc("int >= 1", "2", "overflows tolerated before the scale halves"),
      key("fp16.consecutive_hysteresis", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.loss_scaling.consecutive_hysteresis, bool))
          .doc("bool", "false",
               "refill the tolerance after every clean step (else after each doubling)"),
      key("fp16.min_loss_scale", KeyKind::kNumber)
          .range(0, 1e300)
          .above()
          .or_else(1.0)
          .lands(LOOM_FIELD(c.loss_scaling.min_loss_scale, double))
          .doc("number > 0", "1", "the scale's floor; above the initial scale is an error"),
  };
}

}  // namespace config_table

namespace {

std::vector<ConfigKey> make_keys() {
  std::vector<ConfigKey> keys = config_table::run_keys();
  for (ConfigKey& k : config_table::model_and_job_keys()) keys.push_back(std::move(k));
  return keys;
}

}  // namespace

const std::vector<ConfigKey>& config_keys() {
  static const std::vector<ConfigKey> keys = make_keys();
  return keys;
}

const ConfigKey* find_config_key(const std::string& path) {
  for (const ConfigKey& k : config_keys())
    if (k.path == path) return &k;
  return nullptr;
}

std::string config_keys_markdown() {
  std::string s;
  for (const ConfigKey& k : config_keys())
    s += "| `" + k.path + "` | " + k.doc_type + " | " + k.doc_default + " |" +
         (k.doc_meaning.empty() ? "" : " " + k.doc_meaning) + " |\n";
  return s;
}

json resolved_config(const Config& c) {
  json j = json::object();
  for (const ConfigKey& k : config_keys()) {
    if (!k.value || (k.shown && !k.shown(c))) continue;
    json* node = &j;
    size_t at = 0;
    for (size_t dot; (dot = k.path.find('.', at)) != std::string::npos; at = dot + 1)
      node = &(*node)[k.path.substr(at, dot - at)];
    (*node)[k.path.substr(at)] = k.value(c);
  }
  return j;
}

}  // namespace loom
