// The feed-forward slot of a transformer block, and GPT-2's MLP that fills
// it by default (c_fc, GELU, c_proj). A mixture-of-experts layer fills the
// same slot: the block sees only this interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/nn/context.h"
#include "loom/nn/param_store.h"

namespace loom {

template <typename T>
class FeedForward {
 public:
  virtual ~FeedForward() = default;
  // Elements one micro-batch keeps for backward; `selective` leaves out
  // what is cheap to recompute.
  virtual int64_t record_elems(const Rows& rows, bool selective) const = 0;
  // Room for what selective leaves out (forward writes it there and
  // backward recomputes it there); the stage shares it between layers.
  virtual int64_t recompute_elems(const Rows& rows, bool selective) const = 0;
  // What of the record stays f32 when the record is kept in 16 bits.
  virtual std::vector<RecordRange> exact_ranges(const Rows& rows, bool selective) const = 0;
  // With records packed to bf16 (RecordTwins): the record's ranges read in
  // bf16 alone, by the layer's own 16-bit kernel forms and, when linears16
  // (a backend whose GEMMs read bf16 inputs), by a linear's GEMMs; and
  // whether the normalised input x goes to the layer's linears alone (a
  // twin when linears16). The layer finds their bf16 homes through
  // ParamStore::input.
  virtual std::vector<RecordRange> twin_ranges(const Rows&, bool, bool) const { return {}; }
  virtual bool input_twin() const { return false; }
  // Backward's gradient scratch.
  virtual int64_t scratch_elems(const Rows& rows) const = 0;
  // out (rows.count, C) = ffn(x (rows.count, C)); `record` holds
  // record_elems(rows, selective). A null `out` fills only the record (a
  // recomputation for backward, which never reads the output).
  virtual void forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
                       const Rows& rows, T* recompute) const = 0;
  // Writes dx (rows.count, C) over what it held (the caller need not zero
  // it) and accumulates the parameter gradients, from dout.
  virtual void backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                        const T* x, const Rows& rows, T* scratch, T* recompute) const = 0;
};

template <typename T>
class Mlp final : public FeedForward<T> {
 public:
  // Declares <prefix>.c_fc.{weight,bias} (C, 4C) (4C) and
  // <prefix>.c_proj.{weight,bias} (4C, C) (C); c_proj drawn with proj_std.
  Mlp(ParamLayout& layout, const std::string& prefix, int64_t C, float proj_std);
  ParamId c_fc_w, c_fc_b, c_proj_w, c_proj_b;

  // Record: fch (rows,4C) the GELU's input, and unless selective its output.
  int64_t record_elems(const Rows& rows, bool selective) const override;
  int64_t recompute_elems(const Rows& rows, bool selective) const override;
  std::vector<RecordRange> exact_ranges(const Rows&, bool) const override { return {}; }
  // Unless selective: GELU's input, which GELU alone reads (its 16-bit
  // forms record it and read it back), and with linears16 GELU's output,
  // which c_proj alone reads (x goes to c_fc alone).
  std::vector<RecordRange> twin_ranges(const Rows& rows, bool selective,
                                       bool linears16) const override {
    if (selective) return {};
    const int64_t n = rows.count * 4 * C_;
    if (!linears16) return {{0, n}};
    return {{0, n}, {n, n}};
  }
  bool input_twin() const override { return true; }
  int64_t scratch_elems(const Rows& rows) const override;
  void forward(const ParamStore<T>& ps, T* record, bool selective, T* out, const T* x,
               const Rows& rows, T* recompute) const override;
  void backward(const ParamStore<T>& ps, T* record, bool selective, T* dx, const T* dout,
                const T* x, const Rows& rows, T* scratch, T* recompute) const override;

 private:
  int64_t C_;
};

}  // namespace loom
