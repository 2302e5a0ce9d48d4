/* Attention of a few query rows per sequence over that sequence's keys, read in place from the paged KV cache.

   The engine's plain decode passes (tailrl/model/paged_attention.py builds and calls this). The library route
   gathers each sequence's blocks into a dense copy of its keys and values, padded to the pass's longest sequence,
   then runs the CPU flash kernel on the copy: every key is read three times and written once. Here each
   (sequence, K/V head) item reads its own blocks once, through the block table.

   A row's result depends only on its query, the keys its mask row lets it see and their values: the work is the
   same sequence of float operations whatever else is in the pass (other sequences, other query rows, how many
   keys the pass pads to), since a key a row does not see contributes exactly 0 and is skipped, and every sum runs in
   an order fixed by D or by the key's index (never by how many keys or rows the pass has). No flag reassociates
   floating point; the compiler vectorises the elementwise loops.

   Layouts: q and out [B, Q, H, D]; k_pool and v_pool [KVH, NBLK, BS, D]; table [rows, W] (block ids of each cache
   row); slots [B] (the cache row of each sequence); mask [B, Q, K] bytes (1: the row sees key k). fp32 or bf16
   (bf16: computed in fp32, rounded to nearest even at the end, as torch rounds). H is a multiple of KVH; the
   query heads that share a K/V head are one item. D <= 256 and a multiple of 8. Returns 0, or non-zero when the
   shapes are outside that or memory ran out. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_D 256
#define UNSEEN (-3.0e38f)
#define LANES 8

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

/* q . k over D (a multiple of LANES, checked by the caller) in LANES partial sums combined in a fixed order: an
   elementwise loop the compiler vectorises without reassociating anything. */
static inline float dot_product(const float* a, const float* b, int64_t D) {
  float part[LANES] = {0.f};
  for (int64_t d = 0; d < D; d += LANES)
    for (int l = 0; l < LANES; ++l) part[l] += a[d + l] * b[d + l];
  float sum = 0.f;
  for (int l = 0; l < LANES; ++l) sum += part[l];
  return sum;
}

static inline void load_row(const void* base, int64_t row, int64_t D, int bf16, float* dst) {
  if (bf16) {
    const uint16_t* s = (const uint16_t*)base + row * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = bf16_to_float(s[d]);
  } else {
    memcpy(dst, (const float*)base + row * D, D * sizeof(float));
  }
}

int tailrl_paged_attention(const void* q, const void* k_pool, const void* v_pool, const int64_t* table,
                           const int64_t* slots, const uint8_t* mask, void* out, int64_t B, int64_t Q, int64_t H,
                           int64_t KVH, int64_t D, int64_t NBLK, int64_t BS, int64_t W, int64_t K, int bf16,
                           int threads) {
  if (D > MAX_D || D % LANES || H % KVH) return 1;
  const int64_t G = H / KVH, R = G * Q;
  const float scale = 1.f / sqrtf((float)D);
  int failed = 0;
#pragma omp parallel num_threads(threads)
  {
    float* qs = malloc(sizeof(float) * R * D);   /* the item's query rows, scaled */
    float* acc = malloc(sizeof(float) * R * D);  /* sum of p * v per row */
    float* s = malloc(sizeof(float) * R * K);    /* scores, then p */
    float* top = malloc(sizeof(float) * R);
    const uint8_t** sees = malloc(sizeof(void*) * R);
    if (!qs || !acc || !s || !top || !sees) {
#pragma omp atomic write
      failed = 2;
    }
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * KVH; ++item) {
      if (failed) continue;
      const int64_t b = item / KVH, h = item % KVH;
      const int64_t* blocks = table + slots[b] * W;
      for (int64_t g = 0; g < G; ++g) /* row r = g * Q + i: query head h * G + g, query i */
        for (int64_t i = 0; i < Q; ++i) {
          const int64_t r = g * Q + i;
          load_row(q, (b * Q + i) * H + h * G + g, D, bf16, qs + r * D);
          for (int64_t d = 0; d < D; ++d) qs[r * D + d] *= scale;
          sees[r] = mask + (b * Q + i) * K;
          top[r] = UNSEEN;
        }
      for (int64_t j = 0; j < K; ++j) {
        float key[MAX_D];
        int any = 0; /* a key no row sees is never read */
        for (int64_t r = 0; r < R && !any; ++r) any = sees[r][j];
        if (!any) continue;
        load_row(k_pool, (h * NBLK + blocks[j / BS]) * BS + j % BS, D, bf16, key);
        for (int64_t r = 0; r < R; ++r) {
          if (!sees[r][j]) continue;
          const float* qr = qs + r * D;
          const float dot = dot_product(qr, key, D);
          s[r * K + j] = dot;
          if (dot > top[r]) top[r] = dot;
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        float lane[LANES] = {0.f};  /* partial sums by key index mod LANES: the same for any K */
        for (int64_t j = 0; j < K; ++j) {
          const float p = sees[r][j] ? expf(s[r * K + j] - top[r]) : 0.f;
          s[r * K + j] = p;
          lane[j % LANES] += p;
        }
        float sum = 0.f;
        for (int l = 0; l < LANES; ++l) sum += lane[l];
        top[r] = sum > 0.f ? 1.f / sum : 0.f; /* a row that sees no key gets zeros */
        memset(acc + r * D, 0, sizeof(float) * D);
      }
      for (int64_t j = 0; j < K; ++j) {
        float val[MAX_D];
        int any = 0;
        for (int64_t r = 0; r < R && !any; ++r) any = s[r * K + j] != 0.f;
        if (!any) continue;
        load_row(v_pool, (h * NBLK + blocks[j / BS]) * BS + j % BS, D, bf16, val);
        for (int64_t r = 0; r < R; ++r) {
          const float p = s[r * K + j];
          if (p == 0.f) continue;
          float* ar = acc + r * D;
          for (int64_t d = 0; d < D; ++d) ar[d] += p * val[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < Q; ++i) {
          const int64_t r = g * Q + i, o = ((b * Q + i) * H + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) {
            const float x = acc[r * D + d] * top[r];
            if (bf16)
              ((uint16_t*)out)[o + d] = float_to_bf16(x);
            else
              ((float*)out)[o + d] = x;
          }
        }
    }
    free(qs);
    free(acc);
    free(s);
    free(top);
    free(sees);
  }
  return failed;
}
