/* Attention of a few query rows per sequence over that sequence's keys, read in place from the paged KV cache.

   The engine's plain decode passes (tailrl/model/paged_attention.py builds and calls this). The library route
   gathers each sequence's blocks into a dense copy of its keys and values, padded to the pass's longest sequence,
   then runs the CPU flash kernel on the copy: every key is read three times and written once. Here each
   (sequence, K/V head) item reads its own blocks once, through the block table.

   A row's result depends only on its query, the keys its mask row lets it see and their values: the work is the
   same sequence of float operations whatever else is in the pass (other sequences, other query rows, how many
   keys the pass pads to), since a key a row does not see contributes exactly 0 and is skipped, and every sum runs in
   an order fixed by D or by the key's index (never by how many keys or rows the pass has). Keys are scored in tiles
   of 8 aligned on the key index (the last one padded with a zero key no row sees), so every key goes through the
   same instructions: the scores of a tile (8 lane partial sums per key, combined in one fixed tree) and exp (a
   polynomial of ours over 8 scores at once, not libm's scalar expf) are AVX2 vector code where the CPU has it and
   the same arithmetic in scalar C where not. No flag reassociates floating point.

   Cost (Zen 3, 1 thread, 32 sequences x 1,024 keys, SmolLM2's 9/3 heads of 64): the scalar version of this kernel
   (one dot product and one libm expf per key and row) read the cache at 2.9 GB/s, a fifth of what the core streams;
   scoring and exp were most of its time.

   Layouts: q and out [B, Q, H, D]; k_pool and v_pool [KVH, NBLK, BS, D]; table [rows, W] (block ids of each cache
   row); slots [B] (the cache row of each sequence); mask [B, Q, K] bytes (1: the row sees key k). fp32 or bf16
   (bf16: computed in fp32, rounded to nearest even at the end, as torch rounds). H is a multiple of KVH; the
   query heads that share a K/V head are one item. D <= 256 and a multiple of 8. Returns 0, or non-zero when the
   shapes are outside that or memory ran out. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VEC 1
#endif

#define MAX_D 256
#define UNSEEN (-3.0e38f)
#define LANES 8
#define TILE 8 /* keys scored together; key j is lane j % 8 of its tile */
#define EXP_FLOOR (-87.0f) /* exp below it is taken as 0 (e^-87 = 1.6e-38: nothing next to the row's top key's 1) */

static const float ZERO_KEY[MAX_D] = {0.f}; /* what a padded or unseen key of a tile is scored against */

static inline float bf16_to_float(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

/* exp(x) for x <= 0 (a score minus its row's top): x = n ln2 + r, |r| <= ln2/2, e^r by a degree-7 polynomial (Cephes'
   coefficients), times 2^n built in the exponent bits; 0 below EXP_FLOOR. Within 2 ulp of exp. */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO (-2.12194440e-4f)
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

#ifdef VEC
/* out[k] = q . key_k for the 8 keys of a tile: lane l of key k's partial sum holds d = l mod 8 (fused multiply-adds
   in d order), and the lanes are combined ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)) for all 8 keys at once. */
static inline __m256 dot_tile(const float* q, const float* const* keys, int64_t D) {
  __m256 p0 = _mm256_setzero_ps(), p1 = p0, p2 = p0, p3 = p0, p4 = p0, p5 = p0, p6 = p0, p7 = p0;
  for (int64_t d = 0; d < D; d += LANES) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    p0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[0] + d), p0);
    p1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[1] + d), p1);
    p2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[2] + d), p2);
    p3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[3] + d), p3);
    p4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[4] + d), p4);
    p5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[5] + d), p5);
    p6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[6] + d), p6);
    p7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(keys[7] + d), p7);
  }
  /* hadd(a, b) = [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] */
  const __m256 b0 = _mm256_hadd_ps(_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
  const __m256 b1 = _mm256_hadd_ps(_mm256_hadd_ps(p4, p5), _mm256_hadd_ps(p6, p7));
  /* b0 = [k0 l0-3, k1 l0-3, k2 l0-3, k3 l0-3, k0 l4-7, ...]; b1 the same for keys 4-7 */
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

static inline __m256 exp_tile(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_FLOOR), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_FLOOR));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
  __m256 p = _mm256_set1_ps(EXP_P0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}
#else
static inline void dot_tile_c(const float* q, const float* const* keys, int64_t D, float* out) {
  for (int k = 0; k < TILE; ++k) {
    float part[LANES] = {0.f};
    for (int64_t d = 0; d < D; d += LANES)
      for (int l = 0; l < LANES; ++l) part[l] += q[d + l] * keys[k][d + l];
    out[k] = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  }
}

static inline float exp_c(float x) {
  if (!(x >= EXP_FLOOR)) return 0.f;
  const float n = nearbyintf(x * EXP_LOG2E);
  float r = x - n * EXP_LN2_HI;
  r = r - n * EXP_LN2_LO;
  float p = EXP_P0;
  p = p * r + EXP_P1;
  p = p * r + EXP_P2;
  p = p * r + EXP_P3;
  p = p * r + EXP_P4;
  p = p * r + EXP_P5;
  p = p * (r * r) + (r + 1.f);
  const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}
