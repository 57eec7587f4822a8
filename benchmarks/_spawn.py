"""Benchmarks start their gloo ranks with the library's one launcher helper."""

from hybridpar.distributed.spawn import run_ranks

__all__ = ["run_ranks"]
