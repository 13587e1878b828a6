// PowerSGD over the buckets of the bucketed all-reduce (stages 0-1) and
// over the units of the per-unit reduce-scatter (stages 2-3) (compression.h).
//
// Stages 0-1:
// A bucket's matrices start compressing as soon as backward has finished
// the bucket: the error is added, P = M Q computed and the sum of the P's
// launched with the bucket's uncompressed parameters, so that they travel
// during the rest of backward; when backward ends, each bucket's P is
// orthonormalised, Q = M^T P computed and summed, and M^ = P Q^T / size
// written into the gradients: the same bits on every rank, since P and Q
// are. In 16-bit mode a bucket's matrices are widened into f32 copies to
// compress, and M^ rounded back.
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "loom/core/error.h"
#include "loom/core/rng.h"
#include "loom/parallel/zero/bucketed_reducer.h"

namespace loom {

namespace {

size_t f32_bytes(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

// Orthonormalises the r columns of row-major P (rows x r) in place:
// Gram-Schmidt in double, each column projected off the ones before it
// twice, so that the columns stay orthogonal to working precision even
// where they are nearly dependent (a gradient of lower rank than r). A
// column that is all zeros (a matrix whose gradient is zero) stays zero.
void orthonormalise(float* P, int64_t rows, int64_t r) {
  std::vector<double> q(static_cast<size_t>(rows * r));
  for (int64_t i = 0; i < rows * r; ++i) q[static_cast<size_t>(i)] = P[i];
  auto at = [&](int64_t i, int64_t j) -> double& { return q[static_cast<size_t>(i * r + j)]; };
  std::vector<char> zero(static_cast<size_t>(r), 0);
  for (int64_t j = 0; j < r; ++j) {
    double before = 0;
    for (int64_t i = 0; i < rows; ++i) before += at(i, j) * at(i, j);
    if (before == 0) {
      zero[static_cast<size_t>(j)] = 1;
      continue;
    }
    for (int pass = 0; pass < 2; ++pass)
      for (int64_t k = 0; k < j; ++k) {
        if (zero[static_cast<size_t>(k)]) continue;
        double d = 0;
        for (int64_t i = 0; i < rows; ++i) d += at(i, k) * at(i, j);
        for (int64_t i = 0; i < rows; ++i) at(i, j) -= d * at(i, k);
      }
    double ss = 0;
    for (int64_t i = 0; i < rows; ++i) ss += at(i, j) * at(i, j);
    if (ss == 0) {
      zero[static_cast<size_t>(j)] = 1;
      continue;
    }
    const double inv = 1.0 / std::sqrt(ss);
    for (int64_t i = 0; i < rows; ++i) at(i, j) *= inv;
  }
  for (int64_t i = 0; i < rows * r; ++i) P[i] = static_cast<float>(q[static_cast<size_t>(i)]);
}

// One parameter's part in PowerSGD: a matrix compressed as P Q^T, or a
// vector (or a matrix that would not compress enough) sent whole.
struct Matrix {
  const Param* p;
  int64_t rows, cols, r;
  int64_t p_off, q_off;  // in its plan's P and Q
  Buffer error;          // error feedback (rows x cols), or none
  Buffer m;              // 16-bit mode: the f32 copy being compressed
};
struct Rest {
  int64_t offset, numel, at;  // flat offset, elements, place in the message
};
// What one message set covers (a bucket, or a unit).
struct Plan {
  std::vector<Matrix> mats;
  std::vector<Rest> rest;
  int64_t p_elements = 0, q_elements = 0, rest_elements = 0;
  Buffer q;        // every matrix's Q (warm start keeps it)
  Buffer p, rmsg;  // while the step reduces
  WorkPtr pw, qw, rw;
};

// Adds parameter p to the plan by PyTorch's rule: compressed when (rows +
// cols) r x min_compression_rate < rows cols.
void plan_param(Plan& pl, const Param& p, const CompressionConfig& c, const Backend<float>& be) {
  const int64_t rows = p.matrix() ? p.local[0] : 0, cols = p.matrix() ? p.local[1] : 0;
  const int64_t r = std::min<int64_t>({c.rank, rows, cols});
  if (!p.matrix() || double((rows + cols) * r) * c.min_compression_rate >= double(rows * cols)) {
    pl.rest.push_back({p.offset, p.numel, pl.rest_elements});
    pl.rest_elements += p.numel;
    return;
  }
  Matrix m{&p, rows, cols, r, pl.p_elements, pl.q_elements, Buffer(), Buffer()};
  if (c.error_feedback) m.error = be.alloc(f32_bytes(p.numel), MemCategory::kComm);
  pl.p_elements += rows * r;
  pl.q_elements += cols * r;
  pl.mats.push_back(std::move(m));
}

// A standard normal Q keyed by the run's seed, the tensor and its slice,
// (without warm start) the step: the same on every rank that reduces it.
void init_q(Plan& pl, const Matrix& m, const CompressionConfig& c, int64_t step) {
  const std::string key = format("powersgd.q.{}.{}.{}", m.p->name, m.p->shard.index, step);
  const NormalStream normal(c.seed, key);
  float* q = pl.q.as<float>() + m.q_off;
  for (int64_t i = 0; i < m.cols * m.r; ++i) q[i] = normal.at(static_cast<uint64_t>(i));
}

void init_plan(Plan& pl, const CompressionConfig& c, const Backend<float>& be) {
  pl.q = be.alloc(f32_bytes(pl.q_elements), MemCategory::kComm);
  for (const Matrix& m : pl.mats) init_q(pl, m, c, 0);
}

// P = (M + e) Q of one matrix (the error added into M).
void first_pass(const Backend<float>& be, Plan& pl, Matrix& m, float* M, const CompressionConfig& c,
                int64_t step) {
  if (m.error.data()) be.add(M, m.error.as<float>(), m.p->numel);
  if (!c.warm_start) init_q(pl, m, c, step);
  be.gemm(false, false, m.rows, m.r, m.cols, 1.0f, M, m.cols, pl.q.as<float>() + m.q_off, m.r, 0.0f,
          pl.p.as<float>() + m.p_off, m.r);
}

// With P summed: P orthonormalised, Q = M^T P.
void second_pass(const Backend<float>& be, Plan& pl, const Matrix& m, const float* M) {
  float* P = pl.p.as<float>() + m.p_off;
  orthonormalise(P, m.rows, m.r);
  be.gemm(true, false, m.cols, m.r, m.rows, 1.0f, M, m.cols, P, m.r, 0.0f,
          pl.q.as<float>() + m.q_off, m.r);
}

bool plan_finite(const Backend<float>& be, const Plan& pl) {
  return pl.mats.empty() || (std::isfinite(be.sum_squares(pl.p.as<float>(), pl.p_elements)) &&
                             std::isfinite(be.sum_squares(pl.q.as<float>(), pl.q_elements)));
}

// With Q summed: M^ = P Q^T / size into M and the error M - M^ kept
// (returns its sum of squares). A non-finite P or Q (a non-finite gradient
// on some rank, the same on every rank) makes M non-finite for the step's
// verdict and starts the state afresh: zero error, a new Q.
double last_pass(const Backend<float>& be, Plan& pl, Matrix& m, float* M, bool finite, int size,
                 const CompressionConfig& c, int64_t step) {
  if (!finite) {
    be.fill(M, m.p->numel, std::numeric_limits<float>::quiet_NaN());
    if (m.error.data()) be.fill(m.error.as<float>(), m.p->numel, 0.0f);
    init_q(pl, m, c, step + 1);
    return 0;
  }
  if (m.error.data()) be.copy(m.error.as<float>(), M, m.p->numel);
  be.gemm(false, true, m.rows, m.cols, m.r, 1.0f / static_cast<float>(size),
          pl.p.as<float>() + m.p_off, m.r, pl.q.as<float>() + m.q_off, m.r, 0.0f, M, m.cols);
  if (!m.error.data()) return 0;
  be.axpy(m.error.as<float>(), -1.0f, M, m.p->numel);
  return be.sum_squares(m.error.as<float>(), m.p->numel);
}

// The checkpointed state of the plans: each matrix's error and Q.
std::vector<CompressionState> plans_state(std::vector<Plan>& plans) {
  std::vector<CompressionState> out;
  for (Plan& pl : plans)
    for (Matrix& m : pl.mats) {
      if (m.error.data())
        out.push_back(
            {CompressionState::kError, "powersgd", m.p, m.error.as<float>(), m.rows, m.cols});
      out.push_back(
          {CompressionState::kQ, "powersgd", m.p, pl.q.as<float>() + m.q_off, m.cols, m.r});
    }
  return out;
}

class PowerSgd final : public BucketedAllReduce {
 public:
  PowerSgd(ParamStore<float>& store, const ShardLayout& shards, const ZeroConfig& config,
           GradTarget target)
      : BucketedAllReduce(store, shards, config, target) {
    const CompressionConfig& c = config.compression;
    LOOM_CHECK_KIND(kConfig, c.rank >= 1, "comm.compression.rank must be >= 1, got {}", c.rank);
    plans_.resize(buckets_.size());
    for (size_t k = 0; k < buckets_.size(); ++k) {
      Plan& pl = plans_[k];
      for (const Param& p : shards.layout().params())
        if (p.offset >= buckets_[k].begin && p.offset < buckets_[k].end) plan_param(pl, p, c, be_);
      init_plan(pl, c, be_);
    }
  }

  ~PowerSgd() override {
    for (const Plan& pl : plans_) {
      wait_quietly(pl.pw, "a PowerSGD all-reduce of P");
      wait_quietly(pl.qw, "a PowerSGD all-reduce of Q");
      wait_quietly(pl.rw, "a PowerSGD all-reduce");
    }
  }

  std::vector<CompressionState> state() override { return plans_state(plans_); }

 private:
  bool compressing() const { return steps_ >= config_.compression.start_iter; }
  size_t index(const Bucket& b) const { return static_cast<size_t>(&b - buckets_.data()); }

  // The matrix being compressed: the gradients in place (f32) or the f32 copy.
  float* matrix(Matrix& m) { return half() ? m.m.as<float>() : target_.f32 + m.p->offset; }

  void launch(Bucket& b) override {
    if (!compressing()) {
      BucketedAllReduce::launch(b);
      return;
    }
    const UnitGroup& g = group_of(b);
    if (!g.group) return;
    Plan& pl = plans_[index(b)];
    const size_t es = dtype_size(config_.dtype);
    cstats_.plain_bytes += all_reduce_volume(double(pbytes(b.end - b.begin)), g.size);
    // The uncompressed parameters, in one message of the gradient type.
    if (pl.rest_elements > 0) {
      pl.rmsg = be_.alloc(static_cast<size_t>(pl.rest_elements) * es, MemCategory::kComm, false);
      auto* dst = pl.rmsg.as<char>();
      const auto* src = static_cast<const char*>(at(b)) - static_cast<size_t>(b.begin) * es;
      for (const Rest& r : pl.rest)
        std::memcpy(dst + static_cast<size_t>(r.at) * es, src + static_cast<size_t>(r.offset) * es,
                    static_cast<size_t>(r.numel) * es);
      pl.rw =
          g.group->all_reduce(pl.rmsg.data(), pl.rmsg.data(), static_cast<size_t>(pl.rest_elements),
                              config_.dtype, ReduceOp::kAvg);
      cstats_.sent_bytes += all_reduce_volume(double(pl.rest_elements) * double(es), g.size);
    }
    if (pl.mats.empty()) return;
    // P = (M + e) Q of every matrix.
    pl.p = be_.alloc(f32_bytes(pl.p_elements), MemCategory::kComm, false);
    for (Matrix& m : pl.mats) {
      if (half()) {
        m.m = be_.alloc(f32_bytes(m.p->numel), MemCategory::kComm, false);
        be_.widen_16(target_.h16 + m.p->offset, m.m.as<float>(), m.p->numel, config_.dtype);
      }
      first_pass(be_, pl, m, matrix(m), config_.compression, steps_);
    }
    pl.pw = g.group->all_reduce(pl.p.data(), pl.p.data(), static_cast<size_t>(pl.p_elements),
                                DType::kF32, ReduceOp::kSum);
    cstats_.sent_bytes += all_reduce_volume(double(f32_bytes(pl.p_elements)), g.size);
  }

  void complete() override {
    if (!compressing()) {
      BucketedAllReduce::complete();
      return;
    }
    // Q = M^T P for every bucket, once its P is summed.
    for (Bucket& b : buckets_) {
      Plan& pl = plans_[index(b)];
      if (!pl.pw) continue;
      wait_for_use(pl.pw, be_, &stats_);
      pl.pw = nullptr;
      for (Matrix& m : pl.mats) second_pass(be_, pl, m, matrix(m));
      pl.qw = group_of(b).group->all_reduce(pl.q.data(), pl.q.data(),
                                            static_cast<size_t>(pl.q_elements), DType::kF32,
                                            ReduceOp::kSum);
      cstats_.sent_bytes += all_reduce_volume(double(f32_bytes(pl.q_elements)), group_of(b).size);
    }
    // M^ = P Q^T / size into the gradients; the error M - M^ kept.
    double ess = 0;
    const size_t es = dtype_size(config_.dtype);
    for (Bucket& b : buckets_) {
      Plan& pl = plans_[index(b)];
      const UnitGroup& g = group_of(b);
      if (pl.qw) wait_for_use(pl.qw, be_, &stats_);
      if (pl.rw) wait_for_use(pl.rw, be_, &stats_);
      pl.qw = pl.rw = nullptr;
      const bool finite = plan_finite(be_, pl);
      for (Matrix& m : pl.mats) {
        float* M = matrix(m);
        ess += last_pass(be_, pl, m, M, finite, g.size, config_.compression, steps_);
        if (half()) {
          be_.round_16(M, target_.h16 + m.p->offset, m.p->numel, config_.dtype);
          m.m = Buffer();
        }
      }
      if (pl.rest_elements > 0 && g.group) {
        auto* dst = static_cast<char*>(at(b)) - static_cast<size_t>(b.begin) * es;
        for (const Rest& r : pl.rest)
          std::memcpy(dst + static_cast<size_t>(r.offset) * es,
                      pl.rmsg.as<char>() + static_cast<size_t>(r.at) * es,
                      static_cast<size_t>(r.numel) * es);
      }
      pl.p = Buffer();
      pl.rmsg = Buffer();
      if (g.scale != 1.0f) scale(b, g.scale);
    }
    cstats_.compressed = true;
    cstats_.error_sum_squares = ess;
  }

  std::vector<Plan> plans_;  // per bucket
};

// Stages 2-3: a unit's gradients are compressed where they are reduced,
// every micro-batch, as soon as backward has written them: the error
// added, P = M Q summed, orthonormalised, Q = M^T P summed, M^ = P Q^T /
// size, the unit's other parameters averaged in one message; then this
// rank's slice of the result is added into its shard, as the plain
// reduce-scatter's would be. The exchange waits inside backward (P and Q
// are small); the unit's f32 buffer is freed when it is done: only units
// whose backward is under way (and a tied unit between its uses) are held
// whole.
class UnitPowerSgd final : public UnitReduceScatter {
 public:
  UnitPowerSgd(ParamStore<float>& store, const ShardLayout& shards, const ZeroConfig& config,
               GradTarget target)
      : UnitReduceScatter(store, shards, config, target) {
    const CompressionConfig& c = config.compression;
    LOOM_CHECK_KIND(kConfig, c.rank >= 1, "comm.compression.rank must be >= 1, got {}", c.rank);
    plans_.resize(static_cast<size_t>(shards.num_units()));
    for (int u = 0; u < shards.num_units(); ++u) {
      Plan& pl = plans_[static_cast<size_t>(u)];
      for (const Param& p : shards.layout().params())
        if (p.unit == u) plan_param(pl, p, c, be_);
      init_plan(pl, c, be_);
    }
  }

  void begin(bool reduce, bool last) override {
    reduce_ = reduce;
    last_ = last;
  }

  // Compressed, a unit's gradients stay bound until its last use of the
  // micro-batch has written them (a tied matrix written by two uses is
  // compressed once, summed, as at stages 0-1).
  void written(int u) override {
    if (!compresses(u)) UnitReduceScatter::written(u);
  }
  // u's last use: it and the expert units riding on it.
  void final(int u) override {
    for (int w : shards_.used_with(u))
      if (compresses(w) && buf(w).data()) compress_unit(w);
  }

  void end() override {
    UnitReduceScatter::end();
    if (!reduce_) return;
    cstats_.compressed = compressing();
    if (!last_) return;
    ++steps_;
    double ess = 0;
    for (const Plan& pl : plans_)
      for (const Matrix& m : pl.mats)
        if (m.error.data()) ess += be_.sum_squares(m.error.as<float>(), m.p->numel);
    cstats_.error_sum_squares = ess;
  }

  std::vector<CompressionState> state() override { return plans_state(plans_); }

 private:
  bool compressing() const { return steps_ >= config_.compression.start_iter; }
  // A unit without a matrix to compress goes by the plain reduce-scatter.
  bool compresses(int u) const {
    return reduce_ && compressing() && shards_.group(u).group &&
           !plans_[static_cast<size_t>(u)].mats.empty();
  }

  void compress_unit(int u) {
    Buffer b = unbind(u);  // the unit's gradients (f32)
    float* G = b.as<float>();
    const Unit& un = shards_.unit(u);
    const UnitGroup& g = shards_.group(u);
    const CompressionConfig& c = config_.compression;
    Plan& pl = plans_[static_cast<size_t>(u)];
    // What the plain reduce-scatter would have sent.
    cstats_.plain_bytes += spread_volume(double(pbytes(un.size())), g.size);
    Buffer rest32;  // 16-bit runs: the rest in f32, averaged in 16 bits
    if (pl.rest_elements > 0) {
      // The unit's other parameters, averaged in one message of the run's
      // gradient type (as the plain reduce-scatter would send them).
      const int64_t n = pl.rest_elements;
      Buffer& b32 = half() ? rest32 : pl.rmsg;
      b32 = be_.alloc(f32_bytes(n), MemCategory::kComm, false);
      for (const Rest& r : pl.rest)
        std::memcpy(b32.as<float>() + r.at, G + (r.offset - un.begin), f32_bytes(r.numel));
      if (half()) {
        pl.rmsg = be_.alloc(pbytes(n), MemCategory::kComm, false);
        be_.round_16(rest32.as<float>(), pl.rmsg.as<uint16_t>(), n, config_.dtype);
      }
      pl.rw = g.group->all_reduce(pl.rmsg.data(), pl.rmsg.data(), static_cast<size_t>(n),
                                  config_.dtype, ReduceOp::kAvg);
      cstats_.sent_bytes += all_reduce_volume(double(pbytes(n)), g.size);
    }
    if (!pl.mats.empty()) {
      pl.p = be_.alloc(f32_bytes(pl.p_elements), MemCategory::kComm, false);
      for (Matrix& m : pl.mats) first_pass(be_, pl, m, G + (m.p->offset - un.begin), c, steps_);
      pl.pw = g.group->all_reduce(pl.p.data(), pl.p.data(), static_cast<size_t>(pl.p_elements),
                                  DType::kF32, ReduceOp::kSum);
      cstats_.sent_bytes += all_reduce_volume(double(f32_bytes(pl.p_elements)), g.size);
      wait_for_use(pl.pw, be_, &stats_);
      pl.pw = nullptr;
      for (Matrix& m : pl.mats) second_pass(be_, pl, m, G + (m.p->offset - un.begin));
      pl.qw = g.group->all_reduce(pl.q.data(), pl.q.data(), static_cast<size_t>(pl.q_elements),
                                  DType::kF32, ReduceOp::kSum);
      cstats_.sent_bytes += all_reduce_volume(double(f32_bytes(pl.q_elements)), g.size);
      wait_for_use(pl.qw, be_, &stats_);
      pl.qw = nullptr;
      const bool finite = plan_finite(be_, pl);
      for (Matrix& m : pl.mats)
        last_pass(be_, pl, m, G + (m.p->offset - un.begin), finite, g.size, c, steps_);
      pl.p = Buffer();
    }
    if (pl.rw) {
      wait_for_use(pl.rw, be_, &stats_);
      pl.rw = nullptr;
      if (half())
        be_.widen_16(pl.rmsg.as<uint16_t>(), rest32.as<float>(), pl.rest_elements, config_.dtype);
      const float* avg = half() ? rest32.as<float>() : pl.rmsg.as<float>();
      for (const Rest& r : pl.rest)
        std::memcpy(G + (r.offset - un.begin), avg + r.at, f32_bytes(r.numel));
      pl.rmsg = Buffer();
    }
    // Reduced: this rank's slice into the shard, with what is before it.
    reducing_.push_back({u, std::move(b), nullptr, false});
    reducing_elements_ += un.size();
    while (!reducing_.empty()) drain_one();
  }

  std::vector<Plan> plans_;  // per unit
  bool reduce_ = false, last_ = false;
};

}  // namespace

std::unique_ptr<GradReducer> make_powersgd_reducer(ParamStore<float>& store,
                                                   const ShardLayout& shards,
                                                   const ZeroConfig& config, GradTarget target) {
  if (config.stage >= 2) return std::make_unique<UnitPowerSgd>(store, shards, config, target);
  return std::make_unique<PowerSgd>(store, shards, config, target);
}

}  // namespace loom