#endif

/* The mask bytes of keys j0..j0+7 of a row as one word (keys at or past K unseen). */
static inline uint64_t mask_word(const uint8_t* row, int64_t j0, int64_t K) {
  uint64_t w = 0;
  if (j0 + TILE <= K) {
    memcpy(&w, row + j0, TILE);
  } else {
    uint8_t b[TILE] = {0};
    memcpy(b, row + j0, (size_t)(K - j0));
    memcpy(&w, b, TILE);
  }
  return w;
}

#define ALL_SEEN 0x0101010101010101ull /* mask bytes are 0 or 1 (torch bool) */

/* into L2, not non-temporal: each V row is read again for every query row of the item */
static inline void prefetch_rows(const char* base, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + o, 0, 2);
}

int tailrl_paged_attention(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                           const int64_t* slots, const uint8_t* mask, void* out, int64_t B, int64_t Q, int64_t H,
                           int64_t KVH, int64_t D, int64_t NBLK, int64_t BS, int64_t W, int64_t K, int bf16,
                           int threads) {
  if (D > MAX_D || D % LANES || H % KVH) return 1;
  const int64_t G = H / KVH, R = G * Q, KP = (K + TILE - 1) / TILE * TILE; /* KP: the keys padded to whole tiles */
  const int64_t ES = bf16 ? 2 : 4, ROW = D * ES;                           /* bytes of an element, of a cache row */
  const float scale = 1.f / sqrtf((float)D);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* qs = malloc(sizeof(float) * R * D);      /* the item's query rows, scaled */
    float* s = malloc(sizeof(float) * R * KP);      /* scores, then p */
    float* top = malloc(sizeof(float) * R);
    float* tile = malloc(sizeof(float) * TILE * D); /* a tile's bf16 keys in fp32 */
    float* acc = malloc(sizeof(float) * D);         /* sum of p * v of one row */
    uint64_t* words = malloc(sizeof(uint64_t) * R); /* a tile's mask bytes per row */
    const char** krow = malloc(sizeof(void*) * KP); /* each key's K and V rows in the pool (no division per key) */
    const char** vrow = malloc(sizeof(void*) * KP);
    const uint8_t** sees = malloc(sizeof(void*) * R);
    if (!qs || !s || !top || !tile || !acc || !words || !krow || !vrow || !sees) {
#pragma omp atomic write
      failed = 2;
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * KVH; ++item) {
      if (failed) continue;
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t* blocks = table + slots[b] * W;
      const char* kbase = (const char*)k_pool + h * NBLK * BS * ROW;
      const char* vbase = (const char*)v_pool + h * NBLK * BS * ROW;
      for (int64_t j = 0, blk = 0; j < K; ++blk)
        for (int64_t t = 0, at = blocks[blk] * BS * ROW; t < BS && j < K; ++t, ++j, at += ROW) {
          krow[j] = kbase + at;
          vrow[j] = vbase + at;
        }
      for (int64_t g = 0; g < G; ++g) /* row r = g * Q + i: query head h * G + g, query i */
        for (int64_t i = 0; i < Q; ++i) {
          const int64_t r = g * Q + i, at = ((b * Q + i) * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d)
            qs[r * D + d] = (bf16 ? bf16_to_float(((const uint16_t*)q)[at + d]) : ((const float*)q)[at + d]) * scale;
          sees[r] = mask + (b * Q + i) * K;
          top[r] = UNSEEN;
        }
      /* scores, a tile of 8 keys at a time */
      for (int64_t j0 = 0; j0 < KP; j0 += TILE) {
        for (int64_t j = j0 + 2 * TILE; j < j0 + 3 * TILE && j < K; ++j) /* two tiles ahead: a block may start there */
          prefetch_rows(krow[j], ROW);
        uint64_t seen = 0;
        for (int64_t r = 0; r < R; ++r) seen |= words[r] = mask_word(sees[r], j0, K);
        const float* keys[TILE];
        for (int k = 0; k < TILE; ++k) { /* a key no row sees (or past K) is never read: the zero key stands in */
          const int64_t j = j0 + k;
          keys[k] = ZERO_KEY;
          if (!((seen >> (8 * k)) & 0xff)) continue;
          const char* src = krow[j];
          if (bf16) {
            for (int64_t d = 0; d < D; ++d) tile[k * D + d] = bf16_to_float(((const uint16_t*)src)[d]);
            keys[k] = tile + k * D;
          } else {
            keys[k] = (const float*)src;
          }
        }
        for (int64_t r = 0; r < R; ++r) {
          float* sr = s + r * KP + j0;
          if (!words[r]) {
            for (int k = 0; k < TILE; ++k) sr[k] = UNSEEN;
            continue;
          }
#ifdef VEC
          __m256 x = dot_tile(qs + r * D, keys, D);
          if (words[r] != ALL_SEEN) {
            const __m256i bytes = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)words[r]));
            const __m256 sees8 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(bytes, _mm256_setzero_si256()));
            x = _mm256_blendv_ps(_mm256_set1_ps(UNSEEN), x, sees8);
          }
          _mm256_storeu_ps(sr, x);
