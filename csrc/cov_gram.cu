// cov_gram.cu — exact float64 Gram matrices of many heads in one pass over the rows, on the
// float64 tensor cores (DMMA). Device code: compiled at first use by NVRTC
// (fastspec/eig/nvrtc.py), one cubin per (D, input dtype, arch), launched by
// fastspec/covariance/gram_cuda.py; also, for tests, by the host C++ compiler into the host twin
// (cov_gram_host.cpp: this code on a software GPU; FS_COV_HOST swaps the two asm statements for
// their software equivalents, nothing else). The launcher sets these macros:
//   FS_COV_D          features per head D: 32, 64, 96 or 128
//   FS_COV_IN         input dtype: 0 bfloat16, 1 float16, 2 float32, 3 float64
//   FS_COV_THREADS    block size: 256 (the warp roles below need exactly 8 warps)
//   FS_COV_ROWS       rows per staged tile (a multiple of 8: each warp stages ROWS / 8 of them)
//   FS_COV_MIN_BLOCKS resident blocks per SM the register budget is sized for (launch bounds)
//
// What it computes. x: [B, T, S, D] of any element strides; rows are (b, t) with t = 0, k, 2k,
// ... (row_step k), N = B * ceil(T / k) of them, taken in order r = b * ceil(T / k) + t / k. For a
// head s, a row is valid when mask[b, t] (or no mask) and its D values are all finite; a row whose
// mask is true but that holds a NaN/±Inf is rejected (counted, never summed). Per head:
//   n[s] = #valid, rejected[s] = #rejected, sum[s] = Σ_valid x, G[s] = Σ_valid x xᵀ,
// every value widened to float64 exactly; a product of two bf16/fp16/fp32 values is exact in
// float64 (8+8, 11+11, 24+24 significand bits <= 53), so only the float64 summation rounds. G is
// formed on its lower triangle and mirrored: exactly symmetric.
//
// Design envelope: D in {32, 64, 96, 128} (a multiple of 32, so the lower triangle splits into
// the 8 warp roles below); bf16/fp16/fp32/fp64 input; sm_80 and newer (DMMA is sm_80+). Tuned
// for the keys update of one layer, B 8 (or 4), T 2048, S 8 heads, D 128, bf16 on an H100 (132
// SMs): N = 16384 rows per head.
//   * grid (SPLIT, S): block (split, s) reduces rows [split * rows_per_split, +rows_per_split) of
//     head s, a fixed split (gram_cuda.plan: a function of N, S, D, dtype and the SM count only),
//     to partials in a float64 workspace part[SPLIT][S][D(D+1)/2 + D] (packed lower triangle of
//     G, then the row sums) and counts[SPLIT][S][2]; fastspec_cov_gram_reduce sums the splits in
//     split order and mirrors G. No atomics anywhere: the same bits every run. Keys shape:
//     SPLIT 32 x S 8 = 256 blocks of 512 rows (256 at B 4), 2 per SM: one wave on 132 SMs.
//   * a block stages tiles of ROWS rows as float64 in shared memory (16 at D = 128, 32 below:
//     the prefetched tile's registers are what the D = 128 budget cannot spare), rows padded to
//     D + 4 doubles (the pad makes the fragment loads below conflict-free: (D + 4) mod 16 = 4),
//     two buffers (one barrier per tile): 2 x 16 x 132 x 8 B = 33.8 KB at D = 128 (51.2 KB at
//     D = 96): two blocks per SM fit in 228 KB (sm_90) and 164 KB (sm_80). Staging: warp w owns
//     rows w*ROWS/8 ... of a tile, lane l its columns l + 32 j (coalesced loads, conflict-free
//     stores); a row's validity is one __all_sync; the lane keeps the running sums of its columns
//     in registers; row addresses are stepped, not recomputed (one division per block). The
//     global loads of tile t + 1 are issued before the tensor-core work of tile t (register
//     prefetch), so their latency hides behind it.
//   * the Gram: G = Σ over 4-row steps of Xᵀ X, on 8x8 tiles (I, J), J <= I, of G: tile += A B with
//     A[m][k] = X[r + k][8I + m], B[k][n] = X[r + k][8J + n], one mma.m8n8k4 .f64 each. The lower
//     triangle is cut into a 4x4 grid of blocks of kB = D/32 tiles a side: 6 off-diagonal blocks
//     (kB^2 tiles each) and 4 diagonal ones (kB(kB+1)/2 tiles each, taken in pairs), and the
//     diagonal pairs hand 3 diagonal tiles each to the off-diagonal warps (FS_COV_ROLES): at
//     D = 128 every warp runs 17 DMMAs per step on 8 fragment loads (+1 for the handed-over tile),
//     136 DMMAs and 70 fragment loads per block and step; accumulators in registers, 2 doubles per
//     tile and lane (68 registers at D = 128).
//   * DMMA fragments (PTX ISA 9.7.14.5.2, mma.m8n8k4 with .f64; CUTLASS's SM80_8x8x4_F64 layouts
//     agree): lane l holds A[l >> 2][l & 3] and B[l & 3][l >> 2] (one double each) and
//     C[l >> 2][2 (l & 3) + v], v = 0, 1 (FS_COV_FRAG_* and FS_COV_ACC_* below). Tested without a
//     GPU two ways that check each other bit for bit (tests/test_cov_gram_cuda.py):
//     tests/_cov_gram_emulation.py, a numpy model of the PTX semantics that takes the kernel's
//     side of the mapping from these macros and re-derives the tiles; and the host twin
//     (cov_gram_host.cpp), this file's own code (addresses, operand order, pair_slot, put, the
//     fetch/advance carries) with a software mma.m8n8k4 per the PTX layout, one fiber per
//     thread. A fragment load: lanes 0-15 read rows r..r+3, columns c..c+3
//     of the padded tile, i.e. doubles k (D + 4) + m: 16 distinct 8-byte bank pairs (2 wavefronts
//     per warp, no conflict).
//   * registers (NVRTC 13.5, sm_90 / sm_80; tests/test_cov_gram_cuda.py checks every D and dtype):
//     D = 128: 128 / 127 (bf16, fp16, fp32; launch bounds 256 x 2), fp64 input 174 / 168 (256 x 1,
//     32-row tiles); D = 96: 112-124; D = 64: 80-95; D = 32: 56-72. No stack, no local memory.
//
// Cost model, keys shape (a PREDICTION, not a measurement: no GPU was at hand when this was
// written). H100 SXM float64 tensor cores: 67 TFLOP/s = 128 DFMA/clk/SM at 1.98 GHz = one
// m8n8k4 (256 DFMA) per 2 clocks per SM, i.e. one per 8 clocks per SM sub-partition (SMSP).
//   * DMMA: N / 4 steps x 136 tiles x S = 4.46 M DMMAs (2.28 GFLOP: the diagonal tiles' upper
//     halves are computed too). A block's step is 136 DMMAs, 34 on each SMSP (warps w and w + 4,
//     17 each): 272 clk per step per block; 2 blocks per SM x 128 steps -> 69.6 k clk = 35 µs.
//   * issue (SASS of NVRTC 13.5 for sm_90): a step's DMMA loop is 49-52 instructions per warp (17
//     DMMAs, each padded with an issue slot, 8-9 LDS.64); staging (96), prefetching (~100) and
//     role set-up (~20) of a 16-row tile add ~55 per step: ~106 per warp and step, 424 per SMSP
//     per 544 clk (4 warps of 2 blocks): 78% of the issue slots. Tight: the DMMA rate is reached
//     only if the barriers and latencies hide in the other 22%.
//   * shared memory: per step 70 fragment loads x 256 B + the staged rows 4 x 128 x 8 B = 22 KB
//     per block, 44 KB per SM per 544 clk (two blocks) = 81 B/clk of the 128 B/clk.
//   * HBM: 33.5 MB in ~40 µs = 0.85 TB/s of 3.35: not the limit; loads run a tile ahead.
//   * the reduction: 32 x 8 x 8384 doubles = 17 MB of partials (mostly from L2) and 1 MB of G
//     written: ~4 µs. Launch gap: ~2 µs.
//   => PREDICTED ~46 µs device time for B 8 (35 µs at the DMMA rate + ~15% for the issue-bound
//      overlap = ~40 µs Gram, + 4 µs reduction + 2 µs), ~25 µs for B 4. The <= 60 µs goal holds if
//      m8n8k4 runs at the full float64 tensor rate on sm_90; if Hopper reaches that rate only
//      with its own shapes (m16n8k{4,8,16} .f64, PTX 7.8), the Gram part doubles (~85 µs) and the
//      next step is those shapes (the same tiles in fewer, larger instructions).
// NVRTC has no standard headers: nothing is included; raw pointers, element strides.

