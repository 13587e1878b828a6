// Where a model's parameters and gradients live, unit by unit. By default the
// store owns full flat buffers; under ZeRO a data-parallel engine owns shards
// and binds each unit's storage before a layer uses it. Layers reach their
// parameters only through the store (param(id), grad(id)), and the stage
// announces every use of a unit through the store's hooks, so the engine
// never sees the model itself.
#pragma once

#include <cstdint>
#include <functional>
#include <type_traits>
#include <vector>

#include "loom/core/dtype.h"
#include "loom/core/memory.h"
#include "loom/kernels/backend.h"
#include "loom/nn/context.h"
#include "loom/nn/param.h"

namespace loom {

// Which pass uses a unit: forward and backward read its parameters; a
// recompute (activation checkpointing) reads them again before backward;
// the backward of the token and position lookup only writes gradients.
// A zero-bubble pipeline splits backward: kBackwardInput reads parameters
// and writes no gradients (they are put off), kBackwardGradsOnly then writes
// them.
enum class Pass { kForward, kRecompute, kBackward, kBackwardGradsOnly, kBackwardInput };
inline bool reads_params(Pass p) {
  return p != Pass::kBackwardGradsOnly;
}
inline bool writes_grads(Pass p) {
  return p == Pass::kBackward || p == Pass::kBackwardGradsOnly;
}

struct UnitUse {
  int unit;
  Pass pass;
};

// Called around every use of a unit (ZeRO stage 3 gathers its parameters
// before a use that reads them and releases them after) and, in backward, of
// its gradients (ZeRO reduces them after the last use that writes them). A
// unit may be used more than once in a pass: the embeddings open the forward
// and (tied LM head) close it. The model publishes the order of the uses
// (GptStage::unit_schedule).
struct UnitHooks {
  std::function<void(int unit, Pass pass)> before, after;
};

struct StoreOptions {
  int64_t unit_multiple = 1;  // every unit padded to a multiple of this
  bool params = true;         // allocate the full parameter buffer
  bool grads = true;          // allocate the full gradient buffer
};

template <typename T>
class DeferredGrads;

template <typename T>
class ParamStore {
 public:
  ParamStore() = default;
  // Takes the finished layout; allocates what `options` asks for on
  // `backend`, which every layer running on this store computes with.
  void build(ParamLayout layout, StoreOptions options,
             const Backend<T>& backend = default_backend<T>());

  // The backend the layers reach through the store: their parameters,
  // gradients and activations live on its device.
  const Backend<T>& backend() const { return *backend_; }

  const ParamLayout& layout() const { return layout_; }
  // Elements of the flat buffers (parameters plus alignment and unit padding).
  int64_t num_params() const { return layout_.total(); }
  // The full flat buffers; null when not allocated (see StoreOptions).
  T* params() const { return params_.template as<T>(); }
  T* grads() const { return grads_.template as<T>(); }
  T* param(const Param& p) const {
    if (unit_widened_[static_cast<size_t>(p.unit)]) return widened_param(p);
    return unit_params_[p.unit] + (p.offset - begin(p.unit));
  }
  T* grad(const Param& p) const { return unit_grads_[p.unit] + (p.offset - begin(p.unit)); }
  T* param(ParamId id) const { return param(layout_[id]); }
  // A matrix as a GEMM takes it: its 16-bit values while its unit is bound
  // by bind_params16, else param().
  Weight<T> weight(ParamId id) const {
    const Param& p = layout_[id];
    const size_t u = static_cast<size_t>(p.unit);
    if (unit_widened_[u] && p.matrix())
      return Weight<T>(unit_params16_[u] + (p.offset - begin(p.unit)), dtype16_, packs16_);
    return Weight<T>(param(p));
  }
  T* grad(ParamId id) const { return grad(layout_[id]); }
  // An activation (n elements at x) as a linear (or the attention core's or
  // GELU's 16-bit forms) takes it: with its bf16 twin while the running
  // block's record has one there (set_twins).
  Input<T> input(const T* x, int64_t n) const {
    if constexpr (std::is_same_v<T, float>)
      if (twins_ != nullptr) {
        Input<T> in(x, twins_->find(x, n));
        in.written = in.r16 != nullptr && twins_->is_written(x, n);
        return in;
      }
    return Input<T>(x);
  }
  // A producer wrote the 16-bit home of [x, x + n) itself (input() found
  // it): the linear that reads it takes those values as they are.
  void mark_written(const T* x, int64_t n) const {
    if constexpr (std::is_same_v<T, float>)
      if (twins_ != nullptr) twins_->mark_written(x, n);
  }
  // The running block's record twins (null: none), set by the stage around
  // the block's forward and backward.
  void set_twins(const RecordTwins* t) { twins_ = t; }
  const RecordTwins* twins() const { return twins_; }

