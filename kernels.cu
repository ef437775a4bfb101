// kernels.cu -- every hand-written CUDA kernel of nanoinfer, easy to hard.
//
// Compiled at run time by cupy.RawModule (NVRTC, -arch=sm_90a); CI compiles it with `nvcc -arch=sm_90 -c`. Storage is
// fp16 ("half") or fp32 (the exact-comparison path); accumulation, statistics and softmax are always fp32. Matmul
// weights are (N, K) row-major, so y = x @ w.T reads both operands along K: the tensor cores' "row.col" case, no
// transposes. The KV cache is (num_blocks, block_size, H, 64): a slot is one token's K (or V), all heads. Only
// cuda_fp16.h is included: tensor cores, ldmatrix, cp.async are inline PTX, each before its first user. Contents:
//   1. embed             out = wte[ids] + wpe[positions]: a gather
//   2. cache_write       this step's K and V into their slots of the paged KV cache: a scatter
//   3. layernorm         y = (x - mean) / sqrt(var + eps) * w + b, one warp per row
//   4. matmul_f32        y = epilogue(x @ w.T) in fp32: shared-memory tiles, no tensor cores (exact path)
//   5. attention_decode  one query row against its paged keys, split along the context (flash-decoding)
//   6. matmul_gemv       y = epilogue(ln(x) @ w.T) for one row of x: warps streaming the weights
//   7. matmul_skinny     the same for 2-8 rows of x, on mma.sync with w as the A operand
//   8. matmul_tc         the tiled tensor-core matmul on wgmma (prefill, decode batches of 9 and more)
//   9. attention_prefill causal FlashAttention-2 over the paged KV cache, on mma.sync
//  10. penalize          the logits processors before sampling: repetition, presence, frequency penalties, bans
//  11. sample_pass/pick  one token per row: greedy, or an exponential race over the kept tokens
//  12. decode_advance    CUDA-graph helper: the next decode step's inputs, made on the GPU
//  13. take_rows         CUDA-graph helper: out[i] = src[rows[i]]

#include <cuda_fp16.h>
#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu
constexpr int LOGIT_SEGMENT = 32;  // the lm_head's logits: matmul_tc leaves each segment's max for the sampler (11)

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

// Programmatic dependent launch (sm_90): in a CUDA graph each kernel may start while the one before still runs
// (CudaBackend.launch). Until wait_for_inputs() it may read only what no kernel of the step writes (the weights); the
// call returns once the kernels before have finished, their writes visible, and lets the next kernel's blocks onto the
// SMs to load their weights meanwhile (no-ops in a plain launch). Inputs the kernel before writes are never
// __restrict__: the compiler would read them via ld.global.nc, which returned stale rows. Weights are __restrict__.
__device__ __forceinline__ void wait_for_inputs() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

// Split-K (and split-context attention): the blocks of a group each leave a partial result in global memory
// and count themselves in; the last to arrive (a counter per group, reset for the next launch) merges them, reading
// them from L2 (__ldcg). One acquire-release atomic by thread 0 orders it all: the barrier before it puts the block's
// writes ahead of its release, and the barrier after puts the last block's reads behind its acquire. (A fence in
// every thread, then a plain atomic, costs a round trip to L2 more, in every block.)
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

// the fused matmul epilogue, in fp32 before the single rounding to the output type
template <typename T>
__device__ __forceinline__ float epilogue(float acc, const T* bias, const T* residual, int gelu,
                                          int m, int n, int N) {
    if (bias) acc += to_float(bias[n]);
    if (gelu) acc = gelu_tanh(acc);
    if (residual) acc += to_float(residual[(long)m * N + n]);
    return acc;
}

// matmul outputs are fp16, or fp32 for the logits (the lm_head's accumulator, never rounded to fp16)
__device__ __forceinline__ void store_y(void* y, long i, float v, int y_f32) {
    if (y_f32) reinterpret_cast<float*>(y)[i] = v;
    else reinterpret_cast<half*>(y)[i] = __float2half_rn(v);
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
#pragma unroll
        for (int j = 0; j < VEC; j++) re[j] = from_float<T>(to_float(ae[j]) + to_float(pe[j]));
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

// a small weight used only at the end of a kernel: into L1 before the wait, no registers held for it
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" :: "l"(p)); }

// 3. layernorm: y = (x - mean) / sqrt(var + eps) * w + b per row, for prefill (decode folds it into matmul_gemv).
// Memory-bound: 2*T*C*sizeof(T) bytes (read x, write y), ~8 FLOPs per element. One warp per row; each lane keeps its
// slice (<= 64 values: C <= 2048) in registers, so x is read once: mean, then centred sum of squares (no cancellation).
template <typename T>
__global__ void __launch_bounds__(128) layernorm(const T* x, const T* w, const T* b, T* y, int rows, int C, float eps) {
    constexpr int VEC = 16 / sizeof(T), NV = 64 / VEC;
    const int row = blockIdx.x * 4 + threadIdx.x / 32, lane = threadIdx.x % 32;
    // a decode step's few rows: the gain and bias go to L1 before the wait (no kernel writes them), so in a graph
    // their trip to HBM overlaps the kernel before. Not for a prefill's thousands of blocks: far slower there.
    if (rows <= 256) {
#pragma unroll
        for (int i = 0; i < NV; i++) {
            int c = (i * 32 + lane) * VEC;
            if (c >= C) break;
            prefetch_l1(w + c);
            prefetch_l1(b + c);
        }
    }
    wait_for_inputs();
    if (row >= rows) return;
    const long off = (long)row * C;
    float v[NV][VEC];
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int c = (i * 32 + lane) * VEC;
        if (c >= C) break;
        uint4 xr = load16(x + off + c);
        const T* xe = reinterpret_cast<const T*>(&xr);
#pragma unroll
        for (int j = 0; j < VEC; j++) {
            v[i][j] = to_float(xe[j]);
            sum += v[i][j];
        }
    }
    const float mean = warp_sum(sum) / C;
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < NV; i++) {
        if ((i * 32 + lane) * VEC >= C) break;
#pragma unroll
        for (int j = 0; j < VEC; j++) sq += (v[i][j] - mean) * (v[i][j] - mean);
    }
    const float rstd = rsqrtf(warp_sum(sq) / C + eps);
#pragma unroll
    for (int i = 0; i < NV; i++) {
        int c = (i * 32 + lane) * VEC;
        if (c >= C) break;
        uint4 wr = load16(w + c), br = load16(b + c), out;
        const T *we = reinterpret_cast<const T*>(&wr), *be = reinterpret_cast<const T*>(&br);
        T* oe = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int j = 0; j < VEC; j++) oe[j] = from_float<T>((v[i][j] - mean) * rstd * to_float(we[j]) + to_float(be[j]));
        store16(y + off + c, out);
    }
}

