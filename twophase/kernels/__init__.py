"""Device-side kernels, one package per backend."""
