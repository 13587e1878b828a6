#include "loom/kernels/cpu/gemm_backend.h"

#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <unordered_map>

#ifdef LOOM_HAVE_ONEDNN
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "loom/core/error.h"
#include "loom/core/memory.h"
#include "loom/kernels/cpu/gemm_census.h"
#include "loom/kernels/cpu/matmul.h"
#include "loom/kernels/cpu/precision.h"

extern "C" char* openblas_get_corename();

namespace loom::cpu {

const char* gemm_backend_name(GemmBackend b) {
  return b == GemmBackend::kOneDnn ? "onednn" : "openblas";
}

bool gemm_backend_available(GemmBackend b) {
#ifdef LOOM_HAVE_ONEDNN
  (void)b;
  return true;
#else
  return b == GemmBackend::kOpenBlas;
#endif
}

void check_gemm_backend(GemmBackend b) {
  LOOM_CHECK_KIND(kUnsupported, gemm_backend_available(b),
                  "kernels.gemm: {} is not available in this build (configure with "
                  "-DLOOM_ONEDNN=ON and Debian's libdnnl-dev installed)",
                  gemm_backend_name(b));
}

std::string gemm_backend_isa(GemmBackend b) {
  if (b == GemmBackend::kOpenBlas) return openblas_get_corename();
#ifdef LOOM_HAVE_ONEDNN
  switch (dnnl_get_effective_cpu_isa()) {
    case dnnl_cpu_isa_sse41:
      return "sse41";
    case dnnl_cpu_isa_avx:
      return "avx";
    case dnnl_cpu_isa_avx2:
      return "avx2";
    case dnnl_cpu_isa_avx512_core:
      return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx:
      return "avx512_core_amx";
    case dnnl_cpu_isa_avx2_vnni:
      return "avx2_vnni";
    default:
      return "other";
  }
#else
  return "not built";
#endif
}

std::string openblas_misdetection() {
  const std::string core = openblas_get_corename();
  // The kernels OpenBLAS falls back to when it does not know a processor.
  const bool generic = core == "Prescott" || core == "Core2" || core == "Penryn" ||
                       core == "Dunnington" || core == "Nehalem" || core == "Atom" ||
                       core == "Unknown";
  if (!generic) return "";
  const bool avx512 = __builtin_cpu_supports("avx512f");
  const bool avx2 = __builtin_cpu_supports("avx2");
  if (!avx2 && !avx512) return "";
  return format(
      "OpenBLAS runs its generic '{}' kernel on this CPU, which has {}: this OpenBLAS does not "
      "recognise the processor, and its GEMMs run several times slower; use kernels.gemm: "
      "onednn (or auto), or set OPENBLAS_CORETYPE={}",
      core, avx512 ? "AVX-512" : "AVX2", avx512 ? "SkylakeX" : "Haswell");
}

double measure_sgemm_gflops(GemmBackend b, int n, int reps) {
  check_gemm_backend(b);
  return measure_gemm_gflops(b, DType::kF32, n, reps);
}

#ifdef LOOM_HAVE_ONEDNN
namespace {

// One matmul primitive with its buffers: src (M, K), weights (K, N), dst (M, N).
struct Matmul {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dnnl::memory a, b, c;
  dnnl::matmul prim;
  Matmul(int64_t M, int64_t N, int64_t K, bool bf16) {
    using dt = dnnl::memory::data_type;
    using tag = dnnl::memory::format_tag;
    const dt in = bf16 ? dt::bf16 : dt::f32;
    dnnl::memory::desc a_md({M, K}, in, tag::ab), b_md({K, N}, in, tag::ab),
        c_md({M, N}, dt::f32, tag::ab);
    prim = dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a_md, b_md, c_md), engine));
    a = dnnl::memory(a_md, engine), b = dnnl::memory(b_md, engine), c = dnnl::memory(c_md, engine);
  }
  void run() {
    prim.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
};

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest even (Inf stays Inf)
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace
#endif