// 4. matmul_f32: y = epilogue(x @ w.T) in fp32, for exact comparisons rather than speed (SIMT, no tensor
// cores). Classic shared-memory tiling: a 64 x 64 tile of y per block, K by 16; each of 256 threads owns a
// 4 x 4 patch, so each shared-memory read feeds 4 FMAs. 2*M*N*K FLOPs; x read N/64 times, w M/64 (L2).
extern "C" __global__ void __launch_bounds__(256) matmul_f32(const float* x, const float* __restrict__ w,
                                                             const float* __restrict__ bias, const float* residual, float* __restrict__ y,
                                                             int M, int N, int K, int gelu) {
    wait_for_inputs();
    __shared__ float xs[16][64 + 4], ws[16][64 + 4];  // k-major: the inner loop reads along m and n
    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16, m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    float acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += 16) {
        for (int i = threadIdx.x; i < 64 * 16; i += 256) {
            int r = i / 16, k = k0 + i % 16;  // consecutive threads read consecutive k: coalesced
            xs[i % 16][r] = (m0 + r < M && k < K) ? x[(long)(m0 + r) * K + k] : 0.f;
            ws[i % 16][r] = (n0 + r < N && k < K) ? w[(long)(n0 + r) * K + k] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < 16; k++)
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += xs[k][ty * 4 + i] * ws[k][tx * 4 + j];
        __syncthreads();
    }
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            int m = m0 + ty * 4 + i, n = n0 + tx * 4 + j;
            if (m < M && n < N) y[(long)m * N + n] = epilogue(acc[i][j], bias, residual, gelu, m, n, N);
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
// 4*len*64 FLOPs per (row, head). Lanes work in groups of 64/VEC (8 for fp16), a key per group, a 16-byte chunk of K
// and V per lane; the groups' running max, sum and output merge across the warp, then the 4 warps. For bytes in
// flight each thread cp.asyncs its own chunks of the next 7 key tiles (no registers held), read by it alone: no
// barrier. Several splits (so 12 heads of one sequence fill 132 SMs) each write normalised output and log-sum-exp; the
// last to arrive combines: out = sum_s exp2(lse_s - max) * o_s / sum_s exp2(lse_s - max). The cache write rides
// along: row r's own key (len - 1) comes from k_new / v_new, stored by its split at slot_mapping[row_q[r]].
template <typename T>
__global__ void __launch_bounds__(128) attention_decode(
    const T* q, int q_stride, const T* k_new, const T* v_new, int kv_stride,
    const int* slot_mapping, T* k_cache, T* v_cache,
    const int* block_tables, int max_blocks, int block_size, const int* row_q, const int* row_seq,
    const int* row_len, int H, float scale_log2, T* out, float* part_o, float* part_lse, int* counters) {
    constexpr int D = 64, VEC = 16 / sizeof(T), LPK = D / VEC, KPW = 32 / LPK;  // lanes per key, keys per warp
    const int r = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = lane / LPK, sub = lane % LPK;
    // Before the wait: only the qkv matmul just before writes q and this step's K and V; the row plan, block tables and
    // cache up to each row's previous key are older. >= 32 keys per split: short rows (or graphs) use fewer.
    const int qr = row_q[r], len = row_len[r], nsplit = min((int)gridDim.z, (len + 31) / 32);
    if (split >= nsplit) return;
    const int chunk = (len + nsplit - 1) / nsplit, k_begin = split * chunk, k_end = min(len, k_begin + chunk);
    const int* table = block_tables + (long)row_seq[r] * max_blocks;
    auto slot_off = [&](int j) { return (((long)table[j / block_size] * block_size + j % block_size) * H + h) * D; };
    constexpr int RING = 8;  // key tiles in the ring: RING - 1 in flight while one is read
    __shared__ __align__(16) uint4 ring[RING][2][128];  // [tile][K, V][thread]
    const int own = len - 1;  // the row's own key: from k_new (this step's), never copied from the cache
    auto fetch = [&](int it) {  // tile it holds key k_begin + 4 KPW it + KPW warp + grp
        const int j = k_begin + 4 * KPW * it + warp * KPW + grp;
        if (j < k_end && j != own) {
            cp_async16(smem_addr(&ring[it % RING][0][threadIdx.x]), k_cache + slot_off(j) + sub * VEC, true);
            cp_async16(smem_addr(&ring[it % RING][1][threadIdx.x]), v_cache + slot_off(j) + sub * VEC, true);
        }
        cp_async_commit();
    };
    for (int it = 0; it < RING - 1; it++) fetch(it);  // the cache up to the row's previous key: on their way now
    wait_for_inputs();
    const long new_off = (long)qr * kv_stride + h * D;  // this row's own K and V in k_new / v_new
    if (k_new && split == nsplit - 1 && threadIdx.x < LPK && slot_mapping[qr] >= 0) {
        const long dst = ((long)slot_mapping[qr] * H + h) * D + threadIdx.x * VEC;
        store16(k_cache + dst, load16(k_new + new_off + threadIdx.x * VEC));
        store16(v_cache + dst, load16(v_new + new_off + threadIdx.x * VEC));
    }

    float qv[VEC], o[VEC], m = NEG_INF, l = 0.f;
    uint4 qraw = load16(q + (long)qr * q_stride + h * D + sub * VEC);
#pragma unroll
    for (int i = 0; i < VEC; i++) { qv[i] = to_float(reinterpret_cast<const T*>(&qraw)[i]) * scale_log2; o[i] = 0.f; }

    for (int it = 0, base = k_begin + warp * KPW; base < k_end; it++, base += 4 * KPW) {  // same trip count for the warp
        cp_async_wait<RING - 2>();  // tile it has landed
        fetch(it + RING - 1);       // into the slot of tile it - 1, used up
        const int j = base + grp;
        const bool ok = j < k_end;
        float s = 0.f;
        uint4 kraw, vraw;
        if (ok && j == own) {
            kraw = load16((k_new ? k_new + new_off : k_cache + slot_off(j)) + sub * VEC);
            vraw = load16((k_new ? v_new + new_off : v_cache + slot_off(j)) + sub * VEC);
        } else if (ok) {
            kraw = ring[it % RING][0][threadIdx.x];
            vraw = ring[it % RING][1][threadIdx.x];
        }
        if (ok) {
#pragma unroll
            for (int i = 0; i < VEC; i++) s += qv[i] * to_float(reinterpret_cast<const T*>(&kraw)[i]);
        }
        for (int off = LPK / 2; off > 0; off >>= 1) s += __shfl_xor_sync(FULL_MASK, s, off);
        if (ok) {
            float mn = fmaxf(m, s), c = exp2f(m - mn), p = exp2f(s - mn);
            l = l * c + p;
#pragma unroll
            for (int i = 0; i < VEC; i++) o[i] = o[i] * c + p * to_float(reinterpret_cast<const T*>(&vraw)[i]);
            m = mn;
        }
    }
    // merge the key groups of this warp (lanes with the same `sub`)
    for (int off = LPK; off < 32; off <<= 1) {
        float m2 = __shfl_xor_sync(FULL_MASK, m, off), l2 = __shfl_xor_sync(FULL_MASK, l, off);
        float mn = fmaxf(m, m2);
        float c1 = mn == NEG_INF ? 0.f : exp2f(m - mn), c2 = mn == NEG_INF ? 0.f : exp2f(m2 - mn);
#pragma unroll
        for (int i = 0; i < VEC; i++) o[i] = o[i] * c1 + __shfl_xor_sync(FULL_MASK, o[i], off) * c2;
        l = l * c1 + l2 * c2;
        m = mn;
    }
    // then the 4 warps
    __shared__ float sm_o[4][D], sm_m[4], sm_l[4];
    if (grp == 0) {
#pragma unroll
        for (int i = 0; i < VEC; i++) sm_o[warp][sub * VEC + i] = o[i];
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

// 6. matmul_gemv: y = epilogue(ln(x) @ w.T) for the one row of x of a single stream's decode (from two rows on,
// matmul_skinny's tensor cores are faster), layernorm optionally fused in its prologue. M is 1; the loops over MR = 1
// rows stay, as a one-row rewrite compiled slower (NOTES.md). Memory-bound (N*K*2 weight bytes read once, 2*N*K FLOPs).
// A warp takes a row of w at a time, in rounds of R 16-byte loads per lane (256 * R of K), the next on the way during
// the current one's dot products (two register buffers), then its next row, gridDim.x * 8 on. R = 8 keeps the most
// bytes in flight (2 blocks per SM); R = 4 needs 64 registers, so 4 blocks fit an SM and the next kernel's (dependent
// launch) load their weights beside this one's. The prologue copies x to shared memory while the first rounds fly,
// normalised given ln_w (two block-wide sums): one L2 read of x per block, no layernorm kernel.
template <int R>
__global__ void __launch_bounds__(256, R == 4 ? 4 : 2) matmul_gemv(
    const half* x, const half* __restrict__ w, const half* __restrict__ bias, const half* residual, void* __restrict__ y,
    int M, int N, int K, int gelu, int y_f32, const half* __restrict__ ln_w, const half* __restrict__ ln_b, float eps) {
    constexpr int MR = 1;
    extern __shared__ __align__(16) unsigned char smem[];
    half* xs = reinterpret_cast<half*>(smem);  // (M, K): the rows of x, normalised when ln_w is given
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rounds = (K + R * 256 - 1) / (R * 256), first = blockIdx.x * 8 + warp, stride = gridDim.x * 8;
    const int Q = first < N ? (N - first + stride - 1) / stride * rounds : 0;  // rounds of this warp
    auto load = [&](uint4 (&buf)[R], int q) {  // round q: row first + (q / rounds) * stride, k from 256 R (q % rounds)
        if (q >= Q) return;
        const half* row = w + (long)(first + q / rounds * stride) * K;
#pragma unroll
        for (int j = 0; j < R; j++) {
            int k = (q % rounds) * R * 256 + (j * 32 + lane) * 8;
            if (k < K) buf[j] = load16_stream(row + k);
        }
    };
    uint4 wa[R], wb[R], gw, gb;
    load(wa, 0);
    load(wb, 1);
    if (ln_w && threadIdx.x * 8 < K) { gw = load16(ln_w + threadIdx.x * 8); gb = load16(ln_b + threadIdx.x * 8); }
    wait_for_inputs();  // in a graph the first weights (and the layernorm's) are on their way while the kernel before finishes

    if (!ln_w) {  // prologue: the block stages x (M, K) in shared memory while the weights are on their way
        for (int i = threadIdx.x * 8; i < M * K; i += 256 * 8) store16(xs + i, load16(x + i));
    } else {  // ... normalised: K <= 2048, so each thread owns one 16-byte chunk of each row, all loaded at once
        __shared__ float red[8][MR];
        const int k = threadIdx.x * 8;
        const bool mine = k < K;
        float s[MR];
#pragma unroll
        for (int m = 0; m < MR; m++) {
            s[m] = 0.f;
            if (m < M && mine) {  // each thread re-reads only its own chunks: no barrier needed
                uint4 v = load16(x + (long)m * K + k);
                store16(xs + m * K + k, v);
                const half* e = reinterpret_cast<const half*>(&v);
#pragma unroll
                for (int i = 0; i < 8; i++) s[m] += __half2float(e[i]);
            }
        }
        float mean[MR], rstd[MR];
        for (int pass = 0; pass < 2; pass++) {  // pass 0: the mean; pass 1: the centred sum of squares
#pragma unroll
            for (int m = 0; m < MR; m++) {
                float v = warp_sum(s[m]);
                if (lane == 0) red[warp][m] = v;
            }
            __syncthreads();
#pragma unroll
            for (int m = 0; m < MR; m++) {
                float total = 0.f;
                for (int w8 = 0; w8 < 8; w8++) total += red[w8][m];
                if (pass == 0) mean[m] = total / K;
                else rstd[m] = rsqrtf(total / K + eps);
            }
            __syncthreads();  // red is reused by pass 1
#pragma unroll
            for (int m = 0; m < MR; m++) {
                s[m] = 0.f;
                if (pass == 0 && m < M && mine) {
                    uint4 v = load16(xs + m * K + k);
                    const half* e = reinterpret_cast<const half*>(&v);
#pragma unroll
                    for (int i = 0; i < 8; i++) s[m] += (__half2float(e[i]) - mean[m]) * (__half2float(e[i]) - mean[m]);
                }
            }
        }
#pragma unroll
        for (int m = 0; m < MR; m++) {
            if (m >= M || !mine) continue;
            uint4 v = load16(xs + m * K + k), out;
            const half *e = reinterpret_cast<const half*>(&v), *ge = reinterpret_cast<const half*>(&gw),
                       *be = reinterpret_cast<const half*>(&gb);
            half* oe = reinterpret_cast<half*>(&out);
#pragma unroll
            for (int i = 0; i < 8; i++)  // rounded to fp16, as the layernorm kernel writes it
                oe[i] = __float2half_rn((__half2float(e[i]) - mean[m]) * rstd[m] * __half2float(ge[i]) + __half2float(be[i]));
            store16(xs + m * K + k, out);
        }
    }
    __syncthreads();

    float acc[MR] = {};
    auto consume = [&](const uint4 (&buf)[R], int q) {
        if (q >= Q) return;
#pragma unroll
        for (int j = 0; j < R; j++) {
            int k = (q % rounds) * R * 256 + (j * 32 + lane) * 8;
            if (k >= K) break;
            float wf[8];
            const half2* wh = reinterpret_cast<const half2*>(&buf[j]);
#pragma unroll
            for (int i = 0; i < 4; i++) { float2 f = __half22float2(wh[i]); wf[2 * i] = f.x; wf[2 * i + 1] = f.y; }
#pragma unroll
            for (int m = 0; m < MR; m++) {
                if (m >= M) break;
                uint4 xv = load16(xs + m * K + k);
                const half2* xh = reinterpret_cast<const half2*>(&xv);
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float2 f = __half22float2(xh[i]);
                    acc[m] += wf[2 * i] * f.x + wf[2 * i + 1] * f.y;
                }
            }
        }
        if (q % rounds != rounds - 1) return;
        float mine = 0.f;  // the row is done: lane m keeps row m's total
#pragma unroll
        for (int m = 0; m < MR; m++) {
            float s = warp_sum(acc[m]);
            if (lane == m) mine = s;
            acc[m] = 0.f;
        }
        const int n = first + q / rounds * stride;
        if (lane < M) store_y(y, (long)lane * N + n, epilogue(mine, bias, residual, gelu, lane, n, N), y_f32);
    };
    for (int q = 0; q < Q; q += 2) {  // while one buffer is consumed, the other is on its way
        consume(wa, q);
        load(wa, q + 2);
        consume(wb, q + 1);
        load(wb, q + 3);
    }
}

// mma.sync, one warp: c (16x8 fp32) += a (16x16 fp16, row) * b (16x8 fp16, col). Thread (g = lane/4, t = lane%4)
// holds a: (g, 2t..2t+1) (g+8, 2t..) (g, 2t+8..) (g+8, 2t+8..); b: (2t.., g) (2t+8.., g); c: (g, 2t) (g, 2t+1) (g+8, 2t) (g+8, 2t+1).
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, const unsigned* b) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// 7. matmul_skinny: y = epilogue(x @ w.T) for decode batches of 2-8 rows of x and the lm_head of up to 8 (from 9 rows
// on, matmul_tc wins). Memory-bound: 2*M*N*K FLOPs over N*K*2 bytes of weights; a 64-row tile would be mostly empty.
// A block owns 16 rows of w, on the tensor cores with roles swapped: w is the mma's A (16 x k16), the 8 rows of x its
// B. Dot products ignore k's order, so each thread feeds the mma the 8 consecutive k of one 16-byte load (of w and x),
// not the fragment layout's scattered pairs: no shared memory on the way in, w read once. 4 warps take interleaved
// 64-wide chunks of K, each issuing 4 chunks' loads before its first mma, then sum in shared memory. When N gives too
// few blocks (768 x 3072), K is split over blockIdx.y: the last to arrive adds the partial sums, runs the epilogue.
extern "C" __global__ void __launch_bounds__(128) matmul_skinny(
    const half* x, const half* __restrict__ w, const half* __restrict__ bias, const half* residual, void* __restrict__ y,
    int M, int N, int K, int gelu, int y_f32, int k_per_split, float* partial, int* counters) {
    constexpr int U = 4;  // chunks per warp step
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3, n0 = blockIdx.x * 16;
    const int k_begin = blockIdx.y * k_per_split, k_end = min(K, k_begin + k_per_split);
    // rows past N read a valid row and compute garbage that is never stored
    const half* w0 = w + (long)min(n0 + g, N - 1) * K;
    const half* w1 = w + (long)min(n0 + g + 8, N - 1) * K;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    float acc[4] = {};
    bool waited = false;
    for (int k = k_begin + warp * 64; k < k_end; k += 4 * 64 * U) {  // chunk u of this step: k + 256 u
        uint4 a0[U][2], a1[U][2];
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                int kk = k + 256 * u + 32 * hf + 8 * t;
                a0[u][hf] = kk < k_end ? load16_stream(w0 + kk) : zero;
                a1[u][hf] = kk < k_end ? load16_stream(w1 + kk) : zero;
            }
        if (!waited) wait_for_inputs();  // x comes from the kernel before: the first weights go out first
        waited = true;
#pragma unroll
        for (int u = 0; u < U; u++) {
            uint4 xv[2];
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                int kk = k + 256 * u + 32 * hf + 8 * t;
                xv[hf] = (kk < k_end && g < M) ? load16(x + (long)g * K + kk) : zero;
            }
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                unsigned A0[4] = {a0[u][hf].x, a1[u][hf].x, a0[u][hf].y, a1[u][hf].y};
                unsigned A1[4] = {a0[u][hf].z, a1[u][hf].z, a0[u][hf].w, a1[u][hf].w};
                unsigned B0[2] = {xv[hf].x, xv[hf].y}, B1[2] = {xv[hf].z, xv[hf].w};
                mma16816(acc, A0, B0);
                mma16816(acc, A1, B1);
            }
        }
    }
    if (!waited) wait_for_inputs();  // a warp with no chunk of K
    __shared__ float red[4][4][32];
