// The Python extension: registrations() maps FFI target names to handler capsules, per platform;
// plan() gives the Python lowering the CUDA call's plan (plan/plan.h), which the CUDA handler
// makes again from the same shapes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <stdexcept>
#include <string>

#include "plan/plan.h"
#include "xla/ffi/api/c_api.h"
#ifdef JAX_VARLEN_WITH_CUDA
#include "cuda/launch_record.h"
#endif
#ifdef JAX_VARLEN_FWD_TRACE
#include <vector>

#include "cuda/sm90/fwd_trace.h"
#endif

namespace nb = nanobind;

// The FFI targets, each name once: X(name) for every handler symbol (XLA_FFI_DEFINE_HANDLER_SYMBOL
// in cpu_forward.cc, cpu_backward.cc and cuda.cu). Per platform: the padded and the packed
// forward (with and without sinks) and backward; CUDA also the paged forward (the CPU gathers
// the pages and runs the padded forward: jax_varlen/_paged_primitive.py).
#define JV_CPU_TARGETS(X)                    \
  X(jax_varlen_attention_fwd_cpu)            \
  X(jax_varlen_attention_bwd_cpu)            \
  X(jax_varlen_packed_attention_fwd_cpu)     \
  X(jax_varlen_packed_attention_bwd_cpu)     \
  X(jax_varlen_attention_fwd_sinks_cpu)      \
  X(jax_varlen_packed_attention_fwd_sinks_cpu)
#define JV_CUDA_TARGETS(X)                   \
  X(jax_varlen_attention_fwd_cuda)           \
  X(jax_varlen_attention_bwd_cuda)           \
  X(jax_varlen_packed_attention_fwd_cuda)    \
  X(jax_varlen_packed_attention_bwd_cuda)    \
  X(jax_varlen_paged_attention_fwd_cuda)     \
  X(jax_varlen_attention_fwd_sinks_cuda)     \
  X(jax_varlen_packed_attention_fwd_sinks_cuda)

#define JV_DECLARE(name) extern "C" XLA_FFI_Error* name(XLA_FFI_CallFrame*);
JV_CPU_TARGETS(JV_DECLARE)
#ifdef JAX_VARLEN_WITH_CUDA
JV_CUDA_TARGETS(JV_DECLARE)
#endif
#undef JV_DECLARE

namespace {

template <typename Fn>
nb::capsule capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

jax_varlen::DType dtype_of(const std::string& name) {
  if (name == "float32") return jax_varlen::DType::kF32;
  if (name == "float16") return jax_varlen::DType::kF16;
  if (name == "bfloat16") return jax_varlen::DType::kBF16;
  throw std::invalid_argument("jax_varlen: no CUDA kernels for dtype " + name);
}

const char* path_name(jax_varlen::FwdPath path) {
  constexpr const char* kNames[] = {"portable", "sm80_split", "sm80_one_pass", "sm90_one_pass"};
  return kNames[int(path)];
}
const char* path_name(jax_varlen::BwdPath path) {
  constexpr const char* kNames[] = {"portable", "sm80", "sm90"};
  return kNames[int(path)];
}

}  // namespace