#ifdef LOOM_HAVE_ONEDNN
namespace {
// oneDNN reports what this CPU cannot run (bf16 below AVX-512) by throwing.
std::unique_ptr<Matmul> make_matmul(int64_t M, int64_t N, int64_t K, bool bf16) {
  try {
    return std::make_unique<Matmul>(M, N, K, bf16);
  } catch (const dnnl::error& e) {
    LOOM_FAIL(kUnsupported, "oneDNN cannot run a {} matmul of {} x {} x {} on this CPU ({}): {}",
              bf16 ? "bf16" : "f32", M, N, K, gemm_backend_isa(GemmBackend::kOneDnn), e.what());
  }
}
}  // namespace
#endif

double measure_matmul_gflops(int64_t M, int64_t N, int64_t K, bool bf16, int reps) {
#ifdef LOOM_HAVE_ONEDNN
  const std::unique_ptr<Matmul> owned = make_matmul(M, N, K, bf16);
  Matmul& mm = *owned;
  const size_t esize = bf16 ? 2 : 4;
  std::memset(mm.a.get_data_handle(), 0, static_cast<size_t>(M * K) * esize);
  std::memset(mm.b.get_data_handle(), 0, static_cast<size_t>(K * N) * esize);
  mm.run();
  std::vector<double> g;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    mm.run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g.push_back(2.0 * double(M) * double(N) * double(K) / s / 1e9);
  }
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
#else
  (void)M, (void)N, (void)K, (void)bf16, (void)reps;
  return 0;
#endif
}

void matmul_bf16(const float* A, const float* B, float* C, int64_t M, int64_t N, int64_t K) {
#ifdef LOOM_HAVE_ONEDNN
  const std::unique_ptr<Matmul> owned = make_matmul(M, N, K, true);
  Matmul& mm = *owned;
  auto* a = static_cast<uint16_t*>(mm.a.get_data_handle());
  auto* b = static_cast<uint16_t*>(mm.b.get_data_handle());
  for (int64_t i = 0; i < M * K; ++i) a[i] = to_bf16(A[i]);
  for (int64_t i = 0; i < K * N; ++i) b[i] = to_bf16(B[i]);
  mm.run();
  std::memcpy(C, mm.c.get_data_handle(), static_cast<size_t>(M * N) * sizeof(float));
#else
  (void)A, (void)B, (void)C, (void)M, (void)N, (void)K;
  LOOM_FAIL(kUnsupported, "bf16 matmul needs oneDNN, which this build lacks");
#endif
}

namespace {

// Element (i, j) of op(X), X row-major with leading dimension ld.
inline float at(const float* X, int64_t ld, bool trans, int64_t i, int64_t j) {
  return trans ? X[j * ld + i] : X[i * ld + j];
}
inline uint16_t at(const uint16_t* X, int64_t ld, bool trans, int64_t i, int64_t j) {
  return trans ? X[j * ld + i] : X[i * ld + j];
}
inline float widen(uint16_t x, DType t) {
  return t == DType::kBF16 ? bf16_to_f32(x) : f16_to_f32(x);
}

// op(X)'s rows [0, rows) and columns [c0, c1), rounded to t, into dst
// (rows x (c1 - c0), f32 values or 16-bit words).
void round_block(const float* X, int64_t ld, bool trans, int64_t rows, int64_t c0, int64_t c1,
                 DType t, float* dst) {
  const int64_t w = c1 - c0;
#pragma omp parallel for
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < w; ++j) {
      const float x = at(X, ld, trans, i, c0 + j);
      dst[i * w + j] = t == DType::kBF16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
    }
}