#if !defined(FS_COV_D)
#define FS_COV_D 128
#endif
#if !defined(FS_COV_IN)
#define FS_COV_IN 0
#endif
#if !defined(FS_COV_THREADS)
#define FS_COV_THREADS 256
#endif
#if !defined(FS_COV_ROWS)
#define FS_COV_ROWS 16
#endif
#if !defined(FS_COV_MIN_BLOCKS)
#define FS_COV_MIN_BLOCKS 2
#endif

// Warp roles: warp w takes FS_COV_ROLES[w] = {a, b, g, o} of the 4x4 grid of blocks of the lower
// triangle (block p holds the tile rows/columns p*D/32 ... (p+1)*D/32 - 1):
//   a > b: the off-diagonal block (a, b), plus (D >= 64) the diagonal tile of tile column
//          g*D/32 + D/32 - o, which a diagonal-pair warp hands over;
//   a < b: the diagonal blocks (a, a) and (b, b), less (D >= 64) the last diagonal tile of block a
//          and the last two of block b (the six tiles the off-diagonal warps take; g, o unused).
// D = 128: 16 + 1 and 20 - 3 = 17 tiles for every warp (136 / 8), so the 4 SMSPs get equal work
// and a warp's accumulators take 68 registers (20 tiles would be 80: too many for 2 blocks/SM).
// roles_cover() checks at compile time that every tile of the lower triangle is taken once.
#define FS_COV_ROLES {1, 0, 1, 1}, {2, 0, 0, 1}, {3, 0, 3, 2}, {2, 1, 2, 2}, {3, 1, 3, 1}, {3, 2, 2, 1}, \
                     {0, 3, 0, 0}, {1, 2, 0, 0}

