/* Attention of query rows over their own sequence's keys, read in place from the paged KV cache.

   Serves the engine's plain decode and verify passes, and every attention of its batch-invariant passes (decode,
   verify, prefill; tailrl/model/paged_attention.py builds and calls this). The library route gathers each sequence's
   blocks into a dense copy of its keys and values, padded to the pass's longest sequence, then runs the CPU flash
   kernel on the copy: every key is read three times and written once. Here each item (a sequence, a K/V head and up
   to QBLOCK of the sequence's query tokens, the caller's ITEM_TOKENS, with the query heads that share the K/V head)
   reads its own blocks once, through the block table.

   A row's result depends only on its query, the keys its mask row lets it see and their values: the work is the
   same sequence of float operations whatever else is in the pass (other sequences, other query rows, how many
   keys the pass pads to, how rows are split into items and items over threads), since a key a row does not see
   contributes exactly 0 and is skipped, and every sum runs in an order fixed by D or by the key's index (never by
   how many keys or rows the pass has). Keys are scored in tiles of 8 aligned on the key index (the last one padded
   with a zero key no row sees), so every key goes through the same instructions: the scores of a tile (8 lane
   partial sums per key, combined in one fixed tree) and exp (a polynomial of ours over 8 scores at once, not libm's
   scalar expf) are AVX2 vector code where the CPU has it and the same arithmetic in scalar C where not; the weighted
   sum of values is one fused multiply-add per key and column, in key order. It is built with -ffp-contract=off, so
   the compiler fuses and reassociates nothing: a row decoded alone, verified beside a draft tree and prefilled with
   its prompt gets the same bits (what the batch-invariant passes need, engine/invariant.py).

   Cost (Zen 3, 1 thread, 32 sequences x 1,024 keys, SmolLM2's 9/3 heads of 64): the scalar version of this kernel
   (one dot product and one libm expf per key and row) read the cache at 2.9 GB/s, a fifth of what the core streams;
   scoring and exp were most of its time. Each item converts the bf16 keys of a tile once for all its rows, and the
   values its rows see once.

   Layouts: q and out [B, Q, H, D]; k_pool and v_pool [KVH, NBLK, BS, D]; table [rows, W] (block ids of each cache
   row); slots [B] (the cache row of each sequence); mask [B, Q, K] bytes (1: the row sees key k) or NULL; lens
   [B, 2] (cache_len, q_len of each sequence) or NULL. With lens, sequence b's keys are 0 .. cache_len + q_len - 1,
   rows q_len .. Q - 1 pad it (their output is 0), and without a mask row i is causal: it sees keys 0 .. cache_len +
   i. fp32 or bf16 (bf16: computed in fp32, rounded to nearest even at the end, as torch rounds). H is a multiple of
   KVH. D <= 256 and a multiple of 8. Returns 0, or non-zero when the shapes are outside that or memory ran out. */

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
  } else if (j0 < K) {
    uint8_t b[TILE] = {0};
    memcpy(b, row + j0, (size_t)(K - j0));
    memcpy(&w, b, TILE);
  }
  return w;
}

#define ALL_SEEN 0x0101010101010101ull /* mask bytes are 0 or 1 (torch bool) */

/* The word of keys j0..j0+7 for a causal row that sees keys 0..last. */
static inline uint64_t causal_word(int64_t last, int64_t j0) {
  if (last >= j0 + TILE - 1) return ALL_SEEN;
  if (last < j0) return 0;
  return ALL_SEEN >> (8 * (TILE - 1 - (last - j0)));
}

/* into L2, not non-temporal: a key's row is read again for every query row of the item */
static inline void prefetch_rows(const char* base, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + o, 0, 2);
}

static inline void to_float(const char* src, int bf16, int64_t D, float* dst) {
  if (bf16)
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_float(((const uint16_t*)src)[d]);
  else
    memcpy(dst, src, sizeof(float) * D);
}

/* acc (w <= 64 columns) = sum over the row's keys j, in key order, of p_j * v_j (one fused multiply-add a key and
   column where the CPU has them): the same operations for every column, whichever branch runs it. */