#pragma unroll
    for (int e = 0; e < 4; e++) red[warp][e][lane] = acc[e];
    __syncthreads();
    // warp 0 finishes: acc[e] is y[m = 2t + (e&1)][n = n0 + g + 8*(e>>1)]
    if (warp == 0)
#pragma unroll
        for (int e = 0; e < 4; e++) acc[e] = red[0][e][lane] + red[1][e][lane] + red[2][e][lane] + red[3][e][lane];
    const int m0 = 2 * t;
    if (gridDim.y > 1) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
            if (warp == 0 && m < M && n < N) partial[((long)blockIdx.y * M + m) * N + n] = acc[e];
        }
        if (!last_to_arrive(&counters[blockIdx.x], gridDim.y) || warp != 0) return;
        for (int sp = 0; sp < (int)gridDim.y; sp++)  // split-major: each split's loads all in flight at once
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
                float v = (m < M && n < N) ? __ldcg(&partial[((long)sp * M + m) * N + n]) : 0.f;
                acc[e] = sp == 0 ? v : acc[e] + v;
            }
    }
    if (warp != 0) return;
#pragma unroll
    for (int e = 0; e < 4; e++) {  // epilogue reads first, then the stores
        int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
        acc[e] = (m < M && n < N) ? epilogue(acc[e], bias, residual, gelu, m, n, N) : 0.f;
    }
#pragma unroll
    for (int e = 0; e < 4; e++) {
        int m = m0 + (e & 1), n = n0 + g + 8 * (e >> 1);
        if (m < M && n < N) store_y(y, (long)m * N + n, acc[e], y_f32);
    }
}

// Hopper's warpgroup tensor-core instruction (wgmma, sm_90a): a warpgroup's 128 threads multiply a 64 x 16 tile of A by
// a 16 x N tile of B (N = 32, 128 or 144 here), both in shared memory, into 64 x N fp32 accumulators, N / 2 per thread;
// asynchronous: issue, commit, wait. Shared memory is given by 64-bit descriptors. Our tiles are "K-major, 128-byte
// swizzle": a row holds 64 halves of K, rows come in groups of 8 (1024 bytes apart), and 16-byte chunk c of row r sits
// at chunk c ^ (r % 8), so a group's rows spread over all banks. The hardware XORs the address bits alike: tiles start
// 1024-byte aligned, and a step along K within a row adds 32 bytes. CI's plain sm_90 build traps instead.
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
    else if constexpr (N == 128)
        asm volatile(WGMMA_ASM(128,
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
                     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
                     "%59, %60, %61, %62, %63", "%64", "%65")
                     : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56) : "l"(a), "l"(b));
    else if constexpr (N == 144)
        asm volatile(WGMMA_ASM(144,
                     "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                     "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, "
                     "%40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, "
                     "%59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71", "%72", "%73")
                     : ACC8(0), ACC8(8), ACC8(16), ACC8(24), ACC8(32), ACC8(40), ACC8(48), ACC8(56), ACC8(64) : "l"(a), "l"(b));
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

// 8. matmul_tc: y (M,N) = epilogue(x (M,K) @ w (N,K)^T), fp16 in and out, on wgmma. Compute-bound at prefill sizes:
// 2*M*N*K FLOPs over (M*K + N*K + M*N) * 2 bytes. A block of BM/64 warpgroups owns a BM x BN tile of y (64 x BN each);
// K goes by 64 through a STAGES-deep cp.async pipeline (swizzled as above), STAGES - 1 tiles in flight while the tensor
// cores chew on one. Tiles filling the SMs (prefill): 3 stages let two blocks share an SM, one computing while the other
// waits; 144 wide where that takes fewer rounds (2048 x 2304: 256 tiles of 144 fill the 2 x 132 block slots at once, 288
// of 128 take two). Fewer tiles than SMs: 4 or 8 stages, one wgmma group left running across the barrier. Decode
// batches of 9-512 rows: 64-row tiles, 8 stages, 32 wide while those fill at most two blocks per SM (more tiles of fewer
// k-steps finish sooner, as in cuBLAS); K split over blockIdx.z as in matmul_skinny. Each thread copies one 16-byte
// chunk of every (threads/8)-th row, which the swizzle lands at the same column of each: a constant stride apart. Rows
// past M, N and chunks past K are zero-filled (K % 8 == 0 suffices). The lm_head's logits (segment_max set: a plain
// product, one K split, BN a multiple of 32) also leave each row's 32-logit segment maxima, from the accumulators
// through shared memory so that the stores coalesce: the sampler need not read the logits (section 11), 1/32 more bytes.
template <int BM, int BN, int STAGES>
__global__ void __launch_bounds__(BM * 2, 256 / BM) matmul_tc(
    const half* x, const half* __restrict__ w, const half* __restrict__ bias, const half* residual, void* __restrict__ y,
    int M, int N, int K, int gelu, int y_f32, int k_per_split, float* partial, int* counters, float* segment_max) {
    constexpr int BK = 64, THREADS = BM * 2, RSTEP = THREADS / 8;
    constexpr int A_BYTES = BM * BK * 2, STAGE_BYTES = (BM + BN) * BK * 2;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    const unsigned smem = (smem_addr(smem_raw) + 1023) & ~1023u;  // [STAGES][BM + BN rows][128 bytes]
    const int tid = threadIdx.x, m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int kt0 = blockIdx.z * k_per_split / BK, ktiles = (min(K, (blockIdx.z + 1) * k_per_split) + BK - 1) / BK - kt0;
    const int col = tid & 7, r0 = tid >> 3;  // this thread's chunk of K, and its first row
    const unsigned dst = ((r0 * 8 + (col ^ (r0 & 7))) << 4);  // RSTEP is a multiple of 8: same swizzle every row

    auto load_x = [&](int stage, int kt) {
        const int k = (kt0 + kt) * BK + col * 8;
        const unsigned base = smem + stage * STAGE_BYTES + dst;
#pragma unroll
        for (int i = 0; i < BM / RSTEP; i++) {
            int row = m0 + r0 + i * RSTEP;
            bool ok = row < M && k < K;
            cp_async16(base + i * RSTEP * 128, x + (ok ? (long)row * K + k : 0), ok);
        }
    };
    auto load_w = [&](int stage, int kt) {
        const int k = (kt0 + kt) * BK + col * 8;
        const unsigned base = smem + stage * STAGE_BYTES + dst;
#pragma unroll
        for (int i = 0; i < (BN + RSTEP - 1) / RSTEP; i++) {
            if (BN % RSTEP && r0 + i * RSTEP >= BN) break;  // BN = 144: the last 16 rows, by half the threads
            int row = n0 + r0 + i * RSTEP;
            bool ok = row < N && k < K;
            cp_async16(base + A_BYTES + i * RSTEP * 128, w + (ok ? (long)row * K + k : 0), ok);
        }
    };

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
    float acc[BN / 2];  // y[m][n] for m = 16 * warp + lane / 4 (+8), n = 8 j + 2 (lane % 4) (+1): acc[4 j + ...]
#pragma unroll
    for (int i = 0; i < BN / 2; i++) acc[i] = 0.f;
    for (int kt = 0; kt < ktiles; kt++) {
        cp_async_wait<AHEAD - 1>();
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // cp.async's writes, visible to wgmma's reads
        __syncthreads();  // tile kt has landed; the stage refilled next was last read by group kt - 1 - LAG, retired
        if (kt + AHEAD < ktiles) {
            load_x((kt + AHEAD) % STAGES, kt + AHEAD);
            load_w((kt + AHEAD) % STAGES, kt + AHEAD);
        }
        cp_async_commit();
        const unsigned a = smem + (kt % STAGES) * STAGE_BYTES + wg * 64 * 128;  // this warpgroup's 64 rows of x
        const unsigned b = smem + (kt % STAGES) * STAGE_BYTES + A_BYTES;        // the BN rows of w
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            wgmma<BN>(acc, smem_desc(a + kk * 2), smem_desc(b + kk * 2));
        }
        wgmma_commit_and_wait<LAG>();
    }
    if constexpr (LAG > 0) wgmma_commit_and_wait<0>();  // (an empty group) the last LAG groups too

    // The tile of y goes through shared memory (the stages are free now); each thread walks 16-byte runs along its
    // rows: coalesced stores and split-K sums, not scattered pairs, and an epilogue loop, not 64 unrolled copies.
    constexpr int TLD = BN + 8;  // row pitch (floats): the float2 writes miss no bank
    constexpr int RUNS = BM * BN / 4 / THREADS, IN_FLIGHT = RUNS < 8 ? RUNS : 8;  // float4 runs per thread
    constexpr int SEGS = BN / LOGIT_SEGMENT, MLD = SEGS * 4 + 4;  // segments a row of the tile; their lanes' maxima
    static_assert(BM * (TLD + MLD) * 4 <= STAGES * STAGE_BYTES, "the tile of y fits in the pipeline's stages");
    cp_async_wait<0>();
    __syncthreads();
    float* tile = reinterpret_cast<float*>(smem_raw + (smem - smem_addr(smem_raw)));  // (BM, TLD) fp32
    float* lane_max = tile + BM * TLD;  // (BM, MLD): segment s of a row from 4 lanes at 4 s .. 4 s + 3
    const int lane = tid & 31, rw = wg * 64 + (tid & 127) / 32 * 16 + (lane >> 2), cw = 2 * (lane & 3);
