// The CPU kernels of a beam-search step (§3.2, §6.1) as XLA FFI custom calls, built and registered by
// transformer_jax/cpu/kernels.py, whose functions document the arguments, and reaching a search only through
// transformer_jax/cpu/backend.py. Why they exist: on XLA:CPU a step spends most of its time copying the bf16
// self-attention cache through float32 (the beam reorder's gather, the write of the step's position, the
// one-query products) and passing five times over the logits (docs/performance.md has the figures).
//
// DecodingAttention (kernels.decoding_self_attention): masked self-attention over a cache beam search never
// copies. query [rows, num_heads, d_k]; key_cache [rows, kv_heads, max_len, d_k]; value_cache [rows, kv_heads,
// max_len, d_v]; ancestry int32 [rows, max_len]: row r's key and value at position j are in row
// r + ancestry[r, j] of the caches (beam search reorders this small array instead of the caches); new_key
// [rows, kv_heads, d_k] and new_value [rows, kv_heads, d_v], written at position `index` of row r (ancestry 0
// there). Query head i reads key/value head i / (num_heads / kv_heads). Returns the output [rows, num_heads,
// d_v] and the three caches, updated in place (aliased with the inputs).
//
// CrossAttention (kernels.cross_attention): the encoder-decoder attention of a step, the beams of a
// sentence reading its memory row at its valid (unpadded) positions.
//
// BeamScores (kernels.beam_scores, decoding.extension_scores in one pass over the vocabulary): per row of
// logits [rows, vocab], the log-sum-exp over the tokens other than PAD and BOS, the k largest logits of the
// tokens other than PAD, BOS and EOS (ties to the lowest token id, as lax.top_k) with their ids, and the EOS
// logit.
//
// Numerics of the attention kernels follow attention.decoding_attention: the query divided by sqrt(d_k) in its
// dtype, scores and softmax in float32, the weights rounded to the value dtype, products accumulated in float32
// and the output rounded to the value dtype.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

inline float ToFloat(uint16_t bf16) {
  uint32_t bits = uint32_t(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float ToFloat(float f) { return f; }

// Float to bfloat16, round to nearest even (as XLA's convert); NaN stays NaN.
inline void FromFloat(float f, uint16_t* bf16) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *bf16 = uint16_t((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *bf16 = uint16_t(bits >> 16);
}
inline void FromFloat(float f, float* out) { *out = f; }

template <typename T>
inline float RoundTo(float f) {
  T rounded;
  FromFloat(f, &rounded);
  return ToFloat(rounded);
}

struct Shape {
  int64_t rows, num_heads, kv_heads, max_len, d_k, d_v;
};

// exp(x) for x <= 0 to about 2 ulp, written so that the compiler vectorises the loops that call it: e^x =
// 2^n e^r, |r| <= ln(2)/2, e^r by its degree-6 Taylor polynomial.
inline float ExpNonPositive(float x) {
  x = x >= -87.0f ? x : -87.0f;  // NaN too.
  // n = x log2(e) rounded to the nearest integer: x <= 0, so truncating toward zero after subtracting 1/2
  // rounds to nearest (a vector conversion; std::nearbyint does not vectorise, and the add-and-subtract
  // 1.5 * 2^23 trick is folded away by -fassociative-math).
  const float n = float(int32_t(x * 1.44269504088896341f - 0.5f));
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187045e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += uint32_t(int32_t(n)) << 23;  // Unsigned: a left shift of a negative int is undefined.
  std::memcpy(&p, &bits, sizeof(p));
  return p;
}

// Eq. 1 for one query row and one head over n positions (keys[j], values[j]): out = softmax(q K^T / sqrt(d_k)) V.
// kD > 0 fixes d_k = d_v at compile time (the common 64), so that the compiler unrolls the per-position loops
// into vector registers. scratch holds d_k + n + d_v floats.
template <typename T, int64_t kD>
void Attend(const T* query_row, const T* const* keys, const T* const* values, int64_t n, int64_t d_k_arg,
            int64_t d_v_arg, float* scratch, T* out) {
  const int64_t d_k = kD ? kD : d_k_arg, d_v = kD ? kD : d_v_arg;
  float* q = scratch;
  float* scores = q + d_k;
  float* acc = scores + n;
  const float sqrt_d_k = RoundTo<T>(std::sqrt(float(d_k)));  // In T, as decoding_attention divides.
  for (int64_t i = 0; i < d_k; ++i) q[i] = RoundTo<T>(ToFloat(query_row[i]) / sqrt_d_k);
  float max_score = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const T* k = keys[j];
    float score = 0.0f;
    for (int64_t i = 0; i < d_k; ++i) score += q[i] * ToFloat(k[i]);
    scores[j] = score;
    max_score = score > max_score ? score : max_score;
  }
  float total = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    scores[j] = std::exp(scores[j] - max_score);
    total += scores[j];
  }
  const float inv_total = 1.0f / total;
  for (int64_t i = 0; i < d_v; ++i) acc[i] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float weight = RoundTo<T>(scores[j] * inv_total);  // Weights in the value dtype.
    const T* v = values[j];
    for (int64_t i = 0; i < d_v; ++i) acc[i] += weight * ToFloat(v[i]);
  }
  for (int64_t i = 0; i < d_v; ++i) FromFloat(acc[i], out + i);  // n == 0: zeros, as a fully masked row.
}

