// Kernel harness, no JAX: the sm90 kernel against the sm80 tensor-core kernel (the reference
// here; it is checked against the oracle by the GPU test suite) on the same bf16 inputs with NaN
// in the padding, then a short burst timing of both (20 launches: boost clocks, higher than
// bench.py's sustained numbers -- compare versions with it, peers with bench.py).
// Build here, run on the device (see benchmarks/README.md):
//   nvcc -std=c++17 -O3 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
//     -Iffi -I<cutlass_library>/source/include benchmarks/kernel_harness.cu -o kernel_harness
//   ./kernel_harness [quick|full] [case-name]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "cuda/fwd_tc.cuh"  // sm80 kernels: cuda/sm80/ once the kernel tree is reorganized
#include "cuda/sm90/fwd_sm90.cuh"

using namespace jax_varlen;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

struct Case { const char* name; int B, Sq, Skv, H, Hkv, D, Dv; bool causal; float softcap; std::vector<int> lens; bool time; };

static uint32_t rng = 12345;
static float frand() { rng = rng * 1664525u + 1013904223u; return ((rng >> 8) & 0xFFFF) / 32768.0f - 1.0f; }

template <int kBucket>
cudaError_t run_sm90(const AttentionParams& p, cudaStream_t s) {
  return jax_varlen::cuda::sm90::run_fwd_sm90<__nv_bfloat16, kBucket>(p, s);
}
template <int kBucket>
cudaError_t run_tc(const AttentionParams& p, cudaStream_t s) { return jax_varlen::cuda::run_fwd_tc<__nv_bfloat16, kBucket>(p, s); }