// The kernel's side of the DMMA fragment layout (PTX ISA, mma.m8n8k4 .f64): the lane's element
// of A (row m, column k) and of B (row k, column n), and its two accumulators (row, column v).
#define FS_COV_FRAG_K(lane) ((lane) & 3)
#define FS_COV_FRAG_MN(lane) ((lane) >> 2)
#define FS_COV_ACC_M(lane) ((lane) >> 2)
#define FS_COV_ACC_N(lane, v) (2 * ((lane) & 3) + (v))

namespace fastspec_cov {

constexpr int kD = FS_COV_D;
constexpr int kWarps = 8;
constexpr int kRows = FS_COV_ROWS;
constexpr int kRowsPerWarp = kRows / kWarps;  // rows of a tile one warp stages
constexpr int kSteps = kRows / 4;             // DMMA k-steps per tile
constexpr int kPitch = kD + 4;                // doubles per staged row (bank-conflict pad)
constexpr int kTile = kRows * kPitch;         // doubles per staged tile
constexpr int kB = kD / 32;                   // 8x8 tiles a side of one block; columns a lane stages
constexpr int kTri = kB * (kB + 1) / 2;       // tiles of one diagonal block
constexpr bool kShare = kB >= 2;              // diagonal-pair warps hand 3 diagonal tiles over
constexpr int kOffTiles = kB * kB + kShare;   // tiles of an off-diagonal warp
constexpr int kDiagTiles = 2 * kTri - 3 * kShare;  // tiles of a diagonal-pair warp
constexpr int kAcc = kOffTiles > kDiagTiles ? kOffTiles : kDiagTiles;  // accumulator tiles per warp
constexpr int kPacked = kD * (kD + 1) / 2;    // lower triangle of G, packed row by row
constexpr int kRecord = kPacked + kD;         // one (split, head) partial: packed G, then the sums

static_assert(kD == 32 || kD == 64 || kD == 96 || kD == 128, "FS_COV_D: 32, 64, 96 or 128");
static_assert(FS_COV_IN >= 0 && FS_COV_IN <= 3, "FS_COV_IN: 0 bf16, 1 fp16, 2 fp32, 3 fp64");
static_assert(FS_COV_THREADS == 32 * kWarps, "FS_COV_THREADS: the 8 warp roles need 256 threads");
static_assert(kRows % kWarps == 0 && kRows > 0, "FS_COV_ROWS: a positive multiple of 8");

struct Role {
  int a, b, g, o;
};
constexpr Role kRoles[kWarps] = {FS_COV_ROLES};

// Whether a diagonal-pair warp computes local tile (i, j), j <= i, of its first (second = false)
// or second diagonal block: all but the diagonal tiles it hands over.
__host__ __device__ constexpr bool pair_takes(bool second, int i, int j) {
  return !(kShare && i == j && (i == kB - 1 || (second && i == kB - 2)));
}

// Every tile (I, J), J <= I, of the lower triangle is computed by exactly one warp.
__host__ __device__ constexpr bool roles_cover() {
  constexpr int nt = kD / 8;
  int seen[nt][nt] = {};
  for (int w = 0; w < kWarps; ++w) {
    const Role r = kRoles[w];
    if (r.a < 0 || r.a > 3 || r.b < 0 || r.b > 3 || r.a == r.b) return false;
    for (int i = 0; i < kB; ++i)
      for (int j = 0; j < kB; ++j) {
        if (r.a > r.b) {
          ++seen[kB * r.a + i][kB * r.b + j];
        } else if (j <= i) {
          if (pair_takes(false, i, j)) ++seen[kB * r.a + i][kB * r.a + j];
          if (pair_takes(true, i, j)) ++seen[kB * r.b + i][kB * r.b + j];
        }
      }
    if (r.a > r.b && kShare) {
      const int c = kB * r.g + kB - r.o;
      if (r.o < 1 || r.o > 2 || r.g < 0 || r.g > 3) return false;
      ++seen[c][c];
    }
  }
  for (int I = 0; I < nt; ++I)
    for (int J = 0; J <= I; ++J)
      if (seen[I][J] != 1) return false;
  return true;
}
static_assert(roles_cover(), "FS_COV_ROLES: every tile of the lower triangle must be taken by exactly one warp");

// Accumulator slot of a diagonal-pair warp's local tile (i, j) of its first or second block (tiles
// in row order, skipping those handed over).
__host__ __device__ constexpr int pair_slot(bool second, int i, int j) {
  return second ? (kTri - kShare) + i * (i + 1) / 2 + j - (kShare && i == kB - 1) : i * (i + 1) / 2 + j;
}

// The slots of a diagonal-pair warp's tiles are distinct and within its accumulators.
__host__ __device__ constexpr bool pair_slots_distinct() {
  int used[kAcc] = {};
  for (int blk = 0; blk < 2; ++blk)
    for (int i = 0; i < kB; ++i)
      for (int j = 0; j <= i; ++j)
        if (pair_takes(blk, i, j)) {
          const int t = pair_slot(blk, i, j);
          if (t < 0 || t >= kAcc || used[t]++) return false;
        }
  return true;
}
static_assert(pair_slots_distinct(), "pair_slot: two tiles share an accumulator");
static_assert(kWarps * kD <= kTile, "the row-sum scratch [kWarps][kD] must fit in a staged tile");

// The roles as words of 4-bit fields (a, b, the extra tile's column), so a warp reads its role
// from registers (a table indexed by the warp would go to local or constant memory).
__host__ __device__ constexpr unsigned role_word(int field) {
  unsigned w = 0;
  for (int i = 0; i < kWarps; ++i) {
    const Role r = kRoles[i];
    w |= unsigned(field == 0 ? r.a : field == 1 ? r.b : kShare && r.a > r.b ? kB * r.g + kB - r.o : 0) << (4 * i);
  }
  return w;
}
constexpr unsigned kRoleA = role_word(0), kRoleB = role_word(1), kRoleExtra = role_word(2);

// --- the input dtype: loads, the finiteness test, the exact widening to float64 ---------------

#if FS_COV_IN == 0 || FS_COV_IN == 1
typedef unsigned short Raw;  // bf16 / fp16 bits
#elif FS_COV_IN == 2
typedef float Raw;
#else
typedef double Raw;
#endif

__device__ __forceinline__ Raw load(const Raw* p) { return __ldg(p); }

// Finite: exponent field not all ones (NaN and ±Inf have it all ones, in every format).
__device__ __forceinline__ bool finite_value(Raw v) {
#if FS_COV_IN == 0
  return (v & 0x7f80u) != 0x7f80u;
#elif FS_COV_IN == 1
  return (v & 0x7c00u) != 0x7c00u;
#elif FS_COV_IN == 2
  return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u;
#else
  return (__double2hiint(v) & 0x7ff00000) != 0x7ff00000;
#endif
}

// Exact widening: bf16 is the top half of a float32; fp16 -> float32 by cvt (exact, subnormals
// included); float32 -> float64 is exact.
__device__ __forceinline__ double widen(Raw v) {
#if FS_COV_IN == 0
  return (double)__uint_as_float((unsigned)v << 16);
#elif FS_COV_IN == 1
  float f;
#if defined(FS_COV_HOST)  // the host twin (cov_gram_host.cpp): the same exact conversion in software
  f = ::fastspec_twin::half_to_float(v);
#else
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
#endif
  return (double)f;
#else
  return (double)v;
#endif
}

// c += A B on one 8x8 tile: mma.m8n8k4, float64 in and out (fragments: see the header).
__device__ __forceinline__ void dmma(double (&c)[2], double a, double b) {
#if defined(FS_COV_HOST)  // the host twin (cov_gram_host.cpp): its software mma.m8n8k4 .f64, a warp collective
  ::fastspec_twin::mma_m8n8k4_f64(c, a, b);
#else
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
               : "+d"(c[0]), "+d"(c[1])
               : "d"(a), "d"(b));
#endif
}

}  // namespace fastspec_cov