static void weighted_sum(const float* p, const float* const* v, int64_t d0, int64_t w, int64_t K, float* acc) {
#ifdef VEC
  if (w == 64) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t j = 0; j < K; ++j) {
      if (p[j] == 0.f) continue;
      const __m256 pv = _mm256_set1_ps(p[j]);
      const float* x = v[j] + d0;
      a0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x), a0);
      a1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 8), a1);
      a2 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 16), a2);
      a3 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 24), a3);
      a4 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 32), a4);
      a5 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 40), a5);
      a6 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 48), a6);
      a7 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + 56), a7);
    }
    _mm256_storeu_ps(acc, a0);
    _mm256_storeu_ps(acc + 8, a1);
    _mm256_storeu_ps(acc + 16, a2);
    _mm256_storeu_ps(acc + 24, a3);
    _mm256_storeu_ps(acc + 32, a4);
    _mm256_storeu_ps(acc + 40, a5);
    _mm256_storeu_ps(acc + 48, a6);
    _mm256_storeu_ps(acc + 56, a7);
    return;
  }
  __m256 a[8];
  for (int64_t c = 0; c < w / LANES; ++c) a[c] = _mm256_setzero_ps();
  for (int64_t j = 0; j < K; ++j) {
    if (p[j] == 0.f) continue;
    const __m256 pv = _mm256_set1_ps(p[j]);
    for (int64_t c = 0; c < w / LANES; ++c) a[c] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v[j] + d0 + LANES * c), a[c]);
  }
  for (int64_t c = 0; c < w / LANES; ++c) _mm256_storeu_ps(acc + LANES * c, a[c]);
#else
  for (int64_t d = 0; d < w; ++d) acc[d] = 0.f;
  for (int64_t j = 0; j < K; ++j) {
    if (p[j] == 0.f) continue;
    for (int64_t d = 0; d < w; ++d) acc[d] = acc[d] + p[j] * v[j][d0 + d];
  }
#endif
}

