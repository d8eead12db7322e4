"""The samplers: `dspark::markov_sample`, `dspark::rejection_sample`, `dspark::sample`.

    reference.py          the specification in PyTorch (processing, Gumbel keys, op references)
    plan.py               SamplerPlan: every launch choice, with the result that chose it
    device.py             Triton device library (Philox, keys, packed argmax, histograms)
    thresholds.py         exact top-k / top-p thresholds from candidates
    row_passes.py         reduce / select row passes (for_each_item: the work-item loop)
    refine.py             refinement of overflowing brackets
    row_launch.py         tiling, grids, scratch and compile configs of the row passes
    markov(_kernels).py   the Markov draft sampler
    rejection(_kernels).py, sample.py   rejection sampling and plain target sampling

Importing the package registers the three ops.
"""
from dspark_compile.kernels.sampling import markov, rejection, sample  # noqa: F401