using namespace fastspec_cov;

// The Gram kernel: grid (splits, S), FS_COV_THREADS threads, 2 * kTile doubles of dynamic shared
// memory. x: the [B, T, S, D] input (element strides sb, st, ss, sd); mask: [B, T] bytes (strides
// mb, mt; nonzero = keep) or null; Tk = ceil(T / row_step) kept rows per sequence; block (split, s)
// takes rows [split * rows_per_split, min(N, (split + 1) * rows_per_split)), rows_per_split a
// multiple of FS_COV_ROWS. Writes part[split][s][kRecord] and counts[split][s][2] (n, rejected).
extern "C" __global__ void __launch_bounds__(FS_COV_THREADS, FS_COV_MIN_BLOCKS)
fastspec_cov_gram(const Raw* __restrict__ x, const unsigned char* __restrict__ mask, double* __restrict__ part,
                  long long* __restrict__ counts, long long B, long long Tk, long long row_step, long long sb,
                  long long st, long long ss, long long sd, long long mb, long long mt, long long rows_per_split) {
  extern __shared__ double smem[];  // two staged tiles [kRows][kPitch]
  __shared__ long long block_counts[kWarps][2];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const long long S = gridDim.y;
  const long long s = blockIdx.y;
  const long long split = blockIdx.x;
  const long long N = B * Tk;
  const long long first = split * rows_per_split;
  const int rows = (int)max(0LL, min(rows_per_split, N - first));  // rows of this block
  const int tiles = (rows + kRows - 1) / kRows;

  const Raw* xs = x + s * ss + lane * sd;  // this lane's first column of head s
  const long long cstride = 32 * sd;         // to the lane's next column (l + 32 j)
  const long long tstride = row_step * st;   // to the next kept row of a sequence
  const long long mtstride = row_step * mt;
  const int tk = (int)Tk;
  // The warp's first row of the current tile, g = first + tile * kRows + warp * kRowsPerWarp, as
  // element offsets into x and mask and its kept position t = g mod Tk. Rows are stepped by one
  // (within a tile) or by kRows (tile to tile) with a carry into the next sequence: no division
  // after this one, no 64-bit multiply per row.
  const long long g0 = first + warp * kRowsPerWarp;
  const long long b0 = tk > 0 ? g0 / tk : 0;
  int tpos = tk > 0 ? (int)(g0 - b0 * tk) : 0;
  long long xoff = b0 * sb + tpos * tstride, moff = b0 * mb + tpos * mtstride;
  const int kq = kRows / max(tk, 1), kr = kRows % max(tk, 1);  // kRows rows = kq sequences + kr
  const long long xwrap = sb - tk * tstride, mwrap = mb - tk * mtstride;  // end of a sequence -> next

  // the tile in flight: raw values of the warp's rows, lane's columns; whether each row is kept
  Raw v[kRowsPerWarp][kB];
  bool keep[kRowsPerWarp];
  auto fetch = [&](int tile) {
    long long xo = xoff, mo = moff;
    int tp = tpos;
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q) {
      const bool in = tile * kRows + warp * kRowsPerWarp + q < rows;
      keep[q] = in && (mask == nullptr || mask[mo] != 0);
#pragma unroll
      for (int j = 0; j < kB; ++j) v[q][j] = in ? load(xs + xo + j * cstride) : Raw(0);
      if (q + 1 < kRowsPerWarp) {
        xo += tstride;
        mo += mtstride;
        if (++tp == tk) {
          tp = 0;
          xo += xwrap;
          mo += mwrap;
        }
      }
    }
  };
  auto advance = [&]() {
    xoff += kq * sb + kr * tstride;
    moff += kq * mb + kr * mtstride;
    tpos += kr;
    if (tpos >= tk) {
      tpos -= tk;
      xoff += xwrap;
      moff += mwrap;
    }
  };

  double colsum[kB];
