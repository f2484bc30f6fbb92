"""Test support: switches and stand-ins for test runs and benchmarks (may patch FLA and Triton internals); library
code never names it. Import submodules explicitly: this package imports neither Triton nor FLA."""
