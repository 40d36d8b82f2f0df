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
// thread and the XLA intra-op pool. Scores and weighted sums are register-blocked: a block of
// slots (or of value columns) for up to 4 query vectors is summed over the whole head dim (or
// over all slots) in registers, so each key and value vector is loaded once per block and no
// partial sum goes through memory.
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

// Vectors of 8 floats (GCC vector extensions: one AVX2 register; half an AVX-512 one, two NEON
// ones). Loads and stores go through memcpy: unaligned, and compiled to plain vector moves.
constexpr int kW = 8;
typedef float V8 __attribute__((vector_size(kW * sizeof(float))));
typedef int32_t I8 __attribute__((vector_size(kW * sizeof(int32_t))));

inline V8 Load(const float* p) {
  V8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void Store(float* p, V8 v) { std::memcpy(p, &v, sizeof(v)); }
inline V8 Splat(float x) { return V8{} + x; }

constexpr float kMasked = -1e30f;  // as decoder._MASK_VALUE: exp underflows to exactly 0
constexpr int kMaxBlock = 8;       // query vectors per register block

// exp(x) for x <= 0 (softmax arguments), eight at a time (a libm call per element would cost
// more than the rest of the attention). Cephes' expf polynomial on [-ln2/2, ln2/2], about 1 ulp;
// x below -87 (masked slots) gives 0. Rounding to the nearest integer adds and subtracts 1.5 *
// 2^23, exact for |x * log2(e)| < 2^22 (the project builds without -ffast-math).
inline V8 ExpNonPositive(V8 x) {
  const V8 lowest = Splat(-87.0f);
  const V8 xc = x < lowest ? lowest : x;
  const V8 round = Splat(12582912.0f);
  const V8 n = (xc * 1.44269504088896341f + round) - round;
  const V8 r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  V8 p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  I8 bits;
  std::memcpy(&bits, &p, sizeof(bits));
  bits += __builtin_convertvector(n, I8) << 23;
  V8 out;
  std::memcpy(&out, &bits, sizeof(out));
  return x < lowest ? V8{} : out;
}

// The register block of Scores: scores[m, j * kW + lane] for m < MB, j < NB, summed over all d
// in registers (one key load per vector, one broadcast per query value).
template <int MB, int NB>
void ScoreBlock(const float* q, int64_t d, const float* keys, int64_t ldk, float* scores,
                int64_t lds) {
  V8 acc[MB][NB] = {};
  for (int64_t dd = 0; dd < d; ++dd) {
    __builtin_prefetch(keys + dd * ldk + 2 * kW);  // this row's next line: the next block
    V8 kx[NB];
    for (int j = 0; j < NB; ++j) kx[j] = Load(keys + dd * ldk + j * kW);
    for (int m = 0; m < MB; ++m) {
      const V8 qm = Splat(q[m * d + dd]);
      for (int j = 0; j < NB; ++j) acc[m][j] += qm * kx[j];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) Store(scores + m * lds + j * kW, acc[m][j]);
}

// scores[m, x] = sum_d q[m, d] * keys[d, x] for m < MB, x < cols; key rows are ldk apart.
// Blocks of 2 vectors of slots (1 when MB > 4: MB * NB sums + NB keys + a broadcast fit in the
// 16 AVX2 registers). The last cols % kW slots are copied into a zero-filled [d, kW] block
// first, so nothing past cols is read. `tail` holds d * kW floats.
template <int MB>
void Scores(const float* q, int64_t d, const float* keys, int64_t ldk, int64_t cols,
            float* scores, int64_t lds, float* tail) {
  constexpr int NB = MB <= 4 ? 2 : 1;
  int64_t x = 0;
  for (; x + NB * kW <= cols; x += NB * kW)
    ScoreBlock<MB, NB>(q, d, keys + x, ldk, scores + x, lds);
  for (; x + kW <= cols; x += kW) ScoreBlock<MB, 1>(q, d, keys + x, ldk, scores + x, lds);
  const int64_t rest = cols - x;
  if (rest == 0) return;
  std::fill(tail, tail + d * kW, 0.0f);
  for (int64_t dd = 0; dd < d; ++dd) std::copy_n(keys + dd * ldk + x, rest, tail + dd * kW);
  float block[MB * kW];
  ScoreBlock<MB, 1>(q, d, tail, kW, block, kW);
  for (int m = 0; m < MB; ++m) std::copy_n(block + m * kW, rest, scores + m * lds + x);
}

// out[m, c0 + j * kW + lane] += sum_x probs[m, x] * values[x, c0 + ...] for m < MB, j < NV:
// the sums stay in registers over all rows x; values are [rows, d], read row after row.
template <int MB, int NV>
void WeightedBlock(const float* probs, int64_t ldp, const float* values, int64_t rows, int64_t d,
                   float* out) {
  V8 acc[MB][NV] = {};
  for (int64_t x = 0; x < rows; ++x) {
    V8 vx[NV];
    for (int j = 0; j < NV; ++j) vx[j] = Load(values + x * d + j * kW);
    for (int m = 0; m < MB; ++m) {
      const V8 pm = Splat(probs[m * ldp + x]);
      for (int j = 0; j < NV; ++j) acc[m][j] += pm * vx[j];
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NV; ++j) Store(out + m * d + j * kW, Load(out + m * d + j * kW) + acc[m][j]);
}

// out[m, :] += sum_x probs[m, x] * values[x, :] for m < MB, x < rows; values are [rows, d].
// Column blocks of up to 4 vectors (MB * NV sums of at most 12 registers); the last d % kW
// columns one at a time.
template <int MB>
void WeightedSum(const float* probs, int64_t ldp, const float* values, int64_t rows, int64_t d,
                 float* out) {
  constexpr int NV = MB <= 3 ? 4 : (MB <= 6 ? 2 : 1);
  int64_t c = 0;
  for (; c + NV * kW <= d; c += NV * kW)
    WeightedBlock<MB, NV>(probs, ldp, values + c, rows, d, out + c);
  for (; c + kW <= d; c += kW) WeightedBlock<MB, 1>(probs, ldp, values + c, rows, d, out + c);
  for (; c < d; ++c)
    for (int m = 0; m < MB; ++m) {
      float sum = 0.0f;
      for (int64_t x = 0; x < rows; ++x) sum += probs[m * ldp + x] * values[x * d + c];
      out[m * d + c] += sum;
    }
}

// row[x] = softmax over x < width, in place (masked entries hold kMasked).
void Softmax(float* row, int64_t width) {
  int64_t x = 0;
  float mx = kMasked;
  if (width >= kW) {
    V8 vmax = Load(row);
    for (x = kW; x + kW <= width; x += kW) {
      const V8 v = Load(row + x);
      vmax = v > vmax ? v : vmax;
    }
    for (int i = 0; i < kW; ++i) mx = std::max(mx, vmax[i]);
  }
  for (; x < width; ++x) mx = std::max(mx, row[x]);
  // The tail is padded into one more vector: ExpNonPositive of kMasked - mx is 0.
  V8 vsum{};
  for (x = 0; x + kW <= width; x += kW) {
    const V8 e = ExpNonPositive(Load(row + x) - mx);
    Store(row + x, e);
    vsum += e;
  }
  if (x < width) {
    float t[kW];
    std::fill(t, t + kW, kMasked);
    std::copy_n(row + x, width - x, t);
    const V8 e = ExpNonPositive(Load(t) - mx);
    Store(t, e);
    std::copy_n(t, width - x, row + x);
    vsum += e;
  }
  float sum = 0.0f;
  for (int i = 0; i < kW; ++i) sum += vsum[i];
  const V8 inv = Splat(1.0f / sum);
  for (x = 0; x + kW <= width; x += kW) Store(row + x, Load(row + x) * inv);
  for (; x < width; ++x) row[x] *= inv[0];
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
  buf.resize(MB * width + MB * d + d * kW);
  float* scores = buf.data();
  float* q = scores + MB * width;
  float* tail = q + MB * d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const float* q_src = a.q + (r * heads + k * dm.group + m0) * d;
  for (int64_t i = 0; i < MB * d; ++i) q[i] = q_src[i] * scale;
  const float* pk = a.pk + (b * dm.kv_heads + k) * d * p + lo;
  const float* pv = a.pv + ((b * dm.kv_heads + k) * p + lo) * d;
  const float* ok = a.ok + (r * dm.kv_heads + k) * d * dm.s;
  const float* ov = a.ov + (r * dm.kv_heads + k) * dm.s * d;
  Scores<MB>(q, d, pk, p, span, scores, width, tail);
  Scores<MB>(q, d, ok, dm.s, len, scores + span, width, tail);
  for (int m = 0; m < MB; ++m) {
    float* row = scores + m * width;
    for (int64_t x = 0; x < span; ++x) row[x] = pm[lo + x] ? row[x] : kMasked;
    Softmax(row, width);
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
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  // The caches are stacked over the layers ([L, ...], the decoder's scan carry): this call reads
  // layer `layer` of each, in place.
  const auto qd = q.dimensions(), pkd = pk.dimensions(), okd = ok.dimensions();
  if (qd.size() != 4 || pkd.size() != 5 || okd.size() != 5 || qd[1] != 1)
    return ffi::Error::InvalidArgument("decode_attention: q [R, 1, H, D], caches rank 5");
  Dims dm;
  dm.rows = qd[0];
  dm.prompts = pkd[1];
  dm.kv_heads = pkd[2];
  dm.d = pkd[3];
  dm.p = pkd[4];
  dm.s = okd[4];
  const int64_t num_layers = pkd[0], li = layer.typed_data()[0];
  if (okd[0] != num_layers || li < 0 || li >= num_layers)
    return ffi::Error::InvalidArgument("decode_attention: layer outside [0, L)");
  if (okd[1] != dm.rows || okd[2] != dm.kv_heads || okd[3] != dm.d)
    return ffi::Error::InvalidArgument("decode_attention: own keys do not match the queries");
  if (dm.prompts == 0 || dm.rows % dm.prompts || qd[2] % dm.kv_heads || qd[3] != dm.d)
    return ffi::Error::InvalidArgument("decode_attention: inconsistent shapes");
  dm.n = dm.rows / dm.prompts;
  dm.group = qd[2] / dm.kv_heads;
  dm.own_len = own_len.typed_data()[0];
  if (dm.own_len < 1 || dm.own_len > dm.s)
    return ffi::Error::InvalidArgument("decode_attention: own_len outside [1, S]");
  const int64_t prompt_layer = dm.prompts * dm.kv_heads * dm.d * dm.p;
  const int64_t own_layer = dm.rows * dm.kv_heads * dm.d * dm.s;
  const Args a{q.typed_data(),
               pk.typed_data() + li * prompt_layer,
               pv.typed_data() + li * prompt_layer,
               ok.typed_data() + li * own_layer,
               ov.typed_data() + li * own_layer,
               prompt_mask.typed_data(),
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
                                  .Arg<ffi::Buffer<ffi::F32>>()   // prompt keys [L, B, K, D, P]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // prompt values [L, B, K, P, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // own keys [L, R, K, D, S]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // own values [L, R, K, S, D]
                                  .Arg<ffi::Buffer<ffi::PRED>>()  // prompt mask [B, P]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // own_len [1]
                                  .Arg<ffi::Buffer<ffi::S32>>()   // layer [1]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // out [R, 1, H, D]