// The tiled path: K in tiles of kTile; each tile of op(A) (M x k) and op(B)
// (k x N) rounded into f32 scratch and multiplied by the backend's sgemm,
// accumulating into C.
void gemm_16_tiled(GemmBackend be, DType t, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
                   float alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                   float beta, float* C, int64_t ldc, const uint16_t* B16) {
  constexpr int64_t kTile = 256;
  if (K == 0) {
    gemm_f32(be, false, false, M, N, 0, alpha, A, 1, B, N, beta, C, ldc);
    return;
  }
  const int64_t kt = std::min(K, kTile);
  // Scratch written before it is read.
  Buffer a(static_cast<size_t>(M * kt) * sizeof(float), MemCategory::kWorkspace, false);
  Buffer b(static_cast<size_t>(kt * N) * sizeof(float), MemCategory::kWorkspace, false);
  for (int64_t k0 = 0; k0 < K; k0 += kTile) {
    const int64_t k1 = std::min(K, k0 + kTile), k = k1 - k0;
    round_block(A, lda, ta, M, k0, k1, t, a.as<float>());
    // op(B) rows [k0, k1) = op(B)^T's columns: read B^T's block transposed.
    float* bt = b.as<float>();
    // (16-bit B: the tile widened, exactly.)
#pragma omp parallel for
    for (int64_t r = 0; r < k; ++r)
      for (int64_t j = 0; j < N; ++j) {
        if (B16) {
          bt[r * N + j] = widen(at(B16, ldb, tb, k0 + r, j), t);
          continue;
        }
        const float x = at(B, ldb, tb, k0 + r, j);
        bt[r * N + j] = t == DType::kBF16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
      }
    gemm_f32(be, false, false, M, N, k, alpha, a.as<float>(), k, bt, N, k0 == 0 ? beta : 1.0f, C,
             ldc);
  }
}

#ifdef LOOM_HAVE_ONEDNN
// oneDNN matmul primitives (bf16 inputs for gemm_16, f32 for the forms
// gemm_f32 runs on it) by shape and scaling, made once per thread
// (the attention kernel multiplies blocks from every thread of its parallel
// region at once, and a primitive with its stream runs one call at a time).
struct OneDnnMatmul {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  dnnl::memory::desc a_md, b_md, c_md, bias_md;
  dnnl::memory::desc b_plain;  // packed_b: B16 as stored, which b_md's layout is made from
  dnnl::matmul prim;
  // The arguments, made once; a call points them at its operands.
  dnnl::memory a, b, c, bias;
  std::unordered_map<int, dnnl::memory> args;
  void run(const void* A, const void* B, float* C, const float* bias_row) {
    // oneDNN's handles are not const; A, B and the bias are only read.
    a.set_data_handle(const_cast<void*>(A));
    b.set_data_handle(const_cast<void*>(B));
    c.set_data_handle(C);
    if (bias_row) bias.set_data_handle(const_cast<float*>(bias_row));
    prim.execute(stream, args);
    stream.wait();
  }
};

// A thread's cache holds at most kCachedPrimitives shapes (a training step
// uses a few dozen: the layers' GEMMs and the attention's block products);
// past that the least recently used goes, so a run whose shapes keep
// changing (generation, varying sequence lengths) holds bounded memory.
constexpr size_t kCachedPrimitives = 64;

// One product's shape: op(A) is M x K and op(B) K x N, each a bf16 (or,
// with f32, an f32) matrix stored row-major with leading dimension lda /
// ldb, transposed (ta / tb) or not; C is f32 with ldc.
struct MatmulShape {
  int64_t M, N, K;
  bool ta, tb;
  int64_t lda, ldb, ldc;
  float alpha, beta;
  bool bias = false;      // a row of N f32 added to every row of the product
  bool packed_b = false;  // B in the layout oneDNN picks (reordered from B as stored)
  bool f32 = false;       // A and B in f32, not bf16 (gemm_f32's forms that run here)
  auto key() const {
    return std::tuple{M, N, K, ta, tb, lda, ldb, ldc, alpha, beta, bias, packed_b, f32};
  }
};

