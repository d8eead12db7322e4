"""dspark-compile: an ahead-of-time graph compiler for DeepSeek-V4 DSpark speculative decoding.

The repository's top-level kernels/, models/ and passes/ are this package's subpackages
dspark_compile.kernels, .models and .passes; imported from the source tree (Python started in
the repository root), the finder that source_tree.py installs here resolves them.
"""
from dspark_compile.source_tree import install_finder as _install_finder

_install_finder()
