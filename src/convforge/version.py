"""convforge's version: one leaf module, so the library's rooms (caches, back-ends, the tuner) take it
without importing the package root, which re-exports the public API from above them."""

__version__ = "0.1.0"
