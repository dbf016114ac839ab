"""The project's custom kernels: the folder ``kernels/`` at the repository's top level, installed as
the import package ``epas_kernels`` (``pyproject.toml``'s ``package-dir``). It is not named
``kernels`` on purpose: that is Hugging Face's PyPI package, which ``transformers`` probes for.

Modules:

* :mod:`epas_kernels.region_pv` -- ``P · V`` of every sharing layer of a QK-sharing region over the
  cached positions at a decode step, in one launch (Triton), with the PyTorch contract it replaces
  (one batched matmul over the layers). The decode engine selects it with
  ``epas-generate --region-kernel triton``.
* :mod:`epas_kernels.bench_region_pv` -- its microbenchmark: the kernel against the PyTorch op on
  the same inputs in one run (``python -m epas_kernels.bench_region_pv --help``).

Rules for a kernel here (README.md): imported lazily and selected by config (importing this
package imports neither torch nor Triton), a plain PyTorch reference that is the default on CPU,
tested against that reference under Triton's interpreter on CPU (``TRITON_INTERPRET=1``,
``tests/kernels``), and benchmarked against the op it replaces in one run.
"""