template <typename T>
using AttendFn = void (*)(const T*, const T* const*, const T* const*, int64_t, int64_t, int64_t, float*, T*);

template <typename T>
AttendFn<T> AttendFor(int64_t d_k, int64_t d_v) {
  return d_k == 64 && d_v == 64 ? Attend<T, 64> : Attend<T, 0>;
}

// The self-attention step of every row.
template <typename T>
void Rows(const Shape& s, const T* query, T* key_cache, T* value_cache, int32_t* ancestry, const T* new_key,
          const T* new_value, int64_t index, T* output) {
  const int64_t groups = s.num_heads / s.kv_heads;
  const AttendFn<T> attend = AttendFor<T>(s.d_k, s.d_v);
  std::vector<float> scratch(s.d_k + index + 1 + s.d_v);
  std::vector<const T*> keys(index + 1), values(index + 1);
  for (int64_t r = 0; r < s.rows; ++r) {
    ancestry[r * s.max_len + index] = 0;
    for (int64_t h = 0; h < s.kv_heads; ++h) {
      const int64_t key_head = (r * s.kv_heads + h) * s.max_len * s.d_k;
      const int64_t value_head = (r * s.kv_heads + h) * s.max_len * s.d_v;
      std::memcpy(key_cache + key_head + index * s.d_k, new_key + (r * s.kv_heads + h) * s.d_k,
                  s.d_k * sizeof(T));
      std::memcpy(value_cache + value_head + index * s.d_v, new_value + (r * s.kv_heads + h) * s.d_v,
                  s.d_v * sizeof(T));
      for (int64_t j = 0; j <= index; ++j) {  // Position j of this hypothesis, in the row that wrote it.
        const int64_t row_offset = int64_t(ancestry[r * s.max_len + j]) * s.kv_heads;
        keys[j] = key_cache + key_head + row_offset * s.max_len * s.d_k + j * s.d_k;
        values[j] = value_cache + value_head + row_offset * s.max_len * s.d_v + j * s.d_v;
      }
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t head = h * groups + g;
        attend(query + (r * s.num_heads + head) * s.d_k, keys.data(), values.data(), index + 1, s.d_k, s.d_v,
               scratch.data(), output + (r * s.num_heads + head) * s.d_v);
      }
    }
  }
}

template <ffi::DataType dtype>
ffi::Error Step(ffi::Buffer<dtype> query, ffi::Buffer<dtype> key_cache, ffi::Buffer<dtype> value_cache,
                ffi::Buffer<ffi::S32> ancestry, ffi::Buffer<dtype> new_key, ffi::Buffer<dtype> new_value,
                ffi::Buffer<ffi::S32> index, ffi::ResultBuffer<dtype> output,
                ffi::ResultBuffer<dtype> key_out, ffi::ResultBuffer<dtype> value_out,
                ffi::ResultBuffer<ffi::S32> ancestry_out) {
  using T = ffi::NativeType<dtype>;
  const auto q = query.dimensions(), k = key_cache.dimensions(), v = value_cache.dimensions();
  if (q.size() != 3 || k.size() != 4 || v.size() != 4 || ancestry.dimensions().size() != 2 ||
      new_key.dimensions().size() != 3 || new_value.dimensions().size() != 3 || index.element_count() != 1) {
    return ffi::Error::InvalidArgument("decoding_attention: wrong ranks (see transformer_jax/cpu/kernels.py)");
  }
  const Shape s{q[0], q[1], k[1], k[2], q[2], v[3]};
  if (k[0] != s.rows || v[0] != s.rows || v[1] != s.kv_heads || v[2] != s.max_len || k[3] != s.d_k ||
      s.kv_heads == 0 || s.num_heads % s.kv_heads != 0 || ancestry.dimensions()[0] != s.rows ||
      ancestry.dimensions()[1] != s.max_len || new_key.dimensions()[0] != s.rows ||
      new_key.dimensions()[1] != s.kv_heads || new_key.dimensions()[2] != s.d_k ||
      new_value.dimensions()[0] != s.rows || new_value.dimensions()[1] != s.kv_heads ||
      new_value.dimensions()[2] != s.d_v) {
    return ffi::Error::InvalidArgument("decoding_attention: shapes do not fit (see transformer_jax/cpu/kernels.py)");
  }
  if (key_out->untyped_data() != key_cache.untyped_data() ||
      value_out->untyped_data() != value_cache.untyped_data() ||
      ancestry_out->untyped_data() != ancestry.untyped_data()) {
    return ffi::Error::InvalidArgument("decoding_attention: the caches must be aliased with the outputs");
  }
  const int64_t at = index.typed_data()[0];
  if (at < 0 || at >= s.max_len) {
    return ffi::Error::InvalidArgument("decoding_attention: cache index " + std::to_string(at) +
                                       " outside the cache's " + std::to_string(s.max_len) + " positions");
  }
  const int32_t* anc = ancestry.typed_data();
  for (int64_t r = 0; r < s.rows; ++r) {  // Never read outside the caches.
    for (int64_t j = 0; j < at; ++j) {
      const int64_t source = r + anc[r * s.max_len + j];
      if (source < 0 || source >= s.rows) {
        return ffi::Error::InvalidArgument("decoding_attention: ancestry points outside the cache's rows");
      }
    }
  }
  Rows<T>(s, query.typed_data(), key_out->typed_data(), value_out->typed_data(), ancestry_out->typed_data(),
          new_key.typed_data(), new_value.typed_data(), at, output->typed_data());
  return ffi::Error::Success();
}