#pragma unroll
    for (int i = 0; i < BN / 2; i += 2)  // acc[4 j + 2 hf + e] is the tile's (rw + 8 hf, 8 j + cw + e)
        *reinterpret_cast<float2*>(&tile[(rw + (i & 2) * 4) * TLD + (i >> 2) * 8 + cw]) = make_float2(acc[i], acc[i + 1]);
    if (BN % LOGIT_SEGMENT == 0 && segment_max) {  // the lm_head's logits (a plain product, one K split): each
        const bool edge = n0 + BN > N;  // segment's max, for the sampler (section 11). acc[i .. i + 15], i = 16 s:
#pragma unroll                         // segment s of rows rw and rw + 8, 8 values a lane, a quad's 32
        for (int i = 0; i < BN / 2; i += 16)
#pragma unroll
            for (int hf = 0; hf < 2; hf++) {
                float most = NEG_INF;
#pragma unroll
                for (int j = 0; j < 4; j++)
#pragma unroll
                    for (int e = 0; e < 2; e++)
                        if (!edge || n0 + 2 * i + 8 * j + cw + e < N) most = fmaxf(most, acc[i + 4 * j + 2 * hf + e]);
                lane_max[(rw + 8 * hf) * MLD + i / 4 + (lane & 3)] = most;
            }
    }
    __syncthreads();
    auto run = [&](int u, int& r, int& c) { int q = tid + u * THREADS; r = q / (BN / 4); c = q % (BN / 4) * 4; };
    if (gridDim.z > 1) {  // split-K (N % 4 == 0): leave this split's sums, and the last block adds all up
#pragma unroll
        for (int u = 0; u < RUNS; u++) {
            int r, c;
            run(u, r, c);
            if (m0 + r < M && n0 + c < N)
                *reinterpret_cast<float4*>(&partial[((long)blockIdx.z * M + m0 + r) * N + n0 + c]) =
                    *reinterpret_cast<const float4*>(&tile[r * TLD + c]);
        }
        if (!last_to_arrive(&counters[blockIdx.y * gridDim.x + blockIdx.x], gridDim.z)) return;
        for (int sp = 0; sp < (int)gridDim.z; sp++)  // in split order, its own too: the same sum whichever block is last
#pragma unroll
            for (int u0 = 0; u0 < RUNS; u0 += IN_FLIGHT) {
                float4 v[IN_FLIGHT];  // loads in flight at once (16 would spill)
#pragma unroll
                for (int u = 0; u < IN_FLIGHT; u++) {
                    int r, c;
                    run(u0 + u, r, c);
                    bool ok = m0 + r < M && n0 + c < N;
                    v[u] = ok ? __ldcg(reinterpret_cast<const float4*>(&partial[((long)sp * M + m0 + r) * N + n0 + c]))
                              : make_float4(0.f, 0.f, 0.f, 0.f);
                }
#pragma unroll
                for (int u = 0; u < IN_FLIGHT; u++) {  // each thread adds to its own runs only: no barrier needed
                    int r, c;
                    run(u0 + u, r, c);
                    float4* s = reinterpret_cast<float4*>(&tile[r * TLD + c]);
                    if (sp > 0) v[u] = make_float4(s->x + v[u].x, s->y + v[u].y, s->z + v[u].z, s->w + v[u].w);
                    *s = v[u];
                }
            }
    }
#pragma unroll 1
    for (int u = 0; u < RUNS; u++) {
        int r, c;
        run(u, r, c);
        const int row = m0 + r, col = n0 + c;
        if (row >= M || col >= N) continue;
        float v[4];
#pragma unroll
        for (int e = 0; e < 4; e++) v[e] = col + e < N ? epilogue(tile[r * TLD + c + e], bias, residual, gelu, row, col + e, N) : 0.f;
        if (!y_f32 && N % 4 == 0) {  // 4 halves, one 8-byte store
            half2 h[2] = {__floats2half2_rn(v[0], v[1]), __floats2half2_rn(v[2], v[3])};
            *reinterpret_cast<uint2*>(reinterpret_cast<half*>(y) + (long)row * N + col) = *reinterpret_cast<uint2*>(h);
        } else {
            for (int e = 0; e < 4 && col + e < N; e++) store_y(y, (long)row * N + col + e, v[e], y_f32);
        }
    }
    if (BN % LOGIT_SEGMENT == 0 && segment_max) {  // a row's maxima side by side
        const int S = (N + LOGIT_SEGMENT - 1) / LOGIT_SEGMENT, s0 = n0 / LOGIT_SEGMENT;
        for (int q = tid; q < BM * SEGS; q += THREADS) {
            const int r = q / SEGS, s = q % SEGS;
            const float4 p = *reinterpret_cast<const float4*>(&lane_max[r * MLD + 4 * s]);
            if (m0 + r < M && s0 + s < S) segment_max[(long)(m0 + r) * S + s0 + s] = fmaxf(fmaxf(p.x, p.y), fmaxf(p.z, p.w));
        }
    }
}

// ldmatrix: four 8 x 8 tiles of halves from shared memory (one row address per lane) into registers in the
// mma fragment layout (.trans: transposed); pack_half2: two floats rounded into the halves of an mma operand
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

// 9. attention_prefill: causal FlashAttention-2 (fp16, head_dim 64) for (chunked) prefill query tiles over the paged KV
// cache. A block: 64 queries of one (sequence, head), 4 warps x 16; K, V stream by 64 rows via shared memory (cp.async,
// 2 buffers, by block table). S = QK^T, O += PV on tensor cores; online softmax keeps S in registers. Compute-bound
// (long prompts): 4*64 FLOPs per (query, visible key, head); Q, O once, K, V once per query tile (mostly L2).
extern "C" __global__ void __launch_bounds__(128) attention_prefill(
    const half* __restrict__ q, int q_stride, const half* __restrict__ k_cache, const half* __restrict__ v_cache,
    const int* block_tables, int max_blocks, int block_size, const int* cu_seqlens_q, const int* context_lens,
    const int* tile_seq, const int* tile_q0, int H, float scale_log2, half* out) {
    wait_for_inputs();
    constexpr int BQ = 64, BKV = 64, D = 64, LD = D + 8;  // 144-byte rows: ldmatrix without bank conflicts
    __shared__ __align__(16) half Qs[BQ * LD];
    __shared__ __align__(16) half Ks[2][BKV * LD];
    __shared__ __align__(16) half Vs[2][BKV * LD];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int s = tile_seq[blockIdx.x], h = blockIdx.y, q0 = tile_q0[blockIdx.x];
    const int q_begin = cu_seqlens_q[s], n_q = cu_seqlens_q[s + 1] - q_begin, ctx = context_lens[s];
    const int pos0 = ctx - n_q + q0;                          // position of the tile's first query
    const int n_tiles = min(pos0 + BQ - 1, ctx - 1) / BKV + 1;  // key tiles up to the last visible key
    const int* table = block_tables + (long)s * max_blocks;

    for (int c = tid; c < BQ * 8; c += 128) {
        int r = c >> 3, col = (c & 7) * 8;
        bool ok = q0 + r < n_q;
        cp_async16(smem_addr(&Qs[r * LD + col]), q + (long)(q_begin + q0 + (ok ? r : 0)) * q_stride + h * D + col, ok);
    }
    auto load_kv = [&](int buf, int kt) {
        for (int c = tid; c < BKV * 8; c += 128) {
            int r = c >> 3, col = (c & 7) * 8, j = kt * BKV + r;
            bool ok = j < ctx;  // never read past the context: those slots hold anything, NaN included
            long slot = ok ? (long)table[j / block_size] * block_size + j % block_size : 0;
            long off = (slot * H + h) * D + col;
            cp_async16(smem_addr(&Ks[buf][r * LD + col]), k_cache + off, ok);
            cp_async16(smem_addr(&Vs[buf][r * LD + col]), v_cache + off, ok);
        }
    };
    load_kv(0, 0);
    cp_async_commit();

    float o[8][4] = {}, m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    unsigned qf[4][4];
    for (int kt = 0; kt < n_tiles; kt++) {
        if (kt + 1 < n_tiles) load_kv((kt + 1) & 1, kt + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (kt == 0)
            for (int d = 0; d < 4; d++)
                ldmatrix_x4(qf[d], smem_addr(&Qs[(warp * 16 + (lane & 15)) * LD + d * 16 + (lane >> 4) * 8]));
        const half *ks = Ks[kt & 1], *vs = Vs[kt & 1];

        float sc[8][4] = {};  // S for this warp's 16 queries x 64 keys
#pragma unroll
        for (int d = 0; d < 4; d++)
#pragma unroll
            for (int np = 0; np < 4; np++) {
                unsigned r[4];
                ldmatrix_x4(r, smem_addr(&ks[(np * 16 + (lane & 7) + ((lane >> 4) << 3)) * LD + d * 16 + ((lane >> 3) & 1) * 8]));
                unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma16816(sc[2 * np], qf[d], b0);
                mma16816(sc[2 * np + 1], qf[d], b1);
            }
        // causal mask and online softmax (log2 domain); this thread holds query rows g and g+8
#pragma unroll
        for (int hf = 0; hf < 2; hf++) {
            const int pos = pos0 + warp * 16 + g + hf * 8;
            float mx = m[hf];
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int j = kt * BKV + nt * 8 + 2 * t + e;
                    float v = j > pos ? NEG_INF : sc[nt][2 * hf + e] * scale_log2;
                    sc[nt][2 * hf + e] = v;
                    mx = fmaxf(mx, v);
                }
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
            // key 0 is visible to every query, so mx is finite from the first tile on
            const float corr = exp2f(m[hf] - mx);
            m[hf] = mx;
            l[hf] *= corr;
#pragma unroll
            for (int dt = 0; dt < 8; dt++) { o[dt][2 * hf] *= corr; o[dt][2 * hf + 1] *= corr; }
#pragma unroll
            for (int nt = 0; nt < 8; nt++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    float p = exp2f(sc[nt][2 * hf + e] - mx);
                    sc[nt][2 * hf + e] = p;
                    l[hf] += p;
                }
        }
        // O += P V: the S accumulators are already laid out as the A operand (keys = k)
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            unsigned pa[4] = {pack_half2(sc[2 * kk][0], sc[2 * kk][1]), pack_half2(sc[2 * kk][2], sc[2 * kk][3]),
                              pack_half2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]), pack_half2(sc[2 * kk + 1][2], sc[2 * kk + 1][3])};