#else
          dot_tile_c(qs + r * D, keys, D, sr);
          for (int k = 0; k < TILE; ++k)
            if (!((words[r] >> (8 * k)) & 0xff)) sr[k] = UNSEEN;
#endif
          for (int k = 0; k < TILE; ++k) top[r] = sr[k] > top[r] ? sr[k] : top[r]; /* max: exact in any order */
        }
      }
      /* p = exp(score - top), the row's sum by key index mod 8, then sum_j p_j v_j in key order */
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s + r * KP;
        float lane[LANES] = {0.f}; /* partial sums by key index mod LANES: the same for any K */
#ifdef VEC
        const __m256 t = _mm256_set1_ps(top[r]), unseen = _mm256_set1_ps(UNSEEN);
        __m256 sum8 = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < KP; j0 += TILE) {
          const __m256 x = _mm256_loadu_ps(sr + j0);
          const __m256 p = _mm256_and_ps(exp_tile(_mm256_sub_ps(x, t)), _mm256_cmp_ps(x, unseen, _CMP_NEQ_OQ));
          _mm256_storeu_ps(sr + j0, p);
          sum8 = _mm256_add_ps(sum8, p);
        }
        _mm256_storeu_ps(lane, sum8);
#else
        for (int64_t j = 0; j < KP; ++j) {
          const float p = sr[j] != UNSEEN ? exp_c(sr[j] - top[r]) : 0.f;
          sr[j] = p;
          lane[j % LANES] += p;
        }
#endif
        float sum = 0.f;
        for (int l = 0; l < LANES; ++l) sum += lane[l];
        const float inv = sum > 0.f ? 1.f / sum : 0.f; /* a row that sees no key gets zeros */
        for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 64 columns of the row at a time, summed in registers */
          const int64_t w = D - d0 < 64 ? D - d0 : 64;
          for (int64_t d = 0; d < w; ++d) acc[d] = 0.f;
#ifdef VEC
          __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
#endif
          for (int64_t j = 0; j < K; ++j) {
            if (r == 0 && j + 2 * TILE < K) prefetch_rows(vrow[j + 2 * TILE], ROW);
            const float p = sr[j];
            if (p == 0.f) continue;
            const char* src = vrow[j] + d0 * ES;
#ifdef VEC
            if (w == 64) {
              const __m256 pv = _mm256_set1_ps(p);
#define V8(c) (bf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128( \
                           (const __m128i*)((const uint16_t*)src + 8 * (c)))), 16)) \
                      : _mm256_loadu_ps((const float*)src + 8 * (c)))
              a0 = _mm256_fmadd_ps(pv, V8(0), a0);
              a1 = _mm256_fmadd_ps(pv, V8(1), a1);
              a2 = _mm256_fmadd_ps(pv, V8(2), a2);
              a3 = _mm256_fmadd_ps(pv, V8(3), a3);
              a4 = _mm256_fmadd_ps(pv, V8(4), a4);
              a5 = _mm256_fmadd_ps(pv, V8(5), a5);
              a6 = _mm256_fmadd_ps(pv, V8(6), a6);
              a7 = _mm256_fmadd_ps(pv, V8(7), a7);
#undef V8
              continue;
            }
#endif
            for (int64_t d = 0; d < w; ++d)
              acc[d] += p * (bf16 ? bf16_to_float(((const uint16_t*)src)[d]) : ((const float*)src)[d]);
          }
#ifdef VEC
          if (w == 64) {
            _mm256_storeu_ps(acc, a0);
            _mm256_storeu_ps(acc + 8, a1);
            _mm256_storeu_ps(acc + 16, a2);
            _mm256_storeu_ps(acc + 24, a3);
            _mm256_storeu_ps(acc + 32, a4);
            _mm256_storeu_ps(acc + 40, a5);
            _mm256_storeu_ps(acc + 48, a6);
            _mm256_storeu_ps(acc + 56, a7);
          }
#endif
          const int64_t g = r / Q, i = r % Q, o = ((b * Q + i) * H + h * G + g) * D + d0;
          for (int64_t d = 0; d < w; ++d) {
            const float x = acc[d] * inv;
            if (bf16)
              ((uint16_t*)out)[o + d] = float_to_bf16(x);
            else
              ((float*)out)[o + d] = x;
          }
        }
      }
    }
    free(qs);
    free(s);
    free(top);
    free(tile);
    free(acc);
    free(words);
    free(krow);
    free(vrow);
    free(sees);
  }
  return failed;
}
