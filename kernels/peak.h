/* Register-only multiply-add loops, one per instruction set: the physical peak of
   the cores, which no memory access or BLAS blocking stands between.

   Each loop keeps its accumulators in registers (more of them than the FMA pipes'
   latency times their count, so that every pipe issues every cycle), runs a given
   number of iterations and returns the sum of its accumulators, so that the work
   cannot be dropped and a test can check it was done.  Every loop is compiled for
   its own ISA with a target attribute, so a portable build (no -march) holds all of
   them; adt_peak_isas() says which this CPU and its OS run.

   Per iteration, with c the accumulators and m, a the broadcast inputs:
     ADT_PEAK_AVX2        12 ymm: c = c * m + a (vfmadd), 8 lanes
     ADT_PEAK_AVX512      16 zmm: c = c * m + a, 16 lanes
     ADT_PEAK_AVX512_BF16 16 zmm: c += m*a + m*a (vdpbf16ps on bf16 pairs), 16 lanes
     ADT_PEAK_AMX_BF16    4 tiles of 16 x 16 fp32: c += A B (tdpbf16ps, A 16 x 32 and
                          B 32 x 16 bf16, every element m resp. a), 4 x 256 lanes
   m and a are cut to bf16 (their top 16 bits) for the bf16 loops.  Accumulator k,
   lane l starts at k * lanes + l. */
#ifndef ADT_PEAK_H
#define ADT_PEAK_H

#include <stdint.h>
#include <string.h>

enum {
    ADT_PEAK_AVX2 = 0,
    ADT_PEAK_AVX512 = 1,
    ADT_PEAK_AVX512_BF16 = 2,
    ADT_PEAK_AMX_BF16 = 3,
    ADT_PEAK_N_ISAS = 4
};

/* Accumulators per loop, their lanes, and the flops one lane adds per iteration
   (an fp32 FMA: 2; a bf16 pair dot product: 4; a 16 x 16 x 32 tile product: 64). */
static const int adt_peak_accumulators[ADT_PEAK_N_ISAS] = {12, 16, 16, 4};
static const int adt_peak_lanes[ADT_PEAK_N_ISAS] = {8, 16, 16, 256};
static const int adt_peak_lane_flops[ADT_PEAK_N_ISAS] = {2, 2, 4, 64};

static inline double adt_peak_flops_per_iteration(int isa) {
    return (double)adt_peak_accumulators[isa] * adt_peak_lanes[isa] * adt_peak_lane_flops[isa];
}

static inline void adt_peak_initial(float* init, int isa) {
    for (int i = 0; i < adt_peak_accumulators[isa] * adt_peak_lanes[isa]; i++)
        init[i] = (float)i;
}

static inline double adt_peak_sum(const float* acc, int n) {
    double s = 0.0;
    for (int i = 0; i < n; i++)
        s += acc[i];
    return s;
}

static inline uint16_t adt_peak_bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (uint16_t)(bits >> 16);
}

#if defined(__x86_64__) && defined(__GNUC__)

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

/* The loops' bodies name every accumulator: twelve or sixteen statements. */
#define ADT_PEAK_REP12(S) S(0) S(1) S(2) S(3) S(4) S(5) S(6) S(7) S(8) S(9) S(10) S(11)
#define ADT_PEAK_REP16(S) ADT_PEAK_REP12(S) S(12) S(13) S(14) S(15)

__attribute__((target("avx2,fma")))
static double adt_peak_avx2(int64_t iterations, float mul, float add) {
    float acc[12 * 8];
    adt_peak_initial(acc, ADT_PEAK_AVX2);
    __m256 m = _mm256_set1_ps(mul), a = _mm256_set1_ps(add);
#define LOAD(k) __m256 c##k = _mm256_loadu_ps(acc + 8 * k);
#define STEP(k) c##k = _mm256_fmadd_ps(c##k, m, a);
#define STORE(k) _mm256_storeu_ps(acc + 8 * k, c##k);
    ADT_PEAK_REP12(LOAD)
    for (int64_t i = 0; i < iterations; i++) {
        ADT_PEAK_REP12(STEP)
    }
    ADT_PEAK_REP12(STORE)
#undef LOAD
#undef STEP
#undef STORE
    return adt_peak_sum(acc, 12 * 8);
}

__attribute__((target("avx512f")))
static double adt_peak_avx512(int64_t iterations, float mul, float add) {
    float acc[16 * 16];
    adt_peak_initial(acc, ADT_PEAK_AVX512);
    __m512 m = _mm512_set1_ps(mul), a = _mm512_set1_ps(add);
#define LOAD(k) __m512 c##k = _mm512_loadu_ps(acc + 16 * k);
#define STEP(k) c##k = _mm512_fmadd_ps(c##k, m, a);
#define STORE(k) _mm512_storeu_ps(acc + 16 * k, c##k);
    ADT_PEAK_REP16(LOAD)
    for (int64_t i = 0; i < iterations; i++) {
        ADT_PEAK_REP16(STEP)
    }
    ADT_PEAK_REP16(STORE)
#undef LOAD
#undef STEP
#undef STORE
    return adt_peak_sum(acc, 16 * 16);
}