#pragma unroll
            for (int dp = 0; dp < 4; dp++) {
                unsigned r[4];
                ldmatrix_x4_trans(r, smem_addr(&vs[(kk * 16 + (lane & 15)) * LD + dp * 16 + (lane >> 4) * 8]));
                unsigned b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma16816(o[2 * dp], pa, b0);
                mma16816(o[2 * dp + 1], pa, b1);
            }
        }
        __syncthreads();  // the next iteration refills the buffer just read
    }
#pragma unroll
    for (int hf = 0; hf < 2; hf++) {
        float sum = l[hf];
        sum += __shfl_xor_sync(FULL_MASK, sum, 1);
        sum += __shfl_xor_sync(FULL_MASK, sum, 2);
        const int qi = q0 + warp * 16 + g + hf * 8;
        if (qi >= n_q) continue;
        half* dst = out + ((long)(q_begin + qi) * H + h) * D + 2 * t;
#pragma unroll
        for (int dt = 0; dt < 8; dt++)
            *reinterpret_cast<half2*>(dst + dt * 8) = __floats2half2_rn(o[dt][2 * hf] / sum, o[dt][2 * hf + 1] / sum);
    }
}

// 10. penalize: NumpyBackend.penalize, a thread per (row, token) entry, each pair listed once (no two threads write
// one logit). Only the logits of tokens a sequence has seen change: ~48 bytes per entry.
extern "C" __global__ void penalize(float* logits, int V, const int* rows, const int* ids, const int* output_counts,
    const bool* banned, int E, const float* repetition, const float* presence, const float* frequency) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    const int row = rows[e], n = output_counts[e];
    float* x = logits + (long)row * V + ids[e];
    const float r = repetition[row], v = *x > 0.f ? *x / r : *x * r;
    *x = banned[e] ? NEG_INF : v - frequency[row] * n - (n > 0 ? presence[row] : 0.f);
}

// 11. sampling: nanoinfer.sample_row. Greedy takes the row's argmax. Otherwise the exponential race (Gumbel-max): of the
// kept tokens (top-k, top-p, min-p: thresholds), the one with the largest logit / T + gumbel(key, token) (race_noise),
// the noise keyed by (seed, step, token) so that nothing else in the batch can move it. The race needs no running sum
// and the kept set holds the largest logits only, so nothing is sorted. Two kernels:
// - sample_pass, 13 blocks a row even at batch 1: every warp reduces 512 logits of a row (32-logit segments dealt out
//   in turn, so the low ids of common tokens spread over all warps) to a WarpSummary (max, sum of exp for top-p; with
//   top-k off, the race's best) and hands on its largest logits: all above a cutoff, at most 16. The cutoff starts
//   just below its 8th-largest lane maximum (>= 8 logits lie above that), raised by bisection in the rare warp where
//   more than 16 do;
// - sample_pick, a block a row, picks the token. With top-k off, the race over every token stands whenever its winner
//   is kept (probability >= top_p): only that is checked. Otherwise every logit above the largest cutoff (the "head",
//   ~300 of GPT-2's 50257 on random logits; with top-k only those at or above the k-th largest warp maximum) is a
//   candidate. When the head holds every kept token (the usual case) each entry counts the entries above it and
//   their mass, which decides top-k and top-p for it, and the kept entries race. Otherwise (a flat row, a large k)
//   the thresholds come from a radix select over the whole row (three passes each), and the kept tokens race in one
//   more.
// The pick is a kernel of its own rather than the last of a row's blocks to finish the pass: counting arrivals held
// every block of the pass until its atomic returned, and a kernel gets the registers of its largest part: the
// pick's capped the pass (40 alone) at 4 blocks an SM. Reads 4 bytes a logit once (the pick's passes hit L2); a few
// FLOPs a logit, ~25 more to race it.
// Logits that matmul_tc made (the lm_head of 9 rows and more) come with each 32-logit segment's max: greedy and top-k
// rows then skip the pass, and the pick reads the maxima and the few segments that can hold the top k
// (pick_from_maxima): 1 / 32 of the bytes, where a pass at batch 256 reads 51 MB.
constexpr int SAMPLE_PER_LANE = 16, SAMPLE_RANK = 8, SAMPLE_CAP = 16;  // a warp's 512 logits; its candidates
constexpr int SAMPLE_HEAD = 1024, SAMPLE_BINS = 2048;  // the pick's head; the radix select's bins (11-bit digits)
constexpr int SAMPLE_MAX_WARPS = 128;  // a row's warps at most: V <= 65536 (the radix select's 16-bit counts)

struct WarpSummary {  // one warp's share of a row, for the row's pick
    float max; int argmax;    // the largest logit and its first index
    float sumexp;             // sum of exp((logit - max) / T), for top-p alone
    unsigned cutoff;          // every logit whose order_key is above it is among the warp's candidates
    float race; int race_at;  // top-k off: the best race score (race_noise's units), and its token
};

struct Filters {  // one row's sampling parameters
    float T, inv_t, top_p, min_p;
    float race_scale;         // log2(e) / T: a logit's share of its race score (race_noise)
    int top_k;                // 0: off (also for k >= V)
    unsigned long long key;   // the race's noise key: splitmix64(seed, step)
    bool races_all;           // nothing filtered: every token races
};

__device__ __forceinline__ unsigned order_key(float x) {  // unsigned integers that order as the floats do
    const unsigned u = __float_as_uint(x);  // negative: all bits flipped; else the sign bit set
    return u ^ ((unsigned)((int)u >> 31) | 0x80000000u);
}
__device__ __forceinline__ float key_float(unsigned k) { return __uint_as_float(k & 0x80000000u ? k & 0x7fffffffu : ~k); }

