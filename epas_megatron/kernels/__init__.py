"""Custom kernels (Triton), each imported lazily and selected by config; see README.md here."""