__attribute__((target("avx512bf16,avx512f")))
static double adt_peak_avx512_bf16(int64_t iterations, float mul, float add) {
    float acc[16 * 16];
    adt_peak_initial(acc, ADT_PEAK_AVX512_BF16);
    /* Both bf16 halves of every 32-bit lane hold m (resp. a). */
    uint32_t mb = adt_peak_bf16_bits(mul), ab = adt_peak_bf16_bits(add);
    __m512bh m = (__m512bh)_mm512_set1_epi32((int)(mb << 16 | mb));
    __m512bh a = (__m512bh)_mm512_set1_epi32((int)(ab << 16 | ab));
#define LOAD(k) __m512 c##k = _mm512_loadu_ps(acc + 16 * k);
#define STEP(k) c##k = _mm512_dpbf16_ps(c##k, m, a);
#define STORE(k) _mm512_storeu_ps(acc + 16 * k, c##k);
    ADT_PEAK_REP16(LOAD)
    for (int64_t i = 0; i < iterations; i++) {
        ADT_PEAK_REP16(STEP)
    }
    ADT_PEAK_REP16(STORE)
#undef LOAD
#undef STEP
#undef STORE
    return adt_peak_sum(acc, 16 * 16);
}

/* The tile configuration (palette 1): eight tiles of 16 rows of 64 bytes. */
struct adt_peak_tilecfg {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

/* Tiles 0-3 accumulate, 4-5 hold A, 6-7 hold B: four independent products per
   iteration, each tile of A and of B used twice. */
__attribute__((target("amx-tile,amx-bf16")))
static double adt_peak_amx_bf16(int64_t iterations, float mul, float add) {
    static const int tile = 16 * 16;
    float acc[4 * 16 * 16];
    uint16_t a_tile[16 * 32], b_tile[16 * 32];
    adt_peak_initial(acc, ADT_PEAK_AMX_BF16);
    uint16_t mb = adt_peak_bf16_bits(mul), ab = adt_peak_bf16_bits(add);
    for (int i = 0; i < 16 * 32; i++) {
        a_tile[i] = mb;
        b_tile[i] = ab;
    }
    struct adt_peak_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
    _tile_loadd(0, acc + 0 * tile, 64);
    _tile_loadd(1, acc + 1 * tile, 64);
    _tile_loadd(2, acc + 2 * tile, 64);
    _tile_loadd(3, acc + 3 * tile, 64);
    _tile_loadd(4, a_tile, 64);
    _tile_loadd(5, a_tile, 64);
    _tile_loadd(6, b_tile, 64);
    _tile_loadd(7, b_tile, 64);
    for (int64_t i = 0; i < iterations; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, acc + 0 * tile, 64);
    _tile_stored(1, acc + 1 * tile, 64);
    _tile_stored(2, acc + 2 * tile, 64);
    _tile_stored(3, acc + 3 * tile, 64);
    _tile_release();
    return adt_peak_sum(acc, 4 * tile);
}

/* Linux gives a process the AMX tile data state only on request. */
#define ADT_ARCH_REQ_XCOMP_PERM 0x1023
#define ADT_XFEATURE_XTILEDATA 18

static int adt_peak_request_amx(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    return syscall(SYS_arch_prctl, ADT_ARCH_REQ_XCOMP_PERM, ADT_XFEATURE_XTILEDATA) == 0;
#else
    return 0;
#endif
}

/* Bit ADT_PEAK_<isa> set for each loop this CPU has and its OS saves the registers
   of (XCR0: ymm for AVX2, opmask and zmm for AVX-512, tile config and data for AMX,
   whose use Linux must also grant this process: a refusal counts as absent). */
static int adt_peak_isas(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx))
        return 0;
    int fma = (ecx >> 12) & 1, osxsave = (ecx >> 27) & 1, avx = (ecx >> 28) & 1;
    if (!(osxsave && avx))
        return 0;
    unsigned int xcr0_lo, xcr0_hi;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    int os_ymm = (xcr0_lo & 0x6) == 0x6;
    int os_zmm = os_ymm && (xcr0_lo & 0xe0) == 0xe0;
    int os_tiles = (xcr0_lo & 0x60000) == 0x60000;
    if (!os_ymm || !__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx))
        return 0;
    int avx2 = (ebx >> 5) & 1, avx512f = (ebx >> 16) & 1;
    int amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
    int max_subleaf = (int)eax;
    int avx512_bf16 = 0;
    if (max_subleaf >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx))
        avx512_bf16 = (eax >> 5) & 1;
    int isas = 0;
    if (avx2 && fma)
        isas |= 1 << ADT_PEAK_AVX2;
    if (avx512f && os_zmm)
        isas |= 1 << ADT_PEAK_AVX512;
    if (avx512f && avx512_bf16 && os_zmm)
        isas |= 1 << ADT_PEAK_AVX512_BF16;
    if (amx_bf16 && amx_tile && os_tiles && adt_peak_request_amx())
        isas |= 1 << ADT_PEAK_AMX_BF16;
    return isas;
}

/* Every checksum is written here too: the loops have no other side effect, and a
   caller that only times one would otherwise see the compiler drop the call. */
static volatile double adt_peak_sink;

/* Runs loop ``isa`` (which adt_peak_isas() must list) and returns its checksum. */
static double adt_peak_run(int isa, int64_t iterations, float mul, float add) {
    double checksum = 0.0;
    switch (isa) {
    case ADT_PEAK_AVX2: checksum = adt_peak_avx2(iterations, mul, add); break;
    case ADT_PEAK_AVX512: checksum = adt_peak_avx512(iterations, mul, add); break;
    case ADT_PEAK_AVX512_BF16: checksum = adt_peak_avx512_bf16(iterations, mul, add); break;
    case ADT_PEAK_AMX_BF16: checksum = adt_peak_amx_bf16(iterations, mul, add); break;
    }
    adt_peak_sink = checksum;
    return checksum;
}

#else  /* not x86-64 with GCC or Clang: no loop to run */

static int adt_peak_isas(void) { return 0; }

static double adt_peak_run(int isa, int64_t iterations, float mul, float add) {
    (void)isa; (void)iterations; (void)mul; (void)add;
    return 0.0;
}

#endif
#endif