__device__ __forceinline__ unsigned long long sample_key(unsigned long long seed, int step) {  // splitmix64
    unsigned long long z = seed + (unsigned long long)(step + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// the race's noise in base 2: -log2(-log2(u)) = (gumbel + ln ln 2) / ln 2, gumbel = -ln(-ln(u)). A token's score,
// logit / T + gumbel, scaled by 1 / ln 2 and shifted, is logit * log2(e) / T + this: the same race, fewer instructions.
// The winners come from u near 1, where -log2(u) ~ (1 - u) / ln 2 is tiny and lg2.approx's absolute error (2^-22)
// swamps it, so that those very noises come out wrong by up to whole units: there a series instead.
__device__ __forceinline__ float lg2_approx(float x) {  // MUFU.LG2 alone: x is never denormal here (__log2f checks)
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float race_noise(unsigned long long key, int token) {  // u from murmur3's finalizer
    unsigned h = (unsigned)token * 0x9E3779B1u + (unsigned)key;
    h ^= (unsigned)(key >> 32);
    h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; h ^= h >> 16;
    // u = (h >> 9 + 0.5) / 2^23 in (0, 1): 1.mantissa - (1 - 2^-24) is exact, and cheaper than an int-to-float
    const float u = __uint_as_float(0x3f800000u | (h >> 9)) - 0.99999994f;
    const float d = 1.f - u;  // exact: 24 bits hold it
    // -log2(1 - d) = log2(e) (d + d^2/2 + d^3/3 + ...): five terms below d = 1/16 (relative error < 2^-22); above,
    // lg2.approx's 2^-22 is < 3e-6 of -log2(u)
    const float series = d * (1.44269504f + d * (0.72134752f + d * (0.48089835f + d * (0.36067376f + d * 0.28853901f))));
    return -lg2_approx(d < 0.0625f ? series : -lg2_approx(u));
}

__device__ __forceinline__ void argmax_merge(float& v, int& i, float v2, int i2) {  // ties: the first index
    if (v2 > v || (v2 == v && i2 < i)) { v = v2; i = i2; }
}
__device__ __forceinline__ void warp_argmax(float& v, int& i) {  // two redux.sync: a warp's reduction in one each
    const unsigned key = order_key(v + 0.f), best = __reduce_max_sync(FULL_MASK, key);  // + 0: -0 ties with +0
    i = (int)__reduce_min_sync(FULL_MASK, key == best ? (unsigned)i : ~0u);
    v = key_float(best);
}
__device__ void block_argmax(float& v, int& i) {  // every thread gets the block's (value, first index)
    __shared__ float vs[32];
    __shared__ int is[32];
    warp_argmax(v, i);
    __syncthreads();  // the arrays may still be read by a previous call
    if ((threadIdx.x & 31) == 0) { vs[threadIdx.x >> 5] = v; is[threadIdx.x >> 5] = i; }
    __syncthreads();
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) argmax_merge(v, i, vs[w], is[w]);
}
template <typename T> __device__ T block_sum(T v) {  // the same order in every thread
    __shared__ T scratch[32];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) total += scratch[w];
    return total;
}
template <typename T> __device__ T block_scan(T v, T& total) {  // the inclusive prefix sum over threads, and the sum
    __shared__ T scratch[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int off = 1; off < 32; off <<= 1) { const T n = __shfl_up_sync(FULL_MASK, v, off); if (lane >= off) v += n; }
    __syncthreads();
    if (lane == 31) scratch[warp] = v;
    __syncthreads();
    total = 0;
    for (int w = 0; w < warps; w++) { if (w < warp) v += scratch[w]; total += scratch[w]; }
    return v;
}

// p as an integer, in units of 2^-31: integer sums are the same in any order, so the thresholds do not depend on
// which block finished first (fp32 atomics would)
__device__ __forceinline__ unsigned long long fixed_p(float p) { return (unsigned)(p * 2147483648.f); }

// one warp's 512 logits of a row (v: this lane's) -> its WarpSummary and candidates (order key << 32 | token; 0: empty)
__device__ void summarize_warp(const float* x, const float (&v)[SAMPLE_PER_LANE], int V, int first, int stride,
                               const Filters& f, WarpSummary* summary, unsigned long long* out) {
    const int lane = threadIdx.x & 31;  // v[j] is logit first + j * stride (-inf past the row's end)
    float lane_max = NEG_INF;
    int lane_at = V;
    if (f.T == 0.f) {  // greedy: the first index of the largest
#pragma unroll
        for (int j = 0, i = first; j < SAMPLE_PER_LANE; j++, i += stride)
            if (v[j] > lane_max) { lane_max = v[j]; lane_at = i; }
    } else {  // the largest alone: the pick needs no index
#pragma unroll
        for (int j = 0; j < SAMPLE_PER_LANE; j++) lane_max = fmaxf(lane_max, v[j]);
    }
    float m = lane_max;
    int at = lane_at;
    warp_argmax(m, at);
    WarpSummary s = {m, at, 0.f, 0u, NEG_INF, V};
    if (f.T > 0.f && f.top_k == 0) {  // race every logit here: the answer when nothing is filtered, else a first try
        float best = NEG_INF;
        int best_at = V;
#pragma unroll
        for (int j = 0, i = first; j < SAMPLE_PER_LANE; j++, i += stride) {  // ties keep the first: i grows with j
            const float score = v[j] * f.race_scale + race_noise(f.key, i);  // -inf for -inf (the noise is finite)
            if (score > best) { best = score; best_at = i; }
        }
        warp_argmax(best, best_at);
        s.race = best;
        s.race_at = best_at;
    }
    if (f.T > 0.f && !f.races_all) {
        if (f.top_k == 0 && f.top_p < 1.f && m != NEG_INF) {  // __expf: masses place top-p's boundary only to
            float sum = 0.f;                                     // within rounding anyway
#pragma unroll
            for (int j = 0; j < SAMPLE_PER_LANE; j++) sum += __expf((v[j] - m) * f.inv_t);
            s.sumexp = warp_sum(sum);
        }
        unsigned rest = order_key(lane_max), kth = 0u;  // the 8th largest lane maximum: the largest leaves each round
        for (int r = 0; r < SAMPLE_RANK; r++) {
            kth = __reduce_max_sync(FULL_MASK, rest);
            if (lane == __ffs(__ballot_sync(FULL_MASK, rest == kth)) - 1) rest = 0u;  // order keys are > 0
        }
        unsigned key[SAMPLE_PER_LANE];  // the logits as order keys, made once (the logits are not needed after)
#pragma unroll
        for (int j = 0; j < SAMPLE_PER_LANE; j++) key[j] = order_key(v[j]);
        auto above = [&](unsigned cut) {  // which of this lane's logits have an order key above cut: bit j for v[j]
            unsigned bits = 0u;
#pragma unroll
            for (int j = 0; j < SAMPLE_PER_LANE; j++) bits |= (unsigned)(key[j] > cut) << j;
            return bits;
        };
        unsigned cut = kth - 1, mine = above(cut);
        if (__reduce_add_sync(FULL_MASK, __popc(mine)) > SAMPLE_CAP) {  // crowded: the least cutoff leaving <= 16
            unsigned lo = cut, hi = order_key(m);
            while (hi - lo > 1) {
                const unsigned mid = lo + (hi - lo) / 2;
                if (__reduce_add_sync(FULL_MASK, __popc(above(mid))) <= SAMPLE_CAP) hi = mid; else lo = mid;
            }
            cut = hi;
            mine = above(cut);
        }
        const int n = __popc(mine);
        int pos = 0;  // this lane's place in the warp's list: the lanes below's candidates, a bit of n (<= 16) a time
#pragma unroll
        for (int b = 0; b < 5; b++) pos += __popc(__ballot_sync(FULL_MASK, n >> b & 1) & ((1u << lane) - 1)) << b;
        s.cutoff = cut;
        const int count = __reduce_add_sync(FULL_MASK, n);
        if (count <= lane && lane < SAMPLE_CAP) out[lane] = 0ull;  // an empty slot
        // this lane's candidates, usually none or one: their logits read again (L1) rather than picked out of key[]
        // by an index only known at run time, which would put key[] in local memory
        for (; mine; mine &= mine - 1) {
            const int i = first + (__ffs(mine) - 1) * stride;
            out[pos++] = (unsigned long long)order_key(x[i]) << 32 | (unsigned)i;
        }
    }
    if (lane == 0) *summary = s;
}

// fn(logit, index) for every logit of a row, by the whole block: a pass of the pick's, over a row the pass has just
// read (mostly L2). 16-byte loads, eight in flight a thread: one block alone must keep ~32 KB on the way to stream a row.
template <typename Fn> __device__ void for_each_logit(const float* x, int V, Fn fn) {
    const int head = min(V, (int)((16 - ((size_t)x & 15)) & 15) / 4), n4 = (V - head) / 4;  // floats before 16 B
    if ((int)threadIdx.x < head) fn(x[threadIdx.x], threadIdx.x);
    const float4* x4 = reinterpret_cast<const float4*>(x + head);
#pragma unroll 8
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        const float4 q = x4[i];
        const int at = head + 4 * i;
        fn(q.x, at); fn(q.y, at + 1); fn(q.z, at + 2); fn(q.w, at + 3);
    }
    const int tail = head + 4 * n4 + threadIdx.x;
    if (tail < V) fn(x[tail], tail);
}

// The least of SAMPLE_BINS bins whose bins up to it weigh >= target (set from the bins' total by target_of), and the
// weight of the bins below it, in every thread; past the total, the last bin. Each thread sums SAMPLE_BINS / nt bins.
template <typename Weight, typename Target>
__device__ unsigned bin_reaching(Weight weight, Target target_of, unsigned long long& target, unsigned long long& below) {
    __shared__ unsigned chosen;
    __shared__ unsigned long long chosen_below;
    const int tid = threadIdx.x, per = SAMPLE_BINS / blockDim.x;
    if (tid == 0) { chosen = SAMPLE_BINS - 1; chosen_below = 0; }
    unsigned long long mine = 0, total;  // this thread's bins: [tid * per, tid * per + per)
    for (int b = tid * per; b < tid * per + per; b++) mine += weight(b);
    unsigned long long run = block_scan(mine, total) - mine;  // (its barriers order the write above)
    target = target_of(total);
    if (run < target && target <= run + mine)
        for (int b = tid * per; b < tid * per + per; b++) {
            if (run + weight(b) >= target) { chosen = b; chosen_below = run; break; }
            run += weight(b);
        }
    __syncthreads();
    const unsigned b = chosen;
    below = chosen_below;
    __syncthreads();  // read before the next call writes them
    return b;
}

// The last resort's radix select, over q(logit) = ~order_key(logit): 32 bits that order the logits from the largest
// down, two floats never sharing one (a linear scale from the row's least logit to its max would tie logits one float
// apart there: their difference from the max rounds alike). The least t with weight(q <= t) >= target(total
// weight), over the tokens with q <= limit: three passes of one 11-bit digit each, a histogram in shared memory and
// a prefix sum over it.
template <typename Weight, typename Target>
__device__ unsigned radix_select(const float* x, int V, unsigned limit, Weight weight, Target target_of,
                                 unsigned* low, unsigned* high) {  // a bin's weight: high << 16 + low
    const int tid = threadIdx.x, nt = blockDim.x;
    unsigned prefix = 0u, decided = 0u;  // the digits of t found so far, and their bits
    unsigned long long target = 0, below;
    for (int digit = 0; digit < 3; digit++) {
        const int shift = max(0, 21 - 11 * digit);  // bits 31-21, 20-10, then 10-0 (bit 10 known by then)
        for (int b = tid; b < SAMPLE_BINS; b += nt) low[b] = high[b] = 0u;
        __syncthreads();
        for_each_logit(x, V, [&](float l, int) {
            const unsigned qi = ~order_key(l);
            if (qi <= limit && (qi & decided) == prefix) {  // a weight < 2^32 as two 16-bit halves: 32-bit
                const unsigned b = (qi >> shift) & (SAMPLE_BINS - 1), wt = weight(l);  // adds that return nothing
                atomicAdd(&low[b], wt & 0xffffu);  // (64-bit shared atomics are a CAS loop), and V < 2^16 of each
                if (wt >> 16) atomicAdd(&high[b], wt >> 16);  // half cannot overflow 32 bits
            }
        });
        __syncthreads();
        const unsigned chosen = bin_reaching(
            [&](int b) { return ((unsigned long long)high[b] << 16) + low[b]; },
            [&](unsigned long long total) { return decided ? target : max(1ull, target_of(total)); }, target, below);
        prefix |= chosen << shift;
        decided |= (SAMPLE_BINS - 1) << shift;
        target -= below;
    }
    return prefix;
}

// a logit's probability before normalising (m: the row's max), and its race against the best so far (r, r_at)
__device__ __forceinline__ float prob(const Filters& f, float m, float logit) { return __expf((logit - m) * f.inv_t); }
__device__ __forceinline__ void race(const Filters& f, float& r, int& r_at, float logit, int token) {
    argmax_merge(r, r_at, logit * f.race_scale + race_noise(f.key, token), token);
}

