"""The checkpoint factory: the checkpoints this project makes for itself, apart from the
reference model that reads them (dspark_compile/models/).

    presets.py      the synthetic model shapes (tiny, flash-slice, ...)
    synth.py        a synthetic DeepSeek-native checkpoint of a preset (random, quantised)
    tokenizer.py    the tiny byte-level BPE tokenizer
    train.py, train_data.py, train_model.py   the trained tiny pair (data/tiny-trained)
"""
