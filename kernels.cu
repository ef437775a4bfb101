// kernels.cu -- every hand-written CUDA kernel of nanoinfer, easy to hard.
//
// Compiled at run time by cupy.RawModule (NVRTC, -arch=sm_90a); CI compiles it with `nvcc -arch=sm_90 -c`. Storage is
// fp16 ("half") or fp32 (the exact-comparison path); accumulation, statistics and softmax are always fp32. Matmul
// weights are (N, K) row-major, so y = x @ w.T reads both operands along K: the tensor cores' "row.col" case, no
// transposes. The KV cache is (num_blocks, block_size, H, 64): a slot is one token's K (or V), all heads. Only
// cuda_fp16.h is included: tensor cores, ldmatrix, cp.async are inline PTX, each before its first user. Contents:
//   L. the kernel ladder  matmul, layernorm, attention from the obvious kernel up (read it first if CUDA is new)
//   1. embed             out = wte[ids] + wpe[positions]: a gather
//   2. cache_write       this step's K and V into their slots of the paged KV cache: a scatter
//   3. layernorm         y = (x - mean) / sqrt(var + eps) * w + b, a block per row
//   4. matmul_blocked    y = epilogue(x @ w.T) on the CUDA cores: shared-memory tiles (fp32's exact path)
//   5. attention_decode  one query row against its paged keys, split along the context (flash-decoding)
//   6. matmul_gemv       y = epilogue(ln(x) @ w.T) for one row of x: warps streaming the weights (fp16 or int8)
//   7. matmul_skinny     the same for 2-8 rows of x, on mma.sync with w as the A operand
//   8. matmul_tc         the tiled tensor-core matmul on wgmma (prefill, decode batches of 9 and more)
//   9. attention_prefill causal FlashAttention-2 over the paged KV cache, on mma.sync
//  10. penalize          the logits processors before sampling: repetition, presence, frequency penalties, bans
//  11. sample            one token per row: greedy, or an exponential race over the kept tokens
//  12. decode_advance    CUDA-graph helper: the next decode step's inputs, made on the GPU
//  13. ngram_propose     CUDA-graph helper: each row's n-gram draft and its verification chunk's inputs
//  14. spec_accept       CUDA-graph helper: the drafts a verification kept, into the token history
//  15. draft_inputs      CUDA-graph helper: a draft model's next forward's inputs, made on the GPU

#include <cuda_fp16.h>
#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu
#define UNROLL _Pragma("unroll")  // the loop after it, fully unrolled

// ---------------------------------------------------------------------------------------------
// common helpers
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half x) { return __half2float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half from_float<half>(float x) { return __float2half_rn(x); }

// 16-byte vectors: the unit of every load and store in the memory-bound kernels
__device__ __forceinline__ uint4 load16(const void* p) { return *reinterpret_cast<const uint4*>(p); }
__device__ __forceinline__ void store16(void* p, uint4 v) { *reinterpret_cast<uint4*>(p) = v; }

// Programmatic dependent launch (sm_90, CudaBackend.launch): in a CUDA graph a kernel may start while the one before
// still runs, reading only weights (no kernel of the step writes them) until wait_for_inputs(), which waits for the
// kernels before (writes visible) and lets the next kernel's blocks onto the SMs to load weights meanwhile; no-ops in a
// plain launch. Inputs the kernel before writes are never __restrict__ (ld.global.nc may read them stale); weights are.
__device__ __forceinline__ void wait_for_inputs() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}
template <typename T, typename Op> __device__ T warp_reduce(T v, Op op) {
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(FULL_MASK, v, off));
    return v;
}
template <typename T, typename Op> __device__ T block_reduce(T v, Op op) {  // every thread gets op over the block
    __shared__ T scratch[32];
    v = warp_reduce(v, op);
    __syncthreads();  // a previous call's readers are done with the scratch
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < (int)(blockDim.x >> 5); w++) v = op(v, scratch[w]);  // the same order in every thread
    return v;
}
template <typename T> __device__ T block_sum(T v) { return block_reduce(v, [](T a, T b) { return a + b; }); }

// Split-K (and split-context attention): each block of a group leaves a partial result in global memory and counts
// itself in; the last to arrive (a counter per group, reset for the next launch) merges them from L2 (__ldcg). One
// acq_rel atomic by thread 0 orders it all: the barrier before it puts the block's writes ahead of its release, the
// barrier after puts the last block's reads behind its acquire (a fence in every thread costs another L2 round trip).
__device__ __forceinline__ bool last_to_arrive(int* counter, int blocks) {  // every thread of the block calls it
    __shared__ int last;
    __syncthreads();
    if (threadIdx.x == 0) {
        int before;
        asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(before) : "l"(counter) : "memory");
        last = before == blocks - 1;
        if (last) *counter = 0;
    }
    __syncthreads();
    return last;
}

__device__ __forceinline__ float gelu_tanh(float x) {
    return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
}

// the fused matmul epilogue, fp32 until the one rounding to the output type; scale: int8 weights' (W8A16) per output
// channel, applied once to its dot product. Output (m, n)'s operands load first (1, 0, 0 if absent: exact, zeros' signs
// aside), so a kernel may load many at once (matmul_tc); scale and bias round twice, as numpy (no FMA).
struct EpilogueOperands { float scale, bias, residual; };
template <typename T>
__device__ __forceinline__ EpilogueOperands epilogue_operands(const float* scale, const T* bias, const T* residual,
                                                              int m, int n, int N) {
    return {scale ? scale[n] : 1.f, bias ? to_float(bias[n]) : 0.f, residual ? to_float(residual[(long)m * N + n]) : 0.f};
}
__device__ __forceinline__ float epilogue_of(float acc, EpilogueOperands o, int gelu) {
    acc = __fadd_rn(__fmul_rn(acc, o.scale), o.bias);
    if (gelu) acc = gelu_tanh(acc);
    return acc + o.residual;
}
template <typename T>
__device__ __forceinline__ float epilogue(float acc, const float* scale, const T* bias, const T* residual, int gelu,
                                          int m, int n, int N) {
    return epilogue_of(acc, epilogue_operands(scale, bias, residual, m, n, N), gelu);
}

// matmul outputs are fp16, or fp32 for the logits (the lm_head's accumulator, never rounded to fp16)
__device__ __forceinline__ void store_y(void* y, long i, float v, int y_f32) {
    if (y_f32) reinterpret_cast<float*>(y)[i] = v;
    else reinterpret_cast<half*>(y)[i] = __float2half_rn(v);
}

// mma.sync, one warp: c (16x8 fp32) += a (16x16 fp16, row) * b (16x8 fp16, col). Thread (g = lane/4, t = lane%4)
// holds a: (g, 2t..2t+1) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..); b: (2t.., g) (2t+8.., g); c: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1).
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// =============================================================================================
// The kernel ladder: matmul, layernorm and attention from the obvious kernel up, one idea a rung. Read it first if
// CUDA is new to you; the engine's own kernels (sections 3-9) are each ladder's last rungs. LLM(kernels="simple")
// runs the engine on each op's first rung (L1, L5, L7); bench.py times every rung at GPT-2's shapes (ladder.py).
// A rung launches plainly, never as a dependent: it does not call wait_for_inputs() (below).
//
// The napkin math, GPT-2 124M on an H200 (~4.8 TB/s of HBM, ~990 dense fp16 TFLOP/s on the tensor cores, ~60 on the
// CUDA cores): a decode step's matmul reads each weight once for 2 FLOPs a row of x, so one row is memory-bound
// (2304 x 768 fp16 weights: 3.5 MB, 0.7 us at best); a 1024-token prefill does 1024 times the FLOPs on the same bytes,
// compute-bound. Every rung below is about moving bytes efficiently, then about feeding the tensor cores.

// L1. matmul_naive: y = epilogue(x @ w.T), a thread an output. Thread n of block (n / 256, m) loops over K alone,
// reading x's row m and w's row n straight from global memory. Neighbouring threads read rows of w K elements apart:
// a warp's load asks for 32 scattered sectors of 32 bytes to use 2 (fp16) of each, so the L1 cache, not HBM, sets
// the pace; and nothing one thread reads is shared with another except through the caches. 2*M*N*K FLOPs.
template <typename T>
__global__ void matmul_naive(const T* x, const T* w, const float* scale, const T* bias, const T* residual, void* y,
                             int M, int N, int K, int gelu, int y_f32) {
    const int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
    if (n >= N) return;
    float acc = 0.f;
    for (int k = 0; k < K; k++) acc += to_float(x[(long)m * K + k]) * to_float(w[(long)n * K + k]);
    store_y(y, (long)m * N + n, epilogue(acc, scale, bias, residual, gelu, m, n, N), y_f32);
}

// L2. matmul_tiled: coalesced loads and shared-memory reuse. A 32 x 32 block of threads, still an output a thread,
// first copies a 32 x 32 tile of x and one of w into shared memory, a thread an element, neighbours reading
// neighbours (a warp's load: 64 or 128 contiguous bytes). Each element copied then serves 32 outputs from shared
// memory: x is read from global memory N/32 times, w M/32 times, where L1 read them N and M times.
template <typename T>
__global__ void __launch_bounds__(1024) matmul_tiled(const T* x, const T* w, T* y, int M, int N, int K) {
    __shared__ float xs[32][33], ws[32][33];  // the +1 column: ws[tx][k] of 32 threads falls in 32 different banks
    const int tx = threadIdx.x, ty = threadIdx.y, m0 = blockIdx.y * 32, n0 = blockIdx.x * 32;
    float acc = 0.f;
    for (int k0 = 0; k0 < K; k0 += 32) {
        const int k = k0 + tx;
        xs[ty][tx] = (m0 + ty < M && k < K) ? to_float(x[(long)(m0 + ty) * K + k]) : 0.f;
        ws[ty][tx] = (n0 + ty < N && k < K) ? to_float(w[(long)(n0 + ty) * K + k]) : 0.f;
        __syncthreads();  // the tiles are whole before anyone reads them
        UNROLL for (int j = 0; j < 32; j++) acc += xs[ty][j] * ws[tx][j];
        __syncthreads();  // everyone is done with them before the next tiles overwrite them
    }
    if (m0 + ty < M && n0 + tx < N) y[(long)(m0 + ty) * N + n0 + tx] = from_float<T>(acc);
}

// L3. register blocking: section 4's matmul_blocked (the engine's exact fp32 path). Each thread owns a 4 x 4 patch of
// y, so one value read from shared memory feeds 4 FMAs instead of 1; shared memory's bandwidth was rung 2's limit.

// L4. matmul_mma: tensor cores. One mma.sync instruction multiplies a 16 x 16 tile of x by a 16 x 8 tile of w.T for
// a whole warp (4,096 FLOPs in fp32 accumulators), where a CUDA core does one FMA a thread. A block of 4 warps owns
// a 64 x 64 tile of y, a warp 32 x 32 of it: 2 x 4 mmas per 16 of K, its operands read from shared memory as pairs
// of halves in the layout PTX's m16n8k16 prescribes (mma16816 above). fp16 only; K a multiple of 16.
extern "C" __global__ void __launch_bounds__(128) matmul_mma(const half* x, const half* w, half* y, int M, int N,
                                                            int K) {
    __shared__ __align__(16) half xs[64][24], ws[64][24];  // 16 of K a row, +8: a fragment's rows hit 8 bank groups
    const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
    const int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64, wm = warp / 2 * 32, wn = warp % 2 * 32;
    const int r = threadIdx.x / 2, c = threadIdx.x % 2 * 8;  // this thread's 16-byte piece of each tile
    auto pair = [](const half* p) { return *reinterpret_cast<const unsigned*>(p); };
    float acc[2][4][4] = {};
    for (int k0 = 0; k0 < K; k0 += 16) {
        store16(&xs[r][c], m0 + r < M ? load16(x + (long)(m0 + r) * K + k0 + c) : make_uint4(0, 0, 0, 0));
        store16(&ws[r][c], n0 + r < N ? load16(w + (long)(n0 + r) * K + k0 + c) : make_uint4(0, 0, 0, 0));
        __syncthreads();
        unsigned a[2][4], b[4][2];
        for (int i = 0; i < 2; i++) {  // rows g and g + 8, K 2t and 2t + 8, of the warp's two 16-row tiles
            const half* p = &xs[wm + i * 16 + g][2 * t];
            a[i][0] = pair(p), a[i][1] = pair(p + 8 * 24), a[i][2] = pair(p + 8), a[i][3] = pair(p + 8 * 24 + 8);
        }
        for (int j = 0; j < 4; j++) {  // w's row g of each 8-row tile: K 2t and 2t + 8
            const half* p = &ws[wn + j * 8 + g][2 * t];
            b[j][0] = pair(p), b[j][1] = pair(p + 8);
        }
        for (int i = 0; i < 2; i++)
            for (int j = 0; j < 4; j++) mma16816(acc[i][j], a[i], b[j]);
        __syncthreads();
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++)
            for (int e = 0; e < 4; e++) {  // the accumulator holds (g, 2t), (g, 2t + 1), (g + 8, 2t), (g + 8, 2t + 1)
                const int m = m0 + wm + i * 16 + g + e / 2 * 8, n = n0 + wn + j * 8 + 2 * t + e % 2;
                if (m < M && n < N) y[(long)m * N + n] = __float2half_rn(acc[i][j][e]);
            }
}

