"""Optional CPU-only speed-ups; the paper's model and the searches run the same without them.

  * `backend`: the decoding backend on the C++ kernels (`CpuDecoding`), the one seam through which they
    reach a search: `decoding.backends.decoding_backend` chooses it on the host, before anything is traced.
  * `kernels`: the kernels of a beam-search step (`decoding_attention.cc`, beside it) as XLA FFI custom calls,
    compiled on first use into a kernel cache that is checked before anything in it is loaded.
  * `host_allocator`: the process's malloc for XLA:CPU (tcmalloc where installed, else glibc tuned), chosen
    before JAX starts by `python -m transformer_jax.main` and the benchmark scripts.

Importing this package imports nothing: `host_allocator` must run before JAX is imported.
"""