int tailrl_paged_attention(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                           const int64_t* slots, const uint8_t* mask, const int64_t* lens, void* out, int64_t B,
                           int64_t Q, int64_t H, int64_t KVH, int64_t D, int64_t NBLK, int64_t BS, int64_t W,
                           int64_t K, int64_t QBLOCK, int bf16, int threads) {
  /* QBLOCK: query tokens of one sequence an item takes at most (rows are independent: any split, the same bits) */
  if (D > MAX_D || D % LANES || H % KVH || (!mask && !lens) || QBLOCK < 1) return 1;
  const int64_t G = H / KVH, QB = Q < QBLOCK ? Q : QBLOCK, NQB = (Q + QBLOCK - 1) / QBLOCK;
  const int64_t RB = G * QB, KP = (K + TILE - 1) / TILE * TILE; /* rows of an item at most; keys in whole tiles */
  const int64_t ES = bf16 ? 2 : 4, ROW = D * ES;                /* bytes of an element, of a cache row */
  const float scale = 1.f / sqrtf((float)D);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* qs = malloc(sizeof(float) * RB * D);     /* the item's query rows, scaled */
    float* s = malloc(sizeof(float) * RB * KP);     /* scores, then p */
    float* top = malloc(sizeof(float) * RB);
    float* tile = malloc(sizeof(float) * TILE * D); /* a tile's bf16 keys in fp32 */
    float* vf = malloc(sizeof(float) * (bf16 ? KP * D : 1)); /* the item's seen bf16 values in fp32 */
    float* acc = malloc(sizeof(float) * 64);
    uint64_t* words = malloc(sizeof(uint64_t) * RB);  /* a tile's mask bytes per row */
    uint64_t* tseen = malloc(sizeof(uint64_t) * (KP / TILE + 1)); /* a tile's keys that some row sees */
    const char** krow = malloc(sizeof(void*) * KP);   /* each key's K and V rows in the pool (no division per key) */
    const char** vrow = malloc(sizeof(void*) * KP);
    const float** vals = malloc(sizeof(void*) * KP); /* each key's value row in fp32 */
    const uint8_t** sees = malloc(sizeof(void*) * RB);
    int64_t* last = malloc(sizeof(int64_t) * RB);
    if (!qs || !s || !top || !tile || !vf || !acc || !words || !tseen || !krow || !vrow || !vals || !sees || !last) {
#pragma omp atomic write
      failed = 2;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * KVH * NQB; ++item) {
      if (failed) continue;
      const int64_t b = item / (KVH * NQB), h = item / NQB % KVH, i0 = item % NQB * QBLOCK;
      const int64_t i1 = i0 + QBLOCK < Q ? i0 + QBLOCK : Q;
      const int64_t cl = lens ? lens[2 * b] : 0, ql = lens ? lens[2 * b + 1] : Q;
      const int64_t end = i1 < ql ? i1 : ql; /* rows i0..end-1 are real; end..i1-1 pad the sequence to Q rows */
      for (int64_t i = end > i0 ? end : i0; i < i1; ++i)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t o = ((b * Q + i) * H + h * G + g) * D;
          memset((char*)out + o * ES, 0, (size_t)ROW);
        }
      if (end <= i0) continue;
      /* the keys any row of the item may see: all K without lens; else the sequence's, or a causal block's */
      int64_t Kb = !lens ? K : mask ? cl + ql : cl + end;
      Kb = Kb < K ? Kb : K;
      const int64_t KbP = (Kb + TILE - 1) / TILE * TILE, n = end - i0, R = G * n;
      const int64_t* blocks = table + slots[b] * W;
      const char* kbase = (const char*)k_pool + h * NBLK * BS * ROW;
      const char* vbase = (const char*)v_pool + h * NBLK * BS * ROW;
      for (int64_t j = 0, blk = 0; j < Kb; ++blk)
        for (int64_t t = 0, at = blocks[blk] * BS * ROW; t < BS && j < Kb; ++t, ++j, at += ROW) {
          krow[j] = kbase + at;
          vrow[j] = vbase + at;
        }
      for (int64_t g = 0; g < G; ++g) /* row r = g * n + (i - i0): query head h * G + g, query i */
        for (int64_t i = i0; i < end; ++i) {
          const int64_t r = g * n + (i - i0), at = ((b * Q + i) * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d)
            qs[r * D + d] = (bf16 ? bf16_to_float(((const uint16_t*)q)[at + d]) : ((const float*)q)[at + d]) * scale;
          sees[r] = mask ? mask + (b * Q + i) * K : NULL;
          last[r] = cl + i;
          top[r] = UNSEEN;
        }
      /* scores, a tile of 8 keys at a time */
      for (int64_t j0 = 0; j0 < KbP; j0 += TILE) {
        for (int64_t j = j0 + 2 * TILE; j < j0 + 3 * TILE && j < Kb; ++j) /* two tiles ahead: a block may start there */
          prefetch_rows(krow[j], ROW);
        uint64_t seen = 0;
        for (int64_t r = 0; r < R; ++r) seen |= words[r] = sees[r] ? mask_word(sees[r], j0, Kb) : causal_word(last[r], j0);
        tseen[j0 / TILE] = seen;
        const float* keys[TILE];
        for (int k = 0; k < TILE; ++k) { /* a key no row sees (or past Kb) is never read: the zero key stands in */
          keys[k] = ZERO_KEY;
          if (!((seen >> (8 * k)) & 0xff)) continue;
          if (bf16) {
            to_float(krow[j0 + k], 1, D, tile + k * D);
            keys[k] = tile + k * D;
          } else {
            keys[k] = (const float*)krow[j0 + k];
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
      /* the values some row sees, in fp32 (a bf16 row converted once for all rows of the item) */
      for (int64_t j = 0; j < Kb; ++j) {
        vals[j] = (const float*)vrow[j];
        if (!((tseen[j / TILE] >> (8 * (j % TILE))) & 0xff)) continue;
        if (bf16) {
          if (j + 2 * TILE < Kb) prefetch_rows(vrow[j + 2 * TILE], ROW);
          to_float(vrow[j], 1, D, vf + j * D);
          vals[j] = vf + j * D;
        }
      }
      /* p = exp(score - top), the row's sum by key index mod 8, then sum_j p_j v_j in key order */
      for (int64_t r = 0; r < R; ++r) {
        float* sr = s + r * KP;
        float lane[LANES] = {0.f}; /* partial sums by key index mod LANES: the same for any K */
#ifdef VEC
        const __m256 t = _mm256_set1_ps(top[r]), unseen = _mm256_set1_ps(UNSEEN);
        __m256 sum8 = _mm256_setzero_ps();
        for (int64_t j0 = 0; j0 < KbP; j0 += TILE) {
          const __m256 x = _mm256_loadu_ps(sr + j0);
          const __m256 p = _mm256_and_ps(exp_tile(_mm256_sub_ps(x, t)), _mm256_cmp_ps(x, unseen, _CMP_NEQ_OQ));
          _mm256_storeu_ps(sr + j0, p);
          sum8 = _mm256_add_ps(sum8, p);
        }
        _mm256_storeu_ps(lane, sum8);
#else
        for (int64_t j = 0; j < KbP; ++j) {
          const float p = sr[j] != UNSEEN ? exp_c(sr[j] - top[r]) : 0.f;
          sr[j] = p;
          lane[j % LANES] += p;
        }
#endif
        float sum = 0.f;
        for (int l = 0; l < LANES; ++l) sum += lane[l];
        const float inv = sum > 0.f ? 1.f / sum : 0.f; /* a row that sees no key gets zeros */
        const int64_t g = r / n, i = i0 + r % n;
        for (int64_t d0 = 0; d0 < D; d0 += 64) { /* 64 columns of the row at a time, summed in registers */
          const int64_t w = D - d0 < 64 ? D - d0 : 64, o = ((b * Q + i) * H + h * G + g) * D + d0;
          weighted_sum(sr, vals, d0, w, Kb, acc);
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
    free(vf);
    free(acc);
    free(words);
    free(tseen);
    free(krow);
    free(vrow);
    free(vals);
    free(sees);
    free(last);
  }
  return failed;
}
