"""The engine directory's format: what a build writes and what a load reads and checks.

    format.py        names, paths, program keys, the format version, hashes, ArtifactError
    paths.py         every path the manifest names stays inside the directory (no links, FIFOs)
    weights.py       every weight stored once, shared by the programs
    write.py         save_engine: the atomic write, the file table, the manifest
    load.py          load_manifest / load_engine: the validated load, naming field or file
    build_config.py  BuildConfig: what a build was asked for (buckets, dtype, backend, passes...)
    fields.py        the manifest's fields -> the model, precision and state configuration
    programs.py      a program file checked as data (no pickle, allowlisted ops), then loaded
    kernel_store.py  the engine's compiled Triton kernels (cubins + metadata) for this GPU
    versions.py      the environment a build records and a load compares

Both the build (dspark_compile/build/) and the runtime (dspark_compile/runtime/) import this
wing; it imports neither.
"""
