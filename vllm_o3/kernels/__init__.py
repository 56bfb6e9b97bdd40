"""How the fast paths compute O3: routing and FFN kernels, each beside its reference."""
