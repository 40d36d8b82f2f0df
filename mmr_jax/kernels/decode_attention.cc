// One decode step's attention for the embedded sampler on CPU, as an XLA FFI custom call.
// Python side, build and the reference it must equal: mmr_jax/kernels/decode_attention.py.
//
// Row r = b * n + i (sample i of prompt b) has one query token with H = K * G heads. Its heads
// k * G .. k * G + G - 1 attend, under one softmax, to prompt b's shared cache (keys
// [B, K, D, P], values [B, K, P, D], slots where prompt_mask [B, P] holds) and to the row's own
// cache (keys [R, K, D, S], values [R, K, S, D]), of which only the first own_len slots count.
//
// Why a kernel: XLA needs static shapes, so decoder._attend_shared_prompt reads all P prompt
// slots and all S own slots every step and masks most of them (left padding; own slots not yet
// written). This reads the prompt slots from the first to the last unmasked one and the first
// own_len own slots only: SmolLM2, 8 prompts x 4 samples, 30 layers, about half the time.
//
// Work splits into R * K tasks (one kv head of one row: G query vectors) shared by the calling
// thread and the XLA intra-op pool. Keys and values are read in address order (the hardware
// prefetcher streams them); the G score and output rows stay in L1. Vectors are 16 floats (GCC
// vector extensions: one AVX-512 register, two AVX2 ones).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float V16 __attribute__((vector_size(64)));
typedef float V16U __attribute__((vector_size(64), aligned(4)));

inline V16 Load(const float* p) { return *reinterpret_cast<const V16U*>(p); }
inline void Store(float* p, V16 v) { *reinterpret_cast<V16U*>(p) = v; }
inline V16 Splat(float x) { return V16{} + x; }

constexpr float kMasked = -1e30f;  // as decoder._MASK_VALUE: exp underflows to exactly 0
constexpr int kMaxBlock = 8;       // query vectors per register block

// exp(x) for x <= 0 (softmax arguments), written so the loop that calls it vectorises (a libm
// call per element would cost more than the rest of the attention). Cephes' expf polynomial on
// [-ln2/2, ln2/2], about 1 ulp; x below -87 (masked slots) gives 0.
inline float ExpNonPositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += static_cast<int32_t>(n) << 23;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return x < -87.0f ? 0.0f : out;
}

// scores[m, x] = sum_d q[m, d] * keys[d, x] for m < MB, x < cols; keys rows are ldk apart.
// Keys are read row after row (one pass, in address order, so the prefetcher streams them);
// the MB score rows stay in L1.
template <int MB>
void Scores(const float* q, int64_t d, const float* keys, int64_t ldk, int64_t cols,
            float* scores, int64_t lds) {
  for (int m = 0; m < MB; ++m) std::fill(scores + m * lds, scores + m * lds + cols, 0.0f);
  for (int64_t dd = 0; dd < d; ++dd) {
    const float* k = keys + dd * ldk;
    float qd[MB];
    for (int m = 0; m < MB; ++m) qd[m] = q[m * d + dd];
    int64_t x = 0;
    for (; x + 16 <= cols; x += 16) {
      const V16 kx = Load(k + x);
      for (int m = 0; m < MB; ++m) Store(scores + m * lds + x, Load(scores + m * lds + x) + Splat(qd[m]) * kx);
    }
    for (; x < cols; ++x)
      for (int m = 0; m < MB; ++m) scores[m * lds + x] += qd[m] * k[x];
  }
}

// out[m, :] += sum_x probs[m, x] * values[x, :] for m < MB, x < rows; values are [rows, d],
// read row after row; the MB output rows stay in L1.
template <int MB>
void WeightedSum(const float* probs, int64_t ldp, const float* values, int64_t rows, int64_t d,
                 float* out) {
  for (int64_t x = 0; x < rows; ++x) {
    const float* v = values + x * d;
    float px[MB];
    for (int m = 0; m < MB; ++m) px[m] = probs[m * ldp + x];
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
      const V16 vj = Load(v + j);
      for (int m = 0; m < MB; ++m) Store(out + m * d + j, Load(out + m * d + j) + Splat(px[m]) * vj);
    }
    for (; j < d; ++j)
      for (int m = 0; m < MB; ++m) out[m * d + j] += px[m] * v[j];
  }
}

struct Dims {
  int64_t rows, prompts, n, kv_heads, group, d, p, s, own_len;
};

struct Args {
  const float *q, *pk, *pv, *ok, *ov;
  const bool* pmask;
  float* out;
};