// The race among the head's entries that the filters keep, when the head holds every kept token: each entry counts
// the entries above it and their mass, which decides top-k and top-p for it (this thread's entries: tid + j * nt)
__device__ int race_head(const unsigned long long* head, const unsigned long long* head_mass, int N, int V,
                         const Filters& f, float m, unsigned long long row_target) {
    const int tid = threadIdx.x, nt = blockDim.x, k = f.top_k;
    float r = NEG_INF;
    int r_at = V;
    int larger[SAMPLE_HEAD / 256];
    unsigned long long above[SAMPLE_HEAD / 256], kept_mass = 0;
#pragma unroll
    for (int j = 0; j < SAMPLE_HEAD / 256; j++) {
        const int e = tid + j * nt;
        larger[j] = 0;
        above[j] = 0;
        if (e >= N) continue;
        const unsigned ek = (unsigned)(head[e] >> 32);
        const ulonglong2 *h2 = reinterpret_cast<const ulonglong2*>(head), *p2 = reinterpret_cast<const ulonglong2*>(head_mass);
        int larger2 = 0;  // the odd entries' counts apart: two chains of dependent adds, each half as long
        unsigned long long above2 = 0;
#pragma unroll 4
        for (int i = 0; i < N / 2; i++) {  // two entries per 16-byte load
            const ulonglong2 h = h2[i], p = p2[i];
            if ((unsigned)(h.x >> 32) > ek) { larger[j]++; above[j] += p.x; }
            if ((unsigned)(h.y >> 32) > ek) { larger2++; above2 += p.y; }
        }
        if (N & 1 && (unsigned)(head[N - 1] >> 32) > ek) { larger2++; above2 += head_mass[N - 1]; }
        larger[j] += larger2;
        above[j] += above2;
        if (k > 0 && larger[j] < k) kept_mass += head_mass[e];
    }
    // top-p: kept while the mass above is below top_p of the top-k set's mass (or of the row's)
    const unsigned long long target = k > 0 ? (unsigned long long)((double)f.top_p * block_sum(kept_mass)) : row_target;
#pragma unroll
    for (int j = 0; j < SAMPLE_HEAD / 256; j++) {
        const int e = tid + j * nt;
        if (e >= N) continue;
        const float logit = key_float((unsigned)(head[e] >> 32));
        if ((k == 0 || larger[j] < k) && (f.top_p >= 1.f || above[j] < target) && prob(f, m, logit) >= f.min_p)
            race(f, r, r_at, logit, (int)(unsigned)head[e]);
    }
    block_argmax(r, r_at);
    return r_at;
}

// The last resort: the thresholds by radix select over the whole row (smem: the bins), and the race among all it keeps
__device__ int race_row(const float* x, int V, const Filters& f, float m, unsigned long long* smem) {
    const int k = f.top_k;
    float r = NEG_INF;
    int r_at = V;
    unsigned t = ~0u, *low = reinterpret_cast<unsigned*>(smem), *high = low + SAMPLE_BINS;  // kept: q <= t
    if (k > 0)
        t = radix_select(x, V, t, [](float) { return 1u; }, [&](unsigned long long) { return (unsigned long long)k; },
                         low, high);
    if (f.top_p < 1.f)
        t = radix_select(x, V, t, [&](float l) { return (unsigned)fixed_p(prob(f, m, l)); },
                         [&](unsigned long long total) { return (unsigned long long)((double)f.top_p * total); },
                         low, high);
    for_each_logit(x, V, [&](float l, int i) { if (~order_key(l) <= t && prob(f, m, l) >= f.min_p) race(f, r, r_at, l, i); });
    block_argmax(r, r_at);
    return r_at;
}

// the row's pick: the token, from the warps' summaries and candidates (see the section's head)
__device__ int pick_token(const float* x, int V, int W, const Filters& f, const WarpSummary* ws,
                          const unsigned long long* candidates, unsigned long long* smem) {
    __shared__ __align__(16) float maxima[SAMPLE_MAX_WARPS];            // the warps' maxima, for top-k's floor
    __shared__ unsigned bound, kth_max;
    __shared__ int n_head;
    const int tid = threadIdx.x, nt = blockDim.x, k = f.top_k;
    if (tid == 0) { bound = 0u; kth_max = ~0u; n_head = 0; }
    __syncthreads();
    // warp tid's summary, read once (W <= 128 < 256 threads); the other threads' never win a reduction
    const bool has = tid < W;
    const float wm = has ? __ldcg(&ws[tid].max) : NEG_INF, wsum = has ? __ldcg(&ws[tid].sumexp) : 0.f;
    float m = wm, r = has ? __ldcg(&ws[tid].race) : NEG_INF;  // the row's max; the race's best so far
    int at = has ? __ldcg(&ws[tid].argmax) : V, r_at = has ? __ldcg(&ws[tid].race_at) : V;  // and their tokens
    const unsigned cutoff = __reduce_max_sync(FULL_MASK, has ? __ldcg(&ws[tid].cutoff) : 0u);
    if ((tid & 31) == 0) atomicMax(&bound, cutoff);  // an atomic a warp
    if (tid < SAMPLE_MAX_WARPS) maxima[tid] = wm;
    block_argmax(m, at);
    if (f.T == 0.f) return at;
    if (k == 0) block_argmax(r, r_at);  // every token raced in its warp: the best of the warps' best
    if (f.races_all) return r_at;
    auto P = [&](float logit) { return prob(f, m, logit); };
    // Top-p or min-p alone: the race over every token picks the kept token with the best score whenever its own
    // winner is kept, which it is with probability >= top_p: then the winner stands, with no thresholds to find
    // (rejection sampling's idea, but exact: the same token as the definition's)
    const int raced = r_at;
    const float won = k == 0 && raced < V ? x[raced] : NEG_INF;  // raced == V: every logit is -inf
    const bool won_min_p = P(won) >= f.min_p;
    if (k == 0 && f.top_p >= 1.f && won_min_p) return raced;  // min-p alone
    // top-p alone: the row's mass, from the warps' sums
    const double mass = k == 0 ? block_sum(wm == NEG_INF ? 0.0 : wsum * (double)P(wm)) : 0.0;
    // top-p alone keeps a token while the mass above it is below this (in fixed_p's units)
    const unsigned long long row_target = (unsigned long long)((double)f.top_p * mass * 2147483648.0);

    // the head: every candidate above the largest cutoff, as every logit above it is one. With top-k (k <= W) only
    // those at or above the k-th largest warp maximum can be in the top k (k logits reach it): the rest are dropped
    const bool floor = 0 < k && k <= W;
    unsigned kth = ~0u;  // the k-th largest warp maximum: the least that fewer than k exceed
    if (floor) {  // how many maxima exceed maximum tid / 2: two threads, each counting over half the list
        const float mine = maxima[min(tid >> 1, SAMPLE_MAX_WARPS - 1)];
        const float4* half = reinterpret_cast<const float4*>(maxima) + (tid & 1) * SAMPLE_MAX_WARPS / 8;
        int larger = 0;
#pragma unroll
        for (int q = 0; q < SAMPLE_MAX_WARPS / 8; q++)
            larger += (half[q].x > mine) + (half[q].y > mine) + (half[q].z > mine) + (half[q].w > mine);
        larger += __shfl_xor_sync(FULL_MASK, larger, 1);
        if ((tid >> 1) < W && larger < k) kth = order_key(mine);
    }
    kth = __reduce_min_sync(FULL_MASK, kth);
    if ((tid & 31) == 0) atomicMin(&kth_max, kth);
    __syncthreads();
    const unsigned least = floor ? max(bound + 1, kth_max) : bound + 1;  // the least order key kept
    unsigned long long *head = smem, *head_mass = smem + SAMPLE_HEAD, in_mass = 0, above_won = 0;
    for (int first = 0; first < W * SAMPLE_CAP; first += 8 * nt) {  // one round while V <= 65536
        unsigned long long c[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {  // all loads in flight at once
            const int i = first + j * nt + tid;
            c[j] = i < W * SAMPLE_CAP ? __ldcg(&candidates[i]) : 0ull;
        }
        unsigned kept[8];  // which lanes keep their j-th candidate
        int n = 0;         // the warp's entries, all 8 rounds
#pragma unroll
        for (int j = 0; j < 8; j++) {
            kept[j] = __ballot_sync(FULL_MASK, (unsigned)(c[j] >> 32) >= least);
            n += __popc(kept[j]);
        }
        int slot = 0;  // the warp's entries take consecutive slots: one shared atomic a warp, not one a round
        if ((tid & 31) == 0 && n) slot = atomicAdd(&n_head, n);
        slot = __shfl_sync(FULL_MASK, slot, 0);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int place = slot + __popc(kept[j] & ((1u << (tid & 31)) - 1));
            slot += __popc(kept[j]);
            if (kept[j] >> (tid & 31) & 1) {  // in any order: nothing below depends on it
                const unsigned key = (unsigned)(c[j] >> 32);
                const unsigned long long p = fixed_p(P(key_float(key)));
                in_mass += p;
                if (key > order_key(won)) above_won += p;
                if (place < SAMPLE_HEAD) { head[place] = c[j]; head_mass[place] = p; }
            }
        }
    }
    __syncthreads();
    const int N = n_head;
    // does it hold every token the filters keep? top-k: k <= N; else top-p: top_p of the mass; else min-p alone
    bool in_head = N <= SAMPLE_HEAD;
    if (k > 0) {
        in_head = in_head && k <= N;
    } else if (f.top_p < 1.f) {  // the race's winner stands if it is in the head, and kept
        const bool won_in_head = order_key(won) >= least;
        if (block_sum(above_won) < row_target && won_in_head && won_min_p) return raced;
        in_head = in_head && block_sum(in_mass) >= row_target;
    } else {
        in_head = in_head && P(key_float(bound)) < f.min_p;
    }

    if (in_head) return race_head(head, head_mass, N, V, f, m, row_target);
    if (k == 0 && won_min_p && order_key(won) < least) {  // a flat row: one pass for the mass above the winner
        unsigned long long above = 0;
        for_each_logit(x, V, [&](float l, int) { if (l > won) above += fixed_p(P(l)); });
        if (block_sum(above) < row_target) return raced;
    }
    __syncthreads();  // the head is done with: its memory holds the bins
    return race_row(x, V, f, m, smem);
}

