"""GPU kernels, by the language they are written in (`triton/`)."""