// L5. layernorm_thread: a thread a row, three loops over its C values (the mean, the centred variance as numpy
// computes it, the output). Neighbouring threads read addresses C elements apart, and one decode row is one thread
// of the whole GPU. 2*T*C*sizeof(T) bytes moved, ~8*T*C FLOPs: memory-bound, like every elementwise op.
template <typename T>
__global__ void layernorm_thread(const T* x, const T* w, const T* b, T* y, int rows, int C, float eps) {
    const int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    const T* xr = x + (long)row * C;
    float mean = 0.f, var = 0.f;
    for (int c = 0; c < C; c++) mean += to_float(xr[c]);
    mean /= C;
    for (int c = 0; c < C; c++) var += (to_float(xr[c]) - mean) * (to_float(xr[c]) - mean);
    const float rstd = rsqrtf(var / C + eps);
    for (int c = 0; c < C; c++)
        y[(long)row * C + c] = from_float<T>((to_float(xr[c]) - mean) * rstd * to_float(w[c]) + to_float(b[c]));
}

// L6. layernorm_warp: a warp a row. Lane i reads elements i, i + 32, ...: a warp's load is 64 or 128 contiguous bytes.
// The sums meet across the warp in 5 register shuffles (warp_sum: __shfl_xor_sync), no shared memory, no barrier.
// The engine's layernorm (section 3) then gives a row a block and each thread one 16-byte vector held in registers,
// and a one-row decode fuses it into the next matmul (matmul_gemv's prologue): no kernel, no round trip to memory.
template <typename T>
__global__ void layernorm_warp(const T* x, const T* w, const T* b, T* y, int rows, int C, float eps) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const T* xr = x + (long)row * C;
    float sum = 0.f, sq = 0.f;
    for (int c = lane; c < C; c += 32) sum += to_float(xr[c]);
    const float mean = warp_sum(sum) / C;
    for (int c = lane; c < C; c += 32) sq += (to_float(xr[c]) - mean) * (to_float(xr[c]) - mean);
    const float rstd = rsqrtf(warp_sum(sq) / C + eps);
    for (int c = lane; c < C; c += 32)
        y[(long)row * C + c] = from_float<T>((to_float(xr[c]) - mean) * rstd * to_float(w[c]) + to_float(b[c]));
}

// Attention rungs: one query row r (token row_q[r] of sequence row_seq[r]) against its row_len[r] keys in the paged
// KV cache, out = softmax(q . K^T * scale) V per head. Key j of a sequence lies in slot table[j / bs] * bs + j % bs.
// Memory-bound in decode: 2*L*64*sizeof(T) bytes of K and V for 4*L*64 FLOPs a (row, head).
__device__ __forceinline__ long key_at(const int* table, int j, int block_size, int H, int h) {
    return (((long)table[j / block_size] * block_size + j % block_size) * H + h) * 64;  // K or V of key j, head h
}

// L7. attention_naive: the textbook's three passes, a block of 128 threads a (row, head): every score into shared
// memory (one row of the T x L score matrix; the L-key row fits: max_len * 4 bytes), their max and sum in block-wide
// reductions, then 64 threads a dimension of the output each, walking all L probabilities again. A thread reads a
// whole K row alone (uncoalesced), and in the last pass only two warps of the block work.
template <typename T>
__global__ void __launch_bounds__(128) attention_naive(
    const T* q, int q_stride, const T* k_cache, const T* v_cache, const int* block_tables, int max_blocks,
    int block_size, const int* row_q, const int* row_seq, const int* row_len, int H, float scale, T* out) {
    extern __shared__ float s[];  // (max_blocks * block_size,) scores, then probabilities
    const int r = blockIdx.x, h = blockIdx.y, L = row_len[r];
    const int* table = block_tables + (long)row_seq[r] * max_blocks;
    const T* qh = q + (long)row_q[r] * q_stride + h * 64;
    float mx = NEG_INF, sum = 0.f;
    for (int j = threadIdx.x; j < L; j += blockDim.x) {  // a key a thread
        const T* k = k_cache + key_at(table, j, block_size, H, h);
        float dot = 0.f;
        for (int d = 0; d < 64; d++) dot += to_float(qh[d]) * to_float(k[d]);
        mx = fmaxf(mx, s[j] = dot * scale);
    }
    mx = block_reduce(mx, [](float a, float b) { return fmaxf(a, b); });
    for (int j = threadIdx.x; j < L; j += blockDim.x) sum += s[j] = expf(s[j] - mx);
    sum = block_sum(sum);  // its barriers also make every s[j] visible to every thread
    if (threadIdx.x < 64) {  // a dimension a thread: 64 neighbours read a V row's 64 neighbouring values
        float o = 0.f;
        for (int j = 0; j < L; j++) o += s[j] * to_float(v_cache[key_at(table, j, block_size, H, h) + threadIdx.x]);
        out[((long)row_q[r] * H + h) * 64 + threadIdx.x] = from_float<T>(o / sum);
    }
}

// L8. attention_online: one pass, nothing materialised (FlashAttention's online softmax). A group of 64/VEC lanes
// takes a key, each lane a 16-byte vector of its K and V row (coalesced), 16 (fp16) keys in flight a block. Each
// group keeps a running max m, sum l and output o; a larger score rescales l and o by exp(m_old - m_new), so
// probabilities are never stored. At the end the groups' (m, l, o) merge the same way, in shared memory. The engine's
// attention_decode (section 5) adds what decode needs: the context split over blocks (flash-decoding: 12 heads of one
// sequence would leave 120 of 132 SMs idle), cp.async keeping 7 key tiles in flight, the cache write fused in.
template <typename T>
__global__ void __launch_bounds__(128) attention_online(
    const T* q, int q_stride, const T* k_cache, const T* v_cache, const int* block_tables, int max_blocks,
    int block_size, const int* row_q, const int* row_seq, const int* row_len, int H, float scale, T* out) {
    constexpr int VEC = 16 / sizeof(T), LPK = 64 / VEC, GROUPS = 128 / LPK;  // lanes a key; keys in flight
    __shared__ float gm[GROUPS], gl[GROUPS], go[GROUPS][64];
    const int r = blockIdx.x, h = blockIdx.y, L = row_len[r], group = threadIdx.x / LPK, d0 = threadIdx.x % LPK * VEC;
    const int* table = block_tables + (long)row_seq[r] * max_blocks;
    const uint4 qraw = load16(q + (long)row_q[r] * q_stride + h * 64 + d0);
    float m = NEG_INF, l = 0.f, o[VEC] = {};
    for (int j0 = 0; j0 < L; j0 += GROUPS) {  // j0 is the same in every lane: the shuffles below see whole warps
        const int j = j0 + group;
        uint4 kraw = make_uint4(0, 0, 0, 0), vraw = kraw;
        if (j < L) {
            kraw = load16(k_cache + key_at(table, j, block_size, H, h) + d0);
            vraw = load16(v_cache + key_at(table, j, block_size, H, h) + d0);
        }
        float s = 0.f;
        UNROLL for (int i = 0; i < VEC; i++) s += to_float(reinterpret_cast<const T*>(&qraw)[i]) *
                                                  to_float(reinterpret_cast<const T*>(&kraw)[i]);
        for (int off = LPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);  // the group's dot
        if (j < L) {
            const float m_new = fmaxf(m, s * scale), c = expf(m - m_new), p = expf(s * scale - m_new);
            l = l * c + p;
            UNROLL for (int i = 0; i < VEC; i++) o[i] = o[i] * c + p * to_float(reinterpret_cast<const T*>(&vraw)[i]);
            m = m_new;
        }
    }
    gm[group] = m;  // (every lane of the group writes the same values)
    gl[group] = l;
    UNROLL for (int i = 0; i < VEC; i++) go[group][d0 + i] = o[i];
    __syncthreads();
    if (threadIdx.x < 64) {  // a dimension a thread merges the groups
        float mx = NEG_INF, sum = 0.f, acc = 0.f;
        for (int g = 0; g < GROUPS; g++) mx = fmaxf(mx, gm[g]);
        for (int g = 0; g < GROUPS; g++) {
            sum += gl[g] * expf(gm[g] - mx);
            acc += go[g][threadIdx.x] * expf(gm[g] - mx);
        }
        out[((long)row_q[r] * H + h) * 64 + threadIdx.x] = from_float<T>(acc / sum);
    }
}

// 1. embed: out[t] = wte[input_ids[t]] + wpe[positions[t]]. A gather, memory-bound: 3*T*C*sizeof(T) bytes
// (two rows read, one written) for T*C additions. One block per token, 16-byte vectors.
template <typename T>
__global__ void embed(const T* wte, const T* wpe, const int* ids, const int* pos, T* out, int C) {
    wait_for_inputs();
    constexpr int VEC = 16 / sizeof(T);
    const T* a = wte + (long)ids[blockIdx.x] * C;
    const T* p = wpe + (long)pos[blockIdx.x] * C;
    T* o = out + (long)blockIdx.x * C;
    for (int c = threadIdx.x * VEC; c < C; c += blockDim.x * VEC) {
        uint4 ar = load16(a + c), pr = load16(p + c), r;
        const T *ae = reinterpret_cast<const T*>(&ar), *pe = reinterpret_cast<const T*>(&pr);
        T* re = reinterpret_cast<T*>(&r);
        UNROLL for (int j = 0; j < VEC; j++) re[j] = from_float<T>(to_float(ae[j]) + to_float(pe[j]));
        store16(o + c, r);
    }
}

// 2. cache_write: k_cache.reshape(-1, H*D)[slot_mapping[t]] = k[t] (and v), skipping slot -1 (padding). A scatter,
// memory-bound: 4*T*H*D*sizeof(T) bytes, no arithmetic, a block per token; k, v may be strided qkv views (no copy).
template <typename T>
__global__ void cache_write(const T* k, const T* v, int k_stride, int v_stride, T* k_cache, T* v_cache,
                            const int* slot_mapping, int HD) {
    wait_for_inputs();
    constexpr int VEC = 16 / sizeof(T);
    const long slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    for (int c = threadIdx.x * VEC; c < HD; c += blockDim.x * VEC) {
        store16(k_cache + slot * HD + c, load16(k + (long)blockIdx.x * k_stride + c));
        store16(v_cache + slot * HD + c, load16(v + (long)blockIdx.x * v_stride + c));
    }
}

// 3. layernorm: y = (x - mean) / sqrt(var + eps) * w + b per row, for prefill and decode batches (matmul_gemv fuses it
// for one row). Memory-bound: 2*T*C*sizeof(T) bytes, ~8 FLOPs per element; a decode's few rows, latency-bound. So a
// block a row, a 16-byte vector a thread (C <= 2048: 256 threads in fp16), statistics in two block-wide sums (the mean,
// then the centred sum of squares: no cancellation); gain and bias wait in registers, loaded before the wait. Prefill's
// thousands of rows: a block takes every gridDim-th, loading the next one's x during the sums.
template <typename T>
__global__ void __launch_bounds__(512) layernorm(const T* x, const T* w, const T* b, T* y, int rows, int C, float eps) {
    constexpr int VEC = 16 / sizeof(T);
    const int c = threadIdx.x * VEC;
    const bool mine = c < C;  // the block is whole warps: the last may reach past C
    uint4 wr = make_uint4(0, 0, 0, 0), br = wr, xr = wr;
    if (mine) { wr = load16(w + c); br = load16(b + c); }
    wait_for_inputs();
    const T *we = reinterpret_cast<const T*>(&wr), *be = reinterpret_cast<const T*>(&br);
    if (mine && blockIdx.x < rows) xr = load16(x + (long)blockIdx.x * C + c);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        float v[VEC], sum = 0.f, sq = 0.f;
        const T* xe = reinterpret_cast<const T*>(&xr);
        UNROLL for (int j = 0; j < VEC; j++) sum += v[j] = to_float(xe[j]);
        if (mine && row + gridDim.x < rows) xr = load16(x + (long)(row + gridDim.x) * C + c);  // the next row's
        const float mean = block_sum(sum) / C;
        UNROLL for (int j = 0; j < VEC; j++) sq += mine ? (v[j] - mean) * (v[j] - mean) : 0.f;
        const float rstd = rsqrtf(block_sum(sq) / C + eps);
        if (mine) {
            uint4 out;
            T* oe = reinterpret_cast<T*>(&out);
            UNROLL for (int j = 0; j < VEC; j++) oe[j] = from_float<T>((v[j] - mean) * rstd * to_float(we[j]) + to_float(be[j]));
            store16(y + (long)row * C + c, out);
        }
    }
}