// oneDNN's description of op(X) (rows x cols) for X stored with ld, as the
// strides of the untransposed rows or of the transposed columns.
dnnl::memory::desc operand(int64_t rows, int64_t cols, bool trans, int64_t ld,
                           dnnl::memory::data_type type) {
  return dnnl::memory::desc({rows, cols}, type,
                            trans ? dnnl::memory::dims{1, ld} : dnnl::memory::dims{ld, 1});
}

OneDnnMatmul& onednn_matmul(const MatmulShape& s) {
  using Key = decltype(s.key());
  struct Entry {
    std::unique_ptr<OneDnnMatmul> m;
    uint64_t used = 0;
  };
  thread_local std::map<Key, Entry> cache;
  thread_local uint64_t clock = 0;
  Entry& e = cache[s.key()];
  e.used = ++clock;
  std::unique_ptr<OneDnnMatmul>& m = e.m;
  if (m) return *m;
  if (cache.size() > kCachedPrimitives) {
    auto oldest = cache.end();
    for (auto it = cache.begin(); it != cache.end(); ++it)
      if (it->second.m && (oldest == cache.end() || it->second.used < oldest->second.used))
        oldest = it;
    if (oldest != cache.end()) cache.erase(oldest);
  }
  const auto [M, N, K, ta, tb, lda, ldb, ldc, alpha, beta, bias, packed_b, f32] = s.key();
  using dt = dnnl::memory::data_type;
  const dt in = f32 ? dt::f32 : dt::bf16;
  auto made = std::make_unique<OneDnnMatmul>();
  made->a_md = operand(M, K, ta, lda, in);
  made->b_plain = operand(K, N, tb, ldb, in);
  made->b_md =
      packed_b ? dnnl::memory::desc({K, N}, in, dnnl::memory::format_tag::any) : made->b_plain;
  made->c_md = dnnl::memory::desc({M, N}, dt::f32, dnnl::memory::dims{ldc, 1});
  if (bias) made->bias_md = dnnl::memory::desc({1, N}, dt::f32, dnnl::memory::dims{N, 1});
  dnnl::primitive_attr attr;
  if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
  if (beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(beta);
    attr.set_post_ops(ops);
  }
  try {
    const dnnl::matmul::primitive_desc pd(
        bias ? dnnl::matmul::desc(made->a_md, made->b_md, made->bias_md, made->c_md)
             : dnnl::matmul::desc(made->a_md, made->b_md, made->c_md),
        attr, made->engine);
    made->b_md = pd.weights_desc();
    made->prim = dnnl::matmul(pd);
    made->a = dnnl::memory(made->a_md, made->engine, nullptr);
    made->b = dnnl::memory(made->b_md, made->engine, nullptr);
    made->c = dnnl::memory(made->c_md, made->engine, nullptr);
    made->args = {{DNNL_ARG_SRC, made->a}, {DNNL_ARG_WEIGHTS, made->b}, {DNNL_ARG_DST, made->c}};
    if (bias) {
      made->bias = dnnl::memory(made->bias_md, made->engine, nullptr);
      made->args.emplace(DNNL_ARG_BIAS, made->bias);
    }
  } catch (const dnnl::error& e) {
    LOOM_FAIL(kUnsupported, "oneDNN cannot run a{} matmul of {} x {} x {} on this CPU ({}): {}",
              f32 ? "n f32" : " bf16", M, N, K, gemm_backend_isa(GemmBackend::kOneDnn), e.what());
  }
  m = std::move(made);
  return *m;
}

// Whether oneDNN runs a bf16 matmul on this CPU (it refuses below AVX-512):
// tried once per process.
bool bf16_matmul_runs() {
  static const bool runs = [] {
    try {
      onednn_matmul(MatmulShape{2, 2, 2, false, false, 2, 2, 2, 1.0f, 0.0f});
      return true;
    } catch (const Error&) {
      return false;
    }
  }();
  return runs;
}