// Query vectors [m0, m0 + MB) of row r's kv head k: scores, softmax, weighted values.
template <int MB>
void AttendBlock(const Dims& dm, const Args& a, int64_t r, int64_t k, int64_t m0,
                 std::vector<float>& buf) {
  const int64_t b = r / dm.n, d = dm.d, p = dm.p, len = dm.own_len;
  const int64_t heads = dm.kv_heads * dm.group;
  // Only the prompt slots from the first to the last unmasked one are read: prompts are
  // left-padded to P, so a short prompt costs its own length, not P.
  const bool* pm = a.pmask + b * p;
  int64_t lo = 0, hi = p;
  while (lo < hi && !pm[lo]) ++lo;
  while (hi > lo && !pm[hi - 1]) --hi;
  const int64_t span = hi - lo, width = span + len;
  buf.resize(MB * width + MB * d);
  float* scores = buf.data();
  float* q = scores + MB * width;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* q_src = a.q + (r * heads + k * dm.group + m0) * d;
  for (int64_t i = 0; i < MB * d; ++i) q[i] = q_src[i] * scale;
  const float* pk = a.pk + (b * dm.kv_heads + k) * d * p + lo;
  const float* pv = a.pv + ((b * dm.kv_heads + k) * p + lo) * d;
  const float* ok = a.ok + (r * dm.kv_heads + k) * d * dm.s;
  const float* ov = a.ov + (r * dm.kv_heads + k) * dm.s * d;
  Scores<MB>(q, d, pk, p, span, scores, width);
  Scores<MB>(q, d, ok, dm.s, len, scores + span, width);
  for (int m = 0; m < MB; ++m) {
    float* row = scores + m * width;
    for (int64_t x = 0; x < span; ++x) row[x] = pm[lo + x] ? row[x] : kMasked;
    float mx = kMasked;
    for (int64_t x = 0; x < width; ++x) mx = std::max(mx, row[x]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t x = 0; x < width; ++x) {
      row[x] = ExpNonPositive(row[x] - mx);
      sum += row[x];
    }
    const float inv = 1.0f / sum;
    for (int64_t x = 0; x < width; ++x) row[x] *= inv;
  }
  float* out = a.out + (r * heads + k * dm.group + m0) * d;
  std::fill(out, out + MB * d, 0.0f);
  WeightedSum<MB>(scores, width, pv, span, d, out);
  WeightedSum<MB>(scores + span, width, ov, len, d, out);
}

void AttendTask(const Dims& dm, const Args& a, int64_t task, std::vector<float>& buf) {
  const int64_t r = task / dm.kv_heads, k = task % dm.kv_heads;
  for (int64_t m0 = 0; m0 < dm.group; m0 += kMaxBlock) {
    switch (std::min<int64_t>(kMaxBlock, dm.group - m0)) {
      case 1: AttendBlock<1>(dm, a, r, k, m0, buf); break;
      case 2: AttendBlock<2>(dm, a, r, k, m0, buf); break;
      case 3: AttendBlock<3>(dm, a, r, k, m0, buf); break;
      case 4: AttendBlock<4>(dm, a, r, k, m0, buf); break;
      case 5: AttendBlock<5>(dm, a, r, k, m0, buf); break;
      case 6: AttendBlock<6>(dm, a, r, k, m0, buf); break;
      case 7: AttendBlock<7>(dm, a, r, k, m0, buf); break;
      default: AttendBlock<8>(dm, a, r, k, m0, buf); break;
    }
  }
}

// Tasks handed out by an atomic counter to the caller and the pool's threads; the caller also
// runs tasks, so all of them finish even if no pool thread ever starts.
struct Progress {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                           ffi::Buffer<ffi::F32> pk, ffi::Buffer<ffi::F32> pv,
                           ffi::Buffer<ffi::F32> ok, ffi::Buffer<ffi::F32> ov,
                           ffi::Buffer<ffi::PRED> prompt_mask, ffi::Buffer<ffi::S32> own_len,
                           ffi::ResultBuffer<ffi::F32> out) {
  const auto qd = q.dimensions(), pkd = pk.dimensions(), okd = ok.dimensions();
  if (qd.size() != 4 || pkd.size() != 4 || okd.size() != 4 || qd[1] != 1)
    return ffi::Error::InvalidArgument("decode_attention: q [R, 1, H, D], keys rank 4");
  Dims dm;
  dm.rows = qd[0];
  dm.prompts = pkd[0];
  dm.kv_heads = pkd[1];
  dm.d = pkd[2];
  dm.p = pkd[3];
  dm.s = okd[3];
  if (dm.prompts == 0 || dm.rows % dm.prompts || qd[2] % dm.kv_heads || qd[3] != dm.d)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes");
  dm.n = dm.rows / dm.prompts;
  dm.group = qd[2] / dm.kv_heads;
  dm.own_len = own_len.typed_data()[0];
  if (dm.own_len < 1 || dm.own_len > dm.s)
    return ffi::Error::InvalidArgument("decode_attention: own_len outside [1, S]");
  const Args a{q.typed_data(),  pk.typed_data(),          pv.typed_data(),
               ok.typed_data(), ov.typed_data(),          prompt_mask.typed_data(),
               out->typed_data()};
  const int64_t tasks = dm.rows * dm.kv_heads;
  auto progress = std::make_shared<Progress>();
  auto run = [dm, a, tasks, progress]() {
    thread_local std::vector<float> buf;
    int64_t t;
    while ((t = progress->next.fetch_add(1, std::memory_order_relaxed)) < tasks) {
      AttendTask(dm, a, t, buf);
      progress->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([run]() { run(); });
  run();
  while (progress->done.load(std::memory_order_acquire) < tasks) {
    // The last tasks are running on pool threads: a short wait.
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MmrDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // q [R, 1, H, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // prompt keys [B, K, D, P]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // prompt values [B, K, P, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // own keys [R, K, D, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // own values [R, K, S, D]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // prompt mask [B, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // own_len [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [R, 1, H, D]
