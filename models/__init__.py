"""DeepSeek-V4 target + DSpark draft reference models (imported as dspark_compile.models)."""
if __name__ != "dspark_compile.models":   # the bare name: dspark_compile/source_tree.py
    from dspark_compile.source_tree import hand_over
    hand_over(__name__)


def __getattr__(name: str):
    """`from dspark_compile.models import load_model` imports the model where it is asked for:
    importing the package (which every `dspark_compile.models.X` does first) must stay light,
    since the model imports the kernels and they register the dspark:: ops (models.config or
    models.request alone would otherwise pull the whole model in)."""
    if name == "load_model":
        from dspark_compile.models.loading import load_model
        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
