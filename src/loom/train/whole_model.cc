#include "loom/train/whole_model.h"

#include <cstring>

#include "loom/core/error.h"

namespace loom {

WholeModel::WholeModel(StepEngine& engine, bool moments, bool grads) : engine_(engine) {
  const Config& config = engine.config();
  // Layouts without buffers: the whole model's, and each part's to learn
  // which stage and chunk own a name (the first that declares it: wte
  // belongs to the embedding, not to the head's copy).
  const StoreOptions layout_only{1, false, false};
  whole_ = std::make_unique<GptStage<float>>(config.model, StageSpec{}, layout_only);
  const std::vector<int>& counts = engine.partition().counts;
  const int p = config.parallel.pipeline;
  int first = 0;
  for (size_t k = 0; k < counts.size(); ++k) {
    GptStage<float> part(config.model, StageSpec{first, first + counts[k]}, layout_only);
    for (const Param& q : part.layout().params())
      owner_.emplace(q.name, Owner{static_cast<int>(k) % p, static_cast<int>(k) / p});
    first += counts[k];
  }
  for (int c = 0; c < engine.num_chunks(); ++c) {
    ZeroEngine& z = engine.zero(c);
    if (moments) {
      m_.emplace_back();
      v_.emplace_back();
      z.gather_moments(m_.back(), v_.back());
    }
    if (grads) g_.push_back(z.gather_grads());
    was_gathered_.push_back(z.full_params_gathered());
    z.gather_full_params();
  }
}

WholeModel::~WholeModel() {
  for (int c = 0; c < engine_.num_chunks(); ++c)
    if (!was_gathered_[static_cast<size_t>(c)]) engine_.zero(c).release_full_params(false);
}

int WholeModel::expert_holder(const std::string& name) const {
  const ParallelContext& ctx = engine_.context();
  if (!ctx.ep || ctx.ep->size() == 1) return -1;
  const std::string key = ".mlp.experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos) return -1;
  const int e = std::stoi(name.substr(at + key.size()));
  return e / (engine_.config().model.moe_experts / ctx.ep->size());
}

void WholeModel::get(const Param& p, Kind kind, float* out) {
  const ParallelContext& ctx = engine_.context();
  const Owner o = owner_.at(p.name);
  const size_t n = static_cast<size_t>(p.shape.numel());
  const int holder = expert_holder(p.name);
  if (ctx.coord().pp == o.stage && (holder < 0 || holder == ctx.ep->rank())) {
    GptStage<float>& s = engine_.stage(o.chunk);
    const Param& mine = s.layout().find(p.name);
    const size_t c = static_cast<size_t>(o.chunk);
    const float* src = kind == kParam    ? s.param(mine)
                       : kind == kExpAvg ? m_.at(c).data() + mine.offset
                       : kind == kGrad   ? g_.at(c).data() + mine.offset
                                         : v_.at(c).data() + mine.offset;
    if (!mine.shard.sharded()) {
      std::memcpy(out, src, n * sizeof(float));
    } else {
      // Every slice, then each placed where it belongs in the whole.
      const int tp = ctx.tp->size();
      std::vector<float> all(static_cast<size_t>(mine.numel * tp));
      ctx.tp->all_gather(src, all.data(), static_cast<size_t>(mine.numel), DType::kF32)->wait();
      for (int k = 0; k < tp; ++k) {
        ShardSpec sh = mine.shard;
        sh.index = k;
        shard_to_global(mine.shape, sh, all.data() + k * mine.numel, out);
      }
    }
  }
  // An expert from the rank of the expert-parallel group holding it.
  if (holder >= 0 && ctx.coord().pp == o.stage)
    ctx.ep->broadcast(out, n, DType::kF32, holder)->wait();
  if (ctx.pp) ctx.pp->broadcast(out, n, DType::kF32, o.stage)->wait();
}

std::map<std::string, std::vector<float>> WholeModel::params_by_name() {
  return by_name(kParam);
}

std::map<std::string, std::vector<float>> WholeModel::grads_by_name() {
  return by_name(kGrad);
}

std::map<std::string, std::vector<float>> WholeModel::by_name(Kind kind) {
  std::map<std::string, std::vector<float>> out;
  const int64_t vocab = engine_.config().model.vocab_size;
  for (const Param& p : layout().params()) {
    std::vector<float> whole(static_cast<size_t>(p.shape.numel()));
    get(p, kind, whole.data());
    if (p.name == "transformer.wte.weight") whole.resize(static_cast<size_t>(vocab * p.shape[1]));
    out[p.name] = std::move(whole);
  }
  return out;
}

}  // namespace loom
