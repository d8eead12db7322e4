"""Graph passes over exported step programs, and the manager that runs them (imported as
dspark_compile.passes).

Importing this package registers every pass module in this folder (one file per pass, each
with one `@register_pass` line), so a new pass needs no edit here; catalog.py holds the public
names and the loading.
"""
if __name__ != "dspark_compile.passes":   # the bare name: dspark_compile/source_tree.py
    from dspark_compile.source_tree import hand_over
    hand_over(__name__)
else:
    from dspark_compile.passes.catalog import *  # noqa: F401,F403
    from dspark_compile.passes.catalog import __all__  # noqa: F401