// A thread's bf16 copies of gemm_16's f32 operands (slot 0: A, 1: B, 2: an
// operand shared by several products, round_shared_operand), grown
// to the largest product it has met and kept: fresh pages for every product
// cost more than the rounding itself.
uint16_t* bf16_scratch(int slot, int64_t n) {
  thread_local Buffer scratch[3];
  const size_t bytes = static_cast<size_t>(n) * 2;
  if (scratch[slot].bytes() < bytes) {
    scratch[slot] = Buffer();
    scratch[slot] = Buffer(bytes, MemCategory::kWorkspace, false);
  }
  return scratch[slot].as<uint16_t>();
}

// B16 (described by `plain`) in the layout `packed` at dst: one reorder.
void reorder_weight(OneDnnMatmul& mm, const uint16_t* B16, void* dst) {
  // oneDNN's handle is not const; the source is only read.
  dnnl::memory src(mm.b_plain, mm.engine, const_cast<uint16_t*>(B16));
  dnnl::memory out(mm.b_md, mm.engine, dst);
  dnnl::reorder(src, out).execute(mm.stream, src, out);
  mm.stream.wait();
}

// gemm_16's blocked weights, by the 16-bit matrix they are made from and
// its stored shape; an entry serves a product while it is fresh (made since
// the owner last cleared) and in the layout the product's primitive wants.
class Bf16WeightPacks final : public WeightPacks {
 public:
  void clear() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, e] : packs_) e.fresh = false;
  }
  size_t bytes() const override {
    std::lock_guard<std::mutex> lock(mu_);
    size_t n = 0;
    for (const auto& [key, e] : packs_) n += e.buf.bytes();
    return n;
  }
  const void* get(OneDnnMatmul& mm, const MatmulShape& s, const uint16_t* B16) {
    std::lock_guard<std::mutex> lock(mu_);
    Entry& e = packs_[std::tuple{B16, s.K, s.N, s.tb, s.ldb}];
    if (e.fresh && e.md == mm.b_md) return e.buf.data();
    const size_t bytes = mm.b_md.get_size();
    if (e.buf.bytes() < bytes) {
      e.buf = Buffer();
      e.buf = Buffer(bytes, MemCategory::kParams, false);  // all written next
    }
    reorder_weight(mm, B16, e.buf.data());
    e.md = mm.b_md;
    e.fresh = true;
    return e.buf.data();
  }

 private:
  struct Entry {
    dnnl::memory::desc md;
    Buffer buf;
    bool fresh = false;
  };
  mutable std::mutex mu_;
  std::map<std::tuple<const uint16_t*, int64_t, int64_t, bool, int64_t>, Entry> packs_;
};

// X (rows x cols, leading dimension ld) rounded to bf16 into dense out
// (leading dimension cols), in X's own layout: a transposed operand is
// described to oneDNN by its strides, never transposed here.
void round_rows_bf16(const float* X, int64_t ld, int64_t rows, int64_t cols, uint16_t* out) {
  if (ld == cols) {
    round_to_16(X, out, rows * cols, DType::kBF16);
    return;
  }
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 15))
  for (int64_t r = 0; r < rows; ++r)
    round_to_16_serial(X + r * ld, out + r * cols, cols, DType::kBF16);
}
#endif

}  // namespace

bool gemm_16_uses_bf16_matmul(DType t) {
#ifdef LOOM_HAVE_ONEDNN
  return t == DType::kBF16 && bf16_matmul_runs();
#else
  (void)t;
  return false;
#endif
}

Bf16MatmulFacts bf16_matmul_facts() {
  Bf16MatmulFacts f;
  f.isa = gemm_backend_isa(GemmBackend::kOneDnn);
  f.onednn = gemm_backend_available(GemmBackend::kOneDnn);
  f.runs = gemm_16_uses_bf16_matmul(DType::kBF16);
#ifdef LOOM_HAVE_ONEDNN
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  f.amx = f.runs && isa == dnnl_cpu_isa_avx512_core_amx;
  f.native = f.amx || (f.runs && isa == dnnl_cpu_isa_avx512_core_bf16);
#endif
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  f.amd = __builtin_cpu_is("amd");
#endif
  return f;
}