#pragma unroll
  for (int j = 0; j < kB; ++j) colsum[j] = 0.0;
  int n_valid = 0, n_rejected = 0;  // this warp's rows (the same in every lane)

  double acc[kAcc][2];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i][0] = acc[i][1] = 0.0;

  const int role_a = (kRoleA >> (4 * warp)) & 15;
  const int role_b = (kRoleB >> (4 * warp)) & 15;
  const int role_x = (kRoleExtra >> (4 * warp)) & 15;  // an off-diagonal warp's extra tile (x, x)
  const bool diagonal = role_a < role_b;
  // this lane's fragment element of column group c, step row r: tile[r + FRAG_K][8c + FRAG_MN]
  const int frag = FS_COV_FRAG_K(lane) * kPitch + FS_COV_FRAG_MN(lane);
  const int frag_a = frag + 8 * kB * role_a;  // the first block's tile rows/columns
  const int frag_b = frag + 8 * kB * role_b;  // the second's
  const int frag_x = frag + 8 * role_x;        // the extra diagonal tile's

  if (tiles > 0) fetch(0);
  for (int tile = 0; tile < tiles; ++tile) {
    double* buf = smem + (tile & 1) * kTile;
    // stage: widen, test, zero what is not valid, sum; one row per slot
#pragma unroll
    for (int q = 0; q < kRowsPerWarp; ++q) {
      bool ok = true;
#pragma unroll
      for (int j = 0; j < kB; ++j) ok = ok && finite_value(v[q][j]);
      const bool all_ok = __all_sync(0xffffffffu, ok);
      const bool valid = keep[q] && all_ok;
      n_valid += valid;
      n_rejected += keep[q] && !all_ok;
      double* row = buf + (warp * kRowsPerWarp + q) * kPitch + lane;
#pragma unroll
      for (int j = 0; j < kB; ++j) {
        const double d = valid ? widen(v[q][j]) : 0.0;
        row[32 * j] = d;
        colsum[j] += d;
      }
    }
    __syncthreads();  // the tile is staged; the other buffer's last readers (tile - 1) are done
    if (tile + 1 < tiles) {
      advance();
      fetch(tile + 1);  // in flight during this tile's DMMAs
    }
    // DMMA over the tile: kSteps steps of 4 rows; fragments f[i] (first block), f[kB + i] (second)
    const double* fa = buf + frag_a;
    const double* fb = buf + frag_b;
    if (diagonal) {
#pragma unroll 1
      for (int k = 0; k < kSteps; ++k) {
        double f[2 * kB];
#pragma unroll
        for (int i = 0; i < kB; ++i) {
          f[i] = fa[4 * k * kPitch + 8 * i];
          f[kB + i] = fb[4 * k * kPitch + 8 * i];
        }
#pragma unroll
        for (int i = 0; i < kB; ++i)
#pragma unroll
          for (int j = 0; j <= i; ++j) {
            if (pair_takes(false, i, j)) dmma(acc[pair_slot(false, i, j)], f[i], f[j]);
            if (pair_takes(true, i, j)) dmma(acc[pair_slot(true, i, j)], f[kB + i], f[kB + j]);
          }
      }
    } else {
      const double* fx = buf + frag_x;
#pragma unroll 1
      for (int k = 0; k < kSteps; ++k) {
        double f[2 * kB];
#pragma unroll
        for (int i = 0; i < kB; ++i) {
          f[i] = fa[4 * k * kPitch + 8 * i];
          f[kB + i] = fb[4 * k * kPitch + 8 * i];
        }
#pragma unroll
        for (int i = 0; i < kB; ++i)
#pragma unroll
          for (int j = 0; j < kB; ++j) dmma(acc[i * kB + j], f[i], f[kB + j]);
        if (kShare) {
          const double fd = fx[4 * k * kPitch];
          dmma(acc[kB * kB], fd, fd);
        }
      }
    }
  }

  // partials of this (split, head): packed lower triangle, element (r, c), r >= c, at r (r+1)/2 + c
  double* out = part + (split * S + s) * kRecord;
  const int m = FS_COV_ACC_M(lane);
  auto put = [&](int t, int I, int J) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = 8 * I + m, c = 8 * J + FS_COV_ACC_N(lane, e);
      if (r >= c) out[r * (r + 1) / 2 + c] = acc[t][e];
    }
  };
  if (diagonal) {
#pragma unroll
    for (int i = 0; i < kB; ++i)
#pragma unroll
      for (int j = 0; j <= i; ++j) {
        if (pair_takes(false, i, j)) put(pair_slot(false, i, j), kB * role_a + i, kB * role_a + j);
        if (pair_takes(true, i, j)) put(pair_slot(true, i, j), kB * role_b + i, kB * role_b + j);
      }
  } else {
#pragma unroll
    for (int i = 0; i < kB; ++i)
#pragma unroll
      for (int j = 0; j < kB; ++j) put(i * kB + j, kB * role_a + i, kB * role_b + j);
    if (kShare) put(kB * kB, role_x, role_x);
  }

  // row sums and counts: warps in order (the same order every run)
  __syncthreads();  // every warp is done reading the staged tiles: reuse them as scratch
  double* sums = smem;  // [kWarps][kD]