  // Points unit u's parameters (gradients) at `base`, which holds the unit's
  // elements [begin, end) of the flat layout; null unbinds.
  void bind_params(int u, T* base) {
    unit_params_[static_cast<size_t>(u)] = base;
    unit_widened_[static_cast<size_t>(u)] = nullptr;
  }
  // A 16-bit run whose GEMMs read 16-bit weights: unit u's matrices are the
  // 16-bit values (type t) at base16, which holds the unit's elements
  // [begin, end); its other parameters are f32 in `widened`, at their
  // Param::widened offsets. param() of a matrix is then an error (only
  // weight() reads it); bind_params(u, ...) ends it. packs: where the GEMMs
  // may keep the matrices in their own layout until the binder clears it
  // (null: they lay them out per use).
  void bind_params16(int u, const uint16_t* base16, T* widened, DType t,
                     WeightPacks* packs = nullptr) {
    unit_params_[static_cast<size_t>(u)] = nullptr;
    unit_params16_[static_cast<size_t>(u)] = base16;
    unit_widened_[static_cast<size_t>(u)] = widened;
    dtype16_ = t;
    packs16_ = packs;
  }
  void bind_grads(int u, T* base) { unit_grads_[static_cast<size_t>(u)] = base; }
  // Allocates the full parameter buffer if it is not, and binds every unit
  // to it; release_params() frees it again (both for ZeRO stage 3).
  void allocate_params();
  void release_params();

  // Initialises every parameter from (seed, name, global element index).
  void init(uint64_t seed);
  // Writes elements [begin, end) of the initialised flat buffer into dst
  // (padding zero): a ZeRO shard initialises only what it holds.
  void init_range(uint64_t seed, int64_t begin, int64_t end, T* dst) const;
  void zero_grads();

  // While set, layers compute input gradients and record their parameter
  // gradients there instead of accumulating them (deferred_grads.h).
  void set_deferral(DeferredGrads<T>* d) { defer_ = d; }
  DeferredGrads<T>* deferral() const { return defer_; }

  void set_hooks(UnitHooks hooks) { hooks_ = std::move(hooks); }
  // Told when the layers begin and end computing with a unit (inside the
  // hooks: a gather before and a reduction after are not part of it); the
  // trace draws these spans.
  void set_observer(std::function<void(int unit, Pass pass, bool begin)> f) {
    observer_ = std::move(f);
  }
  void before(int u, Pass pass) const {
    if (hooks_.before) hooks_.before(u, pass);
    if (observer_) observer_(u, pass, true);
  }
  void after(int u, Pass pass) const {
    if (observer_) observer_(u, pass, false);
    if (hooks_.after) hooks_.after(u, pass);
  }

 private:
  int64_t begin(int u) const { return layout_.units()[static_cast<size_t>(u)].begin; }
  T* widened_param(const Param& p) const;

  const Backend<T>* backend_ = &default_backend<T>();
  ParamLayout layout_;
  Buffer params_, grads_;
  std::vector<T*> unit_params_, unit_grads_;
  // bind_params16's: per unit the 16-bit base and the widened copy (null:
  // not so bound), and the type.
  std::vector<const uint16_t*> unit_params16_;
  std::vector<T*> unit_widened_;
  DType dtype16_ = DType::kF32;
  WeightPacks* packs16_ = nullptr;
  const RecordTwins* twins_ = nullptr;
  UnitHooks hooks_;
  std::function<void(int, Pass, bool)> observer_;
  DeferredGrads<T>* defer_ = nullptr;
};

extern template class ParamStore<float>;
extern template class ParamStore<double>;

}  // namespace loom