template <int kBucket>
void run_case(const Case& c) {
  const size_t nq = size_t(c.B) * c.Sq * c.H * c.D, nk = size_t(c.B) * c.Skv * c.Hkv * c.D, nv = size_t(c.B) * c.Skv * c.Hkv * c.Dv;
  const size_t no = size_t(c.B) * c.Sq * c.H * c.Dv, nl = size_t(c.B) * c.H * c.Sq;
  std::vector<__nv_bfloat16> hq(nq), hk(nk), hv(nv);
  for (auto& x : hq) x = __float2bfloat16(frand());
  for (int b = 0; b < c.B; ++b)
    for (int j = 0; j < c.Skv; ++j) {
      const bool pad = j >= c.lens[b];
      for (int e = 0; e < c.Hkv * c.D; ++e) hk[(size_t(b) * c.Skv + j) * c.Hkv * c.D + e] = __float2bfloat16(pad ? NAN : frand());
      for (int e = 0; e < c.Hkv * c.Dv; ++e) hv[(size_t(b) * c.Skv + j) * c.Hkv * c.Dv + e] = __float2bfloat16(pad ? NAN : frand());
    }
  __nv_bfloat16 *q, *k, *v, *o1, *o2; float *l1, *l2; int* lens;
  CK(cudaMalloc(&q, nq * 2)); CK(cudaMalloc(&k, nk * 2 + 16)); CK(cudaMalloc(&v, nv * 2 + 16));
  CK(cudaMalloc(&o1, no * 2)); CK(cudaMalloc(&o2, no * 2)); CK(cudaMalloc(&l1, nl * 4)); CK(cudaMalloc(&l2, nl * 4));
  CK(cudaMalloc(&lens, c.B * 4));
  CK(cudaMemcpy(q, hq.data(), nq * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(k, hk.data(), nk * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, hv.data(), nv * 2, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(lens, c.lens.data(), c.B * 4, cudaMemcpyHostToDevice));
  CK(cudaMemset(o1, 0xFF, no * 2)); CK(cudaMemset(o2, 0xFF, no * 2));  // poison: NaN bf16
  CK(cudaMemset(l1, 0xFF, nl * 4)); CK(cudaMemset(l2, 0xFF, nl * 4));
  AttentionParams p{};
  p.q = q; p.k = k; p.v = v; p.nonpad_kv_seqlen = lens; p.dtype = DType::kBF16;
  p.batch = c.B; p.seqlen_q = c.Sq; p.seqlen_k = c.Skv; p.num_heads = c.H; p.kv_num_heads = c.Hkv;
  p.head_dim = c.D; p.head_dim_v = c.Dv; p.scale = 1.0f / sqrtf(float(c.D)); p.softcap = c.softcap; p.is_causal = c.causal;
  p.workspace = nullptr; p.split_keys = 0;
  AttentionParams p1 = p, p2 = p;
  p1.out = o1; p1.lse = l1; p2.out = o2; p2.lse = l2;
  CK(run_tc<kBucket>(p1, 0));
  CK(run_sm90<kBucket>(p2, 0));
  CK(cudaDeviceSynchronize());
  std::vector<__nv_bfloat16> h1(no), h2(no); std::vector<float> g1(nl), g2(nl);
  CK(cudaMemcpy(h1.data(), o1, no * 2, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(h2.data(), o2, no * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(g1.data(), l1, nl * 4, cudaMemcpyDeviceToHost)); CK(cudaMemcpy(g2.data(), l2, nl * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0, maxd = 0; size_t bad = 0, nan1 = 0;
  for (size_t i = 0; i < no; ++i) {
    const float a = __bfloat162float(h1[i]), b = __bfloat162float(h2[i]);
    if (std::isnan(a)) { ++nan1; continue; }
    if (!std::isfinite(b)) { ++bad; continue; }
    num += (a - b) * (a - b); den += a * a; maxd = fmax(maxd, fabs(a - b));
  }
  double lmax = 0; size_t lbad = 0;
  for (size_t i = 0; i < nl; ++i) {
    if (std::isinf(g1[i]) && g1[i] < 0) { if (!(std::isinf(g2[i]) && g2[i] < 0)) ++lbad; continue; }
    if (!std::isfinite(g2[i])) { ++lbad; continue; }
    lmax = fmax(lmax, fabs(g1[i] - g2[i]));
  }
  const double rel = den > 0 ? sqrt(num / den) : sqrt(num);
  const bool ok = bad == 0 && nan1 == 0 && lbad == 0 && rel < 2e-2 && lmax < 2e-2;
  double t1 = 0, t2 = 0, flops = 0;
  if (c.time) {
    for (int b = 0; b < c.B; ++b)
      for (int i = 0; i < c.Sq; ++i) flops += double(allowed_keys(i, c.lens[b], c.Sq, c.causal));
    flops *= 2.0 * c.H * (c.D + c.Dv);
    cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
    for (int which = 0; which < 2; ++which) {
      for (int it = 0; it < 3; ++it) CK(which ? run_sm90<kBucket>(p2, 0) : run_tc<kBucket>(p1, 0));
      const int iters = 20;
      cudaEventRecord(e0);
      for (int it = 0; it < iters; ++it) CK(which ? run_sm90<kBucket>(p2, 0) : run_tc<kBucket>(p1, 0));
      cudaEventRecord(e1); CK(cudaEventSynchronize(e1));
      float ms; cudaEventElapsedTime(&ms, e0, e1);
      (which ? t2 : t1) = ms / iters;
    }
  }
  printf("%-22s %s rel=%.2e max=%.2e lse=%.2e bad=%zu nanref=%zu lsebad=%zu", c.name, ok ? "OK  " : "FAIL", rel, maxd, lmax, bad, nan1, lbad);
  if (c.time) printf("  sm80 %.3f ms %.0f TF/s | sm90 %.3f ms %.0f TF/s", t1, flops / t1 / 1e9, t2, flops / t2 / 1e9);
  printf("\n");
  cudaFree(q); cudaFree(k); cudaFree(v); cudaFree(o1); cudaFree(o2); cudaFree(l1); cudaFree(l2); cudaFree(lens);
}

int main(int argc, char** argv) {
  const bool quick = argc > 1 && !strcmp(argv[1], "quick");
  std::vector<int> full8(8, 4096), skew = {4096, 685, 8, 1, 297, 1479, 385, 448};
  std::vector<Case> cases = {
      {"small-d128", 2, 128, 128, 2, 2, 128, 128, false, 0.f, {128, 77}, false},
      {"ragged-d128", 4, 333, 1100, 4, 2, 128, 128, false, 0.f, {3, 1100, 1, 0}, false},
      {"causal-d128", 4, 333, 1100, 4, 1, 128, 128, true, 0.f, {333, 1100, 17, 200}, false},
      {"softcap-d128", 3, 200, 577, 8, 2, 128, 128, true, 5.f, {577, 37, 128}, false},
      {"d80-dv64", 3, 150, 300, 4, 4, 80, 64, false, 0.f, {300, 129, 1}, false},
      {"odd-d64", 4, 128, 577, 4, 2, 64, 64, true, 0.f, {17, 37, 127, 577}, false},
      {"odd-d256", 4, 130, 577, 4, 2, 256, 256, false, 0.f, {17, 37, 127, 577}, false},
      {"causal-d256", 2, 300, 400, 2, 1, 256, 256, true, 0.f, {400, 250}, false},
      {"half-d128", 5, 260, 400, 4, 2, 128, 128, false, 0.f, {64, 129, 192, 1, 400}, false},
      {"half-causal-d128", 5, 260, 400, 4, 2, 128, 128, true, 0.f, {64, 129, 192, 1, 400}, false},
      {"half-d256", 3, 100, 200, 2, 2, 256, 256, false, 0.f, {40, 81, 200}, false},
  };
  if (!quick) {
    cases.push_back({"d128-full", 8, 4096, 4096, 32, 8, 128, 128, false, 0.f, full8, true});
    cases.push_back({"d128-skewed", 8, 4096, 4096, 32, 8, 128, 128, false, 0.f, skew, true});
    cases.push_back({"d128-causal-full", 8, 4096, 4096, 32, 8, 128, 128, true, 0.f, full8, true});
    cases.push_back({"d128-causal-skewed", 8, 4096, 4096, 32, 8, 128, 128, true, 0.f, skew, true});
    cases.push_back({"d64-full", 8, 4096, 4096, 32, 8, 64, 64, false, 0.f, full8, true});
    cases.push_back({"d256-full", 4, 4096, 4096, 16, 4, 256, 256, false, 0.f, {4096, 4096, 4096, 4096}, true});
  }
  const char* only = argc > 2 ? argv[2] : nullptr;
  for (auto& c : cases) {
    if (only && strcmp(only, c.name)) continue;
    const int dim = c.D > c.Dv ? c.D : c.Dv;
    if (dim <= 64) run_case<64>(c); else if (dim <= 128) run_case<128>(c); else run_case<256>(c);
  }
  return 0;
}
