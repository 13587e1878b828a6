#include "loom/parallel/zero/shard_optimizer.h"

namespace loom {

namespace {

size_t f32_bytes(int64_t elements) {
  return static_cast<size_t>(elements) * sizeof(float);
}

}  // namespace

ShardOptimizer::ShardOptimizer(const ShardLayout& shards, const ZeroConfig& config,
                               const OptimizerConfig& optimizer, const Backend<float>& backend,
                               int rank)
    : shards_(shards), dtype_(config.dtype) {
  const int64_t n = shards.shard_elements();
  if (config.offload_device == "nvme") {
    check_writable_dir(config.nvme_path, "zero_optimization.offload_optimizer.nvme_path");
    // The moments, and in 16-bit mode the masters after them.
    nvme_ = std::make_unique<NvmeStore>(config.nvme_path, parts() * f32_bytes(n), rank);
    adamw_ = std::make_unique<AdamW>(shards.segments(), n, optimizer, nvme_->data(),
                                     nvme_->data() + n, backend);
  } else {
    adamw_ = std::make_unique<AdamW>(shards.segments(), n, optimizer, nullptr, nullptr, backend);
    if (parts() == 3) master_ = backend.alloc(f32_bytes(n), MemCategory::kOptimizer);
  }
}

float* ShardOptimizer::masters() const {
  return nvme_ ? nvme_->data() + 2 * shards_.shard_elements() : master_.as<float>();
}

template <class F>
void ShardOptimizer::each_unit(F update) {
  if (!nvme_) {
    update(0, SIZE_MAX);
    return;
  }
  // Unit by unit: only the moments (and masters) being updated are resident.
  const size_t all = f32_bytes(shards_.shard_elements());
  for (int u = 0; u < shards_.num_units(); ++u) {
    const size_t bytes = f32_bytes(shards_.slice(u));
    memory_tracker().on_alloc(MemCategory::kOptimizer, parts() * bytes);
    const auto [first, last] = shards_.unit_segments(u);
    update(first, last);
    const size_t off = f32_bytes(shards_.shard_offset(u));
    for (int k = 0; k < parts(); ++k) nvme_->release(k * all + off, bytes);
    memory_tracker().on_free(MemCategory::kOptimizer, parts() * bytes);
  }
  // Faults map a few neighbouring pages in too (fault-around); drop those.
  release();
}

void ShardOptimizer::step(float* params, const float* grads, double lr, int64_t step) {
  each_unit([&](size_t first, size_t last) { adamw_->step(params, grads, lr, step, first, last); });
}

void ShardOptimizer::step_16(uint16_t* params16, const uint16_t* grads16, float grad_factor,
                             double lr, int64_t step) {
  each_unit([&](size_t first, size_t last) {
    adamw_->step_16(masters(), params16, grads16, dtype_, grad_factor, lr, step, first, last);
  });
}

void ShardOptimizer::release() const {
  if (nvme_) nvme_->release(0, nvme_->bytes());
}

size_t ShardOptimizer::resident_bytes() const {
  return nvme_ ? nvme_->resident_bytes() : parts() * f32_bytes(shards_.shard_elements());
}

}  // namespace loom