// Encoder-decoder attention of a decoding step: query [rows, num_heads, d_k] against the memory's keys [batch,
// kv_heads, src_len, d_k] and values [batch, kv_heads, src_len, d_v], row r reading sentence r / (rows / batch)
// (its beams) at the positions where valid [batch, src_len] is true.
template <ffi::DataType dtype>
ffi::Error CrossAttention(ffi::Buffer<dtype> query, ffi::Buffer<dtype> key, ffi::Buffer<dtype> value,
                          ffi::Buffer<ffi::PRED> valid, ffi::ResultBuffer<dtype> output) {
  using T = ffi::NativeType<dtype>;
  const auto q = query.dimensions(), k = key.dimensions(), v = value.dimensions(), m = valid.dimensions();
  if (q.size() != 3 || k.size() != 4 || v.size() != 4 || m.size() != 2) {
    return ffi::Error::InvalidArgument("cross_attention: wrong ranks (see transformer_jax/cpu/kernels.py)");
  }
  const int64_t rows = q[0], num_heads = q[1], d_k = q[2], batch = k[0], kv_heads = k[1], src_len = k[2];
  const int64_t d_v = v[3];
  if (batch == 0 || rows % batch != 0 || kv_heads == 0 || num_heads % kv_heads != 0 || k[3] != d_k ||
      v[0] != batch || v[1] != kv_heads || v[2] != src_len || m[0] != batch || m[1] != src_len) {
    return ffi::Error::InvalidArgument("cross_attention: shapes do not fit (see transformer_jax/cpu/kernels.py)");
  }
  const int64_t beams = rows / batch, groups = num_heads / kv_heads;
  const AttendFn<T> attend = AttendFor<T>(d_k, d_v);
  const T* keys_in = key.typed_data();
  const T* values_in = value.typed_data();
  const bool* is_valid = valid.typed_data();
  std::vector<float> scratch(d_k + src_len + d_v);
  std::vector<const T*> keys(src_len), values(src_len);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      int64_t n = 0;  // Masked positions have weight 0: leaving them out is the same sum.
      for (int64_t j = 0; j < src_len; ++j) {
        if (!is_valid[b * src_len + j]) continue;
        keys[n] = keys_in + ((b * kv_heads + h) * src_len + j) * d_k;
        values[n++] = values_in + ((b * kv_heads + h) * src_len + j) * d_v;
      }
      for (int64_t r = b * beams; r < (b + 1) * beams; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t head = h * groups + g;
          attend(query.typed_data() + (r * num_heads + head) * d_k, keys.data(), values.data(), n, d_k, d_v,
                 scratch.data(), output->typed_data() + (r * num_heads + head) * d_v);
        }
      }
    }
  }
  return ffi::Error::Success();
}

typedef float Floats16 __attribute__((vector_size(64)));  // GCC/Clang vector extension.

