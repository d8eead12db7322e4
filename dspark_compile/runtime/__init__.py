"""The runtime: a loaded engine directory, stepped (never imports dspark_compile/build/).

    engine.py       Engine: load, CUDA-graph capture per bucket, generate / stream
    scheduler.py    GenerationStream: continuous batching, which program a step runs
    cuda_graphs.py  CUDA-graph capture and replay of one bucket's program
    prefill.py      the prefill programs (one per chunk length) and their graphs
    inductor.py     an Inductor-backend engine's compiled programs, loaded and called
    variants.py     the greedy variant of a step program (the Markov sampler switched off)
    lossless.py     the speculative == target-only check of a loaded engine

`from dspark_compile.runtime import Engine` is the public entry point.
"""
from dspark_compile.runtime.engine import Engine  # noqa: F401