// 4. matmul_blocked: y = epilogue(x @ w.T) on the CUDA cores (no tensor cores): the exact fp32 path, and the ladder's
// rung 3 in fp16. Classic shared-memory tiling: a 64 x 64 tile of y per block, K by 16; each of 256 threads owns a
// 4 x 4 patch, so each shared-memory read feeds 4 FMAs. 2*M*N*K FLOPs; x read N/64 times, w M/64 (L2).
template <typename T> __global__ void __launch_bounds__(256) matmul_blocked(
    const T* x, const T* __restrict__ w, const float* __restrict__ scale, const T* __restrict__ bias,
    const T* residual, T* __restrict__ y, int M, int N, int K, int gelu) {
    wait_for_inputs();
    __shared__ float xs[16][64 + 4], ws[16][64 + 4];  // k-major: the inner loop reads along m and n
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += 16) {
        for (int i = threadIdx.x; i < 64 * 16; i += 256) {
            int r = i / 16, k = k0 + i % 16;  // consecutive threads read consecutive k: coalesced
            xs[i % 16][r] = (m0 + r < M && k < K) ? to_float(x[(long)(m0 + r) * K + k]) : 0.f;
            ws[i % 16][r] = (n0 + r < N && k < K) ? to_float(w[(long)(n0 + r) * K + k]) : 0.f;
        }
        __syncthreads();
        UNROLL for (int k = 0; k < 16; k++)
            UNROLL for (int i = 0; i < 4; i++)
                UNROLL for (int j = 0; j < 4; j++) acc[i][j] += xs[k][ty * 4 + i] * ws[k][tx * 4 + j];
        __syncthreads();
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
            if (m < M && n < N)
                y[(long)m * N + n] = from_float<T>(epilogue(acc[i][j], scale, bias, residual, gelu, m, n, N));
        }
}

