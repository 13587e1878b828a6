// The key table's second half: the model, parallelism, activation
// checkpointing, data, train, checkpoints, kernels and log.
#include "loom/train/config_keys_detail.h"

namespace loom::config_table {

std::vector<ConfigKey> model_and_job_keys() {
  return {
      key("model.n_layer", KeyKind::kInt)
          .range(1, 4096)
          .or_else(12)
          .lands(LOOM_FIELD(c.model.n_layer, int))
          .doc("int >= 1", "12", "transformer blocks"),
      key("model.n_embd", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(768)
          .lands(LOOM_FIELD(c.model.n_embd, int))
          .doc("int >= 1", "768", "width; divisible by `n_head`"),
      key("model.n_head", KeyKind::kInt)
          .range(1, 1 << 16)
          .or_else(12)
          .lands(LOOM_FIELD(c.model.n_head, int))
          .doc("int >= 1", "12", "attention heads"),
      key("model.vocab_size", KeyKind::kInt)
          .range(1, 1 << 30)
          .or_else(50257)
          .lands(LOOM_FIELD(c.model.vocab_size, int))
          .doc("int >= 1", "50257",
               "padded internally to a multiple of 128; padded logits are excluded from the loss"),
      key("model.seq_len", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(1024)
          .lands(LOOM_FIELD(c.model.seq_len, int))
          .doc("int >= 1", "1024", "context length (the position table's size)"),
      key("model.dropout", KeyKind::kNumber)
          .range(0, 0.999)
          .or_else(0.0f)
          .lands(LOOM_FIELD(c.model.dropout, float))
          .doc("number in [0, 1)", "0",
               "on embeddings, attention probabilities and both residual branches"),
      key("model.moe.num_experts", KeyKind::kInt)
          .range(1, 1 << 16)
          .or_else(0)
          .lands(LOOM_FIELD(c.model.moe_experts, int))
          .when(moe)
          .doc("int >= 1", "(no `model.moe`: dense)",
               "experts of each mixture-of-experts layer ([moe.md](moe.md))"),
      key("model.moe.top_k", KeyKind::kInt)
          .range(1, 1 << 16)
          .resolved([](const Config& c) { return json(c.model.moe_top_k); })
          .when(moe)
          .doc("int in [1, num_experts]", "2", "experts per token (1: Switch, 2: GShard)"),
      key("model.moe.every_n_layers", KeyKind::kInt)
          .range(1, 4096)
          .or_else(1)
          .lands(LOOM_FIELD(c.model.moe_every, int))
          .when(moe)
          .doc("int in [1, n_layer]", "1",
               "block i is a MoE layer when i + 1 is a multiple of it (2: blocks 1, 3, 5, ...)"),
      key("model.moe.capacity_factor", KeyKind::kNumber)
          .range(0, 1e6)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.model.moe_capacity_factor, double))
          .when(moe)
          .doc("number >= 0", "0",
               "0: no dropping; else each expert takes at most ceil(factor x sequence tokens x "
               "top_k / num_experts) assignments per sequence"),
      key("model.moe.router", KeyKind::kString)
          .one_of({"learned", "hash", "tag"})
          .or_else("learned")
          .lands(
              [](Config& c, const json& v) {
                c.model.moe_router = v == "hash" ? 1 : v == "tag" ? 2 : 0;
              },
              [](const Config& c) {
                return json(c.model.moe_router == 1   ? "hash"
                            : c.model.moe_router == 2 ? "tag"
                                                      : "learned");
              })
          .when(moe)
          .doc("`learned` \\| `hash` \\| `tag`", "`learned`",
               "`learned`: a linear router, softmax, top-k; `hash`: experts fixed by a hash of the "
               "token id; `tag`: by the last tag token of the sample ([moe.md](moe.md#routers)). "
               "Fixed routers take no `aux_loss_coef`, `z_loss_coef` or bias balancing"),
      key("model.moe.tag_tokens", KeyKind::kIntList)
          .range(0, 1 << 30)
          .resolved([](const Config& c) { return json(c.model.moe_tag_tokens); })
          .when([](const Config& c) { return moe(c) && c.model.moe_router == 2; })
          .doc("list of token ids", "(required with `router: tag`)",
               "the tokens that mark tags: `tag_tokens[i]` is tag i, routed to experts i x top_k + "
               "j (mod num_experts)"),
      key("model.moe.aux_loss_coef", KeyKind::kNumber)
          .range(0, 1e6)
          .resolved([](const Config& c) { return json(c.model.moe_aux_loss_coef); })
          .when(learned_moe)
          .doc("number >= 0", "0.01 (0 with `balancing: bias`)",
               "weight of the Switch load-balancing loss"),
      key("model.moe.z_loss_coef", KeyKind::kNumber)
          .range(0, 1e6)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.model.moe_z_loss_coef, double))
          .when(learned_moe)
          .doc("number >= 0", "0", "weight of the router z-loss"),
      key("model.moe.balancing", KeyKind::kString)
          .one_of({"aux_loss", "bias"})
          .or_else("aux_loss")
          .lands([](Config& c, const json& v) { c.model.moe_bias_balancing = v == "bias"; },
                 [](const Config& c) {
                   return json(c.model.moe_bias_balancing ? "bias" : "aux_loss");
                 })
          .when(moe)
          .doc("`aux_loss` \\| `bias`", "`aux_loss`",
               "`bias`: the auxiliary-loss-free method, a per-expert bias added to the "
               "probabilities for choosing experts only, moved after each step towards equal load "
               "over the global batch (aux_loss_coef then defaults to 0)"),
      key("model.moe.bias_update_rate", KeyKind::kNumber)
          .range(0, 1)
          .above()
          .or_else(1e-3)
          .lands(LOOM_FIELD(c.model.moe_bias_update_rate, double))
          .when(learned_moe)
          .doc("number in (0, 1]", "0.001",
               "`bias`: how far each expert's bias moves per step (up when its load is below the "
               "mean, down when above)"),
      key("parallel.data", KeyKind::kInt)
          .range(1, 1 << 20)
          .resolved([](const Config& c) { return json(c.data_parallel); })
          .doc("int >= 1", "ranks / (tensor x context x pipeline)", "data-parallel size"),
      key("parallel.tensor", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(1)
          .lands(LOOM_FIELD(c.parallel.tensor, int))
          .doc("int >= 1", "1",
               "tensor-parallel size: each block, the embedding and the LM head split across this "
               "many ranks ([parallel.md](parallel.md#tensor-parallelism)); `n_head` must be "
               "divisible by it; the vocabulary is padded to a multiple of 128 x it"),
      key("parallel.context", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(1)
          .lands(LOOM_FIELD(c.parallel.context, int))
          .doc("int >= 1", "1",
               "context-parallel size: each sequence is cut into 2 x context chunks and rank r of "
               "the group holds chunks r and 2 x context - 1 - r (equal causal attention work), "
               "so activations per rank shrink with it "
               "([parallel.md](parallel.md#context-parallelism)); `seq_len` must divide by 2 x "
               "context (with `sequence_parallel`, by context x lcm(2, tensor)). The grid puts it "
               "between tensor and data"),
      key("parallel.context_comm", KeyKind::kString)
          .one_of({"p2p", "all_gather", "a2a"})
          .or_else("p2p")
          .lands(LOOM_FIELD(c.parallel.context_comm, std::string))
          .doc("`p2p`, `all_gather`, `a2a`", "`p2p`",
               "how attention reaches the other chunks' keys and values: a ring passing them on "
               "while the attention runs on the ones held (overlapped); all-gathered before the "
               "attention; all-to-all turning the sequence split into a head split (`n_head` / "
               "`tensor` must divide by `context`)"),
      key("parallel.context_balance", KeyKind::kBool)
          .or_else(true)
          .lands(LOOM_FIELD(c.parallel.context_balance, bool))
          .doc("bool", "true",
               "false: rank r holds the r-th contiguous piece of each sequence instead (the last "
               "rank then does the most causal attention work; for measuring the balance)"),
      key("parallel.sequence_parallel", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.parallel.sequence_parallel, bool))
          .doc("bool", "false",
               "with `parallel.tensor` > 1: LayerNorms, dropout and residuals run on each rank's "
               "slice of the sequence, the all-reduces become all-gathers and reduce-scatters "
               "([parallel.md](parallel.md#sequence-parallelism)); micro-batch x seq_len must be "
               "divisible by `parallel.tensor`"),
      key("parallel.pipeline", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(1)
          .lands(LOOM_FIELD(c.parallel.pipeline, int))
          .doc("int >= 1", "1",
               "pipeline-parallel size: the blocks are cut into this many stages (x "
               "`virtual_stages` chunks), the embedding on the first, the head on the last "
               "([parallel.md](parallel.md#pipeline-parallelism)); the micro-batches of a step "
               "(`gradient_accumulation_steps`) flow through them. Rank grid in Megatron-LM's "
               "order: tensor fastest, then context, then data, then pipeline"),
      key("parallel.schedule", KeyKind::kString)
          .one_of({"gpipe", "1f1b", "interleaved", "zero_bubble"})
          .or_else("1f1b")
          .lands(LOOM_FIELD(c.parallel.schedule, std::string))
          .doc(
              "`gpipe`, `1f1b`, `interleaved`, `zero_bubble`", "`1f1b`",
              "the pipeline schedule: all forwards then all backwards; one forward one backward (p "
              "micro-batches in flight on the first stage); 1F1B over `virtual_stages` chunks per "
              "stage (needs the micro-batches a multiple of `parallel.pipeline`); ZB-H1 (backward "
              "split into input and parameter gradients, the latter filling the bubble)"),
      key("parallel.virtual_stages", KeyKind::kInt)
          .range(1, 4096)
          .or_else(1)
          .lands(LOOM_FIELD(c.parallel.virtual_stages, int))
          .doc("int >= 1", "1",
               "chunks per stage with `schedule: interleaved`; `n_layer` must divide into "
               "`pipeline x virtual_stages`"),
      key("parallel.partition", KeyKind::kPartition)
          .or_else("uniform")
          .lands(
              [](Config& c, const json& v) {
                if (v.is_array()) {
                  c.parallel.partition = "list";
                  c.parallel.partition_counts = v.get<std::vector<int>>();
                } else {
                  c.parallel.partition = v.get<std::string>();
                }
              },
              [](const Config& c) {
                return c.parallel.partition == "list" ? json(c.parallel.partition_counts)
                                                      : json(c.parallel.partition);
              })
          .doc("`uniform`, `balanced`, or a list of layer counts", "`uniform`",
               "how the blocks are cut into the `pipeline x virtual_stages` parts: equal counts "
               "(extras to the middle parts); `balanced`: each layer's forward + backward time and "
               "activation memory measured on this machine (embedding and head included) and the "
               "cut minimising the slowest part, printed as a table; a list: the counts, first "
               "part first (each >= 1, summing to `n_layer`)"),
      key("parallel.stage_memory_bytes", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.parallel.stage_memory_bytes, int64_t))
          .doc("int >= 0", "0 (no limit)",
               "with `partition: balanced`, no part may need more (its activations times the "
               "micro-batches it holds at its peak, plus parameters, gradients and moments)"),
      key("parallel.expert", KeyKind::kInt)
          .range(1, 1 << 20)
          .or_else(1)
          .lands(LOOM_FIELD(c.parallel.expert, int))
          .doc("int >= 1", "1",
               "expert-parallel size: each MoE layer's experts split over groups of this many "
               "data-parallel ranks (consecutive ones, carved out of data), tokens travelling to "
               "their experts by all-to-all ([moe.md](moe.md#expert-parallelism)); must divide the "
               "data-parallel size and `model.moe.num_experts`"),
      key("activation_checkpointing.policy", KeyKind::kString)
          .one_of({"none", "full", "selective", "every_n", "budget"})
          .or_else("none")
          .lands(
              [](Config& c, const json& v) {
                c.checkpointing.policy.kind = CheckpointPolicy::parse(v.get<std::string>());
              },
              [](const Config& c) {
                return json(CheckpointPolicy::name(c.checkpointing.policy.kind));
              })
          .doc("`none` \\| `full` \\| `selective` \\| `every_n` \\| `budget`", "`none`",
               "what each transformer block keeps for backward ([Activation "
               "checkpointing](#activation-checkpointing))"),
      key("activation_checkpointing.every_n", KeyKind::kInt)
          .range(1, 4096)
          .or_else(2)
          .lands(LOOM_FIELD(c.checkpointing.policy.every_n, int))
          .when([](const Config& c) {
            return c.checkpointing.policy.kind == CheckpointPolicy::kEveryN;
          })
          .doc("int in [1, 4096]", "2",
               "`every_n`: blocks whose global index is a multiple of n are recomputed in full, "
               "the others kept whole (1 is `full`); only with that policy"),
      key("activation_checkpointing.budget_bytes", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.checkpointing.policy.budget_bytes, int64_t))
          .when([](const Config& c) {
            return c.checkpointing.policy.kind == CheckpointPolicy::kBudget;
          })
          .doc("int >= 1", "required with `budget`",
               "`budget`: activation bytes per rank (the tracker's `activations` category at its "
               "peak: the micro-batch's store and the recompute room); only with that policy"),
      key("activation_checkpointing.activation_dtype", KeyKind::kString)
          .one_of({"auto", "f32"})
          .or_else("auto")
          .lands(LOOM_FIELD(c.checkpointing.activation_dtype, std::string))
          .doc("`auto` \\| `f32`", "`auto`",
               "what kept block records are stored in: `auto` is the run's precision (bf16 or fp16 "
               "in a 16-bit run: packed, [precision.md](precision.md#activations)), `f32` keeps "
               "them f32 in any run"),
      key("activation_checkpointing.partition_activations", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.checkpointing.partition_activations, bool))
          .when([](const Config& c) { return c.checkpointing.deepspeed_keys; })
          .doc("bool", "false",
               "DeepSpeed's keys, accepted so DeepSpeed configs run; each logs what it does here "
               "(below)"),
      key("activation_checkpointing.cpu_checkpointing", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.checkpointing.cpu_checkpointing, bool))
          .when([](const Config& c) { return c.checkpointing.deepspeed_keys; })
          .doc("bool", "false",
               "DeepSpeed's keys, accepted so DeepSpeed configs run; each logs what it does here "
               "(below)"),
      key("activation_checkpointing.contiguous_memory_optimization", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.checkpointing.contiguous_memory_optimization, bool))
          .when([](const Config& c) { return c.checkpointing.deepspeed_keys; })
          .doc("bool", "false",
               "DeepSpeed's keys, accepted so DeepSpeed configs run; each logs what it does here "
               "(below)"),
      key("activation_checkpointing.number_checkpoints", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.checkpointing.number_checkpoints, int64_t))
          .when([](const Config& c) { return c.checkpointing.deepspeed_keys; })
          .doc("int >= 0", "0",
               "DeepSpeed's keys, accepted so DeepSpeed configs run; each logs what it does here "
               "(below)"),
      key("activation_checkpointing.synchronize_checkpoint_boundary", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.checkpointing.synchronize_checkpoint_boundary, bool))
          .when([](const Config& c) { return c.checkpointing.deepspeed_keys; })
          .doc("bool", "false",
               "DeepSpeed's keys, accepted so DeepSpeed configs run; each logs what it does here "
               "(below)"),
      key("activation_checkpointing.profile", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.checkpointing.profile, bool))
          .when([](const Config& c) { return c.checkpointing.deepspeed_keys; })
          .doc("bool", "false",
               "DeepSpeed's keys, accepted so DeepSpeed configs run; each logs what it does here "
               "(below)"),
      key("data.train", KeyKind::kString)
          .or_else("")
          .lands(LOOM_FIELD(c.data.train, std::string))
          .doc("path", "", "token files from `loom prepare-data` ([data.md](data.md))"),
      key("data.val", KeyKind::kString)
          .or_else("")
          .lands(LOOM_FIELD(c.data.val, std::string))
          .doc("path", "", "token files from `loom prepare-data` ([data.md](data.md))"),
      key("data.synthetic", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.data.synthetic, bool))
          .doc("bool", "false", "train on random tokens drawn from the seed (benchmarks, tests)"),
      key("data.sampling", KeyKind::kString)
          .one_of({"random", "sequential"})
          .or_else("random")
          .lands(LOOM_FIELD(c.data.sampling, std::string))
          .doc("`random` \\| `sequential`", "`random`",
               "how windows are chosen ([data.md](data.md#sampling))"),
      key("train.name", KeyKind::kString)
          .or_else("run")
          .lands(LOOM_FIELD(c.train.name, std::string))
          .doc("string", "`run`", "default run folder `runs/<name>`"),
      key("train.steps", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(100)
          .lands(LOOM_FIELD(c.train.steps, int64_t))
          .doc("int >= 1", "100", "optimizer steps"),
      key("train.seed", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(1234)
          .lands(LOOM_FIELD(c.train.seed, uint64_t))
          .doc("int >= 0", "1234", "initialisation, data order and dropout"),
      key("train.eval_every", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.train.eval_every, int64_t))
          .doc("int >= 0", "0 (never)", "validation every this many steps (needs `data.val`)"),
      key("train.eval_steps", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(10)
          .lands(LOOM_FIELD(c.train.eval_steps, int64_t))
          .doc("int >= 1", "10",
               "validation batches of `train_batch_size` samples (always the same samples, under "
               "any layout)"),
      key("train.sample_tokens", KeyKind::kInt)
          .range(0, 1 << 20)
          .or_else(0)
          .lands(LOOM_FIELD(c.train.sample_tokens, int64_t))
          .doc("int >= 0", "0", "print this many sampled tokens at the end"),
      key("train.sample_prompt", KeyKind::kString)
          .or_else("")
          .lands(LOOM_FIELD(c.train.sample_prompt, std::string))
          .doc("string", "\"\"", "the sample's prompt"),
      key("train.sample_temperature", KeyKind::kNumber)
          .range(0, 100)
          .or_else(0.8)
          .lands(LOOM_FIELD(c.train.sample_temperature, double))
          .doc("number >= 0", "0.8", "0 is greedy"),
      key("train.sample_top_k", KeyKind::kInt)
          .range(0, 1 << 30)
          .or_else(40)
          .lands(LOOM_FIELD(c.train.sample_top_k, int64_t))
          .doc("int >= 0", "40", "0 keeps every token"),
      key("train.on_nonfinite", KeyKind::kString)
          .one_of({"stop", "skip"})
          .or_else("stop")
          .lands(LOOM_FIELD(c.train.on_nonfinite, std::string))
          .doc("`stop` \\| `skip`", "`stop`",
               "a step whose gradients hold inf or NaN (on any rank: their global norm is not "
               "finite): `stop` ends the run with `step N: non-finite gradient (norm nan) first in "
               "'<parameter>'` (the first such parameter in the model's order, the same message on "
               "every rank); `skip` leaves parameters and moments as they were, counts the step "
               "(`skipped_steps` in metrics.jsonl, kept in checkpoints) and goes on; a skipped "
               "step does not advance the LR schedule or AdamW's bias correction, as DeepSpeed's "
               "overflow skips do. f32 and bf16 runs; in fp16 a non-finite gradient is an overflow "
               "that dynamic loss scaling skips "
               "([precision](precision.md#fp16-and-dynamic-loss-scaling))"),
      key("checkpoint.dir", KeyKind::kString)
          .or_else("")
          .lands(LOOM_FIELD(c.checkpoint.dir, std::string))
          .doc("path", "`<run folder>/checkpoints`",
               "where checkpoints go ([checkpoints.md](checkpoints.md))"),
      key("checkpoint.every", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.checkpoint.every, int64_t))
          .doc("int >= 0", "0 (never)", "save after every this many steps and after the last"),
      key("checkpoint.keep_last", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.checkpoint.keep_last, int64_t))
          .doc("int >= 0", "0 (all)",
               "keep the checkpoint just written and the newest this many - 1 others (by step)"),
      key("checkpoint.format", KeyKind::kString)
          .one_of({"sharded", "whole"})
          .or_else("sharded")
          .lands(LOOM_FIELD(c.checkpoint.format, std::string))
          .doc("`sharded` \\| `whole`", "`sharded`",
               "`sharded`: every rank writes the state it holds to its own file, nothing gathered; "
               "`whole`: world rank 0 writes whole Hugging Face tensors after gathering them "
               "([checkpoints.md](checkpoints.md))"),
      key("checkpoint.async", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.checkpoint.async, bool))
          .doc("bool", "false",
               "sharded only: copy each rank's state and write it in the background while training "
               "goes on; `latest` moves once every rank's file is durable"),
      key("kernels.gemm", KeyKind::kString)
          .one_of({"auto", "onednn", "openblas"})
          .or_else("auto")
          .lands(LOOM_FIELD(c.kernels.gemm, std::string))
          .doc("`auto` \\| `onednn` \\| `openblas`", "`auto`",
               "the backend of every f32 matrix product (the attention core's block products "
               "included): oneDNN's `dnnl_sgemm` (its f32 matmul primitive for the transposed "
               "forms its sgemm reads slowly: op(B) transposed with K >= N, op(A) transposed "
               "with M > N, outside parallel regions; [performance](performance.md#bf16-gemm)) "
               "or OpenBLAS's `cblas_sgemm`. `auto` is oneDNN "
               "whenever the build has it (it recognises current x86 processors, where OpenBLAS "
               "0.3.21 runs a generic kernel, several times slower, on the ones it does not know), "
               "else OpenBLAS; a rule rather than a timing, so every run and rank computes alike. "
               "A backend the build lacks is an error. When OpenBLAS is in use on a CPU with "
               "AVX2/AVX-512 and has fallen back to its generic kernel, the log says so with the "
               "fix"),
      key("log.every", KeyKind::kInt)
          .range(1, kMaxInt)
          .or_else(1)
          .lands(LOOM_FIELD(c.log.every, int64_t))
          .doc("int >= 1", "1", "progress line interval when stdout is not a terminal"),
      key("log.trace", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.log.trace, bool))
          .doc("bool", "false",
               "write `trace.json` into the run folder: the first 20 steps' timeline as Chrome "
               "trace JSON (a process per rank; rows for compute per unit, the pipeline's "
               "instructions when pipelined, and each communication group's operations with their "
               "bytes and element types), for Perfetto or chrome://tracing"),
      key("log.profile", KeyKind::kBool)
          .or_else(false)
          .lands(LOOM_FIELD(c.log.profile, bool))
          .doc("bool", "false",
               "profile the run ([profile.md](profile.md)): per layer and rank the forward, "
               "backward and recompute time, parameters and FLOPs, per group and kind the "
               "collectives' bytes and time; at the end a table (`profile.txt`), `profile.json` "
               "and the load-imbalance report (compute, memory, communication, with the rank "
               "named and a suggestion); each metrics line gains `imbalance`"),
      key("log.report_every", KeyKind::kInt)
          .range(0, kMaxInt)
          .or_else(0)
          .lands(LOOM_FIELD(c.log.report_every, int64_t))
          .doc("int >= 0", "0 (never)",
               "rewrite `report.html` in the run folder every N steps and at the end (what `loom "
               "report RUN` makes, written atomically); while the run goes the page reloads "
               "itself"),
      key("log.peak_gflops", KeyKind::kNumber)
          .range(0, 1e300)
          .or_else(0.0)
          .lands(LOOM_FIELD(c.log.peak_gflops, double))
          .doc("number >= 0", "0 (measure)",
               "the MFU denominator per rank; 0: the peak of the path the run's GEMMs take, "
               "the best 2048^3 sgemm of any GEMM backend (or, for bf16 GEMM inputs through "
               "oneDNN's bf16 matmul, the 2048^3 bf16 matmul), measured (about 1 s) once per "
               "machine and thread count and cached in `$XDG_CACHE_HOME/loom/peak_gflops.json` "
               "(else `~/.cache/loom/`), raised when `loom bench` measures a higher one"),
  };
}

}  // namespace loom::config_table