bool bf16_matmul_pays(const Bf16MatmulFacts& f, std::string* why) {
  auto say = [&](bool pays, std::string w) {
    if (why) *why = std::move(w);
    return pays;
  };
  if (!f.onednn) return say(false, "this build has no oneDNN (so no bf16 matmul)");
  if (!f.runs) return say(false, format("ISA {} has no bf16 matmul", f.isa));
  if (f.amx) return say(true, format("oneDNN's bf16 matmul on AMX tiles (ISA {})", f.isa));
  if (f.amd && f.native)
    return say(true, format("oneDNN's bf16 matmul on an AMD CPU's AVX512-BF16 (ISA {}), about 2x "
                            "its sgemm",
                            f.isa));
  if (!f.native)
    return say(false, format("ISA {} emulates the bf16 instructions, where rounding the operands "
                             "costs more than its bf16 GEMMs gain",
                             f.isa));
  return say(false, format("ISA {} without AMX and not an AMD CPU, where rounding the operands "
                           "costs more than its bf16 GEMMs gain (docs/precision.md#16-bit-gemms)",
                           f.isa));
}

bool bf16_matmul_pays_here() {
  return bf16_matmul_pays(bf16_matmul_facts());
}

std::unique_ptr<WeightPacks> make_weight_packs() {
#ifdef LOOM_HAVE_ONEDNN
  if (gemm_16_uses_bf16_matmul(DType::kBF16)) return std::make_unique<Bf16WeightPacks>();
#endif
  return nullptr;
}

const char* gemm_16_path(DType t) {
  return gemm_16_uses_bf16_matmul(t) ? "oneDNN's bf16 matmul"
                                     : "K-tiles rounded, then the backend's sgemm";
}

const uint16_t* round_shared_operand(const float* X, int64_t n) {
#ifdef LOOM_HAVE_ONEDNN
  uint16_t* out = bf16_scratch(2, n);
  round_to_16(X, out, n, DType::kBF16);
  return out;
#else
  (void)X, (void)n;
  LOOM_FAIL(kUnsupported, "round_shared_operand: this build has no bf16 matmul");
#endif
}

bool f32_matmul_form(bool ta, bool tb, int64_t M, int64_t N, int64_t K) {
#ifdef LOOM_HAVE_ONEDNN
  // Below 64 in any dimension (PowerSGD's rank-r factors, small blocks) the
  // sgemm keeps them: no primitive to make per shape.
  return std::min({M, N, K}) >= 64 && ta != tb && (tb ? N <= K : M > N);
#else
  (void)ta, (void)tb, (void)M, (void)N, (void)K;
  return false;
#endif
}

void matmul_f32(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
                int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
#ifdef LOOM_HAVE_ONEDNN
  if (M == 0 || N == 0) return;
  LOOM_CHECK(K > 0, "matmul_f32: a product over nothing ({} x {} x 0)", M, N);
  MatmulShape shape{M, N, K, ta, tb, lda, ldb, ldc, alpha, beta};
  shape.f32 = true;
  onednn_matmul(shape).run(A, B, C, nullptr);
#else
  (void)ta, (void)tb, (void)M, (void)N, (void)K, (void)alpha, (void)A, (void)lda, (void)B,
      (void)ldb, (void)beta, (void)C, (void)ldc;
  LOOM_FAIL(kUnsupported, "matmul_f32: this build has no oneDNN");
#endif
}