#pragma unroll
  for (int j = 0; j < kB; ++j) sums[warp * kD + lane + 32 * j] = colsum[j];
  if (lane == 0) {
    block_counts[warp][0] = n_valid;
    block_counts[warp][1] = n_rejected;
  }
  __syncthreads();
  if (threadIdx.x < kD) {
    double total = sums[threadIdx.x];
    for (int w = 1; w < kWarps; ++w) total += sums[w * kD + threadIdx.x];
    out[kPacked + threadIdx.x] = total;
  } else if (threadIdx.x < kD + 2) {
    const int which = threadIdx.x - kD;
    long long total = 0;
    for (int w = 0; w < kWarps; ++w) total += block_counts[w][which];
    counts[(split * S + s) * 2 + which] = total;
  }
}

// The fixed-order reduction of the splits: grid (ceil((kRecord + 2) / 256), S), 256 threads.
// Thread e of head s sums part[0..splits)[s][e] in split order: e < kPacked is G's element (r, c)
// of the packed lower triangle, written to G[s][r][c] and G[s][c][r] (the same double: exactly
// symmetric); then the D row sums (and the center, 0: raw sums); then n and rejected from counts.
// G: [S, D, D], sum and center: [S, D], n and rejected: [S], all contiguous.
// accumulate != 0: G, sum, n and rejected are an accumulator's running totals and the update is
// added to them (total + Σ splits, the additions the Python merge would make, so the same bits;
// center is not written): the merge costs no launch of its own. The thread that owns (r, c) reads
// the total's lower element and writes both mirrors, so the totals stay exactly symmetric, and
// no thread reads an element another one writes.
extern "C" __global__ void __launch_bounds__(256)
fastspec_cov_gram_reduce(const double* __restrict__ part, const long long* __restrict__ counts, long long splits,
                         double* __restrict__ G, double* __restrict__ sum, double* __restrict__ center,
                         long long* __restrict__ n, long long* __restrict__ rejected, int accumulate) {
  const long long S = gridDim.y;
  const long long s = blockIdx.y;
  const int e = blockIdx.x * 256 + threadIdx.x;
  if (e < kRecord) {
    double total = 0.0;
    for (long long k = 0; k < splits; ++k) total += part[(k * S + s) * kRecord + e];
    if (e < kPacked) {
      // row r of packed index e: r (r + 1) / 2 <= e < (r + 1) (r + 2) / 2
      int r = (int)((sqrt(8.0 * e + 1.0) - 1.0) * 0.5);
      while (r * (r + 1) / 2 > e) --r;
      while ((r + 1) * (r + 2) / 2 <= e) ++r;
      const int c = e - r * (r + 1) / 2;
      if (accumulate) total = G[(s * kD + r) * kD + c] + total;
      G[(s * kD + r) * kD + c] = total;
      G[(s * kD + c) * kD + r] = total;
    } else if (accumulate) {
      sum[s * kD + (e - kPacked)] += total;
    } else {
      sum[s * kD + (e - kPacked)] = total;
      center[s * kD + (e - kPacked)] = 0.0;
    }
  } else if (e < kRecord + 2) {
    long long total = 0;
    for (long long k = 0; k < splits; ++k) total += counts[(k * S + s) * 2 + (e - kRecord)];
    long long* out = e == kRecord ? n : rejected;
    out[s] = accumulate ? out[s] + total : total;
  }
}
