"""Triton kernels, their references and launchers (imported as dspark_compile.kernels)."""
if __name__ != "dspark_compile.kernels":   # the bare name: dspark_compile/source_tree.py
    from dspark_compile.source_tree import hand_over
    hand_over(__name__)