void gemm_16(GemmBackend be, DType t, bool ta, bool tb, int64_t M, int64_t N, int64_t K,
             float alpha, const float* A, int64_t lda, const float* B, int64_t ldb, float beta,
             float* C, int64_t ldc, const uint16_t* B16, const uint16_t* A16, const float* bias,
             WeightPacks* packs) {
  LOOM_CHECK(t == DType::kBF16 || t == DType::kF16, "gemm_16 asked for {}", dtype_name(t));
  if (M == 0 || N == 0) return;
  LOOM_CHECK(bias == nullptr || alpha == 1.0f, "gemm_16: a bias needs alpha 1 (alpha is {})",
             alpha);
  const GemmCounted counted({be, t, ta, tb, M, N, K, lda, ldb, ldc, beta != 0.0f, A16 != nullptr,
                             B16 != nullptr, bias != nullptr, B16 != nullptr && packs != nullptr});
#ifdef LOOM_HAVE_ONEDNN
  if (t == DType::kBF16 && K > 0 && bf16_matmul_runs()) {
    // A (and B when it is f32) rounded to bf16 in its stored layout; a
    // 16-bit B is read where it is. oneDNN reads the transposed ones by
    // their strides.
    const uint16_t* a16 = A16;
    int64_t a_ld = lda;
    if (!A16) {
      const int64_t a_rows = ta ? K : M, a_cols = ta ? M : K;
      uint16_t* rounded = bf16_scratch(0, M * K);
      round_rows_bf16(A, lda, a_rows, a_cols, rounded);
      a16 = rounded, a_ld = a_cols;
    }
    const uint16_t* b16 = B16;
    int64_t b_ld = ldb;
    if (!B16) {
      const int64_t b_rows = tb ? N : K, b_cols = tb ? K : N;
      uint16_t* rounded = bf16_scratch(1, K * N);
      round_rows_bf16(B, ldb, b_rows, b_cols, rounded);
      b16 = rounded, b_ld = b_cols;
    }
    // A 16-bit weight with somewhere to keep its layout is multiplied in
    // oneDNN's blocked layout, reordered once per update: the matmul then
    // skips its own copies of plain weights, and the products are the same.
    const bool has_bias = bias != nullptr, packed = B16 != nullptr && packs != nullptr;
    const MatmulShape shape{M, N, K, ta, tb, a_ld, b_ld, ldc, alpha, beta, has_bias, packed};
    OneDnnMatmul& mm = onednn_matmul(shape);
    const void* b_data = b16;
    if (shape.packed_b) {
      auto* kept = dynamic_cast<Bf16WeightPacks*>(packs);
      LOOM_CHECK(kept != nullptr, "gemm_16: weight packs made by another backend");
      b_data = kept->get(mm, shape, B16);
    }
    mm.run(a16, b_data, C, bias);
    return;
  }
#endif
  LOOM_CHECK(A16 == nullptr && bias == nullptr,
             "gemm_16: a 16-bit A or a bias needs the bf16 matmul");
  gemm_16_tiled(be, t, ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, B16);
}

double measure_gemm_gflops(GemmBackend b, DType t, int n, int reps) {
  const size_t bytes = static_cast<size_t>(n) * n * sizeof(float);
  Buffer A(bytes, MemCategory::kWorkspace), B(bytes, MemCategory::kWorkspace),
      C(bytes, MemCategory::kWorkspace);
  for (int64_t i = 0; i < int64_t{n} * n; ++i) {
    A.as<float>()[i] = static_cast<float>(i % 17) * 0.01f;
    B.as<float>()[i] = static_cast<float>(i % 13) * 0.02f;
  }
  auto run = [&] {
    if (t == DType::kF32)
      gemm_f32(b, false, false, n, n, n, 1.0f, A.as<float>(), n, B.as<float>(), n, 0.0f,
               C.as<float>(), n);
    else
      gemm_16(b, t, false, false, n, n, n, 1.0f, A.as<float>(), n, B.as<float>(), n, 0.0f,
              C.as<float>(), n);
  };
  run();
  std::vector<double> g;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    g.push_back(2.0 * double(n) * n * n / s / 1e9);
  }
  std::sort(g.begin(), g.end());
  return g[g.size() / 2];
}

}  // namespace loom::cpu