// The pick of a greedy or top-k row from the lm_head's 32-logit segment maxima (matmul_tc leaves them), in place of
// the pass: the row's max and first argmax come from the S = V / 32 maxima. Top-k: a histogram of m - max over the
// maxima's range (bins order as the logits do, reversed) finds the least bin b that k maxima reach: every logit in a
// later bin has k maxima above it, so the top k lie in the k or so segments whose max is in bins <= b, and the head
// is their logits in bins <= b. Only those are read: ~1 / 32 of a row's bytes and ~k segments.
__device__ int pick_from_maxima(const float* x, int V, const Filters& f, const float* maxima, unsigned long long* smem) {
    __shared__ int n_head;
    __shared__ float warp_least[32];
    constexpr int PER = SAMPLE_MAX_WARPS * 512 / LOGIT_SEGMENT / 256;  // a thread's share of V <= 65536: 8
    const int tid = threadIdx.x, nt = blockDim.x, S = (V + LOGIT_SEGMENT - 1) / LOGIT_SEGMENT, k = f.top_k;
    unsigned* count = reinterpret_cast<unsigned*>(smem);  // top-k's histogram, zeroed while the maxima come
    for (int b = tid; b < SAMPLE_BINS; b += nt) count[b] = 0u;
    float seg[PER];  // this thread's segments' maxima: segment tid + j * nt
    float m = NEG_INF, least = NEG_INF;  // the row's max; its least finite segment max, negated (for a max)
    int at = S, unused = 0;
#pragma unroll
    for (int j = 0; j < PER; j++) {
        const int s = tid + j * nt;
        seg[j] = s < S ? __ldcg(&maxima[s]) : NEG_INF;
        if (seg[j] > m) { m = seg[j]; at = s; }
        if (seg[j] != NEG_INF) least = fmaxf(least, -seg[j]);
    }
    warp_argmax(least, unused);
    if ((tid & 31) == 0) warp_least[tid >> 5] = least;
    block_argmax(m, at);  // the row's max, and the first segment holding it (its barriers publish the above too)
    if (f.T == 0.f) {     // greedy: that segment's first logit equal to the max
        const int i = at * LOGIT_SEGMENT + (tid & 31);
        const unsigned equal = __ballot_sync(FULL_MASK, i < V && x[i] == m);
        return equal ? at * LOGIT_SEGMENT + __ffs(equal) - 1 : V;  // V: every logit -inf
    }
    if (k > S) return race_row(x, V, f, m, smem);  // every segment holds one of the top k
    for (int w = 0; w < nt / 32; w++) least = fmaxf(least, warp_least[w]);
    const float scale = m + least > 0.f ? (SAMPLE_BINS - 1) / (m + least) : 0.f;
    auto bin_of = [&](float l) { return (int)fminf((m - l) * scale, SAMPLE_BINS - 1); };  // -inf, nan: the last
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (tid + j * nt < S) atomicAdd(&count[bin_of(seg[j])], 1u);
    __syncthreads();
    unsigned long long target, below;
    const int last = bin_reaching([&](int b) { return (unsigned long long)count[b]; },
                                  [&](unsigned long long) { return (unsigned long long)k; }, target, below);
    const int n_seg = (int)(below + count[last]);  // the segments whose max is in bins <= last: >= k of them
    __syncthreads();  // every thread has read the counts: their memory is free
    if (n_seg > SAMPLE_HEAD) return race_row(x, V, f, m, smem);  // more than the head has entries: the last resort
    __shared__ int seg_list[SAMPLE_HEAD], n_listed;
    if (tid == 0) n_listed = n_head = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < PER; j++)
        if (tid + j * nt < S && bin_of(seg[j]) <= last) seg_list[atomicAdd(&n_listed, 1)] = tid + j * nt;
    __syncthreads();
    // their logits in bins <= last go to the head: a segment a warp, 8 a warp in flight
    unsigned long long *head = smem, *head_mass = smem + SAMPLE_HEAD;
    for (int first = tid / 32; first < n_seg; first += 8 * nt / 32) {
        float l[8];
        int i[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            const int c = first + u * nt / 32;
            i[u] = c < n_seg ? seg_list[c] * LOGIT_SEGMENT + (tid & 31) : V;
            l[u] = i[u] < V ? x[i[u]] : NEG_INF;
        }
#pragma unroll
        for (int u = 0; u < 8; u++) {
            if (i[u] >= V || bin_of(l[u]) > last) continue;
            const int place = atomicAdd(&n_head, 1);
            if (place < SAMPLE_HEAD) {
                head[place] = (unsigned long long)order_key(l[u]) << 32 | (unsigned)i[u];
                head_mass[place] = fixed_p(prob(f, m, l[u]));
            }
        }
    }
    __syncthreads();
    const int N = n_head;  // >= k: the maxima in bins <= last are entries
    if (N <= SAMPLE_HEAD) return race_head(head, head_mass, N, V, f, m, 0);
    __syncthreads();  // the head is done with: its memory holds the bins
    return race_row(x, V, f, m, smem);
}

__device__ Filters row_filters(int row, int V, const float* temperature, const int* top_k, const float* top_p,
                               const float* min_p, const unsigned long long* seed, const int* step) {
    Filters f;
    f.T = temperature[row];
    f.inv_t = __frcp_rn(f.T);  // 1 / T rounded as the division rounds it, without the division's slow path
    f.race_scale = 1.4426950408889634f * f.inv_t;
    f.top_k = top_k[row] < V ? top_k[row] : 0;
    f.top_p = top_p[row];
    f.min_p = min_p[row];
    f.key = sample_key(seed[row], step[row]);
    f.races_all = f.top_k == 0 && f.top_p >= 1.f && f.min_p <= 0.f;
    return f;
}

// with the lm_head's segment maxima (segment_max: else null), greedy and top-k rows (k <= 256, so that the ~k segments
// leave the head room) are picked from those alone
__device__ __forceinline__ bool picks_from_maxima(const float* segment_max, float T, int top_k) {
    return segment_max && (T == 0.f || (0 < top_k && top_k <= SAMPLE_HEAD / 4));  // top_k: Filters' (0 for k >= V)
}

// The pass: a block per 8 warps' share of a row (13 blocks a row for GPT-2). The logits are loaded first, on their way
// while the row's parameters come (with segment maxima, after: a row picked from those needs no pass).
extern "C" __global__ void __launch_bounds__(256) sample_pass(
    const float* logits, const float* segment_max, int V, int W, const float* temperature, const int* top_k,
    const float* top_p, const float* min_p, const unsigned long long* seed, const int* step, WarpSummary* summary,
    unsigned long long* candidates) {
    wait_for_inputs();
    const int row = blockIdx.y, w = blockIdx.x * 8 + (threadIdx.x >> 5), first = w * 32 + (threadIdx.x & 31);
    if (picks_from_maxima(segment_max, temperature[row], top_k[row] < V ? top_k[row] : 0)) return;
    const int stride = W * 32;  // this lane's logits: first, first + stride, ... (segment w, w + W, ... of 32)
    const float* x = logits + (long)row * V;
    const float* p = x + first;
    float v[SAMPLE_PER_LANE];  // this warp's 512 logits
#pragma unroll
    for (int j = 0, i = first; j < SAMPLE_PER_LANE; j++, i += stride, p += stride) v[j] = w < W && i < V ? *p : NEG_INF;
    const Filters f = row_filters(row, V, temperature, top_k, top_p, min_p, seed, step);
    const long at = (long)row * W + w;  // this warp's summary
    if (w < W) summarize_warp(x, v, V, first, stride, f, summary + at, candidates + at * SAMPLE_CAP);
}

// The pick: a block a row. Two blocks an SM are all a batch of 256 rows needs: the bound lets ptxas give the pick the
// registers it wants (with 256 threads alone it held it to 64, and the pick lost time to that).
extern "C" __global__ void __launch_bounds__(256, 2) sample_pick(
    const float* logits, const float* segment_max, int V, int W, const float* temperature, const int* top_k,
    const float* top_p, const float* min_p, const unsigned long long* seed, const int* step,
    const WarpSummary* summary, const unsigned long long* candidates, int* tokens) {
    __shared__ __align__(16) unsigned long long smem[2 * SAMPLE_HEAD];  // the head's keys and masses, or radix bins
    wait_for_inputs();
    const int row = blockIdx.x;
    const Filters f = row_filters(row, V, temperature, top_k, top_p, min_p, seed, step);
    const float* x = logits + (long)row * V;
    const int token = picks_from_maxima(segment_max, f.T, f.top_k)
        ? pick_from_maxima(x, V, f, segment_max + (long)row * ((V + LOGIT_SEGMENT - 1) / LOGIT_SEGMENT), smem)
        : pick_token(x, V, W, f, summary + (long)row * W, candidates + (long)row * W * SAMPLE_CAP, smem);
    if (threadIdx.x == 0) tokens[row] = token < V ? token : 0;  // V: every logit -inf, and argmax's first index is 0
}

// ---------------------------------------------------------------------------------------------
// CUDA-graph helpers. 12. decode_advance: a graph decode step's last kernel, so the next step needs no host (multi-step
// decoding). Each row's token goes to a ring of history rows (row substep % ring: one run's rows are read while the
// next writes). A live row moves on: its token becomes its input, position and context length grow by one, its KV slot
// comes from its block table (blocks the engine reserved), its sampling counter steps; after its last allowed token
// (`remaining`) it becomes padding (slot -1). Tiny: a thread per row, 8 ints.
extern "C" __global__ void decode_advance(const int* tokens, int* input_ids, int* positions, int* context_lens,
                                          int* slot_mapping, int* step, int* remaining, const int* block_tables,
                                          int max_blocks, int block_size, int* history, int ring, int* substep, int B) {
    wait_for_inputs();
    const int i = threadIdx.x, s = *substep;
    __syncthreads();  // every thread has read the counter before thread 0 moves it on
    if (i == 0) *substep = s + 1;
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
    step[i] += 1;
    slot_mapping[i] = blk < max_blocks ? block_tables[(long)i * max_blocks + blk] * block_size + pos % block_size : -1;
}

// 13. take_rows: out[i] = src[rows[i]] for i < n. When the decode rows that go on fit a smaller CUDA graph,
// their next input tokens (left on the GPU by decode_advance) move into its buffer without the host. Tiny.
extern "C" __global__ void take_rows(const int* src, const int* rows, int* out, int n) {
    const int i = threadIdx.x;
    if (i < n) out[i] = src[rows[i]];
}

// nvcc (CI) compiles every instantiation NVRTC gets through name_expressions, so ptxas sees them all
#ifndef __CUDACC_RTC__
#define INSTANTIATE(...) template __global__ decltype(__VA_ARGS__) __VA_ARGS__;
INSTANTIATE(matmul_tc<128, 128, 3>) INSTANTIATE(matmul_tc<128, 144, 3>) INSTANTIATE(matmul_tc<128, 128, 4>)
INSTANTIATE(matmul_tc<64, 128, 3>) INSTANTIATE(matmul_tc<64, 128, 8>) INSTANTIATE(matmul_tc<64, 32, 8>)
INSTANTIATE(matmul_gemv<4>) INSTANTIATE(matmul_gemv<8>)
INSTANTIATE(embed<float>) INSTANTIATE(cache_write<float>) INSTANTIATE(layernorm<float>) INSTANTIATE(attention_decode<float>)
INSTANTIATE(embed<half>) INSTANTIATE(cache_write<half>) INSTANTIATE(layernorm<half>) INSTANTIATE(attention_decode<half>)
#endif
