"""CPU kernels (numba ``nogil`` / numpy); each builder takes tiling and views and returns a launch."""