template <ffi::DataType dtype>
ffi::Error BeamScores(ffi::Buffer<dtype> logits, int64_t k, int64_t eos_id, int64_t bos_id, int64_t pad_id,
                      ffi::ResultBuffer<ffi::F32> lse, ffi::ResultBuffer<ffi::F32> top_logits,
                      ffi::ResultBuffer<ffi::S32> top_tokens, ffi::ResultBuffer<ffi::F32> eos_logit) {
  const auto dims = logits.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("beam_scores: logits must be [rows, vocab]");
  const int64_t rows = dims[0], vocab = dims[1];
  if (k < 1 || k > vocab) return ffi::Error::InvalidArgument("beam_scores: k must be in [1, vocab]");
  for (int64_t id : {eos_id, bos_id, pad_id}) {
    if (id < 0 || id >= vocab) {
      return ffi::Error::InvalidArgument("beam_scores: a special id is outside the vocabulary");
    }
  }
  const auto* in = logits.typed_data();
  constexpr int64_t kBlock = 64;
  const int64_t blocks = (vocab + kBlock - 1) / kBlock;
  std::vector<float> row(blocks * kBlock, -INFINITY), block_max(blocks);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t i = 0; i < vocab; ++i) row[i] = ToFloat(in[r * vocab + i]);
    row[pad_id] = row[bos_id] = -INFINITY;
    const float eos = row[eos_id];
    row[eos_id] = -INFINITY;
    for (int64_t b = 0; b < blocks; ++b) {  // 16 lanes at once (a chain of scalar maxima is 4x slower).
      Floats16 lanes, v;
      std::memcpy(&lanes, &row[b * kBlock], sizeof(lanes));
      for (int64_t i = 16; i < kBlock; i += 16) {
        std::memcpy(&v, &row[b * kBlock + i], sizeof(v));
        lanes = v > lanes ? v : lanes;
      }
      float m = lanes[0];
      for (int64_t j = 1; j < 16; ++j) m = lanes[j] > m ? lanes[j] : m;
      block_max[b] = m;
    }
    // The k best, best first; a later token never displaces an equal one (lowest id first among ties, as
    // lax.top_k). Only blocks whose maximum beats the k-th best so far are scanned.
    float* best = top_logits->typed_data() + r * k;
    int32_t* best_id = top_tokens->typed_data() + r * k;
    int64_t filled = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      if (filled == k && !(block_max[b] > best[k - 1])) continue;
      for (int64_t i = b * kBlock; i < std::min(vocab, (b + 1) * kBlock); ++i) {
        const float v = row[i];
        if (filled == k && !(v > best[k - 1])) continue;
        int64_t at = filled < k ? filled++ : k - 1;
        while (at > 0 && v > best[at - 1]) {
          best[at] = best[at - 1];
          best_id[at] = best_id[at - 1];
          --at;
        }
        best[at] = v;
        best_id[at] = int32_t(i);
      }
    }
    row[eos_id] = eos;
    float max_logit = eos;
    for (int64_t b = 0; b < blocks; ++b) max_logit = block_max[b] > max_logit ? block_max[b] : max_logit;
    float total = 0.0f;
    if (max_logit > -INFINITY) {
      for (int64_t i = 0; i < blocks * kBlock; ++i) total += ExpNonPositive(row[i] - max_logit);
    }
    lse->typed_data()[r] = std::isinf(max_logit) ? max_logit : max_logit + std::log(total);
    eos_logit->typed_data()[r] = eos;
  }
  return ffi::Error::Success();
}

}  // namespace

#define TRANSFORMER_JAX_BEAM_SCORES(name, dtype)                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, BeamScores<dtype>,            \
                                ffi::Ffi::Bind()                    \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Attr<int64_t>("k")             \
                                    .Attr<int64_t>("eos_id")        \
                                    .Attr<int64_t>("bos_id")        \
                                    .Attr<int64_t>("pad_id")        \
                                    .Ret<ffi::Buffer<ffi::F32>>()   \
                                    .Ret<ffi::Buffer<ffi::F32>>()   \
                                    .Ret<ffi::Buffer<ffi::S32>>()   \
                                    .Ret<ffi::Buffer<ffi::F32>>());

#define TRANSFORMER_JAX_CROSS_ATTENTION(name, dtype)                \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, CrossAttention<dtype>,        \
                                ffi::Ffi::Bind()                    \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<ffi::PRED>>()  \
                                    .Ret<ffi::Buffer<dtype>>());

TRANSFORMER_JAX_CROSS_ATTENTION(CrossAttentionF32, ffi::F32)
TRANSFORMER_JAX_CROSS_ATTENTION(CrossAttentionBF16, ffi::BF16)

TRANSFORMER_JAX_BEAM_SCORES(BeamScoresF32, ffi::F32)
TRANSFORMER_JAX_BEAM_SCORES(BeamScoresBF16, ffi::BF16)

#define TRANSFORMER_JAX_DECODING_ATTENTION(name, dtype)   \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, Step<dtype>,         \
                                ffi::Ffi::Bind()           \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<dtype>>()      \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Ret<ffi::Buffer<dtype>>()      \
                                    .Ret<ffi::Buffer<dtype>>()      \
                                    .Ret<ffi::Buffer<dtype>>()      \
                                    .Ret<ffi::Buffer<ffi::S32>>());

TRANSFORMER_JAX_DECODING_ATTENTION(DecodingAttentionBF16, ffi::BF16)
TRANSFORMER_JAX_DECODING_ATTENTION(DecodingAttentionF32, ffi::F32)
