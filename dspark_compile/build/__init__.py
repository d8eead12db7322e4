"""The build: a checkpoint -> an engine directory (offline; never imported by the runtime).
What it is asked to build (BuildConfig) is recorded in the manifest, so it lives with the
format: dspark_compile/engine_dir/build_config.py.

    checks.py           the checkpoint and the build's settings checked before any export
    kernel_compile.py   the kernel store filled: every program run once, its Triton kernels collected
    pipeline.py         build_engine: export every program, run the passes, fill the kernel
                        store, write the engine directory (dspark_compile/engine_dir/write.py)
    inductor.py         the Inductor backend's compile of a program (--backend inductor)
    compile_workers.py  those compiles in parallel worker processes
"""
