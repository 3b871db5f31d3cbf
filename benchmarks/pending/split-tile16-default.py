# Makes 16-key split tiles the default at d128 and drops the JAX_VARLEN_SPLIT_TILE switch, once a
# GPU call measures them ahead (benchmarks/NOTES.md, "Next"). Run from the repository root.
p = 'ffi/cuda/sm80/fwd_split.cuh'
s=open(p).read()
old='template <int kHeadDim_, int kBlockN_ = (kHeadDim_ <= 128 ? 32 : 16)>'
new='template <int kHeadDim_, int kBlockN_ = (kHeadDim_ <= 64 ? 32 : 16)>'
assert old in s; s=s.replace(old,new)
a=s.index('// EXPERIMENT (session 2026-12-06 e')
b=s.index('}  // namespace jax_varlen::cuda::sm80')
s=s[:a]+'''template <typename Elem, int kHeadDim>
cudaError_t run_fwd_split(const AttentionParams& p, cudaStream_t stream) {
  return run_fwd_split_with<Elem, kHeadDim, SplitTraits<kHeadDim>>(p, stream);
}

'''+s[b:]
open(p,'w').write(s)
