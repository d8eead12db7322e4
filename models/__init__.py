"""DeepSeek-V4 target + DSpark draft reference models (imported as dspark_compile.models)."""
if __name__ != "dspark_compile.models":   # the bare name: dspark_compile/source_tree.py
    from dspark_compile.source_tree import hand_over
    hand_over(__name__)
else:
    from dspark_compile.models.loading import load_model  # noqa: F401