// cp.async: copies that hold no registers while they fly; commit closes a group, wait<N> waits till <= N fly
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// 16 bytes global -> shared without passing through registers; src_bytes 0 writes zeros (tile edges)
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// 5. attention_decode: single query rows (decode; all rows on the fp32 path), split along the context (flash-decoding):
// block (row, head, split) takes the row's keys [split*chunk, ...). Memory-bound: 2*len*64*sizeof(T) bytes (K, V) for
// 4*len*64 FLOPs per (row, head). Lane groups of 64/VEC (8 in fp16) take a key each, a lane a 16-byte chunk of its K
// and V; the groups' running max, sum and output merge across the warp, then the 4 warps. Each thread cp.asyncs its own
// chunks of the next 7 key tiles (in flight, no registers held), read by it alone: no barrier. Several splits (so one
// sequence's 12 heads fill 132 SMs) each write normalised output and log-sum-exp; the last to arrive combines:
// out = sum_s w_s o_s / sum_s w_s, w_s = exp2(lse_s - max). The cache write rides along: this step's keys of its
// sequence (its own, len - 1, and its earlier rows': a verification or short prompt chunk's) come from k_new / v_new,
// each row storing its own; without k_new (cache_write ran first), from the cache after the wait.
template <typename T>
__global__ void __launch_bounds__(128) attention_decode(
    const T* q, int q_stride, const T* k_new, const T* v_new, int kv_stride,
    const int* slot_mapping, T* k_cache, T* v_cache, const int* cu_seqlens_q,
    const int* block_tables, int max_blocks, int block_size, const int* row_q, const int* row_seq,
    const int* row_len, int H, float scale_log2, T* out, float* part_o, float* part_lse, int* counters) {
    constexpr int D = 64, VEC = 16 / sizeof(T), LPK = D / VEC, KPW = 32 / LPK;  // lanes per key, keys per warp
    const int r = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = lane / LPK, sub = lane % LPK;
    // Before the wait, what the step doesn't write: row plan, block tables, older keys. >= 32 keys a split
    const int qr = row_q[r], len = row_len[r], nsplit = min((int)gridDim.z, (len + 31) / 32);
    const int own = len - 1, first_new = own - (qr - cu_seqlens_q[row_seq[r]]);  // its key; the first of the step
    if (split >= nsplit) return;
    const int chunk = (len + nsplit - 1) / nsplit, k_begin = split * chunk, k_end = min(len, k_begin + chunk);
    const int* table = block_tables + (long)row_seq[r] * max_blocks;
    auto slot_off = [&](int j) { return (((long)table[j / block_size] * block_size + j % block_size) * H + h) * D; };
    const long new_off = (long)qr * kv_stride + h * D;  // this row's own K and V in k_new / v_new
    auto key_of = [&](const T* step_kv, const T* cache, int j) {  // key (or value) j: this step's from k_new
        return (j >= first_new && k_new ? step_kv + new_off - (long)(own - j) * kv_stride : cache + slot_off(j)) + sub * VEC;
    };
    constexpr int RING = 8;  // key tiles in the ring: RING - 1 in flight while one is read
    __shared__ __align__(16) uint4 ring[RING][2][128];  // [tile][K, V][thread]
    auto fetch = [&](int it) {  // tile it holds key k_begin + 4 KPW it + KPW warp + grp; the first RING - 1 tiles,
        const int j = k_begin + 4 * KPW * it + warp * KPW + grp;  // fetched before the wait, skip this step's keys
        if (j < k_end && (j < first_new || it >= RING - 1)) {
            cp_async16(smem_addr(&ring[it % RING][0][threadIdx.x]), key_of(k_new, k_cache, j), true);
            cp_async16(smem_addr(&ring[it % RING][1][threadIdx.x]), key_of(v_new, v_cache, j), true);
        }
        cp_async_commit();
    };
    for (int it = 0; it < RING - 1; it++) fetch(it);  // the cache's older keys: on their way now
    wait_for_inputs();
    if (k_new && split == nsplit - 1 && threadIdx.x < LPK && slot_mapping[qr] >= 0) {
        const long dst = ((long)slot_mapping[qr] * H + h) * D + threadIdx.x * VEC;
        store16(k_cache + dst, load16(k_new + new_off + threadIdx.x * VEC));
        store16(v_cache + dst, load16(v_new + new_off + threadIdx.x * VEC));
    }

    float qv[VEC], o[VEC], m = NEG_INF, l = 0.f;
    uint4 qraw = load16(q + (long)qr * q_stride + h * D + sub * VEC);
    UNROLL for (int i = 0; i < VEC; i++) { qv[i] = to_float(reinterpret_cast<const T*>(&qraw)[i]) * scale_log2; o[i] = 0.f; }

    for (int it = 0, base = k_begin + warp * KPW; base < k_end; it++, base += 4 * KPW) {  // same trip count for the warp
        cp_async_wait<RING - 2>();  // tile it has landed
        fetch(it + RING - 1);       // into the slot of tile it - 1, used up
        const int j = base + grp;
        const bool ok = j < k_end;
        float s = 0.f;
        uint4 kraw, vraw;
        if (ok && j >= first_new && it < RING - 1) {  // this step's key, not fetched before the wait
            kraw = load16(key_of(k_new, k_cache, j));
            vraw = load16(key_of(v_new, v_cache, j));
        } else if (ok) {
            kraw = ring[it % RING][0][threadIdx.x];
            vraw = ring[it % RING][1][threadIdx.x];
        }
        if (ok) {
            UNROLL for (int i = 0; i < VEC; i++) s += qv[i] * to_float(reinterpret_cast<const T*>(&kraw)[i]);
        }
        for (int off = LPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
        if (ok) {
            float mn = fmaxf(m, s), c = exp2f(m - mn), p = exp2f(s - mn);
            l = l * c + p;
            UNROLL for (int i = 0; i < VEC; i++) o[i] = o[i] * c + p * to_float(reinterpret_cast<const T*>(&vraw)[i]);
            m = mn;
        }
    }
    for (int off = LPK; off < 32; off <<= 1) {  // merge the warp's key groups (lanes with the same sub)
        float m2 = __shfl_xor_sync(FULL_MASK, m, off), l2 = __shfl_xor_sync(FULL_MASK, l, off);
        float mn = fmaxf(m, m2);
        float c1 = mn == NEG_INF ? 0.f : exp2f(m - mn), c2 = mn == NEG_INF ? 0.f : exp2f(m2 - mn);
        UNROLL for (int i = 0; i < VEC; i++) o[i] = o[i] * c1 + __shfl_xor_sync(FULL_MASK, o[i], off) * c2;
        l = l * c1 + l2 * c2;
        m = mn;
    }
    __shared__ float sm_o[4][D], sm_m[4], sm_l[4];  // then the 4 warps
    if (grp == 0) {
        UNROLL for (int i = 0; i < VEC; i++) sm_o[warp][sub * VEC + i] = o[i];
        if (sub == 0) { sm_m[warp] = m; sm_l[warp] = l; }
    }
    __syncthreads();
    const int d = threadIdx.x;
    if (d < D) {
        float mx = fmaxf(fmaxf(sm_m[0], sm_m[1]), fmaxf(sm_m[2], sm_m[3])), L = 0.f, acc = 0.f;
        if (mx != NEG_INF)
            for (int w = 0; w < 4; w++) {
                float c = exp2f(sm_m[w] - mx);
                L += sm_l[w] * c;
                acc += sm_o[w][d] * c;
            }
        if (nsplit == 1) {
            out[((long)qr * H + h) * D + d] = from_float<T>(acc / L);
            return;
        }
        const long pi = ((long)r * H + h) * gridDim.z + split;
        part_o[pi * D + d] = L > 0.f ? acc / L : 0.f;
        if (d == 0) part_lse[pi] = L > 0.f ? mx + log2f(L) : NEG_INF;
    }
    if (nsplit == 1 || !last_to_arrive(&counters[r * H + h], nsplit)) return;
    const long base = ((long)r * H + h) * gridDim.z;
    __shared__ float lse[32];  // nsplit <= 32 (the host plans so); loaded in one round, not one per split
    if (threadIdx.x < nsplit) lse[threadIdx.x] = __ldcg(&part_lse[base + threadIdx.x]);
    __syncthreads();
    if (d >= D) return;
    float mx = NEG_INF, L = 0.f, acc = 0.f;
    for (int s = 0; s < nsplit; s++) mx = fmaxf(mx, lse[s]);  // split 0 is never empty, so mx is finite
#pragma unroll 8
    for (int s = 0; s < nsplit; s++) {
        float c = exp2f(lse[s] - mx);
        L += c;
        acc += c * __ldcg(&part_o[(base + s) * D + d]);
    }
    out[((long)qr * H + h) * D + d] = from_float<T>(acc / L);
}

// weights are read exactly once per matmul: do not let them push x out of L1
__device__ __forceinline__ uint4 load16_stream(const void* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// int8 weights (W8A16), 8 at a time, as 8 halves, exactly (|q| <= 127): byte b placed under the exponent byte 0x64 is
// the half 1024 + (b ^ 0x80), and 1152 (0x6480) less is b. A byte permute and a half2 subtraction a pair: int-to-float
// conversions, 16 an SM a clock, would cost the ALU about what the halved bytes save.
using i8 = signed char;
__device__ __forceinline__ uint4 halves_of_int8(uint2 q) {
    uint4 h;
    unsigned* out = reinterpret_cast<unsigned*>(&h);
    UNROLL for (int i = 0; i < 4; i++) {
        unsigned p = __byte_perm((i < 2 ? q.x : q.y) ^ 0x80808080u, 0x64646464u, i % 2 ? 0x5352 : 0x5150);
        __half2 v = __hsub2(*reinterpret_cast<__half2*>(&p), __half2half2(__ushort_as_half(0x6480)));
        out[i] = *reinterpret_cast<unsigned*>(&v);
    }
    return h;
}
// weights come 16 bytes a load (8 in fp16, 16 in int8), made halves when used: part 0 of a load, or (int8) part 1
template <typename W> __device__ __forceinline__ uint4 halves(uint4 raw, int part);
template <> __device__ __forceinline__ uint4 halves<half>(uint4 raw, int) { return raw; }
template <> __device__ __forceinline__ uint4 halves<i8>(uint4 raw, int part) {
    return halves_of_int8(part ? make_uint2(raw.z, raw.w) : make_uint2(raw.x, raw.y));
}
__device__ __forceinline__ float dot8(uint4 a, uint4 b) {  // 8 halves by 8, summed in fp32
    const half2 *ah = reinterpret_cast<const half2*>(&a), *bh = reinterpret_cast<const half2*>(&b);
    float d = 0.f;
    UNROLL for (int i = 0; i < 4; i++) {
        const float2 u = __half22float2(ah[i]), v = __half22float2(bh[i]);
        d += u.x * v.x + u.y * v.y;
    }
    return d;
}

// dequantize: int8 weights as T, unscaled, for matmul_tc and matmul_blocked (the epilogue scales): 1 + sizeof(T)
// bytes a weight. Neither it nor the next matmul is a dependent launch: kernels load weights before they wait.
template <typename T>
__global__ void dequantize(const i8* q, T* out, long n) {  // n % 8 == 0
    for (long i = (blockIdx.x * (long)blockDim.x + threadIdx.x) * 8; i < n; i += (long)gridDim.x * blockDim.x * 8) {
        uint4 h = halves_of_int8(*reinterpret_cast<const uint2*>(q + i));
        UNROLL for (int j = 0; j < 8; j++) out[i + j] = from_float<T>(__half2float(reinterpret_cast<const half*>(&h)[j]));
    }
}

// 6. matmul_gemv: y = epilogue(ln(x) @ w.T) for one row of x, a single stream's decode (from two rows on matmul_skinny
// wins). Memory-bound: N*K weights read once (2 bytes each, 1 in int8), 2*N*K FLOPs. Warp i takes rows
// [i * rows_per_warp, ...), as many for every warp (else all wait for those with one more), in rounds of R 16-byte
// loads a lane (32 R loads a row), D rounds in flight during one round's dot products (D register buffers, 2 blocks an
// SM). R = 8 (D = 2) suits rows of ~200 loads (fp16 K 1600, one round a row); R = 4 (D = 3) rows of ~100 (gpt2's K 768,
// int8's K 1600), where R = 8 idles most lanes, and matrices up to 8 MB, a third round in flight making up for shorter
// rounds. While the first rounds fly, x goes to shared memory (one L2 read a block), normalised given ln_w (the fused
// layernorm).
template <typename W, int R>
__global__ void __launch_bounds__(256, 2) matmul_gemv(
    const half* x, const W* __restrict__ w, const float* __restrict__ scale, const half* __restrict__ bias,
    const half* residual, void* __restrict__ y, int N, int K, int gelu, int y_f32, const half* __restrict__ ln_w,
    const half* __restrict__ ln_b, float eps, int rows_per_warp) {
    constexpr int E = 16 / sizeof(W), D = R == 4 ? 3 : 2;  // weights a load, rounds in flight
    extern __shared__ __align__(16) unsigned char smem[];
    half* xs = reinterpret_cast<half*>(smem);  // (K,): the row of x, normalised when ln_w is given
    const int lane = threadIdx.x & 31, first = (blockIdx.x * 8 + (threadIdx.x >> 5)) * rows_per_warp;
    const int rounds = (K + R * 32 * E - 1) / (R * 32 * E), Q = max(0, min(rows_per_warp, N - first)) * rounds;
    auto load = [&](uint4 (&buf)[R], int q) {  // round q: row first + q / rounds, its k from 32 R E (q % rounds)
        if (q >= Q) return;
        const W* row = w + (long)(first + q / rounds) * K;
        UNROLL for (int j = 0; j < R; j++) {
            int k = (q % rounds) * R * 32 * E + (j * 32 + lane) * E;
            if (k < K) buf[j] = load16_stream(row + k);
        }
    };
    uint4 buf[D][R], gw, gb;
    UNROLL for (int d = 0; d < D; d++) load(buf[d], d);
    const int k = threadIdx.x * 8;  // the layernorm's 8 values of this thread (K <= 2048)
    if (ln_w && k < K) { gw = load16(ln_w + k); gb = load16(ln_b + k); }
    wait_for_inputs();  // in a graph the first weights (and the layernorm's) are on their way while the kernel before finishes

    if (!ln_w) {  // prologue: the block stages x in shared memory while the weights are on their way
        for (int i = k; i < K; i += 256 * 8) store16(xs + i, load16(x + i));
    } else {  // ... normalised: the mean, then the centred sum of squares (no cancellation)
        float v[8] = {}, sum = 0.f, sq = 0.f;
        if (k < K) {
            uint4 r = load16(x + k);
            UNROLL for (int i = 0; i < 8; i++) sum += v[i] = __half2float(reinterpret_cast<const half*>(&r)[i]);
        }
        const float mean = block_sum(sum) / K;
        UNROLL for (int i = 0; i < 8; i++) sq += k < K ? (v[i] - mean) * (v[i] - mean) : 0.f;
        const float rstd = rsqrtf(block_sum(sq) / K + eps);
        if (k < K) {
            const half *ge = reinterpret_cast<const half*>(&gw), *be = reinterpret_cast<const half*>(&gb);
            uint4 out;
            UNROLL for (int i = 0; i < 8; i++)  // rounded to fp16, as the layernorm kernel writes it
                reinterpret_cast<half*>(&out)[i] = __float2half_rn((v[i] - mean) * rstd * __half2float(ge[i]) + __half2float(be[i]));
            store16(xs + k, out);
        }
    }
    __syncthreads();

    float acc = 0.f;
    auto consume = [&](const uint4 (&buf)[R], int q) {
        if (q >= Q) return;
        UNROLL for (int j = 0; j < R; j++) {
            int k = (q % rounds) * R * 32 * E + (j * 32 + lane) * E;
            if (k >= K) break;
            UNROLL for (int part = 0; part < E / 8; part++) acc += dot8(halves<W>(buf[j], part), load16(xs + k + 8 * part));
        }
        if (q % rounds != rounds - 1) return;
        const int n = first + q / rounds;  // the row is done
        const float dot = warp_sum(acc);
        acc = 0.f;
        if (lane == 0) store_y(y, n, epilogue(dot, scale, bias, residual, gelu, 0, n, N), y_f32);
    };
    for (int q = 0; q < Q; q += D) {  // while one buffer is consumed, the others are on their way
        UNROLL for (int d = 0; d < D; d++) {
            consume(buf[d], q + d);
            load(buf[d], q + d + D);
        }
    }
}

// 7. matmul_skinny: y = epilogue(x @ w.T) for decode batches of 2-8 rows of x and the lm_head of up to 8 (from 9 rows
// on, matmul_tc wins). Memory-bound: 2*M*N*K FLOPs over N*K*2 bytes of weights; a 64-row tile would be mostly empty. A
// block owns 16 rows of w, on the tensor cores with roles swapped: w is the mma's A (16 x k16), the 8 rows of x its B.
// Dot products ignore k's order, so each thread feeds the mma the 8 consecutive k of one 16-byte load (of w and x), not
// the fragment layout's scattered pairs: no shared memory on the way in, w read once (int8: 16 k a load). 4 warps take
// interleaved 64-wide chunks of K, each issuing 4 chunks' loads before its first mma, then sum in shared memory. When N
// gives too few blocks (768 x 3072), K is split over blockIdx.y; the last to arrive sums and runs the epilogue.
template <typename W>
__global__ void __launch_bounds__(128) matmul_skinny(
    const half* x, const W* __restrict__ w, const float* __restrict__ scale, const half* __restrict__ bias,
    const half* residual, void* __restrict__ y, int M, int N, int K, int gelu, int y_f32, int k_per_split, float* partial,
    int* counters) {
    constexpr int U = 4;  // chunks per warp step
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, n0 = blockIdx.x * 16;
    const int k_begin = blockIdx.y * k_per_split, k_end = min(K, k_begin + k_per_split);
    // this thread's k of group hf (of 2) in chunk u: fp16 two loads 32 apart, int8 one load of 16 (see halves)
    constexpr int E = 16 / sizeof(W), LOADS = 16 / E;
    auto k_of = [&](int k, int u, int hf) { return k + 256 * u + (E == 8 ? 32 * hf + 8 * t : 16 * t + 8 * hf); };
    const W* w0 = w + (long)min(n0 + g, N - 1) * K;  // rows past N: a valid row's garbage, never stored
    const W* w1 = w + (long)min(n0 + g + 8, N - 1) * K;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[4] = {};
    bool waited = false;
    for (int k = k_begin + warp * 64; k < k_end; k += 4 * 64 * U) {  // chunk u of this step: k + 256 u
        uint4 a0[U][LOADS], a1[U][LOADS];
        UNROLL for (int u = 0; u < U; u++)
            UNROLL for (int i = 0; i < LOADS; i++) {
                int kk = k_of(k, u, i);
                a0[u][i] = kk < k_end ? load16_stream(w0 + kk) : zero;
                a1[u][i] = kk < k_end ? load16_stream(w1 + kk) : zero;
            }
        if (!waited) wait_for_inputs();  // x comes from the kernel before: the first weights go out first
        waited = true;
        UNROLL for (int u = 0; u < U; u++) {
            uint4 xv[2];
            UNROLL for (int hf = 0; hf < 2; hf++) {
                int kk = k_of(k, u, hf);
                xv[hf] = (kk < k_end && g < M) ? load16(x + (long)g * K + kk) : zero;
            }
            UNROLL for (int hf = 0; hf < 2; hf++) {
                const uint4 r0 = halves<W>(a0[u][hf % LOADS], hf / LOADS), r1 = halves<W>(a1[u][hf % LOADS], hf / LOADS);
                unsigned A0[4] = {r0.x, r1.x, r0.y, r1.y}, A1[4] = {r0.z, r1.z, r0.w, r1.w};
                unsigned B0[2] = {xv[hf].x, xv[hf].y}, B1[2] = {xv[hf].z, xv[hf].w};
                mma16816(acc, A0, B0);
                mma16816(acc, A1, B1);
            }
        }
    }
    if (!waited) wait_for_inputs();  // a warp with no chunk of K
    __shared__ float red[4][4][32];
    UNROLL for (int e = 0; e < 4; e++) red[warp][e][lane] = acc[e];
    __syncthreads();
    if (warp == 0)  // warp 0 finishes: acc[e] is y[m = 2t + (e&1)][n = n0 + g + 8*(e>>1)]
        UNROLL for (int e = 0; e < 4; e++) acc[e] = red[0][e][lane] + red[1][e][lane] + red[2][e][lane] + red[3][e][lane];
    const int m0 = 2 * t;
    if (gridDim.y > 1) {
        UNROLL for (int e = 0; e < 4; e++) {
            int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
            if (warp == 0 && m < M && n < N) partial[((long)blockIdx.y * M + m) * N + n] = acc[e];
        }
        if (!last_to_arrive(&counters[blockIdx.x], gridDim.y) || warp != 0) return;
        for (int sp = 0; sp < (int)gridDim.y; sp++)  // split-major: each split's loads all in flight at once
            UNROLL for (int e = 0; e < 4; e++) {
                int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
                float v = (m < M && n < N) ? __ldcg(&partial[((long)sp * M + m) * N + n]) : 0.f;
                acc[e] = sp == 0 ? v : acc[e] + v;
            }
    }
    if (warp != 0) return;
    UNROLL for (int e = 0; e < 4; e++) {  // epilogue reads first, then the stores
        int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
        acc[e] = (m < M && n < N) ? epilogue(acc[e], scale, bias, residual, gelu, m, n, N) : 0.f;
    }
    UNROLL for (int e = 0; e < 4; e++) {
        int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
        if (m < M && n < N) store_y(y, (long)m * N + n, acc[e], y_f32);
    }
}

// Hopper's warpgroup tensor-core instruction (wgmma, sm_90a): 128 threads multiply a 64 x 16 tile of A by a 16 x N tile
// of B, both in shared memory (64-bit descriptors), into fp32 accumulators; asynchronous: issue, commit, wait. Tiles
// are "K-major, 128-byte swizzle": a row holds 64 halves of K, rows come in groups of 8 (1024 bytes apart), and 16-byte
// chunk c of row r sits at chunk c ^ (r % 8), spreading a group's rows over all banks. The hardware XORs the address
// bits alike: tiles start 1024-byte aligned, and a step along K adds 32 bytes. CI's plain sm_90 build traps.
__device__ __forceinline__ unsigned long long smem_desc(unsigned addr) {
    return ((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);  // 62: 128-byte swizzle
}
// d (64 x N, fp32, N / 2 per thread) += a (64 x 16) @ b (N x 16)^T, for the tile widths matmul_tc uses
#define ACC8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                "+f"(d[i + 6]), "+f"(d[i + 7])
#define WGMMA_ASM(N, REGS, A, B) "{ .reg .pred p; setp.ne.b32 p, 1, 0;\n" \
    "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" REGS "}, " A ", " B ", p, 1, 1, 0, 0; }"
template <int N> __device__ __forceinline__ void wgmma(float (&d)[N / 2], unsigned long long a, unsigned long long b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    if constexpr (N == 32)
        asm volatile(WGMMA_ASM(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16", "%17")
                     : ACC8(0), ACC8(8) : "l"(a), "l"(b));
    else if constexpr (N == 64)
        asm volatile(WGMMA_ASM(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, "
                     "%19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "%32", "%33")
                     : ACC8(0), ACC8(8), ACC8(16), ACC8(24) : "l"(a), "l"(b));
    else if constexpr (N == 128)
        asm volatile(WGMMA_ASM(128,
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
                     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
                     "%59, %60, %61, %62, %63", "%64", "%65")
                     : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56) : "l"(a), "l"(b));
    else static_assert(N == 0, "no wgmma wrapper for this tile width");
#else
    __trap();
#endif
}
#undef ACC8
#undef WGMMA_ASM
__device__ __forceinline__ void wgmma_fence() {  // accumulators written by ordinary instructions: wgmma may use them
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void wgmma_commit_and_wait() {  // all but the last N groups are done
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory");
#endif
}

// 8. matmul_tc: y (M,N) = epilogue(x (M,K) @ w (N,K)^T) on wgmma. Compute-bound at prefill sizes: 2*M*N*K FLOPs over
// (M*K + N*K + M*N) * 2 bytes. A block of BM/64 warpgroups owns a BM x BN tile of y (64 x BN each); K goes by 64
// through a STAGES-deep cp.async pipeline (swizzled as above), STAGES - 1 tiles in flight while the tensor cores take
// one. Tiles filling the SMs (prefill): 3 stages let two blocks share an SM, one computing while the other waits. Fewer
// tiles than SMs: 4 stages or more, a wgmma group running across the barrier. Decode batches of 9-512 rows: 64-row
// tiles, 8 stages, 32 wide while those fill <= 2 blocks an SM (more tiles of fewer k-steps finish sooner), then 64 wide
// in 6 stages; K split over blockIdx.z as in matmul_skinny. int8 weights: dequantize's output.
template <int BM, int BN, int STAGES>
__global__ void __launch_bounds__(BM * 2, 256 / BM) matmul_tc(
    const half* x, const half* __restrict__ w, const float* __restrict__ scale, const half* __restrict__ bias,
    const half* residual, void* __restrict__ y, int M, int N, int K, int gelu, int y_f32, int k_per_split,
    float* partial, int* counters) {
    constexpr int BK = 64, THREADS = BM * 2, RSTEP = THREADS / 8;
    constexpr int A_BYTES = BM * BK * 2, STAGE_BYTES = (BM + BN) * BK * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const unsigned smem = (smem_addr(smem_raw) + 1023) & ~1023u;  // [STAGES][BM + BN rows][128 bytes]
    const int tid = threadIdx.x, m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int kt0 = blockIdx.z * k_per_split / BK, ktiles = (min(K, (blockIdx.z + 1) * k_per_split) + BK - 1) / BK - kt0;
    const int col = tid & 7, r0 = tid >> 3;  // this thread's chunk of K, and its first row
    const unsigned dst = ((r0 * 8 + (col ^ (r0 & 7))) << 4);  // RSTEP is a multiple of 8: same swizzle every row

    // Each thread copies a 16-byte chunk of every RSTEP-th row, at one swizzled column: a row pointer and a fixed
    // stride, so a copy costs a multiply-add, not its row's index math. Rows past M or N, chunks past K (K % 8 == 0
    // suffices): zeros, read from inside the matrix (the thread's last row in range, column 0).
    const int x_rows = (M - m0 - r0 + RSTEP - 1) / RSTEP, w_rows = (N - n0 - r0 + RSTEP - 1) / RSTEP;  // in range
    const half* xr = x + (long)min(m0 + r0, M - 1) * K;
    const half* wr = w + (long)min(n0 + r0, N - 1) * K;
    auto load = [&](unsigned base, const half* r, int rows, int n, int kt) {
        const int k = (kt0 + kt) * BK + col * 8;
        const half* p = r + (k < K ? k : 0);
        for (int i = 0; i < n; i++)  // (unrolled: n is BM or BN over RSTEP)
            cp_async16(base + i * RSTEP * 128, p + (long)min(i, max(rows - 1, 0)) * RSTEP * K, i < rows && k < K);
    };
    auto load_x = [&](int stage, int kt) { load(smem + stage * STAGE_BYTES + dst, xr, x_rows, BM / RSTEP, kt); };
    auto load_w = [&](int stage, int kt) { load(smem + stage * STAGE_BYTES + A_BYTES + dst, wr, w_rows, BN / RSTEP, kt); };

    // STAGES >= 4: one wgmma group runs across the barrier; loads run LAG tiles less ahead, sparing the stages it reads
    constexpr int LAG = STAGES >= 4 ? 1 : 0, AHEAD = STAGES - 1 - LAG;
    for (int s = 0; s < AHEAD; s++)  // the first tiles' weights go out before the wait (no kernel writes them)
        if (s < ktiles) load_w(s, s);
    wait_for_inputs();
    for (int s = 0; s < AHEAD; s++) {  // (the first group carries those weights too)
        if (s < ktiles) load_x(s, s);
        cp_async_commit();
    }
    const int wg = tid / 128;
    // stage 0's descriptors: this warpgroup's 64 rows of x, the BN rows of w
    const unsigned long long x_desc = smem_desc(smem + wg * 64 * 128), w_desc = smem_desc(smem + A_BYTES);
    float acc[BN / 2];  // y[m][n] for m = 16 * warp + lane / 4 (+8), n = 8 j + 2 (lane % 4) (+1): acc[4 j + ...]
    UNROLL for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<AHEAD - 1>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async's writes, visible to wgmma's reads
        __syncthreads();  // tile kt has landed; the stage refilled next was last read by group kt - 1 - LAG, retired
        if (kt + AHEAD < ktiles) {
            load_x((kt + AHEAD) % STAGES, kt + AHEAD);
            load_w((kt + AHEAD) % STAGES, kt + AHEAD);
        }
        cp_async_commit();
        // descriptors count 16 bytes: a stage further is STAGE_BYTES / 16 more, 16 halves along K are 2 more
        const unsigned long long stage = (kt % STAGES) * (STAGE_BYTES / 16);
        wgmma_fence();
        UNROLL for (int kk = 0; kk < BK; kk += 16) wgmma<BN>(acc, x_desc + stage + kk / 8, w_desc + stage + kk / 8);
        wgmma_commit_and_wait<LAG>();
    }
    if constexpr (LAG > 0) wgmma_commit_and_wait<0>();  // (an empty group) the last LAG groups too

    // y's tile goes via the free stages, 16-byte runs a thread: coalesced stores, split-K sums, one epilogue loop
    constexpr int TLD = BN + 8;  // row pitch (floats): the float2 writes miss no bank
    constexpr int RUNS = BM * BN / 4 / THREADS, IN_FLIGHT = RUNS < 8 ? RUNS : 8;  // float4 runs per thread
    static_assert(BM * TLD * 4 <= STAGES * STAGE_BYTES, "the tile of y fits in the pipeline's stages");
    cp_async_wait<0>();
    __syncthreads();
    float* tile = reinterpret_cast<float*>(smem_raw + (smem - smem_addr(smem_raw)));  // (BM, TLD) fp32
    const int lane = tid & 31, rw = wg * 64 + (tid & 127) / 32 * 16 + (lane >> 2), cw = 2 * (lane & 3);
    UNROLL for (int i = 0; i < BN / 2; i += 2)  // acc[4 j + 2 hf + e] is the tile's (rw + 8 hf, 8 j + cw + e)
        *reinterpret_cast<float2*>(&tile[(rw + (i & 2) * 4) * TLD + (i >> 2) * 8 + cw]) = make_float2(acc[i], acc[i + 1]);
    __syncthreads();
    auto run = [&](int u, int& r, int& c) { int q = tid + u * THREADS; r = q / (BN / 4); c = q % (BN / 4) * 4; };
    if (gridDim.z > 1) {  // split-K (N % 4 == 0): leave this split's sums, and the last block adds all up
        UNROLL for (int u = 0; u < RUNS; u++) {
            int r, c;
            run(u, r, c);
            if (m0 + r < M && n0 + c < N)
                *reinterpret_cast<float4*>(&partial[((long)blockIdx.z * M + m0 + r) * N + n0 + c]) =
                    *reinterpret_cast<const float4*>(&tile[r * TLD + c]);
        }
        if (!last_to_arrive(&counters[blockIdx.y * gridDim.x + blockIdx.x], gridDim.z)) return;
        for (int sp = 0; sp < (int)gridDim.z; sp++)  // in split order, its own too: the same sum whichever block is last
            UNROLL for (int u0 = 0; u0 < RUNS; u0 += IN_FLIGHT) {
                float4 v[IN_FLIGHT];  // loads in flight at once (16 would spill)
                UNROLL for (int u = 0; u < IN_FLIGHT; u++) {
                    int r, c;
                    run(u0 + u, r, c);
                    bool ok = m0 + r < M && n0 + c < N;
                    v[u] = ok ? __ldcg(reinterpret_cast<const float4*>(&partial[((long)sp * M + m0 + r) * N + n0 + c]))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
                }
                UNROLL for (int u = 0; u < IN_FLIGHT; u++) {  // each thread adds to its own runs only: no barrier needed
                    int r, c;
                    run(u0 + u, r, c);
                    float4* s = reinterpret_cast<float4*>(&tile[r * TLD + c]);
                    if (sp > 0) v[u] = make_float4(s->x + v[u].x, s->y + v[u].y, s->z + v[u].z, s->w + v[u].w);
                    *s = v[u];
                }
            }
    }
    // 4 runs at a time: all their epilogue operands in flight together (not an L2 round trip each), then the stores
#pragma unroll 1
    for (int u0 = 0; u0 < RUNS; u0 += 4) {
        EpilogueOperands ops[4][4];
        UNROLL for (int u = 0; u < 4; u++) {
            int r, c;
            run(u0 + u, r, c);
            UNROLL for (int e = 0; e < 4; e++)  // past the edge: read (inside the matrices), not used
                ops[u][e] = epilogue_operands(scale, bias, residual, min(m0 + r, M - 1), min(n0 + c + e, N - 1), N);
        }
        UNROLL for (int u = 0; u < 4; u++) {
            int r, c;
            run(u0 + u, r, c);
            const int row = m0 + r, col = n0 + c;
            if (row >= M || col >= N) continue;
            float v[4];
            UNROLL for (int e = 0; e < 4; e++) v[e] = epilogue_of(tile[r * TLD + c + e], ops[u][e], gelu);
            if (!y_f32 && N % 4 == 0) {  // 4 halves, one 8-byte store
                half2 h[2] = {__floats2half2_rn(v[0], v[1]), __floats2half2_rn(v[2], v[3])};
                *reinterpret_cast<uint2*>(reinterpret_cast<half*>(y) + (long)row * N + col) = *reinterpret_cast<uint2*>(h);
            } else {
                for (int e = 0; e < 4 && col + e < N; e++) store_y(y, (long)row * N + col + e, v[e], y_f32);
            }
        }
    }
}

// ldmatrix: four 8x8 tiles of halves (a row address a lane) into mma fragments (.trans: transposed)
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ unsigned pack_half2(float lo, float hi) {
    half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&h);
}

// 9. attention_prefill: causal FlashAttention-2 (fp16, head_dim 64) for (chunked) prefill over the paged KV cache.
// Compute-bound (long prompts): 4*64 FLOPs per (query, visible key, head); Q, O read once, K, V once per query tile
// (mostly L2). A block: 64 queries of one (sequence, head), 8 warps: warps w and w + 4 take queries 16w..16w+15, keys
// 0-31 and 32-63 of each key tile, each with its own running max, sum and output, merged at the end: half the serial
// work a tile, twice the warps to hide latency where few blocks run. K, V stream by 64 rows through shared memory
// (cp.async, 2 buffers); S = QK^T and O += PV on tensor cores, S in registers (online softmax). Few tiles over a long
// context (a prompt's last chunk after a cached prefix) would idle most SMs: then gridDim.z blocks split the key tiles,
// merged as in attention_decode (2*4*64*nsplit bytes more a (query, head): fp32 outputs written, read back).
extern "C" __global__ void __launch_bounds__(256) attention_prefill(
    const half* __restrict__ q, int q_stride, const half* __restrict__ k_cache, const half* __restrict__ v_cache,
    const int* block_tables, int max_blocks, int block_size, const int* cu_seqlens_q, const int* context_lens,
    const int* tile_seq, const int* tile_q0, int H, float scale_log2, half* out, float* part_o, float* part_lse,
    int* counters) {
    wait_for_inputs();
    constexpr int BQ = 64, BKV = 64, D = 64, LD = D + 8;  // 144-byte rows: ldmatrix without bank conflicts
    __shared__ __align__(16) half Qs[BQ * LD];
    __shared__ __align__(16) half Ks[2][BKV * LD];
    __shared__ __align__(16) half Vs[2][BKV * LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = (tid >> 5) & 3, g = lane >> 2, t = lane & 3;
    const int kh = tid >> 7;  // the half of each key tile this warp takes: keys 32 * kh .. 32 * kh + 31
    const int s = tile_seq[blockIdx.x], h = blockIdx.y, q0 = tile_q0[blockIdx.x];
    const int q_begin = cu_seqlens_q[s], n_q = cu_seqlens_q[s + 1] - q_begin, ctx = context_lens[s];
    const int pos0 = ctx - n_q + q0;                          // position of the tile's first query
    const int n_tiles = min(pos0 + BQ - 1, ctx - 1) / BKV + 1;  // key tiles up to the last visible key
    const int asked = min((int)gridDim.z, n_tiles), chunk = (n_tiles + asked - 1) / asked;  // key tiles a split
    const int nsplit = (n_tiles + chunk - 1) / chunk, split = blockIdx.z;  // so that no split is left empty
    if (split >= nsplit) return;
    const int kt_begin = split * chunk, kt_end = min(n_tiles, kt_begin + chunk);  // this block's key tiles
    const int* table = block_tables + (long)s * max_blocks;

    for (int c = tid; c < BQ * 8; c += 256) {
        int r = c >> 3, col = (c & 7) * 8;
        bool ok = q0 + r < n_q;
        cp_async16(smem_addr(&Qs[r * LD + col]), q + (long)(q_begin + q0 + (ok ? r : 0)) * q_stride + h * D + col, ok);
    }
    auto load_kv = [&](int buf, int kt) {
        for (int c = tid; c < BKV * 8; c += 256) {
            int r = c >> 3, col = (c & 7) * 8, j = kt * BKV + r;
            bool ok = j < ctx;  // never read past the context: those slots hold anything, NaN included
            long slot = ok ? (long)table[j / block_size] * block_size + j % block_size : 0;
            long off = (slot * H + h) * D + col;
            cp_async16(smem_addr(&Ks[buf][r * LD + col]), k_cache + off, ok);
            cp_async16(smem_addr(&Vs[buf][r * LD + col]), v_cache + off, ok);
        }
    };
    load_kv(kt_begin & 1, kt_begin);
    cp_async_commit();

    float o[8][4] = {}, m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    unsigned qf[4][4];
    for (int kt = kt_begin; kt < kt_end; kt++) {
        if (kt + 1 < kt_end) load_kv((kt + 1) & 1, kt + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (kt == kt_begin)
            for (int d = 0; d < 4; d++)
                ldmatrix_x4(qf[d], smem_addr(&Qs[(warp * 16 + (lane & 15)) * LD + d * 16 + (lane >> 4) * 8]));
        const half *ks = Ks[kt & 1], *vs = Vs[kt & 1];

        float sc[4][4] = {};  // S for this warp's 16 queries x its 32 keys
        UNROLL for (int d = 0; d < 4; d++)
            UNROLL for (int np = 0; np < 2; np++) {
                unsigned r[4];
                ldmatrix_x4(r, smem_addr(&ks[(kh * 32 + np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + d * 16 + ((lane >> 3) & 1) * 8]));
                unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma16816(sc[2 * np], qf[d], b0);
                mma16816(sc[2 * np + 1], qf[d], b1);
            }
        UNROLL for (int hf = 0; hf < 2; hf++) {  // causal mask, online softmax (log2 domain) of rows g, g+8
            const int pos = pos0 + warp * 16 + g + hf * 8;
            float mx = m[hf];
            UNROLL for (int nt = 0; nt < 4; nt++)
                UNROLL for (int e = 0; e < 2; e++) {
                    int j = kt * BKV + kh * 32 + nt * 8 + 2 * t + e;
                    float v = j > pos ? NEG_INF : sc[nt][2 * hf + e] * scale_log2;
                    sc[nt][2 * hf + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            // a split after the first may hold no key a query sees yet (mx -inf): then every p and corr is 0, not NaN
            const float ms = mx == NEG_INF ? 0.f : mx, corr = exp2f(m[hf] - ms);
            m[hf] = mx;
            l[hf] *= corr;
            UNROLL for (int dt = 0; dt < 8; dt++) { o[dt][2 * hf] *= corr; o[dt][2 * hf + 1] *= corr; }
            UNROLL for (int nt = 0; nt < 4; nt++)
                UNROLL for (int e = 0; e < 2; e++) {
                    float p = exp2f(sc[nt][2 * hf + e] - ms);
                    sc[nt][2 * hf + e] = p;
                    l[hf] += p;
                }
        }
        UNROLL for (int kk = 0; kk < 2; kk++) {  // O += P V: S's accumulators are already the A operand
            unsigned pa[4] = {pack_half2(sc[2 * kk][0], sc[2 * kk][1]), pack_half2(sc[2 * kk][2], sc[2 * kk][3]),
                              pack_half2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), pack_half2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
            UNROLL for (int dp = 0; dp < 4; dp++) {
                unsigned r[4];
                ldmatrix_x4_trans(r, smem_addr(&vs[(kh * 32 + kk * 16 + (lane & 15)) * LD + dp * 16 + (lane >> 4) * 8]));
                unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma16816(o[2 * dp], pa, b0);
                mma16816(o[2 * dp + 1], pa, b1);
            }
        }
        __syncthreads();  // the next iteration refills the buffer just read
    }
    {   // warps 4-7 hand their key half's state to warps 0-3 (same query rows), merged as splits are, through Ks
        static_assert(4 * 32 * 36 * sizeof(float) <= sizeof(Ks), "warps 4-7's states fit in Ks");
        float* xo = reinterpret_cast<float*>(&Ks[0][0]) + ((warp * 32 + lane) * 36);  // 32 of o, 2 of m, 2 of l
        if (kh == 1) {
            UNROLL for (int dt = 0; dt < 8; dt++) UNROLL for (int e = 0; e < 4; e++) xo[dt * 4 + e] = o[dt][e];
            xo[32] = m[0]; xo[33] = m[1]; xo[34] = l[0]; xo[35] = l[1];
        }
        __syncthreads();
        if (kh == 0) {
            UNROLL for (int hf = 0; hf < 2; hf++) {
                const float m1 = xo[32 + hf], mx = fmaxf(m[hf], m1), ms = mx == NEG_INF ? 0.f : mx;
                const float c0 = exp2f(m[hf] - ms), c1 = exp2f(m1 - ms);
                l[hf] = l[hf] * c0 + xo[34 + hf] * c1;
                m[hf] = mx;
                UNROLL for (int dt = 0; dt < 8; dt++)
                    UNROLL for (int e = 0; e < 2; e++) o[dt][2 * hf + e] = o[dt][2 * hf + e] * c0 + xo[dt * 4 + 2 * hf + e] * c1;
            }
        }
    }
    if (kh == 0) UNROLL for (int hf = 0; hf < 2; hf++) {
        float sum = l[hf];
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const int r = warp * 16 + g + hf * 8, qi = q0 + r;
        if (qi >= n_q) continue;
        if (nsplit == 1) {
            half* dst = out + ((long)(q_begin + qi) * H + h) * D + 2 * t;
            UNROLL for (int dt = 0; dt < 8; dt++)
                *reinterpret_cast<half2*>(dst + dt * 8) = __floats2half2_rn(o[dt][2 * hf] / sum, o[dt][2 * hf + 1] / sum);
            continue;
        }
        const long pi = (((long)blockIdx.x * BQ + r) * H + h) * gridDim.z + split;  // (tile row, head, split)
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        UNROLL for (int dt = 0; dt < 8; dt++)
            *reinterpret_cast<float2*>(&part_o[pi * D + dt * 8 + 2 * t]) = make_float2(o[dt][2 * hf] * inv, o[dt][2 * hf + 1] * inv);
        if (t == 0) part_lse[pi] = sum > 0.f ? m[hf] + log2f(sum) : NEG_INF;
    }
    if (nsplit == 1 || !last_to_arrive(&counters[blockIdx.x * H + h], nsplit)) return;
    // the merge: a thread takes 8 outputs of a row, all splits' lse and values loaded at once; absent splits weigh 0
    for (int c = tid; c < BQ * 8 && q0 + (c >> 3) < n_q; c += 256) {
        const int r = c >> 3, d0 = (c & 7) * 8;
        const long base = (((long)blockIdx.x * BQ + r) * H + h) * gridDim.z;
        float lse[8], mx = NEG_INF, L = 0.f, acc[8] = {};  // nsplit <= 8: the host plans so (prefill_splits)
        float4 v[8][2] = {};
        UNROLL for (int sp = 0; sp < 8; sp++) {
            const float4* src = reinterpret_cast<const float4*>(&part_o[(base + sp) * D + d0]);
            lse[sp] = sp < nsplit ? __ldcg(&part_lse[base + sp]) : NEG_INF;
            if (sp < nsplit) { v[sp][0] = __ldcg(src); v[sp][1] = __ldcg(src + 1); }
            mx = fmaxf(mx, lse[sp]);
        }
        UNROLL for (int sp = 0; sp < 8; sp++) {  // split 0 sees key 0, so mx is finite
            const float w = exp2f(lse[sp] - mx), *f = reinterpret_cast<const float*>(v[sp]);
            L += w;
            UNROLL for (int i = 0; i < 8; i++) acc[i] += w * f[i];
        }
        uint4 o8;
        UNROLL for (int i = 0; i < 4; i++) reinterpret_cast<half2*>(&o8)[i] = __floats2half2_rn(acc[2 * i] / L, acc[2 * i + 1] / L);
        store16(out + ((long)(q_begin + q0 + r) * H + h) * D + d0, o8);
    }
}

// 10. penalize: NumpyBackend.penalize, a thread per (row, token) entry, each pair listed once (no two threads write
// one logit). Only the logits of tokens a sequence has seen or biases change: ~56 bytes per entry.
extern "C" __global__ void penalize(float* logits, int V, const int* rows, const int* ids, const int* output_counts,
    const bool* banned, int E, const float* repetition, const float* presence, const float* frequency,
    const float* bias) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    const int row = rows[e], n = output_counts[e];
    float* x = logits + (long)row * V + ids[e];
    const float r = repetition[e], v = *x > 0.f ? *x / r : *x * r;
    *x = banned[e] ? NEG_INF : v - frequency[row] * n - (n > 0 ? presence[row] : 0.f) + bias[e];
}

// 11. sample: a token per row (nanoinfer.sample_row). Greedy: the first argmax. Otherwise the exponential race
// (Gumbel-max): of the tokens the filters keep, the largest logit / T + gumbel(seed, token index, token id), so no
// other row can move it. Each filter is a threshold (kept: logit >= t): mostly only top logits matter. Two kernels, a
// row split so batch 1 fills the GPU: sample_pass, a warp per 512 logits (max, race winner, sum of p; if filtered, its
// 8-16 largest logits as candidates, the largest kept back as bound); sample_pick, a block a row (the race's winner if
// kept; else the thresholds over the head, the candidates above every bound, if it holds the kept set; else the exact
// way, the whole row). Masses are integers (p in 2^-31 units): order-free sums. 4 bytes a logit, read once.
constexpr int SAMPLE_MIN = 8, SAMPLE_CAP = 16;  // the candidates a warp of the pass hands on
constexpr int SAMPLE_THREADS = 256, SAMPLE_HEAD = 2048;  // the pick's block, its head (W <= 128)

__device__ __forceinline__ unsigned order_key(float x) {  // unsigned integers that order as the floats do
    const unsigned u = __float_as_uint(x);  // negative: all bits flipped; else the sign bit set
    return u ^ ((unsigned)((int)u >> 31) | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) { return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k); }

__device__ __forceinline__ unsigned long long sample_key(unsigned long long seed, int token_index) {  // splitmix64
    unsigned long long z = seed + (unsigned long long)(token_index + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// the race's noise in base 2: -log2(-log2(u)) = (gumbel + ln ln 2) / ln 2, so logit * log2(e) / T + this is the same
// race in fewer instructions. Winners come from u near 1, where lg2.approx's absolute error (2^-22) swamps -log2(u):
__device__ __forceinline__ float lg2_approx(float x) {  // MUFU.LG2 alone: x is never denormal here (__log2f checks)
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float race_noise(unsigned long long key, int token) {  // u from murmur3's finalizer
    unsigned h = (unsigned)token * 0x9E3779B1u + (unsigned)key;
    h ^= (unsigned)(key >> 32);
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    const float u = __uint_as_float(0x3f800000u | (h >> 9)) - 0.99999994f;  // (h >> 9 + 0.5) / 2^23, exactly
    const float d = 1.f - u;  // exact. -log2(1 - d) = log2(e) (d + d^2/2 + ...): five terms below d = 1/16
    const float series = d * (1.44269504f + d * (0.72134752f + d * (0.48089835f + d * (0.36067376f + d * 0.28853901f))));
    return -lg2_approx(d < 0.0625f ? series : -lg2_approx(u));
}

__device__ __forceinline__ unsigned long long warp_max(unsigned long long v) {  // two redux.sync, not 10 shuffles
    const unsigned hi = __reduce_max_sync(FULL_MASK, (unsigned)(v >> 32));
    return (unsigned long long)hi << 32 | __reduce_max_sync(FULL_MASK, (unsigned)(v >> 32) == hi ? (unsigned)v : 0u);
}
struct Max64 { __device__ auto operator()(unsigned long long a, unsigned long long b) const { return max(a, b); } };
__device__ unsigned long long warp_reduce(unsigned long long v, Max64) { return warp_max(v); }  // block_max's warps
__device__ unsigned long long block_max(unsigned long long v) { return block_reduce(v, Max64{}); }
// (value, index) as one integer whose max is the largest value, ties to the least index: argmax in one reduction
__device__ __forceinline__ unsigned long long ranked(float v, int i) {
    return (unsigned long long)order_key(v) << 32 | ~(unsigned)i;
}

struct Filters {  // one row's sampling parameters
    float T, m;               // temperature; the row's largest logit (the pick's)
    float inv_t, race_scale;  // 1 / T; log2(e) / T, a logit's share of its race score (race_noise's units)
    float top_p, min_p;
    int top_k;                // 0: off (also for k >= V)
    unsigned long long key;   // the race's noise key: splitmix64(seed, token index)
    __device__ bool races_all() const { return top_k == 0 && top_p >= 1.f && min_p <= 0.f; }
    __device__ float prob(float x) const { return __expf((x - m) * inv_t); }  // p relative to the most likely's
    __device__ unsigned long long race(float x, int i) const {  // the race's entry of logit x, token i
        return ranked(x * race_scale + race_noise(key, i), i);
    }
};
__device__ Filters row_filters(int r, int V, const float* temperature, const int* top_k, const float* top_p,
                               const float* min_p, const unsigned long long* seed, const int* token_index) {
    const float inv_t = __frcp_rn(temperature[r]);  // 1 / T rounded as the division rounds it, without its slow path
    return {temperature[r], NEG_INF, inv_t, 1.4426950408889634f * inv_t, top_p[r], min_p[r],
            top_k[r] < V ? top_k[r] : 0, sample_key(seed[r], token_index[r])};
}
__device__ __forceinline__ unsigned long long fixed_p(float p) { return (unsigned)(p * 2147483648.f); }
__device__ __forceinline__ unsigned long long top_p_target(const Filters& f, unsigned long long total) {
    return (unsigned long long)((double)f.top_p * total);
}

// The kept set and its race, over n entries in shared memory (the head, or the exact way's whole row); at(i): entry i's
// logit and token id. Each threshold by bisection over order keys: the largest t whose logits >= t meet a need (top-k:
// k of them; top-p: top_p of the mass), from lo, where they do. Each step's pass also finds the nearest logits above
// and below t and moves an end onto one, stopping at a logit once one is left between ends (~log2 n steps).
struct Entry { float x; int id; };
struct Above { int n; unsigned long long mass; unsigned least, most; };  // >= t: how many, their p; the least key >= t,
template <typename Op> __device__ Above warp_reduce(Above a, Op op) {   // the largest key < t. A redux.sync a field:
    const unsigned hi = __reduce_add_sync(FULL_MASK, (unsigned)(a.mass >> 16));  // a thread's mass < 2^40
    return {(int)__reduce_add_sync(FULL_MASK, (unsigned)a.n),
            ((unsigned long long)hi << 16) + __reduce_add_sync(FULL_MASK, (unsigned)(a.mass & 0xffff)),
            __reduce_min_sync(FULL_MASK, a.least), __reduce_max_sync(FULL_MASK, a.most)};
}
template <typename At> __device__ Above above(At at, int n, float t, const Filters& f, bool mass) {
    Above a = {0, 0ull, ~0u, 0u};
    const unsigned kt = order_key(t);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float x = at(i).x;
        const unsigned k = order_key(x);
        if (k >= kt) { a.n++; a.mass += mass ? fixed_p(f.prob(x)) : 0ull; a.least = min(a.least, k); }
        else a.most = max(a.most, k);
    }
    return block_reduce(a, [](Above a, Above b) {
        return Above{a.n + b.n, a.mass + b.mass, min(a.least, b.least), max(a.most, b.most)};
    });
}
template <typename At, typename Need>
__device__ float threshold(At at, int n, const Filters& f, float lo, bool mass, Need need) {
    unsigned a = order_key(lo), b = order_key(f.m) + 1;  // need holds at a, fails at b (no logit is >= b)
    while (b - a > 1) {
        const Above c = above(at, n, key_float(a + (b - a) / 2), f, mass);
        if (need(c)) a = c.least;  // the same logits are >= their least
        else b = c.most + 1;       // none lies between the largest below the midpoint and it
    }
    return key_float(a);
}
// total: the mass top-p cuts from, when top-k is off (the row's); top-k's is found here
template <typename At> __device__ int sample_kept(At at, int n, const Filters& f, float lo, unsigned long long total) {
    if (f.top_k > 0) lo = threshold(at, n, f, lo, false, [&](Above c) { return c.n >= f.top_k; });
    if (f.top_p < 1.f) {
        if (f.top_k > 0) total = above(at, n, lo, f, true).mass;
        const unsigned long long target = top_p_target(f, total);
        lo = threshold(at, n, f, lo, true, [&](Above c) { return c.mass >= target; });
    }
    unsigned long long best = 0;  // the race: every logit >= lo that min-p keeps
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const Entry e = at(i);
        if (e.x >= lo && (f.min_p <= 0.f || f.prob(e.x) >= f.min_p)) best = max(best, f.race(e.x, e.id));
    }
    return ~(unsigned)block_max(best);
}

struct WarpSummary {               // one warp's share of a row, for the pick:
    unsigned long long top, race;  // its largest logit and its race's winner (ranked)
    float sumexp, bound;           // sum exp((logit - its max) / T), for top-p alone; the largest logit not handed on
};

// The pass: warp w of a row takes logits w * 512 + lane + 32 j, j < 16, in registers; warps alone, no block barrier
extern "C" __global__ void __launch_bounds__(256) sample_pass(
    const float* logits, int V, int W, const float* temperature, const int* top_k, const float* top_p,
    const float* min_p, const unsigned long long* seed, const int* token_index, WarpSummary* summary,
    unsigned long long* candidates) {
    wait_for_inputs();
    const int r = blockIdx.y, w = blockIdx.x * 8 + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (w >= W) return;
    const int first = w * 512 + lane;
    const float* in = logits + (long)r * V;
    float v[16];
    UNROLL for (int j = 0; j < 16; j++) v[j] = first + 32 * j < V ? in[first + 32 * j] : NEG_INF;
    Filters f = row_filters(r, V, temperature, top_k, top_p, min_p, seed, token_index);  // (its loads with the row's)
    unsigned long long top = 0;
    UNROLL for (int j = 0; j < 16; j++) top = max(top, ranked(v[j], first + 32 * j));
    WarpSummary s = {warp_max(top), 0ull, 0.f, NEG_INF};
    f.m = key_float((unsigned)(s.top >> 32));  // the warp's max
    if (f.T > 0.f && f.m != NEG_INF && f.top_k == 0) {  // race every token: the answer unless a filter rejects it
        unsigned long long best = 0;
        UNROLL for (int j = 0; j < 16; j++) best = max(best, f.race(v[j], first + 32 * j));  // -inf: a score of -inf
        s.race = warp_max(best);
    }
    if (f.T > 0.f && f.m != NEG_INF && !f.races_all()) {
        if (f.top_k == 0 && f.top_p < 1.f) {
            float sum = 0.f;
            UNROLL for (int j = 0; j < 16; j++) sum += f.prob(v[j]);
            s.sumexp = warp_sum(sum);
        }
        auto count = [&](float t) {
            int n = 0;
            UNROLL for (int j = 0; j < 16; j++) n += v[j] >= t;
            return (int)__reduce_add_sync(FULL_MASK, n);
        };
        unsigned least = ~0u;  // the cut: bisect until 8-16 logits are >= lo, from the least finite one
        UNROLL for (int j = 0; j < 16; j++) if (v[j] != NEG_INF) least = min(least, order_key(v[j]));
        float lo = key_float(__reduce_min_sync(FULL_MASK, least)), hi = key_float(order_key(f.m) + 1);
        int n_lo = count(lo);
        for (int i = 0; i < 24 && n_lo > SAMPLE_CAP && order_key(hi) - order_key(lo) > 1; i++) {
            const float t = 0.5f * lo + 0.5f * hi;
            const int n = count(t);
            if (n >= SAMPLE_MIN) { lo = t; n_lo = n; } else { hi = t; }
        }
        const float cut = n_lo <= SAMPLE_CAP ? lo : hi;  // hi: fewer than SAMPLE_MIN (ties), never more than the cap
        unsigned long long* out = candidates + ((long)r * W + w) * SAMPLE_CAP;
        unsigned kept_back = 0;  // the order key of this lane's largest logit not handed on
        int placed = 0;          // the warp's candidates so far: slots filled in (j, lane) order
        UNROLL for (int j = 0; j < 16; j++) {
            const unsigned picked = __ballot_sync(FULL_MASK, v[j] >= cut);
            if (v[j] >= cut) out[placed + __popc(picked & ((1u << lane) - 1))] = ranked(v[j], first + 32 * j);
            else kept_back = max(kept_back, order_key(v[j]));
            placed += __popc(picked);
        }
        if (lane >= placed && lane < SAMPLE_CAP) out[lane] = 0ull;  // the empty slots
        s.bound = key_float(max(__reduce_max_sync(FULL_MASK, kept_back), order_key(NEG_INF)));
    }
    if (lane == 0) summary[(long)r * W + w] = s;
}

// The pick: warp w's summary by thread w, loaded with this thread's candidates in one L2 trip, then the head and the
// race. Top-k off: the race over every token stands if its winner is kept (top-p: the mass above it is below the
// target, which holds with probability >= top_p; min-p: its p) - the definition's token, no threshold needed.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS) sample_pick(
    const float* logits, int V, int W, const float* temperature, const int* top_k, const float* top_p,
    const float* min_p, const unsigned long long* seed, const int* token_index, const WarpSummary* summary,
    const unsigned long long* candidates, int* tokens) {
    constexpr int LOADS = 128 * SAMPLE_CAP / SAMPLE_THREADS;  // candidates a thread (W <= 128)
    extern __shared__ __align__(16) unsigned char sample_smem[];  // the exact way's row
    __shared__ unsigned long long head[SAMPLE_HEAD];  // the candidates above the bound (ranked)
    __shared__ float maxima[SAMPLE_THREADS];
    __shared__ int filled;
    wait_for_inputs();
    const int r = blockIdx.x, tid = threadIdx.x;
    const bool has = tid < W;
    const WarpSummary mine = has ? summary[(long)r * W + tid] : WarpSummary{0ull, 0ull, 0.f, NEG_INF};
    unsigned long long cand[LOADS];
    UNROLL for (int j = 0; j < LOADS; j++) {
        const int i = tid + j * SAMPLE_THREADS;
        cand[j] = i < W * SAMPLE_CAP ? __ldcg(&candidates[(long)r * W * SAMPLE_CAP + i]) : 0ull;
    }
    Filters f = row_filters(r, V, temperature, top_k, top_p, min_p, seed, token_index);
    const unsigned long long top = block_max(mine.top);
    f.m = key_float((unsigned)(top >> 32));
    if (f.T == 0.f || f.m == NEG_INF) {  // greedy; or every logit -inf (all banned): token 0, argmax's first index
        if (tid == 0) tokens[r] = f.m == NEG_INF ? 0 : ~(unsigned)top;
        return;
    }
    const unsigned long long raced = f.top_k == 0 ? block_max(mine.race) : 0ull;  // the race's winner
    const float won = raced ? logits[(long)r * V + ~(unsigned)raced] : NEG_INF;  // its logit
    const float bound = block_reduce(mine.bound, [](float a, float b) { return fmaxf(a, b); });
    float floor = NEG_INF;  // top-k: the k-th largest warp maximum, the least that fewer than k exceed
    const float m_w = key_float((unsigned)(mine.top >> 32));
    if (0 < f.top_k && f.top_k <= W) {
        maxima[tid] = m_w;
        __syncthreads();
        int larger = 0;
        for (int j = 0; j < W; j++) larger += maxima[j] > m_w;
        floor = block_reduce(has && larger < f.top_k ? m_w : __int_as_float(0x7f800000),
                             [](float a, float b) { return fminf(a, b); });
    }
    // the row's mass, for top-p alone: the warps' sums, scaled to the row's max
    const double mass = f.top_k == 0 && f.top_p < 1.f ? block_sum(has ? mine.sumexp * (double)f.prob(m_w) : 0.) : 0.;
    const unsigned long long total = (unsigned long long)(mass * 2147483648.0), target = top_p_target(f, total);
    if (tid == 0) filled = 0;
    __syncthreads();
    unsigned long long in_head = 0, above_won = 0;  // the head's mass, and its mass above the race's winner
    UNROLL for (int j = 0; j < LOADS; j++) {
        const float x = key_float((unsigned)(cand[j] >> 32));
        if (cand[j] && x > bound && x >= floor) {
            head[atomicAdd(&filled, 1)] = cand[j];
            in_head += fixed_p(f.prob(x));
            above_won += x > won ? fixed_p(f.prob(x)) : 0ull;
        }
    }
    int token = -1;
    if (f.top_k == 0 && (f.top_p >= 1.f || (won >= bound && block_sum(above_won) < target)) &&
        (f.min_p <= 0.f || f.prob(won) >= f.min_p)) {
        token = ~(unsigned)raced;  // the race's winner is kept: it stands
    } else {
        if (f.top_k > 0) __syncthreads();  // filled
        else in_head = block_sum(in_head);  // (its barriers: filled)
        const int n = filled;
        const bool holds = f.top_k > 0 ? n >= f.top_k : f.top_p < 1.f ? in_head >= target : f.prob(bound) < f.min_p;
        if (holds) {
            token = sample_kept([&](int i) { return Entry{key_float(head[i] >> 32), (int)~(unsigned)head[i]}; }, n, f,
                                bound, total);
        } else {  // the exact way: the row into shared memory (every copy in flight at once), then over it
            float* row = reinterpret_cast<float*>(sample_smem);
            for (int i = tid; i < V; i += SAMPLE_THREADS)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(smem_addr(row + i)), "l"(logits + (long)r * V + i));
            cp_async_commit();
            cp_async_wait<0>();
            __syncthreads();
            token = sample_kept([&](int i) { return Entry{row[i], i}; }, V, f, NEG_INF, total);
        }
    }
    if (tid == 0) tokens[r] = token;
}

// ---------------------------------------------------------------------------------------------
// 12. decode_advance: a CUDA-graph decode step's last kernel, making the next step's inputs. Each row's token goes to a
// ring of history rows (row ring_row % ring: a run's rows are read while the next writes). A live row: its token
// becomes its input, position and context length grow by one, its KV slot comes from its (reserved) block table,
// token_index steps; past its last allowed token (`remaining`): padding (slot -1). Tiny: a thread per row, 8 ints.
extern "C" __global__ void decode_advance(const int* tokens, int* input_ids, int* positions, int* context_lens,
                                          int* slot_mapping, int* token_index, int* remaining, const int* block_tables,
                                          int max_blocks, int block_size, int* history, int ring, int* ring_row, int B) {
    wait_for_inputs();
    const int i = threadIdx.x, s = *ring_row;
    __syncthreads();  // every thread has read the counter before thread 0 moves it on
    if (i == 0) *ring_row = s + 1;
    if (i >= B) return;
    history[(s % ring) * B + i] = tokens[i];
    if (slot_mapping[i] < 0) return;
    if (--remaining[i] == 0) {
        slot_mapping[i] = -1;
        return;
    }
    const int pos = positions[i] + 1, blk = pos / block_size;
    input_ids[i] = tokens[i];
    positions[i] = pos;
    context_lens[i] = pos + 1;
    token_index[i] += 1;
    slot_mapping[i] = blk < max_blocks ? block_tables[(long)i * max_blocks + blk] * block_size + pos % block_size : -1;
}

// 13. ngram_propose: a speculating graph step's first kernel (SpecGraph in speculation.py; on the host
// NgramProposer.propose). Block b drafts for row b from history: the latest end e of the longest earlier match of its
// last n_min..n_max tokens, and what followed, copied LZ77-style (draft i = ids[e + 1 + i % d], d = L - 1 - e: a match
// near the end loops). Then its verification chunk of T = k + 1 queries: its last token and the draft at positions
// L - 1 + j, the rest pads (no slot) at the last real position; declared T long (context L + T - 1): query j sees L + j
// keys, as in graph_runner.ChunkGraph. A finished row (remaining 0): padding. n_max 0: no search, a draft model's draft
// follows the row's L history tokens (draft_inputs). Tiny: a thread per end, L ints read ~n_max times (L2).
extern "C" __global__ void ngram_propose(const int* history, const int* length, const int* remaining,
                                         const int* token_base, int* ndraft, int* input_ids, int* positions,
                                         int* slot_mapping, int* context_lens, int* row_len, int* token_index,
                                         const int* block_tables, int width, int block_size, int n_ctx, int T,
                                         int n_min, int n_max) {
    wait_for_inputs();
    __shared__ int best;  // (match length << 20) | end: the longest, then the latest
    const int b = blockIdx.x, L = length[b], left = remaining[b];
    const int* ids = history + (long)b * n_ctx;
    const int room = left > 0 ? min(T - 1, left - 1) : 0;  // left: the tokens it may still make (context included)
    const bool drafted = n_max == 0;
    if (threadIdx.x == 0) best = -1;
    __syncthreads();
    for (int e = threadIdx.x; !drafted && room > 0 && e < L - 1; e += blockDim.x) {
        int m = 0;
        while (m < n_max && m <= e && ids[e - m] == ids[L - 1 - m]) m++;
        if (m >= n_min) atomicMax(&best, m << 20 | e);
    }
    __syncthreads();
    const int nd = drafted || best >= 0 ? room : 0, e = best & 0xfffff, d = L - 1 - e, live = left > 0;
    for (int j = threadIdx.x; j < T; j += blockDim.x) {
        const int i = b * T + j, pos = live ? L - 1 + min(j, nd) : 0, blk = pos / block_size;
        int id = 0;  // a pad's
        if (live && j == 0) id = ids[L - 1];
        if (live && j > 0 && j <= nd) id = drafted ? ids[L - 1 + j] : ids[e + 1 + (j - 1) % d];
        input_ids[i] = id;
        positions[i] = pos;
        slot_mapping[i] = live && j <= nd ? block_tables[(long)b * width + blk] * block_size + pos % block_size : -1;
        token_index[i] = token_base[b] + j;
        row_len[i] = (live ? L : 1) + j;  // attention_decode's rows (a scratch when the chunk is tiled)
    }
    if (threadIdx.x == 0) {
        ndraft[b] = live ? nd : -1;
        context_lens[b] = (live ? L : 1) + T - 1;
    }
}

// 14. spec_accept: a speculating graph step's last kernel. Row b (a thread) keeps its draft up to the first token
// unlike that sampled in its place (tokens, T a row), and the sampled token there: a + 1 tokens, appended to its
// history (length, remaining, token_base advance); the step's ring entry (at the row's own step count: no row waits) is
// [a + 1, drafts verified, the kept tokens]. Rejected K/V: rewritten by the next step. Tiny: a thread per row, ~T ints.
extern "C" __global__ void spec_accept(const int* tokens, const int* input_ids, const int* ndraft, int* history,
                                       int* length, int* remaining, int* token_base, int* step, int* ring, int B, int T,
                                       int n_ctx) {
    wait_for_inputs();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const int nd = ndraft[b], L = length[b];
    int* entry = ring + ((long)step[b]++ * B + b) * (T + 2);
    if (nd < 0) {  // padding, or finished
        entry[0] = entry[1] = 0;
        return;
    }
    int a = 0;
    while (a < nd && tokens[b * T + a] == input_ids[b * T + a + 1]) a++;
    entry[0] = a + 1;
    entry[1] = nd;
    for (int j = 0; j <= a; j++) entry[2 + j] = history[(long)b * n_ctx + L + j] = tokens[b * T + j];
    length[b] = L + a + 1;
    remaining[b] -= a + 1;
    token_base[b] += a + 1;
}

// 15. draft_inputs: a draft model's steps chained on the GPU (DraftGraph in speculation.py), launched before each of
// its k forwards (j = 0 .. k - 1) and once after the last (Q 0). Row b (a thread) first stores the token the last
// forward sampled (tokens) as draft j - 1 after its L history tokens (ngram_propose, n_max 0, reads it there). Then
// forward j's inputs, Q queries a row: at j = 0 its last two tokens (positions L - 2 and L - 1: the draft model's K/V
// of all before them is right, DraftModelProposer.catch_up), after that draft j - 1 at L - 1 + j. The last query
// samples, with the target's race at the same token index (token_base + j). Row b needs forward j only while j < its
// room (drafts it may verify: remaining - 1, k at most); else it is padding. Tiny: a thread per row, ~4 ints a query.
extern "C" __global__ void draft_inputs(const int* tokens, int* history, const int* length, const int* remaining,
                                        const int* token_base, int* input_ids, int* positions, int* slot_mapping,
                                        int* context_lens, int* row_len, int* token_index, const int* block_tables,
                                        int width, int block_size, int n_ctx, int T, int j, int Q, int B) {
    wait_for_inputs();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= B) return;
    const int L = length[b], left = remaining[b], room = left > 0 ? min(T - 1, left - 1) : 0, live = j < room;
    int* ids = history + (long)b * n_ctx;
    if (j > 0 && j <= room) ids[L + j - 1] = tokens[b];
    if (Q == 0) return;
    for (int q = 0; q < Q; q++) {
        const int i = b * Q + q, pos = L - Q + j + q, real = live && pos >= 0;  // (a 1-token prompt: no L - 2)
        input_ids[i] = real ? ids[pos] : 0;
        positions[i] = real ? pos : 0;
        slot_mapping[i] = real ? block_tables[(long)b * width + pos / block_size] * block_size + pos % block_size : -1;
        row_len[i] = real ? pos + 1 : q + 1;  // attention_decode's rows (a scratch when the chunk is tiled)
    }
    token_index[b] = token_base[b] + j;
    context_lens[b] = live ? L + j : Q;
}

// The templates' instantiations: NVRTC's name expressions (cuda_backend reads them here); nvcc (CI) compiles each
#ifndef __CUDACC_RTC__
#define INSTANTIATE(...) template __global__ decltype(__VA_ARGS__) __VA_ARGS__;
#else
#define INSTANTIATE(...)
#endif
INSTANTIATE(matmul_tc<128,128,3>) INSTANTIATE(matmul_tc<128,128,4>) INSTANTIATE(matmul_tc<64,128,3>)
INSTANTIATE(matmul_tc<64,64,6>) INSTANTIATE(matmul_tc<64,32,8>) INSTANTIATE(matmul_blocked<float>)
INSTANTIATE(matmul_gemv<half,4>) INSTANTIATE(matmul_gemv<half,8>) INSTANTIATE(matmul_gemv<i8,4>)
INSTANTIATE(matmul_skinny<half>) INSTANTIATE(matmul_skinny<i8>) INSTANTIATE(dequantize<half>) INSTANTIATE(dequantize<float>)
// the ladder's rungs
INSTANTIATE(matmul_blocked<half>) INSTANTIATE(matmul_naive<float>) INSTANTIATE(matmul_naive<half>)
INSTANTIATE(matmul_tiled<float>) INSTANTIATE(matmul_tiled<half>) INSTANTIATE(layernorm_thread<float>)
INSTANTIATE(layernorm_thread<half>) INSTANTIATE(layernorm_warp<float>) INSTANTIATE(layernorm_warp<half>)
INSTANTIATE(attention_naive<float>) INSTANTIATE(attention_naive<half>) INSTANTIATE(attention_online<float>)
INSTANTIATE(attention_online<half>)
INSTANTIATE(embed<float>) INSTANTIATE(cache_write<float>) INSTANTIATE(layernorm<float>) INSTANTIATE(attention_decode<float>)
INSTANTIATE(embed<half>) INSTANTIATE(cache_write<half>) INSTANTIATE(layernorm<half>) INSTANTIATE(attention_decode<half>)