NB_MODULE(_jax_varlen, m) {
  // {"cpu": {target: capsule}, "cuda": {target: capsule}}; "cuda" only in a CUDA build (the
  // targets: JV_CPU_TARGETS, JV_CUDA_TARGETS above).
  m.def("registrations", []() {
    nb::dict platforms, cpu;
#define JV_REGISTER_CPU(name) cpu[#name] = capsule(name);
    JV_CPU_TARGETS(JV_REGISTER_CPU)
#undef JV_REGISTER_CPU
    platforms["cpu"] = cpu;
#ifdef JAX_VARLEN_WITH_CUDA
    nb::dict cuda;
#define JV_REGISTER_CUDA(name) cuda[#name] = capsule(name);
    JV_CUDA_TARGETS(JV_REGISTER_CUDA)
#undef JV_REGISTER_CUDA
    platforms["cuda"] = cuda;
#endif
    return platforms;
  });
  // plan(dtype=..., pack_seqs=..., ...) -> dict: make_plan for these static facts (PlanInputs,
  // the same names; dtype by its numpy name). The workspaces are float32 elements per pack.
  m.def(
      "plan",
      [](const std::string& dtype, int64_t pack_seqs, int64_t pack_rows_q, int64_t pack_rows_k,
         int64_t seqlen_q, int64_t seqlen_k, int64_t num_heads, int64_t kv_num_heads, int64_t head_dim,
         int64_t head_dim_v, int64_t num_packs, int64_t page_size, bool is_causal, int64_t window_left,
         int64_t window_right, int compute_major, bool packed_queries) {
        jax_varlen::PlanInputs in;
        in.dtype = dtype_of(dtype);
        in.num_packs = num_packs;
        in.pack_seqs = pack_seqs;
        in.pack_rows_q = pack_rows_q;
        in.pack_rows_k = pack_rows_k;
        in.seqlen_q = seqlen_q;
        in.seqlen_k = seqlen_k;
        in.num_heads = num_heads;
        in.kv_num_heads = kv_num_heads;
        in.head_dim = head_dim;
        in.head_dim_v = head_dim_v;
        in.page_size = page_size;
        in.packed_queries = packed_queries;
        in.is_causal = is_causal;
        in.window_left = window_left;
        in.window_right = window_right;
        in.compute_major = compute_major;
        const jax_varlen::Plan plan = jax_varlen::make_plan(in);
        nb::dict d;
        d["unsupported"] = plan.unsupported;  // why CUDA cannot take the call; "" when it can
        if (!plan.unsupported.empty()) return d;
        d["head_dim_bucket"] = plan.head_dim_bucket();  // the kernels' D: max(D, Dv) rounded up
        d["fwd_path"] = path_name(plan.fwd_path);       // dispatch.cu's row, before alignment
        d["bwd_path"] = path_name(plan.bwd_path);
        d["split_keys"] = plan.split_keys;              // 0: one pass
        d["split_persistent"] = plan.split_persistent;  // split-KV on a persistent grid (JAX_VARLEN_SPLIT_PERSISTENT)
        d["fwd_workspace_per_pack"] = plan.fwd_workspace_per_pack;
        d["dynamic_units"] = plan.dynamic_units;         // Hopper forward: a unit counter (unpaged calls)
        d["pack_gqa"] = plan.pack_gqa;                  // Hopper forward: query heads packed (JAX_VARLEN_PACK_GQA)
        d["fwd_block_n"] = plan.fwd_block_n;            // Hopper forward: keys per tile (0: another path)
        d["lean_units"] = plan.lean_units;              // Hopper forward: lean units (limits.h)
        d["fwd_plain_tiles"] = plan.fwd_plain_tiles;    // Hopper forward: the plain-tile loop
        d["fwd_mixed_order"] = plan.fwd_mixed_order;    // Hopper forward: the packed list's mixed order
        d["bwd_block_m"] = plan.bwd_block_m;            // Hopper backward's rows per dQ step (0: none)
        d["dq_workspace_per_pack"] = plan.dq_workspace_per_pack;
        d["fwd_workspace_per_seq"] = plan.fwd_workspace_per_seq;  // the workspaces' growth per sequence
        d["dq_workspace_per_seq"] = plan.dq_workspace_per_seq;
        return d;
      },
      nb::kw_only(), nb::arg("dtype"), nb::arg("pack_seqs"), nb::arg("pack_rows_q"), nb::arg("pack_rows_k"),
      nb::arg("seqlen_q"), nb::arg("seqlen_k"), nb::arg("num_heads"), nb::arg("kv_num_heads"),
      nb::arg("head_dim"), nb::arg("head_dim_v"), nb::arg("num_packs") = 1, nb::arg("page_size") = 0,
      nb::arg("is_causal") = false, nb::arg("window_left") = -1, nb::arg("window_right") = -1,
      nb::arg("compute_major") = 0, nb::arg("packed_queries") = false);
  // last_launch() -> dict or None: the path and split-KV chunk of the last CUDA forward and
  // backward this process launched (cuda/launch_record.h; fwd_path/bwd_path None before the first),
  // for tests that prove which kernel ran. None in a build without CUDA.
  m.def("last_launch", []() -> nb::object {
#ifdef JAX_VARLEN_WITH_CUDA
    const jax_varlen::cuda::LaunchRecord r = jax_varlen::cuda::last_launch();
    nb::dict d;
    d["fwd_path"] = r.fwd_path < 0 ? nb::object(nb::none()) : nb::object(nb::str(path_name(jax_varlen::FwdPath(r.fwd_path))));
    d["bwd_path"] = r.bwd_path < 0 ? nb::object(nb::none()) : nb::object(nb::str(path_name(jax_varlen::BwdPath(r.bwd_path))));
    d["split_keys"] = r.split_keys;
    d["split_persistent"] = r.split_persistent;  // the split-KV forward ran on a persistent grid
    d["paged"] = r.paged;  // the forward read a paged cache in place
    d["pack_gqa"] = r.pack_gqa;  // the Hopper forward could pack query heads
    d["dynamic_units"] = r.dynamic_units;  // the Hopper forward's units came from a counter
    d["fwd_block_n"] = r.fwd_block_n;  // the Hopper forward's keys per tile (0: another path)
    d["lean_units"] = r.lean_units;  // the Hopper forward ran its lean kernel
    d["fwd_plain_tiles"] = r.fwd_plain_tiles;  // the Hopper forward ran its plain-tile loop
    d["fwd_mixed_order"] = r.fwd_mixed_order;  // the Hopper forward ranked a packed list in the mixed order
    return d;
#else
    return nb::none();
#endif
  });
#ifdef JAX_VARLEN_FWD_TRACE
  // fwd_trace() -> bytes: the Hopper forward's unit trace since the last call (int64, [CTAs,
  // 1 + rounds, fields]; cuda/sm90/fwd_trace.h), then cleared. A profiling build only
  // (-DJAX_VARLEN_FWD_TRACE=ON): call it once before the traced calls (it allocates the buffer).
  m.def("fwd_trace", []() {
    std::vector<int64_t> host(jax_varlen::cuda::sm90::kTraceValues, -1);
    if (!jax_varlen::cuda::sm90::fwd_trace_read(host.data()))
      throw std::runtime_error("fwd_trace: a CUDA call failed (allocating, copying or clearing the trace buffer)");
    return nb::bytes(reinterpret_cast<const char*>(host.data()), host.size() * sizeof(int64_t));
  });
  m.attr("fwd_trace_shape") = nb::make_tuple(jax_varlen::cuda::sm90::kTraceCtas, 1 + jax_varlen::cuda::sm90::kTraceRounds,
                                             jax_varlen::cuda::sm90::kTraceFields);
#endif
  m.attr("with_cuda") =
#ifdef JAX_VARLEN_WITH_CUDA
      true;
#else
      false;
#endif
  m.attr("with_sm90") = jax_varlen::kWithSm90;  // the Hopper kernels (sm_90a) are built in
}
