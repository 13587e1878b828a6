// Causal multi-head self-attention, computed in query x key blocks with an
// online softmax: forward keeps only the output and one log-sum-exp per
// (batch, head, query), so activation memory is linear in T; backward
// recomputes the probabilities block by block.
#pragma once

#include <cstdint>

#include "loom/kernels/cpu/gemm_backend.h"
#include "loom/kernels/types.h"

namespace loom::cpu {

// qkv (B, T, 3C) holds q, k, v side by side, each (NH heads x hs), hs = C / NH.
// out (B, T, C); lse (B, NH, T) = log sum_j exp(q.k_j / sqrt(hs)). With
// qkv16 (T = float), q|k|v rounded to bf16 there too, laid out as qkv
// (Backend::attention_forward_16).
template <typename T>
void attention_forward(const GemmConfig& g, T* out, T* lse, const T* qkv, int64_t B, int64_t Tn,
                       int64_t C, int64_t NH, const DropoutSpec& dropout,
                       uint16_t* qkv16 = nullptr);

// Writes dqkv (B, T, 3C) from dout (B, T, C), given forward's inputs and
// outputs; with qkv16 (T = float), from q|k|v's bf16 values there, qkv
// unread (Backend::attention_backward_16).
template <typename T>
void attention_backward(const GemmConfig& g, T* dqkv, const T* dout, const T* qkv, const T* out,
                        const T* lse, int64_t B, int64_t Tn, int64_t C, int64_t NH,
                        const DropoutSpec& dropout, const uint16_t* qkv16 = nullptr);

// Context parallelism's chunk pair (Backend::attention_chunk_forward):
// merges the attention of a.Tq queries over a.Tk keys into out and lse.
template <typename T>
void attention_chunk_forward(const GemmConfig& g, T* out, T* lse, const T* q, const T* kv,
                             const AttentionChunk& a, const DropoutSpec& dropout);

// Accumulates dq and dkv of one chunk pair given the final out and lse.
template <typename T>
void attention_chunk_backward(const GemmConfig& g, T* dq, T* dkv, const T* dout, const T* q,
                              const T* kv, const T* out, const T* lse, const AttentionChunk& a,
                              const DropoutSpec& dropout);

}  // namespace loom::cpu
